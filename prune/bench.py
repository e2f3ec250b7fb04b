"""Benchmark: pruning wall time and peak RSS, with where the time goes.

    python -m prune.bench [--teacher smollm2-135m --method sparsegpt --pattern 2:4 --calib-windows 128]
                          [--calib-forward float32 --calib-hessian float64] [--calib-true-sequential] [--json OUT]

Runs prune.run.prune_model once (no artifact written, no evaluation) and prints wall time, peak resident
memory of the process (target for SparseGPT 2:4 on SmolLM2 with 128 x 512 windows: <= 3 GiB, since
activations are streamed block by block), and the split: block forward passes, Hessian/norm
accumulation, Hessian inverses, and the pruning updates. `--json` also writes them (experiments/bench_oneshot.py
runs several settings interleaved and prints ratios).
"""
from __future__ import annotations

import json
import time

from core.calibrate import CalibConfig, add_precision_args
from core.device import default_device, machine_record, peak_device_memory_gib, peak_rss_gib
from core.errors import ArgumentParser, run_cli
from core.files import atomic_write_text
from core.patterns import NMPattern
from models.hf_io import load_hf, load_tokenizer
from models.teacher import DEFAULT_TEACHER, resolve_teacher
from prune.run import prune_model


def main() -> None:
    ap = ArgumentParser(prog="python -m prune.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=DEFAULT_TEACHER)
    ap.add_argument("--method", default="sparsegpt")
    ap.add_argument("--pattern", default="2:4")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    add_precision_args(ap)
    ap.add_argument("--calib-true-sequential", action="store_true", help="one forward pass per block (docs/performance.md)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    pattern = NMPattern.parse(args.pattern) if args.pattern else None
    teacher_dir = resolve_teacher(args.teacher)
    t0 = time.perf_counter()
    model = load_hf(teacher_dir, device=str(default_device()))  # the GPU when one is present
    cfg = CalibConfig(n_windows=args.calib_windows, seq_len=args.calib_seq_len, forward=args.calib_forward,
                      hessian=args.calib_hessian, true_sequential=args.calib_true_sequential)
    windows = cfg.windows(load_tokenizer(teacher_dir))
    t_load = time.perf_counter() - t0
    _, report = prune_model(model, windows, args.method, args.sparsity, pattern, cfg=cfg)
    wall = time.perf_counter() - t0
    split = report["timings_s"]
    print(f"{args.method} {args.pattern or args.sparsity} on {teacher_dir.name}, "
          f"{args.calib_windows} x {args.calib_seq_len} calibration windows")
    print(f"wall time        {wall:8.1f} s   (load + tokenize {t_load:.1f} s)")
    print(f"peak RSS         {peak_rss_gib():8.2f} GiB (the recipe's CPU budget: <= 2.5 GiB)")
    gpu = peak_device_memory_gib(default_device())
    if gpu is not None:
        print(f"peak GPU memory  {gpu:8.2f} GiB (allocated by tensors)")
    for key in ("forward_s", "stats_s", "hessian_inverse_s", "prune_update_s", "metrics_s"):
        if key in split:
            print(f"  {key:<16}{split[key]:8.1f} s  ({100 * split[key] / max(split['total_s'], 1e-9):4.1f}%)")
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "stage": "prune", "method": args.method, "pattern": args.pattern,
            "calibration": cfg.record(default_device()), "machine": machine_record(),
            "wall_s": wall, "load_s": t_load, "peak_rss_gib": peak_rss_gib(),
            "peak_gpu_memory_gib": gpu, "timings_s": split}, indent=2) + "\n")


if __name__ == "__main__":
    run_cli(main)
