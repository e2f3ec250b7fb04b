"""How far one stage's quality moves with the calibration seed alone: the spread that any speed lever's "KL within
2%" is judged against. Reads the manifests (a run's directory or its manifest file) of runs that differ only in --seed (each
evaluated with --eval) and
writes, per setting and bucket, every seed's KL mean / P99 / PPL, their mean and their range as a share of the
mean; each manifest is copied next to the summary.

    smelt seed-spread --out results/bench/oneshot-seeds [--reference today] \
        today=runs/seeds/today-seed0,runs/seeds/today-seed1 fast=runs/seeds/fast-seed0,runs/seeds/fast-seed1

With --reference LABEL, every other setting is also compared with that one seed by seed (the same seed draws
the same calibration windows in both): per bucket and metric the mean paired difference as a share of the
reference's mean, its standard error over the seeds (sd / sqrt(n)), and the reference's own seed-to-seed sd in
the same units, so a difference can be read against the draw's noise (`paired` in spread.json).
"""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text, read_json

METRICS = ("kl_mean", "kl_p99", "ppl")


def _manifest(p: Path) -> Path:
    return p if p.is_file() else p / "manifest.json"


def spread(dirs: list[Path]) -> dict:
    """{bucket: {metric: {"seeds": {seed: value}, "mean": m, "range_pct": 100 (max - min) / m}}}."""
    runs = {}
    for d in dirs:
        manifest = read_json(_manifest(d), "a stage's manifest")
        try:
            seed = manifest["settings"]["calibration"]["seed"]
            ev = manifest["metrics"]["eval"]
        except KeyError as e:
            raise SmeltError(f"settings: {_manifest(d)} has no {e.args[0]!r} (not a calibrated stage run with "
                             "--eval)") from None
        runs[seed] = ev.get("buckets", ev)
    out = {}
    for bucket in next(iter(runs.values())):
        out[bucket] = {}
        for k in METRICS:
            values = {s: round(r[bucket][k], 4) for s, r in sorted(runs.items())}
            m = statistics.fmean(values.values())
            out[bucket][k] = {"seeds": values, "mean": round(m, 4),
                              "range_pct": round(100 * (max(values.values()) - min(values.values())) / m, 2)}
    return out


def paired(setting: dict, reference: dict) -> dict:
    """{bucket: {metric: {"diff_pct", "se_pct", "n", "reference_sd_pct"}}} over the seeds both settings ran."""
    out = {}
    for bucket, ms in setting.items():
        out[bucket] = {}
        for k in METRICS:
            ref = reference[bucket][k]
            seeds = sorted(set(ms[k]["seeds"]) & set(ref["seeds"]))
            if len(seeds) < 2:
                raise SmeltError(f"--reference: fewer than two seeds in common with it for {bucket} {k}")
            m = ref["mean"]
            d = [100 * (ms[k]["seeds"][s] - ref["seeds"][s]) / m for s in seeds]
            out[bucket][k] = {"diff_pct": round(statistics.fmean(d), 2),
                              "se_pct": round(statistics.stdev(d) / len(d) ** 0.5, 2), "n": len(seeds),
                              "reference_sd_pct": round(100 * statistics.stdev(ref["seeds"].values()) / m, 2)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.seed_spread", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder: spread.json and a copy of each manifest")
    ap.add_argument("--reference", help="the LABEL every other setting is compared with, seed by seed")
    ap.add_argument("settings", nargs="+", help="LABEL=RUN,RUN,...: one setting's runs (directories or manifest "
                    "files), one per seed")
    args = ap.parse_args(argv)
    labels = [item.partition("=")[0] for item in args.settings]
    if any(not label or not sep or not dirs for label, sep, dirs in (i.partition("=") for i in args.settings)):
        raise SmeltError("settings: give each as LABEL=RUN,RUN,...")
    if args.reference is not None and args.reference not in labels:
        raise SmeltError(f"--reference {args.reference!r} is none of the settings' labels ({', '.join(labels)})")
    summary, runs = {}, {}
    for item in args.settings:
        label, _, dirs = item.partition("=")
        runs[label] = [Path(p) for p in dirs.split(",")]
        summary[label] = spread(runs[label])
    if args.reference is not None:
        summary["paired"] = {label: paired(summary[label], summary[args.reference])
                             for label in labels if label != args.reference}
    out = Path(args.out)  # written only once every input has been read and checked
    out.mkdir(parents=True, exist_ok=True)
    for label, paths in runs.items():
        for p in paths:
            name = p.name.removesuffix(".manifest.json")
            shutil.copy(_manifest(p), out / f"{label}-{name}.manifest.json")
    atomic_write_text(out / "spread.json", json.dumps(summary, indent=1) + "\n")
    for label in labels:
        for bucket, ms in summary[label].items():
            print(label, bucket, "  ".join(f"{k} {v['mean']:.4f} (range {v['range_pct']:.1f}%)" for k, v in ms.items()))
    for label, buckets in summary.get("paired", {}).items():
        for bucket, ms in buckets.items():
            print(f"{label} - {args.reference}", bucket, "  ".join(
                f"{k} {v['diff_pct']:+.2f} ± {v['se_pct']:.2f}% (ref sd {v['reference_sd_pct']:.2f}%)"
                for k, v in ms.items()))


if __name__ == "__main__":
    run_cli(main)
