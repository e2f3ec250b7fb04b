"""Why a 2-token verification costs ~2 decode steps on some CPUs: F.linear at a few rows.

Median microseconds of F.linear(x[M, in], W[out, in]) for M = 1, 2, 3, 4, 8 on SmolLM2's shapes (q/o, gate/up,
down, the output head), fp32 and bf16; also M=2 as two M=1 calls ('2xgemv'), and every M as (W @ x.T).T
('mv_T M'; 'mv_T' alone is M=2): the forms among which models.generate.small_m_linears picks, per machine.
The cases of one shape run interleaved (core.device.interleaved_seconds), after one warm-up round.

    python experiments/bench_small_m_linear.py --out results/bench/mtp/small-m-linear.json
    python experiments/bench_small_m_linear.py --shapes 4096x576,8192x576,16384x576 --dtypes float32 \
        --out results/bench/mtp/small-m-linear-draft-heads.json   # restricted draft heads (--draft-vocab)
"""
import argparse
import json
import shlex
import sys
from functools import partial

import torch
import torch.nn.functional as F

from core.device import interleaved_seconds, machine_record


def _two_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([F.linear(x[0], w), F.linear(x[1], w)])


def _mv_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w @ x.T).T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="576x576,1536x576,576x1536,49152x576", help="OUTxIN weight shapes")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
        dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    except (ValueError, AttributeError):
        ap.error(f"--shapes {args.shapes!r} / --dtypes {args.dtypes!r}: OUTxIN,... and torch dtype names")
    if any(len(s) != 2 or min(s) < 1 for s in shapes) or not all(isinstance(d, torch.dtype) for d in dtypes):
        ap.error(f"--shapes {args.shapes!r} / --dtypes {args.dtypes!r}: OUTxIN with positive sizes, torch dtypes")
    torch.manual_seed(0)
    rows = []
    for dt in dtypes:
        for out, inn in shapes:
            w = torch.randn(out, inn, dtype=dt)
            cases = {str(m): partial(F.linear, torch.randn(m, inn, dtype=dt), w) for m in (1, 2, 3, 4, 8)}
            x2 = torch.randn(2, inn, dtype=dt)
            cases["2xgemv"], cases["mv_T"] = partial(_two_gemv, x2, w), partial(_mv_t, x2, w)
            cases.update({f"mv_T {m}": partial(_mv_t, torch.randn(m, inn, dtype=dt), w) for m in (1, 3, 4, 8)})
            interleaved_seconds(cases, 1)  # warm-up
            times, _ = interleaved_seconds(cases, 50 if out > 40000 else 200)
            us = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
            print(dt, (out, inn), {k: round(v, 1) for k, v in us.items()}, flush=True)
            rows.append({"dtype": str(dt).removeprefix("torch."), "out": out, "in": inn, "median_us": us})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": shlex.join(["python", "experiments/bench_small_m_linear.py", *sys.argv[1:]]),
                       "machine": machine_record(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
