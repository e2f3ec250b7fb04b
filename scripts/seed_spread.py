"""How far one stage's quality moves with the calibration seed alone: the spread that any speed lever's "KL within
2%" is judged against. Reads the manifests (a run's directory or its manifest file) of runs that differ only in --seed (each
evaluated with --eval) and
writes, per setting and bucket, every seed's KL mean / P99 / PPL, their mean and their range as a share of the
mean; each manifest is copied next to the summary.

    python scripts/seed_spread.py --out results/bench/oneshot-seeds \
        today=runs/seeds/today-seed0,runs/seeds/today-seed1 fast=runs/seeds/fast-seed0,runs/seeds/fast-seed1
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

METRICS = ("kl_mean", "kl_p99", "ppl")


def _manifest(p: Path) -> Path:
    return p if p.is_file() else p / "manifest.json"


def spread(dirs: list[Path]) -> dict:
    """{bucket: {metric: {"seeds": {seed: value}, "mean": m, "range_pct": 100 (max - min) / m}}}."""
    runs = {}
    for d in dirs:
        manifest = json.loads(_manifest(d).read_text())
        seed = manifest["settings"]["calibration"]["seed"]
        ev = manifest["metrics"]["eval"]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("settings", nargs="+", help="LABEL=RUN,RUN,...: one setting's runs (directories or manifest "
                    "files), one per seed")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for item in args.settings:
        label, _, dirs = item.partition("=")
        paths = [Path(p) for p in dirs.split(",")]
        summary[label] = spread(paths)
        for p in paths:
            name = p.name.removesuffix(".manifest.json")
            shutil.copy(_manifest(p), out / f"{label}-{name}.manifest.json")
    tmp = out / "spread.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(out / "spread.json")
    for label, buckets in summary.items():
        for bucket, ms in buckets.items():
            print(label, bucket, "  ".join(f"{k} {v['mean']:.4f} (range {v['range_pct']:.1f}%)" for k, v in ms.items()))


if __name__ == "__main__":
    main()
