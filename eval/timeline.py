"""Minutes per recipe stage from a recipe run's console log with a wall-clock time before every line.

    ./scripts/recipe.sh 2>&1 | while IFS= read -r l; do printf '%s %s\n' "$(date +%H:%M:%S)" "$l"; done > LOG
    smelt timeline LOG [--time-v TIME_V.txt] [--json OUT]        # or: python -m eval.timeline ...

Each stage starts at its `== name [kind]` line and ends where the next one starts (the last at the log's
last line); its evaluation is the part from its `python -m eval.evaluate` command on. --time-v adds
/usr/bin/time -v's elapsed time and peak RSS. Reads the log only.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text

LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) (.*)$")
STAGE = re.compile(r"^== (\S+) \[(\w+)\]")


def _seconds(h: str, m: str, s: str) -> int:
    return int(h) * 3600 + int(m) * 60 + int(s)


def timeline(text: str) -> dict:
    stamps, stages = [], []
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        t = _seconds(*m.groups()[:3])
        if stamps and t < stamps[-1]:
            t += 86400  # past midnight
        stamps.append(t)
        rest = m.group(4)
        if st := STAGE.match(rest):
            stages.append({"name": st.group(1), "kind": st.group(2), "start": t, "eval": None})
        elif stages and rest.startswith("$ python -m eval.evaluate") and stages[-1]["kind"] != "evaluate":
            stages[-1]["eval"] = t
    if not stages:
        raise SmeltError("log: no `== name [kind]` stage lines with a HH:MM:SS prefix in the log")
    out = []
    for i, st in enumerate(stages):
        end = stages[i + 1]["start"] if i + 1 < len(stages) else stamps[-1]
        split = st["eval"] if st["eval"] is not None else end
        out.append({"stage": st["name"], "kind": st["kind"], "work_min": round((split - st["start"]) / 60, 2),
                    "evaluation_min": round((end - split) / 60, 2), "total_min": round((end - st["start"]) / 60, 2)})
    return {"stages": out, "total_min": round((stamps[-1] - stages[0]["start"]) / 60, 2),
            "evaluation_min": round(sum(s["evaluation_min"] for s in out), 2)}


def time_v(text: str) -> dict:
    elapsed = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"elapsed": elapsed.group(1) if elapsed else None,
            "peak_rss_gib_largest_process": round(int(rss.group(1)) / 2**20, 2) if rss else None}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.timeline", description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path, help="the recipe's console log, HH:MM:SS before every line")
    ap.add_argument("--time-v", type=Path, help="/usr/bin/time -v's output file for the same run")
    ap.add_argument("--json", type=Path, help="also write the timeline here")
    args = ap.parse_args(argv)
    result = timeline(args.log.read_text(errors="replace"))
    if args.time_v:
        result["time_v"] = time_v(args.time_v.read_text())
    for s in result["stages"]:
        print(f"{s['stage']:<10} {s['kind']:<8} work {s['work_min']:6.2f} min  evaluation {s['evaluation_min']:5.2f} min")
    print(f"total {result['total_min']:.2f} min, of which evaluation {result['evaluation_min']:.2f}")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run_cli(main)
