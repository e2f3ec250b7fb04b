"""How far apart two pruned artifacts' masks are: the share of 2:4 groups (4 consecutive inputs of a row) whose kept
set differs, per block and in all. It tells a numerics
change (same calibration windows, another dtype) from a draw (another calibration seed): block 0 sees the same
inputs in both runs, so its share is the numerics' own effect; later blocks add what the sequential calibration
carried on.

    smelt mask-agreement --out results/bench/oneshot-seeds-wanda-6/mask-agreement.json \
        bf16-vs-today:runs/seeds-ns/today-seed1=runs/seeds-ns/bf16-seed1 ...
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text
from core.masks import load_masks

GROUP = 4  # 2:4 groups run along the input dimension


def group_changes(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(groups whose kept set differs, groups) for two [out, in] keep-masks of one linear."""
    if a.shape != b.shape:
        raise SmeltError(f"mask shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.shape[1] % GROUP:
        raise SmeltError(f"a mask's {a.shape[1]} inputs are no multiple of the group size {GROUP}")
    diff = (a != b).reshape(a.shape[0], -1, GROUP).any(-1)
    return int(diff.sum()), diff.numel()


def compare(dir_a: Path, dir_b: Path) -> dict:
    ma, mb = load_masks(dir_a), load_masks(dir_b)
    if not ma or set(ma) != set(mb):
        raise SmeltError(f"pairs: {dir_a} and {dir_b} do not hold masks for the same linears")
    blocks: dict[int, list[int]] = {}
    for name in ma:
        block = int(re.search(r"layers\.(\d+)\.", name).group(1))
        changed, total = group_changes(ma[name], mb[name])
        acc = blocks.setdefault(block, [0, 0])
        acc[0] += changed
        acc[1] += total
    changed = sum(c for c, _ in blocks.values())
    total = sum(t for _, t in blocks.values())
    return {"a": str(dir_a), "b": str(dir_b), "changed_share": round(changed / total, 6), "groups": total,
            "per_block": {b: round(c / t, 6) for b, (c, t) in sorted(blocks.items())}}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.mask_agreement", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("pairs", nargs="+", help="LABEL:RUN_A=RUN_B (artifact directories)")
    args = ap.parse_args(argv)
    result = {}
    for item in args.pairs:
        label, sep, rest = item.partition(":")
        a, sep2, b = rest.partition("=")
        if not (label and sep and sep2):
            raise SmeltError(f"pairs: {item!r} is not LABEL:RUN_A=RUN_B")
        result[label] = compare(Path(a), Path(b))
        r = result[label]
        first, last = min(r["per_block"]), max(r["per_block"])
        print(f"{label}: {100 * r['changed_share']:.3f}% of {r['groups']:,} groups differ; block {first} "
              f"{100 * r['per_block'][first]:.3f}%, block {last} {100 * r['per_block'][last]:.3f}%")
    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run_cli(main)
