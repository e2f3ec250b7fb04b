"""Seconds per optimizer step of training runs, from torchtitan's structured logs (rank 0).

    python experiments/step_times.py RUN_DIR [RUN_DIR ...] [--skip 1] [--json OUT]

RUN_DIR is a trainer's --dump_folder. Per run: steps, median / mean step seconds (step_start -> step_end;
the first --skip steps left out: they include lazy initialisation), the checkpoint saves' total seconds and
the wall time from the trainer's build to its last step. Reads logs only; runs nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def events(run: Path) -> list[dict]:
    logs = sorted((run / "structured_logs").glob("*.global_rank_0.*.jsonl"))
    if not logs:
        raise SystemExit(f"error: {run}: no structured_logs/*global_rank_0*.jsonl (not a trainer dump folder?)")
    return [json.loads(line) for f in logs for line in f.read_text().splitlines() if line.strip()]


def spans(evs: list[dict], name: str) -> list[float]:
    """Seconds between each `<name>_start` and the next `<name>_end`."""
    out, start = [], None
    for e in evs:
        if e["log_type_name"] == f"{name}_start":
            start = e["time_us"]
        elif e["log_type_name"] == f"{name}_end" and start is not None:
            out.append((e["time_us"] - start) / 1e6)
            start = None
    return out


def summary(run: Path, skip: int = 1) -> dict:
    evs = events(run)
    steps = spans(evs, "step")
    timed = steps[skip:] or steps
    first = next(e["time_us"] for e in evs if e["log_type_name"].endswith("Config.build_start"))
    last = max(e["time_us"] for e in evs if e["log_type_name"] == "step_end") if steps else first
    return {"steps": len(steps), "skipped": len(steps) - len(timed),
            "median_step_s": round(statistics.median(timed), 3) if timed else None,
            "mean_step_s": round(statistics.fmean(timed), 3) if timed else None,
            "checkpoint_save_s": round(sum(spans(evs, "checkpoint_save")), 2),
            "build_to_last_step_s": round((last - first) / 1e6, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python experiments/step_times.py", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--skip", type=int, default=1, help="leading steps left out of the median (default 1)")
    ap.add_argument("--json", type=Path, help="also write {run: summary} here")
    args = ap.parse_args(argv)
    out = {str(r): summary(r, args.skip) for r in args.runs}
    for r, s in out.items():
        print(f"{r}: {s}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
