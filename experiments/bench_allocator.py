"""Peak RSS and time of one one-shot stage under glibc allocator settings, interleaved repeats: the same
command, only GLIBC_TUNABLES differs, so the artifact must be byte-identical (checked by hash) and what moves
is how much freed memory glibc keeps.

    .venv/bin/python experiments/bench_allocator.py --runs /tmp/alloc --out results/bench/oneshot-allocator \
        --variant default= --variant mmap8MiB=glibc.malloc.mmap_threshold=8388608 --repeats 2 \
        -- -m prune.run --method sparsegpt --pattern 2:4 --calib-forward bfloat16 --calib-hessian bfloat16 \
        --calib-true-sequential

Run it on an otherwise idle machine. Writes OUT/summary.json: per variant, each repeat's calibration seconds
(the stage's own timer), peak RSS (its manifest) and the artifact's sha256.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from core.device import machine_record


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="scratch directory for the artifacts (deleted after reading)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", action="append", required=True,
                    help="LABEL=TUNABLES (GLIBC_TUNABLES' value; empty for glibc's defaults)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the stage's python arguments")
    args = ap.parse_args()
    command = [a for a in args.command if a != "--"]
    if not command:
        ap.error("give the stage's python arguments after --")
    variants = dict(v.split("=", 1) for v in args.variant)
    runs, out = Path(args.runs), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {label: [] for label in variants}
    for r in range(args.repeats):
        for label, tunables in variants.items():
            art = runs / f"{label}-r{r}"
            env = dict(os.environ)
            env.pop("GLIBC_TUNABLES", None)
            if tunables:
                env["GLIBC_TUNABLES"] = tunables
            argv = [sys.executable, *command, "--overwrite", "--out", str(art)]
            print("$", f"GLIBC_TUNABLES={tunables}" if tunables else "", " ".join(argv[1:]), flush=True)
            subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
            m = json.loads((art / "manifest.json").read_text())["metrics"]
            work = m["ptq"]["wall_s"] if "ptq" in m else m["timings_s"]["total_s"]
            rss = m["ptq"]["peak_rss_gib"] if "ptq" in m else m["peak_rss_gib"]
            rows[label].append({"work_s": round(work, 1), "peak_rss_gib": rss,
                                "model_sha256": _sha256(art / "model.safetensors")})
            print(f"  {label}: {work:.1f} s, peak {rss} GiB", flush=True)
            shutil.rmtree(art)
    base = statistics.median(x["work_s"] for x in rows[next(iter(variants))])
    summary = {"command": command, "repeats": args.repeats, "machine": machine_record(), "variants": [
        {"label": label, "glibc_tunables": variants[label], "runs": rs,
         "median_work_s": statistics.median(x["work_s"] for x in rs),
         "time_ratio": round(statistics.median(x["work_s"] for x in rs) / base, 3),
         "max_peak_rss_gib": max(x["peak_rss_gib"] for x in rs)} for label, rs in rows.items()],
        "identical_artifacts": len({x["model_sha256"] for rs in rows.values() for x in rs}) == 1}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for v in summary["variants"]:
        print(f"{v['label']:12s} {v['median_work_s']:7.1f} s  x{v['time_ratio']:.3f}  peak <= {v['max_peak_rss_gib']} GiB")
    print("identical artifacts:", summary["identical_artifacts"])


if __name__ == "__main__":
    main()
