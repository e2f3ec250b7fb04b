"""Two or more needle grids on the same prompts, compared prompt by prompt against the first.

    smelt needle-paired --out needle-paired.json default=A.json fast=B.json ...   # or: python -m eval.needle_paired

Each grid must come from `eval.needle` with the same lengths, depths, samples and seed, so prompt i is the same
needle in the same haystack in every file (checked: name, value, length, depth). Per length and in all: each
model's accuracy, the discordant pairs (reference right and this one wrong, and the reverse), and McNemar's exact
two-sided p-value on them: whether the two models retrieve differently, counting only prompts where they differ.
"""
from __future__ import annotations

import json
import math

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text, read_json


def _prompts(path: str) -> list[dict]:
    langs = read_json(path, "an eval.needle result").get("languages", {})
    prompts = [p for lang in sorted(langs) for p in langs[lang].get("prompts", [])]
    if not prompts:
        raise SmeltError(f"grids: {path} holds no needle prompts (write it with eval.needle --out)")
    return prompts


def mcnemar_p(lost: int, won: int) -> float:
    """Exact two-sided McNemar: P(a split at least this uneven) when each discordant pair is a fair coin."""
    n = lost + won
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, won) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(ref: list[dict], other: list[dict]) -> dict:
    key = ("name", "value", "length", "depth")
    if [tuple(p[k] for k in key) for p in ref] != [tuple(p[k] for k in key) for p in other]:
        raise SmeltError("the grids hold different prompts: run eval.needle with the same lengths, depths, "
                         "samples and seed")
    out = {}
    for length in [*sorted({p["length"] for p in ref}), "all"]:
        pairs = [(a["correct"], b["correct"]) for a, b in zip(ref, other, strict=True)
                 if length == "all" or a["length"] == length]
        lost = sum(a and not b for a, b in pairs)
        won = sum(b and not a for a, b in pairs)
        out[str(length)] = {"prompts": len(pairs), "reference": sum(a for a, _ in pairs) / len(pairs),
                            "this": sum(b for _, b in pairs) / len(pairs), "lost": lost, "won": won,
                            "mcnemar_p": round(mcnemar_p(lost, won), 5)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.needle_paired", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("grids", nargs="+", help="LABEL=needle.json; the first is the reference")
    args = ap.parse_args(argv)
    labelled = [g.partition("=")[::2] for g in args.grids]
    if len(labelled) < 2 or any(not label or not path for label, path in labelled):
        raise SmeltError("grids: give at least two LABEL=needle.json")
    (ref_label, ref_path), *rest = labelled
    ref = _prompts(ref_path)
    summary = {"reference": ref_label, "files": dict(labelled),
               "against": {label: compare(ref, _prompts(path)) for label, path in rest}}
    atomic_write_text(args.out, json.dumps(summary, indent=1) + "\n")
    for label, rows in summary["against"].items():
        for length, r in rows.items():
            print(f"{label:>12} {length:>5}: {r['this']:.3f} against {r['reference']:.3f} ({ref_label}); "
                  f"lost {r['lost']}, won {r['won']}, McNemar p {r['mcnemar_p']:.4f}")


if __name__ == "__main__":
    run_cli(main)
