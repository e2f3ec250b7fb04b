"""The one-shot stages' speed levers, time and quality side by side: each setting of the calibration engine
runs the real stage command (prune.run / qat.ptq with --eval) as its own process on the real teacher, the
settings interleaved so machine drift hits them alike; the table gives each setting's calibration work
time as a ratio to the first setting (today's default), its peak RSS, and its evaluation against the
teacher (per-bucket KL mean / P99, PPL) next to the first setting's.

    .venv/bin/python experiments/bench_oneshot.py --runs runs/oneshot --out results/bench/oneshot \
        [--stages sparsegpt,wanda,gptq] [--settings float32/float64,float32/float32,bfloat16/float64,bfloat16/float32]
        [--stage-settings wanda=float32/float64,bfloat16/float64] [--repeats 1] [--windows 128]

A setting is FORWARD/HESSIAN (CalibConfig.forward / .hessian), FORWARD/HESSIAN/ts (and true-sequential
calibration, CalibConfig.true_sequential), FORWARD/HESSIAN/ns (every block calibrated on the dense model's
activations, one forward per block: CalibConfig.sequential off), or `today`: the same stage command run from
--today-tree, a checkout of the code before these levers (`git worktree add /tmp/today <commit>`), with its
own defaults; or LABEL from `--tree LABEL=PATH`: another checkout, run the same way (e.g. the previous
commit, to time one change). Writes OUT/summary.json (+ each run's manifest as OUT/<stage>-<setting>-r<k>.manifest.json).
Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

MIX = "wikitext2-valid+code-train+zh-train"  # the recipe's calibration text
COMMANDS = {
    "sparsegpt": ["-m", "prune.run", "--method", "sparsegpt", "--pattern", "2:4"],
    "wanda": ["-m", "prune.run", "--method", "wanda", "--pattern", "2:4"],
    "gptq": ["-m", "qat.ptq", "--method", "gptq", "--group-size", "64", "--act-order"],
}
ORDERS = {"ts": "--calib-true-sequential", "ns": "--no-sequential"}  # a setting's third part: one forward per block


def _work(manifest: dict) -> tuple[float, float]:
    """(calibration work seconds, peak RSS GiB) from a stage's manifest."""
    m = manifest["metrics"]
    if "ptq" in m:
        return m["ptq"]["wall_s"], m["ptq"].get("peak_rss_gib")  # absent before it was recorded
    return m["timings_s"]["total_s"], m.get("peak_rss_gib")


def _quality(manifest: dict) -> dict:
    ev = manifest["metrics"]["eval"]
    ev = ev.get("buckets", ev)
    return {b: {k: round(v[k], 4) for k in ("ppl", "kl_mean", "kl_p99", "top1_agree")} for b, v in ev.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="where the artifacts go (deleted after reading unless --keep)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--stages", default="sparsegpt,wanda,gptq")
    ap.add_argument("--settings", default="float32/float64,float32/float32,bfloat16/float64,bfloat16/float32")
    ap.add_argument("--stage-settings", action="append", default=[],
                    help="STAGE=S1,S2,...: settings for one stage (default: --settings)")
    ap.add_argument("--today-tree", help="checkout of the code the `today` setting runs")
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH: a checkout the setting LABEL runs")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    out, runs = Path(args.out), Path(args.runs)
    stages = args.stages.split(",")
    per_stage = {st: args.settings.split(",") for st in stages}
    for item in args.stage_settings:
        st, _, settings = item.partition("=")
        per_stage[st] = settings.split(",")
    bad = next((t for t in args.tree if "=" not in t or not t.partition("=")[0] or "/" in t.partition("=")[0]), None)
    if bad is not None:
        ap.error(f"--tree {bad!r} must be LABEL=PATH (a label without '/', so it is no FORWARD/HESSIAN setting)")
    trees = dict(t.split("=", 1) for t in args.tree)
    if args.today_tree:
        trees["today"] = args.today_tree
    for setting in {x for settings in per_stage.values() for x in settings if x not in trees}:
        parts = setting.split("/")  # checked before any run: a typo must not cost the runs before it
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ORDERS):
            ap.error(f"setting {setting!r} must be FORWARD/HESSIAN[/ts|/ns], or `today` with --today-tree, "
                     "or a --tree label")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.repeats):
        for st in stages:
            for setting in per_stage[st]:
                name = f"{st}-{setting.replace('/', '-')}-r{r}"
                cmd = [sys.executable, *COMMANDS[st], "--calib-windows", str(args.windows), "--calib-corpus", MIX,
                       "--eval", "--overwrite", "--out", str((runs / name).resolve())]
                if setting not in trees:
                    fwd, hess, *order = setting.split("/")
                    cmd += ["--calib-forward", fwd, "--calib-hessian", hess]
                    if order:
                        cmd.append(ORDERS[order[0]])
                cwd = trees.get(setting)
                print(f"$ {'(in ' + cwd + ') ' if cwd else ''}python", " ".join(cmd[1:]), flush=True)
                proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (its tree: eval included)
                proc.returncode = os.waitstatus_to_exitcode(status)
                if proc.returncode:
                    raise SystemExit(f"{name} failed with exit code {proc.returncode}")
                tree_rss = usage.ru_maxrss / 2**20
                manifest = json.loads((runs / name / "manifest.json").read_text())
                (out / f"{name}.manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
                work, rss = _work(manifest)
                results.setdefault((st, setting), []).append({"work_s": work, "peak_rss_gib": rss,
                                                              "tree_peak_rss_gib": tree_rss,
                                                              "quality": _quality(manifest)})
                print(f"  {work:.1f} s, peak {rss} GiB (with eval {tree_rss:.2f}), {_quality(manifest)}", flush=True)
                if not args.keep:
                    shutil.rmtree(runs / name)
    summary = {"windows": args.windows, "repeats": args.repeats, "calibration_corpus": MIX, "rows": []}
    for st in stages:
        base = statistics.median(x["work_s"] for x in results[(st, per_stage[st][0])])
        base_q = results[(st, per_stage[st][0])][0]["quality"]
        for setting in per_stage[st]:
            rs = results[(st, setting)]
            work = statistics.median(x["work_s"] for x in rs)
            q = rs[0]["quality"]
            row = {"stage": st, "setting": setting, "work_s": round(work, 1), "speedup": round(base / work, 2),
                   "peak_rss_gib": None if rs[0]["peak_rss_gib"] is None else max(x["peak_rss_gib"] for x in rs),
                   "tree_peak_rss_gib": round(max(x["tree_peak_rss_gib"] for x in rs), 2), "quality": q,
                   "kl_mean_change": {b: round(q[b]["kl_mean"] / base_q[b]["kl_mean"] - 1, 4) for b in q},
                   "kl_p99_change": {b: round(q[b]["kl_p99"] / base_q[b]["kl_p99"] - 1, 4) for b in q},
                   "ppl_change": {b: round(q[b]["ppl"] / base_q[b]["ppl"] - 1, 4) for b in q}}
            summary["rows"].append(row)
            print(f"{st:9s} {setting:18s} {work:7.1f} s {base / work:5.2f}x peak {row['peak_rss_gib']} GiB "
                  f"KL mean {row['kl_mean_change']} P99 {row['kl_p99_change']}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
