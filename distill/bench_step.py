"""Benchmark: distillation step time vs a plain cross-entropy step, same student, same batch.

    python -m distill.bench_step [--teacher smollm2-135m] [--batch 4 --seq-len 256 --repeats 5]
        [--top-k 64] [--dtype bfloat16] [--out results/bench/....json]

All steps are forward + backward + AdamW on the student; the distillation step adds the frozen
teacher's forward and the chunked KL; the cached-teacher step (topk) reads the teacher's top-k for the
batch, computed once before timing (distill.teacher_cache), so it has the KL but no teacher forward. They are timed interleaved in one process (so machine noise hits
both alike), and each mode's peak memory is measured in a fresh subprocess (peak RSS on CPU,
max_memory_allocated on GPU). Target: ratio <= 1.45 (the teacher forward alone makes ~1.33).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from core.device import default_device, machine_record, peak_rss_gib
from core.errors import ArgumentParser, run_cli
from core.files import atomic_write_text
from core.teacher_topk import topk_from_logits
from distill.losses import DistillLoss
from models.hf_io import load_hf
from models.teacher import DEFAULT_TEACHER, resolve_teacher

MODES = ("ce", "kd", "topk")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_step(mode: str, student, teacher, opt, loss_fn, batch: torch.Tensor, top_k: int = 64):
    inputs, labels = batch[:, :-1], batch[:, 1:]
    if mode == "topk":  # what the cache would hold for this batch; built here, outside the timed step
        with torch.no_grad():  # the student starts as the teacher's weights: no teacher needs loading for it
            cached = topk_from_logits((teacher or student)(inputs), top_k)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = student(inputs)
        if mode == "ce":
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        elif mode == "topk":
            loss, _ = loss_fn(logits, cached, labels)
        else:
            with torch.no_grad():
                t_logits = teacher(inputs)
            loss, _ = loss_fn(logits, t_logits, labels)
        loss.backward()
        opt.step()
    return step


def setup(teacher_dir, batch: int, seq_len: int, device, dtype, with_teacher: bool = True):
    student = load_hf(teacher_dir).to(device, dtype)
    teacher = load_hf(teacher_dir).to(device, dtype).requires_grad_(False).eval() if with_teacher else None
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, foreach=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, student.cfg.vocab_size, (batch, seq_len + 1), generator=g).to(device)
    return student, teacher, opt, DistillLoss(), tokens


def peak_memory_of(mode: str, args) -> float:
    """Run one mode alone in a subprocess; its peak memory in GiB."""
    cmd = [sys.executable, "-m", "distill.bench_step", "--teacher", args.teacher, "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--repeats", "2", "--only", mode, "--top-k", str(args.top_k),
           "--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_gib"]


def main() -> None:
    ap = ArgumentParser(prog="python -m distill.bench_step", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=DEFAULT_TEACHER)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=64, help="the cached teacher's k (topk mode)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="student and teacher dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--out", help="also write the medians and ratios here (JSON)")
    ap.add_argument("--only", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = default_device()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    teacher_dir = resolve_teacher(args.teacher)
    student, teacher, opt, loss_fn, tokens = setup(teacher_dir, args.batch, args.seq_len, device, dtype,
                                                   with_teacher=args.only not in ("ce", "topk"))
    modes = [args.only] if args.only else list(MODES)
    steps = {m: make_step(m, student, teacher, opt, loss_fn, tokens, args.top_k) for m in modes}
    for m in modes:  # warm-up (allocator, AdamW state)
        steps[m]()
    times = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            _sync(device)
            t0 = time.perf_counter()
            steps[m]()
            _sync(device)
            times[m].append(time.perf_counter() - t0)
    if args.only:
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else peak_rss_gib()
        print(json.dumps({"mode": args.only, "peak_gib": peak}))
        return
    ce, kd, tk = (statistics.median(times[m]) for m in MODES)
    print(f"device={device.type} dtype={dtype} batch={args.batch}x{args.seq_len} repeats={args.repeats}")
    print(f"cross-entropy step  {ce * 1000:9.1f} ms (median)")
    print(f"distillation step   {kd * 1000:9.1f} ms (median)")
    print(f"cached top-{args.top_k} step {tk * 1000:8.1f} ms (median)")
    print(f"ratio distill/CE    {kd / ce:9.3f}   (target <= 1.45)")
    print(f"ratio cached/distill {tk / kd:8.3f}")
    del student, teacher, opt
    peaks = {m: peak_memory_of(m, args) for m in MODES}
    print("peak memory  " + "   ".join(f"{m} {v:.2f} GiB" for m, v in peaks.items()))
    if args.out:
        atomic_write_text(args.out, json.dumps({
            "command": " ".join(["python -m distill.bench_step", *sys.argv[1:]]), "device": device.type,
            "dtype": str(dtype), "batch": args.batch, "seq_len": args.seq_len, "repeats": args.repeats,
            "top_k": args.top_k, "median_ms": {m: round(statistics.median(times[m]) * 1000, 1) for m in MODES},
            "ratio_distill_over_ce": round(kd / ce, 3), "ratio_cached_over_distill": round(tk / kd, 3),
            "peak_gib": peaks, "machine": machine_record()}, indent=2) + "\n")


if __name__ == "__main__":
    run_cli(main)
