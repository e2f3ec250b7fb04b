"""The one-shot stages' speed levers, measured side by side: each setting of the calibration engine runs
as its own process (prune.bench / qat.bench), settings interleaved within each repeat so machine drift hits
them alike, and the table prints each setting's wall time as a ratio to the first (today's default).

    .venv/bin/python scripts/bench_oneshot.py --out results/bench/oneshot [--repeats 2] [--windows 128]
        [--stages sparsegpt,wanda,gptq] [--settings float32/float64,float32/float32,bfloat16/float64,bfloat16/float32]

A setting is FORWARD/HESSIAN (CalibConfig.forward / .hessian). Writes OUT/<stage>-<setting>-r<k>.json
and OUT/summary.json. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

COMMANDS = {
    "sparsegpt": ["-m", "prune.bench", "--method", "sparsegpt", "--pattern", "2:4"],
    "wanda": ["-m", "prune.bench", "--method", "wanda", "--pattern", "2:4"],
    "gptq": ["-m", "qat.bench", "--group-size", "64", "--act-order"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--stages", default="sparsegpt,wanda,gptq")
    ap.add_argument("--settings", default="float32/float64,float32/float32,bfloat16/float64,bfloat16/float32")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = args.settings.split(",")
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.repeats):
        for stage in args.stages.split(","):
            for setting in settings:
                fwd, hess = setting.split("/")
                path = out / f"{stage}-{fwd}-{hess}-r{r}.json"
                cmd = [sys.executable, *COMMANDS[stage], "--calib-windows", str(args.windows),
                       "--calib-forward", fwd, "--calib-hessian", hess, "--json", str(path)]
                print("$", " ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                runs.setdefault((stage, setting), []).append(json.loads(path.read_text()))
    summary = {"windows": args.windows, "repeats": args.repeats, "rows": []}
    for stage in args.stages.split(","):
        base = statistics.median(x["wall_s"] - x["load_s"] for x in runs[(stage, settings[0])])
        for setting in settings:
            rs = runs[(stage, setting)]
            work = statistics.median(x["wall_s"] - x["load_s"] for x in rs)
            row = {"stage": stage, "setting": setting, "work_s": round(work, 1), "speedup": round(base / work, 2),
                   "peak_rss_gib": round(max(x["peak_rss_gib"] for x in rs), 2),
                   "split_s": {k: round(statistics.median(x["timings_s"].get(k, 0) for x in rs), 1)
                               for k in rs[0]["timings_s"]}}
            summary["rows"].append(row)
            print(f"{stage:9s} {setting:18s} {work:7.1f} s  {base / work:5.2f}x  peak {row['peak_rss_gib']:.2f} GiB  "
                  f"{row['split_s']}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
