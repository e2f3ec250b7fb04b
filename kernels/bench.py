"""Kernel speed on a GPU: W4A16, 2:4, 2:4 + W4 against torch's bf16 matmul (and cuSPARSELt's 2:4 through
torch.sparse.to_sparse_semi_structured), in one run, with the device's measured copy bandwidth.

    python -m kernels.bench [--out results/bench/kernels/<gpu>.json] [--shapes smollm2,llama3-8b] [--m 1,16,2048]

For every (K -> N) layer shape and M: time (median of triton.testing.do_bench), effective GB/s (bytes of
weights + activations read and written / time), TFLOP/s (2MNK / time), the speed-up over bf16 in the same
run, and the kernels' max error against the dequantized fp32 reference. A GPU is required: the CPU runs
these kernels in Triton's interpreter, where time means nothing.
"""
from __future__ import annotations

import json
import time

import torch

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text
from core.packing import pack_24, pack_int4
from core.patterns import NMPattern

# (K, N) of the Linears: SmolLM2-135M (d 576, ffn 1536) and Llama-3-8B (d 4096, ffn 14336).
SHAPES = {"smollm2": [(576, 576), (576, 1536), (1536, 576)],
          "llama3-8b": [(4096, 4096), (4096, 14336), (14336, 4096)]}
GROUP = {"smollm2": 64, "llama3-8b": 128}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (read + write counted), the ceiling for a memory-bound kernel."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200)
    return 2 * nbytes / ms / 1e6


def _case(K: int, N: int, M: int, group: int, gen: torch.Generator) -> dict:
    from triton.testing import do_bench

    from kernels.matmul import sparse24_matmul, sparse24_w4a16_matmul, w4a16_matmul

    dev = "cuda"
    x = torch.randn(M, K, generator=gen).to(dev, torch.bfloat16)
    q = torch.randint(-8, 8, (N, K), generator=gen)
    scale = (torch.rand(N, K // group, generator=gen) * 0.02 + 0.001)
    keep = NMPattern(2, 4).keep_top(torch.rand(N, K, generator=gen))
    w_bf16 = (q.float() * scale.repeat_interleave(group, 1)).to(torch.bfloat16)
    w24 = w_bf16 * keep
    q24 = q * keep
    packed, vals, kept = pack_int4(q), *pack_24(w24.float(), keep), pack_24(q24, keep)
    values, meta = vals[0].to(torch.bfloat16), vals[1]
    kept_packed, kept_meta = pack_int4(kept[0]), kept[1]
    s = scale.to(dev, torch.bfloat16)
    t = {k: v.to(dev) for k, v in dict(packed=packed, values=values, meta=meta, kept=kept_packed,
                                       kmeta=kept_meta, w=w_bf16, w24=w24).items()}
    runs = {
        "bf16": (lambda: x @ t["w"].T, 2 * N * K, x.float() @ t["w"].float().T),
        "w4a16": (lambda: w4a16_matmul(x, t["packed"], s, group), N * K // 2 + 2 * N * K // group,
                  x.float() @ (q.float() * s.float().cpu().repeat_interleave(group, 1)).to(dev).T),
        "2:4": (lambda: sparse24_matmul(x, t["values"], t["meta"]), N * K + N * K // 8,
                x.float() @ t["w24"].float().T),
        "2:4+w4": (lambda: sparse24_w4a16_matmul(x, t["kept"], t["kmeta"], s, group),
                   N * K // 4 + N * K // 8 + 2 * N * K // group,
                   x.float() @ (q24.float() * s.float().cpu().repeat_interleave(group, 1)).to(dev).T),
    }
    try:  # cuSPARSELt / CUTLASS 2:4 through torch, where this build and GPU have it
        from torch.sparse import to_sparse_semi_structured

        ws = to_sparse_semi_structured(t["w24"])
        runs["torch 2:4"] = (lambda: torch.mm(ws, x.T).T, N * K + N * K // 8, x.float() @ t["w24"].float().T)
    except Exception as e:  # noqa: BLE001 - not available: recorded, not fatal
        runs_note = f"torch semi-structured unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    else:
        runs_note = None
    act_bytes = 2 * M * K + 2 * M * N
    out = {"K": K, "N": N, "M": M, "group_size": group, "note": runs_note, "kernels": {}}
    for name, (fn, w_bytes, ref) in runs.items():
        try:
            y = fn().float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            ms = do_bench(fn, warmup=25, rep=100)
        except Exception as e:  # noqa: BLE001 - a shape a path cannot take is a row, not a crash
            out["kernels"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            continue
        out["kernels"][name] = {"ms": ms, "GBps": (w_bytes + act_bytes) / ms / 1e6,
                                "TFLOPs": 2 * M * N * K / ms / 1e9, "max_rel_err": err}
    base = out["kernels"]["bf16"].get("ms")
    for r in out["kernels"].values():
        if "ms" in r and base:
            r["speedup_vs_bf16"] = base / r["ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file (default: results/bench/kernels/<gpu name>.json)")
    ap.add_argument("--shapes", default="smollm2,llama3-8b", help=f"comma-separated of {sorted(SHAPES)}")
    ap.add_argument("--m", default="1,16,2048", help="comma-separated token counts M")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SmeltError("kernels.bench needs a CUDA GPU (on a CPU the kernels run in the interpreter)")
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SmeltError(f"--shapes: {unknown[0]!r} is not one of {', '.join(sorted(SHAPES))}")
    ms_ = [int(v) for v in args.m.split(",")]
    gpu = torch.cuda.get_device_name()
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    res = {"device": gpu, "torch": torch.__version__, "copy_GBps": copy_bandwidth(), "cases": []}
    import triton

    res["triton"] = triton.__version__
    print(f"{gpu}: copy bandwidth {res['copy_GBps']:.0f} GB/s")
    for fam in names:
        for K, N in SHAPES[fam]:
            for M in ms_:
                c = _case(K, N, M, GROUP[fam], gen)
                c["family"] = fam
                res["cases"].append(c)
                row = "  ".join(f"{k} {v['ms'] * 1e3:7.1f}us {v.get('speedup_vs_bf16', 0):4.2f}x {v['GBps']:6.0f}GB/s"
                                if "ms" in v else f"{k} error" for k, v in c["kernels"].items())
                print(f"{fam:9s} K={K:5d} N={N:5d} M={M:4d}  {row}", flush=True)
    res["wall_s"] = time.time() - t0
    out = args.out or f"results/bench/kernels/{gpu.replace(' ', '-')}.json"
    atomic_write_text(out, json.dumps(res, indent=2) + "\n")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
