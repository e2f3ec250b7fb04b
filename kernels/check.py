"""Run a release (or a 2:4-pruned artifact) through the kernels and compare its logits with the
decompressed model's.

    python -m kernels.check RELEASE_OR_ARTIFACT [--layers N] [--tokens 64] [--dtype float32] [--out check.json]

The reference is the dense model with each Linear's decompressed weight (codes * scales: what QAT trained
and transformers loads), in fp32 on the same device (ieee, no tf32 on a GPU); the kernel model runs in
--dtype, its fp32 dots in ieee fp32 too. `--layers N` runs
the first N blocks only (the final norm and head after them): the Triton interpreter on a CPU is slow,
and a few layers exercise every kernel path. Exit 1 when the logits disagree beyond the dtype's tolerance.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from core.data import bucket_prompts
from core.errors import ArgumentParser, run_cli
from core.files import atomic_write_text
from kernels.linear import KernelLinear
from kernels.release_model import dense_reference, kernel_model, pruned_model
from models.hf_io import load_tokenizer
from models.load import is_release

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Pass bounds per kernel dtype: mean KL(reference || kernels) over positions, and top-1 agreement.
TOLERANCE = {"float32": (1e-6, 1.0), "float16": (1e-3, 0.98), "bfloat16": (5e-3, 0.95)}


def compare(rel: str | Path, layers: int | None, tokens: int, dtype: str, device: str) -> dict:
    rel = Path(rel)
    # fp32 means ieee fp32 on both sides: the kernels' fp32 dots are ieee, and a tf32 reference would differ
    # from them by more than the fp32 tolerance
    torch.set_float32_matmul_precision("highest")
    ids = bucket_prompts(load_tokenizer(rel), "en", 1, tokens)[0].to(device)
    if is_release(rel):
        kern = kernel_model(rel, layers, DTYPES[dtype]).to(device)
        ref = dense_reference(rel, layers, torch.float32).to(device)
    else:  # a 2:4-pruned artifact: the 2:4 kernel on its bf16/fp32 values
        kern = pruned_model(rel, layers, DTYPES[dtype]).to(device)
        ref = pruned_model(rel, layers, torch.float32, kernels=False).to(device)
    kern.init_rope(device)
    ref.init_rope(device)
    kinds: dict[str, int] = {}
    for m in kern.modules():
        if isinstance(m, KernelLinear):
            kinds[m.kind] = kinds.get(m.kind, 0) + 1
    with torch.no_grad():
        t0 = time.perf_counter()
        got = kern(ids).float()
        t_kernel = time.perf_counter() - t0
        want = ref(ids).float()
    logp, logq = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    max_kl, min_top1 = TOLERANCE[dtype]
    res = {"release": str(rel), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
           "dtype": dtype, "layers": len(kern.layers), "tokens": tokens, "kernel_linears": kinds,
           "max_abs_logit_diff": (got - want).abs().max().item(), "max_abs_logit": want.abs().max().item(),
           "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
           "top1_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
           "kernel_forward_s": round(t_kernel, 3), "float32_matmul": torch.get_float32_matmul_precision(), "tolerance": {"kl_mean": max_kl, "top1_agree": min_top1}}
    res["passed"] = res["kl_mean"] <= max_kl and res["top1_agree"] >= min_top1
    return res


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m kernels.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("release")
    ap.add_argument("--layers", type=int, help="run the first N blocks only (default: all)")
    ap.add_argument("--tokens", type=int, default=64, help="prompt length (English evaluation text)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the kernel model's dtype")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.tokens < 2:
        ap.error("--tokens must be >= 2")
    res = compare(args.release, args.layers, args.tokens, args.dtype, args.device)
    print(f"kernels vs decompressed reference ({res['device']}, {res['dtype']}, {res['layers']} layers, "
          f"{res['tokens']} tokens, {res['kernel_linears']}): KL mean {res['kl_mean']:.2e} max {res['kl_max']:.2e}, "
          f"top-1 {res['top1_agree']:.4f}, max |dlogit| {res['max_abs_logit_diff']:.2e} of {res['max_abs_logit']:.1f}"
          f" -> {'PASSED' if res['passed'] else 'FAILED'}")
    if args.out:
        atomic_write_text(args.out, json.dumps(res, indent=2) + "\n")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    run_cli(main)
