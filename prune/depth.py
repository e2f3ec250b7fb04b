"""Depth removal: score every block, drop k of them, keep the ones that hold protected heads.

    python -m prune.depth --teacher smollm2-135m --remove 6 --heads runs/smollm2/heads.json --out runs/smollm2/depth-24

Scores, over calibration windows of training text (the model's own forward, hooks on the blocks):
- block influence (BI): 1 - mean cos(x_in, x_out) per block: how much a block changes the residual stream;
- angular distance of n = `--remove` contiguous blocks (Gromov et al. 2024): mean arccos(cos(x_l, x_l+n))/pi
  between the stream before block l and after block l+n-1;
- drop KL: the mean per-token KL(model || model without block l) of the next-token distributions, over
  `--kl-windows` of the windows (one forward per block: the block is made an identity by a hook).
`--method angular` removes the contiguous run with the smallest angular distance; `--method influence` /
`--method kl` the k blocks with the smallest BI / drop KL. A block that holds a protected head (prune.heads'
JSON) is never removed (`--protect-penalty` instead adds that much to its score, for a soft rule). The
result is a smaller dense model (config with the new depth, layers renumbered), `protected.json` (the
protected heads that survived, renumbered for it) and a manifest saying what was removed and why.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from core.artifact import parent_record, write_manifest
from core.calibrate import CalibConfig, add_sampling_arg
from core.device import default_device
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_dir
from core.kl import kl_rows
from core.protected import PROTECTED_FILE, read_protected
from models.hf_io import load_hf, load_tokenizer, save_hf
from models.teacher import resolve_teacher


@torch.no_grad()
def block_states(model, windows: torch.Tensor, batch_size: int = 4):
    """Yield, per batch, the residual stream before every block and after the last: [n_layers + 1, T, d]."""
    keys = list(model.layers)
    for s in range(0, len(windows), batch_size):
        states: dict[str, torch.Tensor] = {}
        hooks = [model.layers[k].register_forward_pre_hook(
            lambda mod, args, k=k, states=states: states.update({k: args[0].detach()})) for k in keys]
        last = model.layers[keys[-1]].register_forward_hook(
            lambda mod, args, out, states=states: states.update(out=out.detach()))
        try:
            model.hidden_states(windows[s:s + batch_size].to(model.tok_embeddings.weight.device))
        finally:
            for h in (*hooks, last):
                h.remove()
        yield torch.stack([states[k] for k in keys] + [states["out"]]).flatten(1, 2).float()


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1, 1)


def depth_scores(model, windows: torch.Tensor, n: int, batch_size: int = 4) -> dict[str, list[float]]:
    """{"influence": [n_layers], "angular": [n_layers - n + 1] (run starting at each block)}."""
    layers = len(model.layers)
    if not 1 <= n < layers:
        raise SmeltError(f"--remove {n}: the model has {layers} layers; remove between 1 and {layers - 1}")
    bi, ang, tokens = torch.zeros(layers, dtype=torch.float64), torch.zeros(layers - n + 1, dtype=torch.float64), 0
    for x in block_states(model, windows, batch_size):
        bi += (1 - _cos(x[:-1], x[1:])).double().sum(-1).cpu()
        ang += (torch.arccos(_cos(x[:layers - n + 1], x[n:])) / math.pi).double().sum(-1).cpu()
        tokens += x.shape[1]
    return {"influence": (bi / tokens).tolist(), "angular": (ang / tokens).tolist()}


@torch.no_grad()
def drop_kl(model, windows: torch.Tensor, batch_size: int = 2) -> list[float]:
    """[n_layers]: mean per-token KL(full model || model with block l skipped)."""
    keys = list(model.layers)
    total, tokens = torch.zeros(len(keys), dtype=torch.float64), 0
    device = model.tok_embeddings.weight.device
    for s in tqdm(range(0, len(windows), batch_size), desc="drop KL", unit="batch", leave=False):
        x = windows[s:s + batch_size].to(device)
        ref = torch.log_softmax(model(x).float(), -1)
        for i, k in enumerate(keys):
            # a forward hook that returns a value replaces the output: here, the block's input (an identity)
            h = model.layers[k].register_forward_hook(lambda mod, args, out: args[0])
            try:
                logq = torch.log_softmax(model(x).float(), -1)
            finally:
                h.remove()
            total[i] += kl_rows(ref, logq).double().sum().cpu()
        tokens += x.numel()
    return (total / tokens).tolist()


def choose(scores: dict[str, list[float]], n: int, method: str, protected: set[int],
           penalty: float | None = None) -> list[int]:
    """Indices of the blocks to remove. Protected blocks are excluded (penalty None) or cost `penalty`."""
    layers = len(scores["influence"])
    if method == "angular":
        cost = {s: scores["angular"][s] + (penalty or 0) * len(protected & set(range(s, s + n)))
                for s in range(layers - n + 1)
                if penalty is not None or not protected & set(range(s, s + n))}
        if not cost:
            raise SmeltError(f"--remove {n}: every run of {n} contiguous layers holds a protected head "
                             f"(protected layers {sorted(protected)}); remove fewer or pass --protect-penalty")
        start = min(cost, key=cost.get)
        return list(range(start, start + n))
    key = "kl" if method == "kl" else "influence"
    cost = {i: scores[key][i] + (penalty or 0) * (i in protected)
            for i in range(layers) if penalty is not None or i not in protected}
    if len(cost) < n:
        raise SmeltError(f"--remove {n}: only {len(cost)} layers hold no protected head "
                         f"(protected layers {sorted(protected)})")
    return sorted(sorted(cost, key=cost.get)[:n])




def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m prune.depth", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True, help="registered name, .gguf or HF directory")
    ap.add_argument("--model", help="HF model directory to shorten (default: the teacher)")
    ap.add_argument("--remove", type=int, required=True, help="how many blocks to remove")
    ap.add_argument("--method", default="angular", choices=("angular", "influence", "kl"))
    ap.add_argument("--heads", help="prune.heads JSON: blocks holding its protected heads are kept")
    ap.add_argument("--protect-penalty", type=float, help="instead of keeping them: add this to their score")
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--calib-corpus", default="wikitext2-valid")
    add_sampling_arg(ap)
    ap.add_argument("--kl-windows", type=int, default=8, help="windows for the drop-KL score (0: skip it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = CalibConfig(n_windows=args.calib_windows, seq_len=args.calib_seq_len, corpus=args.calib_corpus,
                      sampling=args.calib_sampling)
    out = Path(args.out)
    if out.exists():
        raise SmeltError(f"--out {out} already exists")
    teacher_dir = resolve_teacher(args.teacher)
    src = Path(args.model) if args.model else teacher_dir
    model = load_hf(src, device=str(default_device())).eval()
    if not 1 <= args.remove < len(model.layers):
        raise SmeltError(f"--remove {args.remove}: the model has {len(model.layers)} layers; remove between 1 "
                         f"and {len(model.layers) - 1}")
    if args.method == "kl" and args.kl_windows < 1:
        raise SmeltError(f"--kl-windows {args.kl_windows}: --method kl needs at least 1")
    keys = list(model.layers)
    heads = read_protected(args.heads, keys, model.cfg.n_heads) if args.heads else []
    protected = {keys.index(k) for k, _ in heads}
    tokenizer = load_tokenizer(teacher_dir)
    windows = cfg.windows(tokenizer)
    scores = depth_scores(model, windows, args.remove)
    if args.kl_windows:
        scores["kl"] = drop_kl(model, windows[:args.kl_windows])
    removed = choose(scores, args.remove, args.method, protected, args.protect_penalty)
    kept = [k for i, k in enumerate(keys) if i not in removed]
    for i in removed:
        del model.layers[keys[i]]
    print(f"removed layers {removed} ({args.method}); protected layers {sorted(protected)}", file=sys.stderr)
    with atomic_dir(out) as tmp:
        save_hf(model, tmp, tokenizer=tokenizer)
        (tmp / PROTECTED_FILE).write_text(json.dumps(  # layers renumbered as save_hf numbers them
            {"protected": [{"layer": str(kept.index(k)), "head": h} for k, h in heads if k in kept],
             "source": args.heads}, indent=1) + "\n")
        write_manifest(tmp, stage="depth", settings={
            "method": args.method, "remove": args.remove, "heads": args.heads,
            "protect_penalty": args.protect_penalty, "calibration": cfg.record(), "kl_windows": args.kl_windows},
            metrics={"removed_layers": removed, "protected_layers": sorted(protected),
                     "scores": json.loads(json.dumps(scores))}, parent=parent_record(src))
    print(out)


if __name__ == "__main__":
    run_cli(main)
