"""Cached decoding with grouped-query attention read from the cache in place against the cache repeated per
query head, side by side in one process on the real model.

    python experiments/bench_decode_gqa.py [--teacher smollm2-135m] [--batches 64,1] [--context 192] [--steps 16] \
        [--repeats 3] [--out results/bench/decode-gqa.json]

Each case fills a KV cache with `context` tokens, then times `steps` one-token decoding steps (greedy, the
cache growing) with one of two attention paths: `repeated` is what models.llama.KVCache.attend did before
(repeat_interleave of the cached keys and values to every query head, then SDPA); `in place` is what it does
now (SDPA's enable_gqa: each query head reads its KV head where it lies). Batch 64 is distill.self_text's,
batch 1 eval.speculative's. Reports median seconds per step, tokens/s, the speed-up, and whether the two
paths' logits are bit-identical over the steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.device import machine_record
from core.files import atomic_write_text
from models.hf_io import load_hf
from models.llama import KVCache
from models.teacher import resolve_teacher


def repeated_attend(self: KVCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The decoding path before this change, kept here as the reference (one-token steps only)."""
    start = self.pos
    self.k[:, :, start:start + 1] = k
    self.v[:, :, start:start + 1] = v
    self.pos = start + 1
    rep = q.shape[1] // self.k.shape[1]
    keys = self.k[:, :, :self.pos].repeat_interleave(rep, dim=1)
    values = self.v[:, :, :self.pos].repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, keys, values)


def decode_steps(model, prompt: torch.Tensor, steps: int, attend) -> tuple[float, torch.Tensor]:
    """Prefill `prompt` (untimed, the same path for every case), then `steps` greedy one-token steps with
    KVCache.attend set to `attend`: their wall seconds and logits [steps, batch, vocab]."""
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + steps)
    logits = model(prompt, cache)[:, -1]
    in_place, KVCache.attend = KVCache.attend, attend
    try:
        out, t = [], time.perf_counter()
        for _ in range(steps):
            logits = model(logits.argmax(-1)[:, None], cache)[:, -1]
            out.append(logits)
        return time.perf_counter() - t, torch.stack(out)
    finally:
        KVCache.attend = in_place


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python experiments/bench_decode_gqa.py", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--batches", default="64,1", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=192, help="cached tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=16, help="timed one-token steps per case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    model = load_hf(resolve_teacher(args.teacher)).eval()
    paths = {"repeated": repeated_attend, "in place": KVCache.attend}
    result = {"what": __doc__.split("\n")[0], "context": args.context, "steps": args.steps,
              "repeats": args.repeats, "cases": {}, "machine": machine_record()}
    for batch in (int(b) for b in args.batches.split(",")):
        prompt = torch.randint(0, model.cfg.vocab_size, (batch, args.context),
                               generator=torch.Generator().manual_seed(batch))
        seconds, logits = {n: [] for n in paths}, {}
        for _ in range(args.repeats):  # interleaved, so drift in the machine's speed hits both alike
            for name, attend in paths.items():
                s, logits[name] = decode_steps(model, prompt, args.steps, attend)
                seconds[name].append(s / args.steps)
        median = {n: statistics.median(v) for n, v in seconds.items()}
        result["cases"][f"batch {batch}"] = {
            "median_s_per_step": {n: round(v, 5) for n, v in median.items()},
            "tokens_per_s": {n: round(batch / v, 1) for n, v in median.items()},
            "speedup": round(median["repeated"] / median["in place"], 3),
            "s_per_step": {n: [round(x, 5) for x in v] for n, v in seconds.items()},
            "bit_identical_logits": bool(torch.equal(logits["repeated"], logits["in place"]))}
    print(json.dumps({k: {m: v[m] for m in ("tokens_per_s", "speedup", "bit_identical_logits")}
                      for k, v in result["cases"].items()}, indent=1))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
