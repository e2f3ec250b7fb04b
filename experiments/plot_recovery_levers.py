"""Table and plot of the recovery levers (experiments/bench_recovery_levers.sh's JSON) next to the one-shot start.

    python experiments/plot_recovery_levers.py --start runs/smollm2/evals/pruned-2of4.json \
        --dir results/bench/recovery-levers fixed srste hidden
Writes DIR/levers.md (lever x bucket: PPL, KL mean, KL P99, top-1) and DIR/levers.png (KL mean and P99
against distillation tokens, per bucket, one line per lever from the one-shot start). `news` is the held-out
English bucket; runs evaluated before it existed show "–" there and no line in its panels.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BUCKETS = ("en", "zh", "code", "news")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", required=True, help="the one-shot start's evaluation JSON")
    ap.add_argument("--dir", required=True, help="folder holding <lever>.json")
    ap.add_argument("levers", nargs="+")
    args = ap.parse_args()
    start = json.loads(Path(args.start).read_text())
    runs = {name: json.loads((Path(args.dir) / f"{name}.json").read_text()) for name in args.levers}
    rows = ["| lever | tokens | " + " | ".join(f"{b} PPL / KL mean / P99 / top-1" for b in BUCKETS) + " |",
            "|---|---:|" + "---|" * len(BUCKETS)]

    def cell(m):
        return "–" if m is None else f"{m['ppl']:.2f} / {m['kl_mean']:.3f} / {m['kl_p99']:.2f} / {m['top1_agree']:.3f}"

    def cells(report):
        return " | ".join(cell(report["buckets"].get(b)) for b in BUCKETS)
    rows.append(f"| one-shot start | 0 | {cells(start)} |")
    for name, r in runs.items():
        rows.append(f"| {name} | {r['lever']['tokens']:,} | {cells(r)} |")
    (Path(args.dir) / "levers.md").write_text("\n".join(rows) + "\n")
    fig, axes = plt.subplots(2, len(BUCKETS), figsize=(4 * len(BUCKETS), 6), sharex=True)
    for j, b in enumerate(BUCKETS):
        for i, (key, label) in enumerate((("kl_mean", "KL mean"), ("kl_p99", "KL P99"))):
            ax = axes[i, j]
            for name, r in runs.items():
                if b not in r["buckets"] or b not in start["buckets"]:
                    ax.plot([], [], "o-", label=name)  # keeps each lever's colour the same in every panel
                    continue
                ax.plot([0, r["lever"]["tokens"]], [start["buckets"][b][key], r["buckets"][b][key]], "o-",
                        label=name)
            ax.set_title(f"{b}: {label}")
            ax.set_xlabel("distillation tokens")
            ax.grid(alpha=0.3)
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(Path(args.dir) / "levers.png", dpi=110)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
