"""KL mean and P99 per bucket against training tokens, one line per series of evaluations of one stage.

    python experiments/plot_token_curve.py --out qat-tokens.png [--ref "float 2:4=recovered.json"] \
        "QAT from the quantized fit=24576:a.json,98304:b.json,196608:c.json" ["OTHER=..."]

Each series is LABEL=TOKENS:EVAL_JSON,... (eval.evaluate's JSON); points are drawn in token order. Writes the PNG
and prints a table of the points. Reads the JSON only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BUCKETS = ("en", "zh", "code", "news")


def parse_series(spec: str) -> tuple[str, list[tuple[int, dict]]]:
    label, sep, points = spec.partition("=")
    if not sep or not label or not points:
        sys.exit(f"error: series {spec!r}: expected LABEL=TOKENS:EVAL_JSON,...")
    out = []
    for point in points.split(","):
        tokens, sep, path = point.partition(":")
        if not sep or not tokens.isdigit():
            sys.exit(f"error: series {label!r}: point {point!r}: expected TOKENS:EVAL_JSON")
        if not Path(path).is_file():
            sys.exit(f"error: series {label!r}: {path} does not exist")
        out.append((int(tokens), json.loads(Path(path).read_text())))
    return label, sorted(out, key=lambda p: p[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--ref", action="append", default=[], metavar="LABEL=EVAL_JSON",
                    help="a model drawn as a dashed level line (e.g. the float model the W4 stages start from)")
    ap.add_argument("series", nargs="+", help="LABEL=TOKENS:EVAL_JSON,...")
    args = ap.parse_args()
    series = [parse_series(s) for s in args.series]
    refs = []
    for spec in args.ref:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            sys.exit(f"error: --ref {spec!r}: expected LABEL=EVAL_JSON of an existing file")
        refs.append((label, json.loads(Path(path).read_text())))
    fig, axes = plt.subplots(2, len(BUCKETS), figsize=(4 * len(BUCKETS), 6), sharex=True)
    for j, b in enumerate(BUCKETS):
        for i, (key, name) in enumerate((("kl_mean", "KL mean"), ("kl_p99", "KL P99"))):
            ax = axes[i, j]
            for label, points in series:
                drawn = [(t, r["buckets"][b][key]) for t, r in points if b in r["buckets"]]
                ax.plot([t for t, _ in drawn], [v for _, v in drawn], "o-", label=label)
            for k, (label, r) in enumerate(refs):
                if b in r["buckets"]:
                    ax.axhline(r["buckets"][b][key], ls="--", color=f"C{len(series) + k}", label=label)
            ax.set_title(f"{b}: {name}")
            ax.set_xlabel("training tokens")
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    ncol = min(len(labels), 3)  # more entries wrap into rows instead of running off the figure
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9)
    fig.tight_layout(rect=(0, 0.035 * -(-len(labels) // ncol) + 0.025, 1, 1))
    tmp = Path(args.out).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(args.out)  # never a half-written plot
    for label, points in series:
        for tokens, r in points:
            cells = " | ".join(f"{b} {r['buckets'][b]['kl_mean']:.3f} / {r['buckets'][b]['kl_p99']:.2f}"
                               for b in BUCKETS if b in r["buckets"])
            print(f"{label} | {tokens:,} | {cells}")


if __name__ == "__main__":
    main()
