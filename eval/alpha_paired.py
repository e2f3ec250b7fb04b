"""Two MTP modules' greedy acceptance compared prompt by prompt: eval.speculative JSONs over the same prompts
(same buckets, counts and lengths), each prompt one paired sample. Per bucket and in all: the mean difference
of α per prompt (B − A) ± its standard error, and how many prompts went up and down. Rounds within one prompt
are not independent (eval.speculative's alpha_first_se), so the prompt is the unit here too.

    smelt alpha-paired A.json B.json [--out paired.json]        # or: python -m eval.alpha_paired ...

A and B are `smelt speculative --out` results (eval.speculative) of two MTP modules on the same prompts.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text


def paired(a: list[float], b: list[float], where: str = "") -> dict:
    """Mean and standard error of b - a over paired prompts, with the counts up / down / level."""
    if len(a) != len(b) or len(a) < 2:
        raise SmeltError(f"paired prompts{where}: {len(a)} against {len(b)}; need the same number, at least 2")
    d = [y - x for x, y in zip(a, b)]
    return {"prompts": len(d), "mean_a": statistics.fmean(a), "mean_b": statistics.fmean(b),
            "diff": statistics.fmean(d), "se": statistics.stdev(d) / math.sqrt(len(d)),
            "up": sum(x > 0 for x in d), "down": sum(x < 0 for x in d), "level": sum(x == 0 for x in d)}


def compare(ra: dict, rb: dict) -> dict:
    for key in ("prompts_per_bucket", "prompt_len", "new_tokens", "languages", "greedy", "draft_vocab"):
        va, vb = ra.get("settings", {}).get(key), rb.get("settings", {}).get(key)
        if va != vb:
            raise SmeltError(f"settings.{key}: {va} against {vb}; the two runs must decode the same prompts")
    if ra.get("gamma") != rb.get("gamma"):
        raise SmeltError(f"gamma: {ra.get('gamma')} against {rb.get('gamma')}")
    if set(ra["buckets"]) != set(rb["buckets"]):
        raise SmeltError(f"buckets: {sorted(ra['buckets'])} against {sorted(rb['buckets'])}")
    def per_prompt(r: dict, key: str) -> list[float]:
        part = r["overall"] if key == "all" else r["buckets"][key]
        if "alpha_first_per_prompt" not in part:
            raise SmeltError(f"{key}: no alpha_first_per_prompt (a benchmark JSON from before it was recorded)")
        return part["alpha_first_per_prompt"]

    return {k: paired(per_prompt(ra, k), per_prompt(rb, k), f" ({k})") for k in [*ra["buckets"], "all"]}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.alpha_paired", description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="eval.speculative JSON of the reference module")
    ap.add_argument("b", help="eval.speculative JSON of the module compared with it")
    ap.add_argument("--out", help="write the comparison here as JSON")
    args = ap.parse_args(argv)
    runs = []
    for name in (args.a, args.b):
        try:
            runs.append(json.loads(Path(name).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise SmeltError(f"{name}: not a readable eval.speculative JSON ({type(e).__name__})") from None
        if "overall" not in runs[-1] or "buckets" not in runs[-1]:
            raise SmeltError(f"{name}: no overall / buckets (not an eval.speculative JSON)")
    result = {"a": args.a, "b": args.b, "paired": compare(*runs)}
    for bucket, r in result["paired"].items():
        print(f"{bucket:5s} α {r['mean_a']:.3f} -> {r['mean_b']:.3f} (per-prompt means): {r['diff']:+.3f} ± "
              f"{r['se']:.3f}, {r['up']} up / {r['down']} down of {r['prompts']}")
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    run_cli(main)
