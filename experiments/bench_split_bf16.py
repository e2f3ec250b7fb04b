"""Can a calibration forward be fast *and* near-exact? One linear of SmolLM2's MLP shape ([tokens x 576] x
[576 x 1536]) timed four ways, interleaved, with each result's relative error against fp64: fp32; bf16 tensors;
fp32 tensors through oneDNN's bf16 math mode (inputs rounded inside the matmul, fp32 out); and the split
x·W ≈ hi(x)·hi(W) + hi(x)·lo(W) + lo(x)·hi(W) in that mode (three bf16 products, fp32 sums), which keeps about
16 bits of each operand. Run it on an idle machine; it writes one JSON.

    python experiments/bench_split_bf16.py --out results/bench/oneshot-seeds-wanda-6/split-bf16.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from core.device import interleaved_seconds, machine_record
from core.files import atomic_write_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, 576, generator=g)
    w = torch.randn(1536, 576, generator=g) * 0.05
    xb, wb = x.bfloat16(), w.bfloat16()
    w_hi = wb.float()
    w_lo = w - w_hi
    mkl = torch.backends.mkldnn.matmul

    def math_mode(fn, mode="bf16"):
        def run():
            before, mkl.fp32_precision = mkl.fp32_precision, mode
            try:
                return fn()
            finally:
                mkl.fp32_precision = before
        return run

    def split3():
        x_hi = x.bfloat16().float()
        return F.linear(x_hi, w_hi) + F.linear(x_hi, w_lo) + F.linear(x - x_hi, w_hi)

    ways = {"fp32": lambda: F.linear(x, w), "bf16 tensors": lambda: F.linear(xb, wb).float(),
            "fp32 tensors, bf16 math mode": math_mode(lambda: F.linear(x, w)),
            "split hi/lo, three bf16 products": math_mode(split3)}
    ref = x.double() @ w.double().T
    errors = {k: ((f().double() - ref).norm() / ref.norm()).item() for k, f in ways.items()}  # also a warm-up
    times, _ = interleaved_seconds(ways, args.repeats)
    rows = {k: {"median_ms": round(1e3 * statistics.median(times[k]), 2), "relative_error": float(f"{errors[k]:.3g}")}
            for k in ways}
    for k, r in rows.items():
        print(f"{k:34s} {r['median_ms']:8.2f} ms  error {r['relative_error']:.2e}")
    atomic_write_text(args.out, json.dumps({"shape": [args.tokens, 576, 1536], "repeats": args.repeats,
                                            "machine": machine_record(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
