"""The degradation report of a run: every stage's evaluation side by side, as a table and a plot.

    python -m eval.report --run runs/smollm2      # reads runs/smollm2/evals/*.json

Writes report.md (markdown table: PPL, KL mean, KL P99, top-1 per bucket) and report.png into the run
directory, and prints the table. report.png has one column per bucket (en / zh / code) and three rows:
KL mean per stage, KL P99 per stage (linear axes, each bar labelled with its value, the teacher's 0 drawn
as 0), and the tail of the per-token KL distribution of each stage (from the report's `kl_cdf` quantiles:
fraction of tokens whose KL exceeds x, log-log, so the worst 1% and 0.1% of tokens are visible).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_path, atomic_write_text
from eval.needle import heatmap

STAGE_ORDER = ["teacher", "pruned", "reconstructed", "recovered", "gptq", "rtn", "qat"]  # the recipe's chain
# Per-token KL below this (nats) is the harness's noise floor (fp16-cached teacher log-probs): the tail
# panels start here, and a stage whose stored quantiles all lie below it is listed, not drawn.
KL_FLOOR = 1e-4
TEACHER_GREY = "0.45"


def _stage_key(name: str) -> tuple[int, str]:
    for i, s in enumerate(STAGE_ORDER):
        if name.startswith(s):
            return i, name
    return len(STAGE_ORDER), name


def load_reports(run: Path) -> dict[str, dict]:
    files = sorted((run / "evals").glob("*.json"), key=lambda p: _stage_key(p.stem))
    if not files:
        raise SmeltError(f"{run}/evals has no evaluation reports (*.json)")
    reports = {}
    for p in files:
        try:
            reports[p.stem] = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise SmeltError(f"{p} is not valid JSON ({e})") from None
        if not isinstance(reports[p.stem].get("buckets"), dict):
            raise SmeltError(f"{p} has no 'buckets' (not an eval.evaluate report?)")
    return reports


def bucket_names(reports: dict[str, dict]) -> list[str]:
    """Buckets of all reports, in order of first appearance (en, zh, code for eval.evaluate's reports)."""
    return list(dict.fromkeys(b for rep in reports.values() for b in rep["buckets"]))


def markdown_table(reports: dict[str, dict]) -> str:
    lines = ["| stage | bucket | PPL | KL mean | KL P99 | top-1 agree |", "|---|---|---:|---:|---:|---:|"]
    for stage, rep in reports.items():
        for i, (bucket, m) in enumerate(rep["buckets"].items()):
            lines.append(f"| {stage if i == 0 else ''} | {bucket} | {m['ppl']:.2f} | {m['kl_mean']:.3f} | "
                         f"{m['kl_p99']:.3f} | {m['top1_agree']:.3f} |")
    return "\n".join(lines)


def _value_label(v: float) -> str:
    if math.isnan(v):
        return "n/a"
    if abs(v) < 5e-4:
        return "0"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _stage_colors(stages: list[str]) -> dict[str, object]:
    from matplotlib import colormaps  # lazy like every matplotlib import here (see figure())

    n = sum(not s.startswith("teacher") for s in stages)
    # tab10 without its grey (the teacher's); tab20 (greys dropped too) once there are more stages than that
    name, greys = ("tab10", {7}) if n <= 9 else ("tab20", {14, 15})
    palette = [c for i, c in enumerate(colormaps[name].colors) if i not in greys]
    colors, k = {}, 0
    for s in stages:
        if s.startswith("teacher"):
            colors[s] = TEACHER_GREY
        else:
            colors[s] = palette[k % len(palette)]
            k += 1
    return colors


def _bars(ax, stages, values, colors, title, ymax):
    xs = range(len(stages))
    ax.bar(xs, [0.0 if math.isnan(v) else v for v in values], 0.75, color=[colors[s] for s in stages])
    rotate = len(stages) > 8
    for x, v in zip(xs, values):
        y = 0.0 if math.isnan(v) else v
        ax.text(x, y + ymax * 0.012, _value_label(v), ha="center", va="bottom", fontsize=8,
                rotation=90 if rotate else 0)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(stages, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, ymax * (1.25 if rotate else 1.12))
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _tail(ax, reports, stages, bucket, colors):
    """Complementary CDF of the per-token KL of each stage in one bucket; returns the stages not drawn."""
    from matplotlib.ticker import FuncFormatter, NullFormatter  # lazy (see figure())

    skipped, ymin, drawn = [], None, False
    for s in stages:
        m = reports[s]["buckets"].get(bucket)
        if m is None:
            skipped.append(f"{s} (no {bucket} bucket)")
            continue
        cdf = m.get("kl_cdf")
        if not cdf or not cdf.get("p") or len(cdf["p"]) != len(cdf.get("kl", ())):
            skipped.append(f"{s} (no kl_cdf in its report)")
            continue
        pts = [(kl, 1.0 - p) for p, kl in zip(cdf["p"], cdf["kl"]) if kl > KL_FLOOR]
        if not pts:
            skipped.append(f"{s} (KL < {KL_FLOOR:g} at every stored quantile)")
            continue
        ymin = min(1.0 - p for p in cdf["p"]) if ymin is None else min(ymin, *(1.0 - p for p in cdf["p"]))
        ax.plot([x for x, _ in pts], [y for _, y in pts], color=colors[s], lw=1.8, label=s)
        drawn = True
    ax.set_xscale("log")
    ax.set_yscale("log")
    ymin = 1e-3 if ymin is None else ymin  # nothing drawn: the range eval.metrics' KL_CDF_P covers
    ax.set_ylim(ymin * 0.6, 1.05)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{100 * y:g}%"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    for y, name in ((0.5, "P50"), (0.1, "P90"), (0.01, "P99")):
        if y >= ymin:
            ax.axhline(y, color="0.6", lw=0.7, ls=":")
            ax.text(1.0, y, f" {name}", transform=ax.get_yaxis_transform(), fontsize=7, va="center",
                    color="0.4", clip_on=False)
    if not drawn:
        ax.set_xlim(KL_FLOOR, 10)
    ax.grid(which="major", alpha=0.3)
    ax.set_title(f"{bucket}: per-token KL distribution (tail)", fontsize=10)
    ax.set_xlabel("per-token KL(teacher‖model), nats (log)", fontsize=9)
    if skipped:
        ax.text(0.02, 0.03, "not drawn:\n" + "\n".join(skipped), transform=ax.transAxes, fontsize=7,
                va="bottom", ha="left", color="0.3",
                bbox={"boxstyle": "round", "fc": "white", "ec": "0.8", "alpha": 0.9})
    return skipped


def figure(reports: dict[str, dict], title: str = ""):
    """The report figure: a column per bucket; rows KL mean, KL P99 (bars per stage), per-token KL tail."""
    # matplotlib is imported here, not at the top: it is heavy (~1 s) and only the plot needs it, so
    # `import eval.report` for the table or load_reports stays cheap.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = list(reports)
    buckets = bucket_names(reports)
    colors = _stage_colors(stages)
    ncol = len(buckets)
    col_w = max(4.2, 1.4 + 0.5 * len(stages))
    fig, axes = plt.subplots(3, ncol, figsize=(col_w * ncol, 12.5), squeeze=False)

    for row, key, name in ((0, "kl_mean", "KL mean"), (1, "kl_p99", "KL P99")):
        values = {b: [float(reports[s]["buckets"].get(b, {}).get(key, math.nan)) for s in stages] for b in buckets}
        finite = [v for vs in values.values() for v in vs if not math.isnan(v)]
        ymax = max(finite, default=0.0) or 1.0  # one linear scale per row: buckets compare at a glance
        for col, b in enumerate(buckets):
            _bars(axes[row][col], stages, values[b], colors, f"{b}: {name} per token", ymax)
        axes[row][0].set_ylabel(f"{name}, nats per token")
    for col, b in enumerate(buckets):
        _tail(axes[2][col], reports, stages, b, colors)
    axes[2][0].set_ylabel("share of tokens with KL > x")
    xlims = [ax.get_xlim() for ax in axes[2]]  # one x range for the tail row too
    for ax in axes[2]:
        ax.set_xlim(min(lo for lo, _ in xlims), max(hi for _, hi in xlims))

    handles = [Patch(color=colors[s], label=s) for s in stages]
    fig.legend(handles=handles, loc="upper center", ncol=min(len(stages), 8), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.97))
    fig.suptitle(title or "Distance to the teacher per stage: KL(teacher‖model) per token", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.95 if len(stages) <= 8 else 0.93), h_pad=1.5)
    return fig


def plot(reports: dict[str, dict], out: Path, title: str = "") -> None:
    import matplotlib.pyplot as plt  # lazy: see figure()

    fig = figure(reports, title)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def main() -> None:
    ap = ArgumentParser(prog="python -m eval.report", description="Side-by-side degradation report of a run's stages.")
    ap.add_argument("--run", required=True, help="run directory holding evals/*.json")
    args = ap.parse_args()
    run = Path(args.run)
    reports = load_reports(run)
    table = markdown_table(reports)
    atomic_write_text(run / "report.md", table + "\n")
    plot(reports, run / "report.png", title=f"{run.name}: KL(teacher‖model) per token, per stage and bucket")
    print(table)
    print(f"\nwrote {run / 'report.md'} and {run / 'report.png'}")
    needles = {stage: rep["needle"] for stage, rep in reports.items() if "needle" in rep}
    if needles:  # the stages evaluated with --needle, side by side
        heatmap(needles, run / "needle.png")
        print(f"wrote {run / 'needle.png'}")


if __name__ == "__main__":
    run_cli(main)
