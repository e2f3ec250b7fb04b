"""Peak RSS per rank after the trainer has built and loaded student and teacher, at several rank counts,
and after a few training steps next to the plan's estimate (configs.memory, what `--dry-run` prints).

    python -m train.bench_load --student DIR --teacher smollm2-135m --nproc 1,2,4 --out results/bench/load-rss.json

Each rank builds both models on the meta device, shards them (FSDP2) and reads only its own slices of
the safetensors, so the per-rank figure must not grow with the rank count (it shrinks by the model's
share; the rest is the Python/torch process itself). Then each run trains --steps steps (no checkpoint,
no export) and reports the peak RSS per rank again, beside the estimate for the same budget.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

from configs.memory import GIB, Budget, estimate, find_shape
from core.device import machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text

LOADED = re.compile(r"rank (\d+) loaded: peak RSS ([0-9.]+) GiB")
TRAINED = re.compile(r"rank (\d+) trained to step \d+: peak RSS ([0-9.]+) GiB")


def estimate_gib(teacher: str, nproc: int, seq_len: int) -> dict[str, float]:
    """The plan's per-rank estimate for this budget (2 windows a rank, fp32, CPU)."""
    shape = find_shape(teacher, None, None)
    mem = estimate(shape, Budget("recover", local_batch=2, seq_len=seq_len, dtype="float32", dp=nproc, device="cpu"))
    return {k: round(v / GIB, 3) for k, v in mem.items()}


def measure(student: str, teacher: str, nproc: int, config: str, seq_len: int, steps: int) -> dict:
    with TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "train.launch", "--nproc", str(nproc), "--all-ranks", "--",
               "--module", "train.config_registry", "--config", config, "--student", student,
               "--teacher", teacher, "--dump_folder", tmp, "--training.steps", str(steps),
               "--training.seq_len", str(seq_len), "--training.global_batch_size", str(2 * nproc),
               "--checkpoint.no-enable"]
        env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SmeltError(f"{nproc} ranks: training failed (exit {proc.returncode}): {log[-500:]!r}")
    loaded = {int(r): float(g) for r, g in LOADED.findall(log)}
    trained = {int(r): float(g) for r, g in TRAINED.findall(log)}
    if len(loaded) != nproc:
        raise SmeltError(f"{nproc} ranks: found the load figure of {len(loaded)} rank(s) only")
    return {"nproc": nproc, "loaded_peak_rss_gib": loaded, "trained_peak_rss_gib": trained, "steps": steps,
            "estimate_gib": estimate_gib(teacher, nproc, seq_len),
            "max_loaded_gib": max(loaded.values()), "command": shlex.join(cmd[1:])}


def main() -> None:
    ap = ArgumentParser(prog="python -m train.bench_load", description=__doc__.split("\n")[0])
    ap.add_argument("--student", required=True, help="artifact directory (HF layout)")
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--nproc", default="2,4", help="comma-separated rank counts")
    ap.add_argument("--config", default="smollm2_recover")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="training steps after loading")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args()
    counts = [int(n) for n in args.nproc.split(",")]
    runs = [measure(args.student, args.teacher, n, args.config, args.seq_len, args.steps) for n in counts]
    for r in runs:
        print(f"{r['nproc']} ranks: peak RSS per rank after loading "
              + ", ".join(f"{g:.3f}" for _, g in sorted(r["loaded_peak_rss_gib"].items())) + " GiB; after "
              f"{r['steps']} steps " + ", ".join(f"{g:.3f}" for _, g in sorted(r["trained_peak_rss_gib"].items()))
              + f" GiB (estimate {r['estimate_gib']['total']:.2f} GiB)")
    result = {"runs": runs, "machine": machine_record(), "command": shlex.join(["python", "-m", "train.bench_load",
                                                                                 *sys.argv[1:]])}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    run_cli(main)
