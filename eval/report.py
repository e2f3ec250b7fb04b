"""The degradation report of a run: every stage's evaluation side by side, as a table and a plot.

    python -m eval.report --run runs/smollm2      # reads runs/smollm2/evals/*.json

Writes report.md (markdown table: PPL, KL mean, KL P99, top-1 per bucket) and report.png (KL mean and
P99 per stage and bucket, log scale) into the run directory, and prints the table.
"""
from __future__ import annotations

import json
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text

STAGE_ORDER = ["teacher", "pruned", "recovered", "gptq", "rtn", "qat"]


def _stage_key(name: str) -> tuple[int, str]:
    for i, s in enumerate(STAGE_ORDER):
        if name.startswith(s):
            return i, name
    return len(STAGE_ORDER), name


def load_reports(run: Path) -> dict[str, dict]:
    files = sorted((run / "evals").glob("*.json"), key=lambda p: _stage_key(p.stem))
    if not files:
        raise SmeltError(f"{run}/evals has no evaluation reports (*.json)")
    return {p.stem: json.loads(p.read_text()) for p in files}


def markdown_table(reports: dict[str, dict]) -> str:
    lines = ["| stage | bucket | PPL | KL mean | KL P99 | top-1 agree |", "|---|---|---:|---:|---:|---:|"]
    for stage, rep in reports.items():
        for i, (bucket, m) in enumerate(rep["buckets"].items()):
            lines.append(f"| {stage if i == 0 else ''} | {bucket} | {m['ppl']:.2f} | {m['kl_mean']:.3f} | "
                         f"{m['kl_p99']:.3f} | {m['top1_agree']:.3f} |")
    return "\n".join(lines)


def plot(reports: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(reports)
    buckets = list(next(iter(reports.values()))["buckets"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in zip(axes, ("kl_mean", "kl_p99"), ("KL(teacher‖model) mean", "KL P99")):
        width = 0.8 / len(buckets)
        for j, b in enumerate(buckets):
            vals = [max(reports[s]["buckets"].get(b, {}).get(key, 0.0), 1e-4) for s in stages]
            ax.bar([i + j * width for i in range(len(stages))], vals, width, label=b)
        ax.set_xticks([i + width * (len(buckets) - 1) / 2 for i in range(len(stages))])
        ax.set_xticklabels(stages, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].set_ylabel("nats per token")
    axes[0].legend()
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(out)


def main() -> None:
    ap = ArgumentParser(prog="python -m eval.report", description="Side-by-side degradation report of a run's stages.")
    ap.add_argument("--run", required=True, help="run directory holding evals/*.json")
    args = ap.parse_args()
    run = Path(args.run)
    reports = load_reports(run)
    table = markdown_table(reports)
    atomic_write_text(run / "report.md", table + "\n")
    plot(reports, run / "report.png")
    print(table)
    print(f"\nwrote {run / 'report.md'} and {run / 'report.png'}")


if __name__ == "__main__":
    run_cli(main)
