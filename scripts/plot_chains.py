"""Two or more recipe chains side by side: KL mean and P99 per bucket at every stage, one line per chain.

    python scripts/plot_chains.py --out results/bench/refit/chains.png \
        default=results/bench/recipe-2026-12-03 refit=results/bench/refit/recipe-refit

Each chain is LABEL=DIR, DIR holding the stages' evaluation JSON (eval.evaluate's, named <stage>.json);
stages are drawn in recipe order, and a stage a chain lacks is left out of its line.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STAGES = ("pruned-2of4", "reconstructed-2of4", "recovered-2of4", "gptq-2of4", "gptq-2of4-fit", "qat-2of4")
BUCKETS = ("en", "zh", "code", "news")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("chains", nargs="+", help="LABEL=DIR")
    args = ap.parse_args()
    chains = {}
    for spec in args.chains:
        label, sep, folder = spec.partition("=")
        if not sep or not Path(folder).is_dir():
            ap.error(f"chain {spec!r} must be LABEL=DIR with DIR an existing folder")
        chains[label] = {st: json.loads((Path(folder) / f"{st}.json").read_text())["buckets"]
                         for st in STAGES if (Path(folder) / f"{st}.json").is_file()}
    fig, axes = plt.subplots(2, len(BUCKETS), figsize=(4 * len(BUCKETS), 6.5), sharex=True)
    for col, bucket in enumerate(BUCKETS):
        for row, (metric, name) in enumerate((("kl_mean", "KL mean"), ("kl_p99", "KL P99"))):
            ax = axes[row][col]
            for label, stages in chains.items():
                xs = [i for i, st in enumerate(STAGES) if st in stages and bucket in stages[st]]
                ax.plot(xs, [stages[STAGES[i]][bucket][metric] for i in xs], marker="o", label=label)
            ax.set_title(f"{bucket}: {name}")
            ax.set_xticks(range(len(STAGES)), [s.removesuffix("-2of4").replace("reconstructed", "recon").replace("gptq-2of4-fit", "W4 fit") for s in STAGES])
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("per-token KL to the teacher at each stage of the chain")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
