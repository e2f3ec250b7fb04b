"""The two prefill changes behind eval.needle's (and every sampler's) speed, side by side in one process.

    python experiments/bench_prefill.py [--teacher smollm2-135m] [--batch 2] [--length 2048] [--repeats 3] \
        [--out results/bench/prefill.json]

- head: a cached prefill with the output head over every prompt position (what sampling did) against the
  head on the last position only (what it does now); both on the real model, interleaved.
- attention: one layer's SDPA call on a prefill with an explicit [L, L] causal mask (the KV cache's general
  path) against the fused causal kernel (its prefill path now), at the model's head shape.
Reports the median seconds of each and checks that the outputs agree.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from core.device import interleaved_seconds, machine_record
from core.files import atomic_write_text
from models.hf_io import load_hf
from models.teacher import resolve_teacher


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python experiments/bench_prefill.py", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    model = load_hf(resolve_teacher(args.teacher)).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(0))

    def every_position():
        return model(tokens, model.new_cache(args.batch, args.length))[:, -1]

    def last_position():
        return model.output(model.hidden_states(tokens, model.new_cache(args.batch, args.length))[:, -1])

    cfg, g = model.cfg, torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(args.batch, cfg.n_heads, args.length, cfg.head_dim, generator=g) for _ in range(3))
    mask = torch.ones(args.length, args.length, dtype=torch.bool).tril()
    cases = {"head over every position": every_position, "head on the last position": last_position,
             "SDPA, explicit causal mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
             "SDPA, fused causal kernel": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    times, outs = interleaved_seconds(cases, args.repeats)
    names = list(cases)
    result = {"what": __doc__.split("\n")[0], "batch": args.batch, "length": args.length, "repeats": args.repeats,
              "median_s": {n: round(statistics.median(times[n]), 4) for n in names},
              "seconds": {n: [round(x, 4) for x in times[n]] for n in names},
              "max_abs_diff": {"head": (outs[names[0]] - outs[names[1]]).abs().max().item(),
                               "attention": (outs[names[2]] - outs[names[3]]).abs().max().item()},
              "machine": machine_record()}
    m = result["median_s"]
    result["speedup"] = {"head": round(m[names[0]] / m[names[1]], 3), "attention": round(m[names[2]] / m[names[3]], 3)}
    print(json.dumps({k: result[k] for k in ("median_s", "speedup", "max_abs_diff")}, indent=1))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
