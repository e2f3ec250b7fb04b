"""Why a 2-token verification costs ~2 decode steps on some CPUs (issue 13): F.linear at a few rows.

Median microseconds of F.linear(x[M, in], W[out, in]) for M = 1, 2, 3, 4, 8 on SmolLM2's shapes (q/o, gate/up,
down, the output head), fp32 and bf16; also M=2 as two M=1 calls ('2xgemv') and as (W @ x.T).T ('mv_T').

    python scripts/bench_small_m_linear.py --out results/bench/mtp/small-m-linear.json
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def median_us(fn, n: int) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for dt in (torch.float32, torch.bfloat16):
        for out, inn in ((576, 576), (1536, 576), (576, 1536), (49152, 576)):
            n = 50 if out > 40000 else 200
            w = torch.randn(out, inn, dtype=dt)
            r = {}
            for m in (1, 2, 3, 4, 8):
                x = torch.randn(m, inn, dtype=dt)
                r[m] = median_us(lambda: F.linear(x, w), n)
            x2 = torch.randn(2, inn, dtype=dt)
            r["2xgemv"] = median_us(lambda: torch.stack([F.linear(x2[0], w), F.linear(x2[1], w)]), n)
            r["mv_T"] = median_us(lambda: (w @ x2.T).T, n)
            print(dt, (out, inn), {k: round(v, 1) for k, v in r.items()}, flush=True)
            rows.append({"dtype": str(dt).removeprefix("torch."), "out": out, "in": inn,
                         "median_us": {str(k): v for k, v in r.items()}})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python scripts/bench_small_m_linear.py", "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
