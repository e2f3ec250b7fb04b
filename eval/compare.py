"""Two or more recipe runs side by side: every stage's evaluation per bucket, and each run's difference from the first.

    smelt compare runs/smollm2 runs/smollm2-seed1                 # or: python -m eval.compare ...
    smelt compare default=runs/smollm2 refit=runs/refit --json compare.json --plot compare.png

A RUN is a recipe run directory (its stages' evaluations in RUN/evals/<stage>.json, as `smelt run` writes them)
or a folder holding those evaluation JSONs themselves (a results/ folder); `LABEL=DIR` names it, else the
folder's name does. Stages are matched by name (`pruned-2of4`, `qat-2of4`, ...). Printed: a markdown table,
one row per stage and bucket, with each run's KL mean, KL P99, PPL and top-1 agreement (runs lettered A, B, ...
in the order given) and each later run's difference from A (Δ); a stage or bucket a run lacks shows "–".
Reads JSON only.
"""
from __future__ import annotations

import json
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_path, atomic_write_text, read_json
from eval.report import _stage_key, load_reports

METRICS = (("kl_mean", "KL mean", "{:.3f}"), ("kl_p99", "KL P99", "{:.3f}"), ("ppl", "PPL", "{:.2f}"),
           ("top1_agree", "top-1", "{:.3f}"))


def _is_evaluation(data) -> bool:
    """An eval.evaluate report: per-bucket KL statistics (a speculative benchmark also has 'buckets')."""
    buckets = data.get("buckets") if isinstance(data, dict) else None
    return isinstance(buckets, dict) and bool(buckets) and all(
        isinstance(m, dict) and "kl_mean" in m for m in buckets.values())


def load_run(folder: Path) -> dict[str, dict]:
    """{stage: its evaluation report}, in the recipe's stage order."""
    if not folder.is_dir():
        raise SmeltError(f"runs: {folder} is not a directory")
    if (folder / "evals").is_dir():
        return load_reports(folder)
    reports = {}
    for p in sorted(folder.glob("*.json"), key=lambda p: _stage_key(p.stem)):
        data = read_json(p, "an evaluation report")
        if _is_evaluation(data):
            reports[p.stem] = data
    if not reports:
        raise SmeltError(f"runs: {folder} has no evals/ folder and no evaluation reports (eval.evaluate JSON)")
    return reports


def parse_runs(specs: list[str]) -> dict[str, dict[str, dict]]:
    """{label: load_run(...)} from RUN or LABEL=RUN arguments."""
    runs = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or Path(spec).is_dir():
            label, path = Path(spec).resolve().name, spec
            label = spec if label in runs else label  # two runs/<x>/smollm2: the paths tell them apart
        if not label:
            raise SmeltError(f"runs: {spec!r} has an empty label (LABEL=DIR)")
        if label in runs:
            raise SmeltError(f"runs: two runs are labelled {label!r}; name them LABEL=DIR")
        runs[label] = load_run(Path(path))
    if len(runs) < 2:
        raise SmeltError("runs: give at least two runs to compare")
    return runs


def comparison(runs: dict[str, dict[str, dict]]) -> dict:
    """{stage: {bucket: {metric: {"values": [one per run, None where missing], "delta": [run - first]}}}}."""
    stages = sorted({s for reports in runs.values() for s in reports}, key=_stage_key)
    out = {}
    for stage in stages:
        buckets = dict.fromkeys(b for reports in runs.values() for b in reports.get(stage, {}).get("buckets", {}))
        out[stage] = {}
        for bucket in buckets:
            row = {}
            for key, _, _ in METRICS:
                values = [reports.get(stage, {}).get("buckets", {}).get(bucket, {}).get(key)
                          for reports in runs.values()]
                first = values[0]
                row[key] = {"values": values,
                            "delta": [None if first is None or v is None else v - first for v in values[1:]]}
            out[stage][bucket] = row
    return out


def _cell(v, fmt: str, signed: bool = False) -> str:
    if v is None:
        return "–"
    return (fmt.replace("{:", "{:+") if signed else fmt).format(v)


def letters(n: int) -> list[str]:
    return [chr(ord("A") + i) if i < 26 else f"R{i + 1}" for i in range(n)]


def markdown(labels: list[str], table: dict) -> str:
    """A legend (letter: run) and the table; a column is a metric of one run, Δ a later run minus run A."""
    tags = letters(len(labels))
    head, align = ["stage", "bucket"], ["---", "---"]
    for _, name, _ in METRICS:
        head += [f"{name} {t}" for t in tags] + [f"Δ {t}" for t in tags[1:]]
        align += ["---:"] * (2 * len(labels) - 1)
    lines = [f"{t}: {label}" for t, label in zip(tags, labels, strict=True)]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for stage, buckets in table.items():
        for i, (bucket, row) in enumerate(buckets.items()):
            cells = [stage if i == 0 else "", bucket]
            for key, _, fmt in METRICS:
                cells += [_cell(v, fmt) for v in row[key]["values"]]
                cells += [_cell(d, fmt, signed=True) for d in row[key]["delta"]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(labels: list[str], table: dict, path: Path) -> None:
    """KL mean and P99 per bucket at every stage, one line per run (a stage a run lacks is left out of its line)."""
    import matplotlib  # lazy: a heavy optional dependency, needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(table)
    buckets = list(dict.fromkeys(b for rows in table.values() for b in rows))
    fig, axes = plt.subplots(2, len(buckets), figsize=(4 * len(buckets), 6.5), sharex=True, squeeze=False)
    for col, bucket in enumerate(buckets):
        for row, (key, name) in enumerate((("kl_mean", "KL mean"), ("kl_p99", "KL P99"))):
            ax = axes[row][col]
            for r, label in enumerate(labels):
                xs = [i for i, s in enumerate(stages)
                      if bucket in table[s] and table[s][bucket][key]["values"][r] is not None]
                ax.plot(xs, [table[stages[i]][bucket][key]["values"][r] for i in xs], marker="o", label=label)
            ax.set_title(f"{bucket}: {name}")
            ax.set_xticks(range(len(stages)), stages, rotation=30, ha="right", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("per-token KL to the teacher at each stage")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.compare", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directory or folder of evaluation JSONs, or LABEL=DIR; "
                    "the first is the reference of Δ")
    ap.add_argument("--json", type=Path, help="also write the comparison here as JSON")
    ap.add_argument("--plot", type=Path, help="also draw KL mean and P99 per bucket and stage into this PNG")
    args = ap.parse_args(argv)
    runs = parse_runs(args.runs)
    labels = list(runs)
    table = comparison(runs)
    print(markdown(labels, table))
    if args.json:
        atomic_write_text(args.json, json.dumps({"runs": labels, "stages": table}, indent=1) + "\n")
    if args.plot:
        plot(labels, table, args.plot)


if __name__ == "__main__":
    run_cli(main)
