"""Benchmark: GPTQ wall time and peak RSS, with where the time goes (as prune.bench for pruning).

    python -m qat.bench [--teacher smollm2-135m --group-size 64 --act-order --calib-windows 128]
                        [--calib-forward float32 --calib-hessian float64] [--json OUT]

Runs qat.ptq.quantize_model once on the teacher (no artifact, no evaluation): block forwards, Hessian
accumulation and the GPTQ column sweeps.
"""
from __future__ import annotations

import json
import time

from core.calibrate import FORWARD_DTYPES, HESSIAN_DTYPES, CalibConfig
from core.device import default_device, machine_record, peak_rss_gib
from core.errors import ArgumentParser, run_cli
from core.files import atomic_write_text
from models.hf_io import load_hf, load_tokenizer
from models.teacher import DEFAULT_TEACHER, resolve_teacher
from qat.ptq import quantize_model
from qat.quantizers import QuantSpec


def main() -> None:
    ap = ArgumentParser(prog="python -m qat.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=DEFAULT_TEACHER)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--calib-forward", default=CalibConfig.forward, choices=FORWARD_DTYPES)
    ap.add_argument("--calib-hessian", default=CalibConfig.hessian, choices=HESSIAN_DTYPES)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    teacher_dir = resolve_teacher(args.teacher)
    t0 = time.perf_counter()
    model = load_hf(teacher_dir, device=str(default_device()))  # the GPU when one is present
    cfg = CalibConfig(n_windows=args.calib_windows, seq_len=args.calib_seq_len, forward=args.calib_forward,
                      hessian=args.calib_hessian)
    windows = cfg.windows(load_tokenizer(teacher_dir))
    t_load = time.perf_counter() - t0
    _, report = quantize_model(model, "gptq", QuantSpec(group_size=args.group_size), {}, windows, cfg,
                               act_order=args.act_order)
    wall = time.perf_counter() - t0
    split = report["seconds"]
    print(f"gptq W4 g{args.group_size} on {teacher_dir.name}, {args.calib_windows} x {args.calib_seq_len} windows, "
          f"forward {args.calib_forward}, hessian {args.calib_hessian}")
    print(f"wall time        {wall:8.1f} s   (load + tokenize {t_load:.1f} s)")
    print(f"peak RSS         {peak_rss_gib():8.2f} GiB")
    for key, v in split.items():
        print(f"  {key:<16}{v:8.1f} s")
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "stage": "gptq", "group_size": args.group_size, "act_order": args.act_order,
            "calibration": cfg.record(default_device()), "machine": machine_record(), "wall_s": wall, "load_s": t_load, "peak_rss_gib": peak_rss_gib(),
            "timings_s": split}, indent=2) + "\n")


if __name__ == "__main__":
    run_cli(main)
