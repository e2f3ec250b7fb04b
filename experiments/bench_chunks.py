"""Token chunk size of the [tokens x vocab] fp32 row passes: evaluation statistics and the distillation loss.

    python experiments/bench_chunks.py [--tokens 2044] [--vocab 49152] [--repeats 3] [--out JSON]

eval.metrics.per_token_stats and distill.losses.DistillLoss (forward + backward, bf16 logits) at 1,024
tokens a chunk (the former setting) against core.kl.chunk_tokens' choice for this device, interleaved;
checks that the per-token statistics and the gradient are bit-identical and prints the median seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from core.device import interleaved_seconds, machine_record
from core.files import atomic_write_text
from core.kl import chunk_tokens
from distill.losses import DistillLoss, DistillLossConfig
from eval.metrics import per_token_stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python experiments/bench_chunks.py", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2044, help="evaluation rows (one batch of 4 x 511)")
    ap.add_argument("--loss-tokens", type=int, default=512, help="loss rows (one micro-batch of 2 x 256)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=g) * 3
    tlp = torch.log_softmax(logits + torch.randn(args.tokens, args.vocab, generator=g), -1).half()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    s_logits = logits[:args.loss_tokens].bfloat16()
    t_logits = tlp[:args.loss_tokens].float().bfloat16()
    labels = targets[:args.loss_tokens]
    chosen = chunk_tokens(logits.device.type)

    def stats(chunk):
        return per_token_stats(logits, tlp, targets, chunk=chunk)

    def loss(chunk):
        x = s_logits.clone().requires_grad_(True)
        value, _ = DistillLoss(DistillLossConfig(chunk_tokens=chunk))(x, t_logits, labels)
        value.backward()
        return x.grad

    cases = {f"{what} {c}": (lambda fn=fn, c=c: fn(c)) for what, fn in (("metrics", stats), ("loss", loss))
             for c in (1024, chosen)}
    times, outs = interleaved_seconds(cases, args.repeats)
    same_stats = all(torch.equal(outs["metrics 1024"][k], outs[f"metrics {chosen}"][k]) for k in outs["metrics 1024"])
    same_grad = torch.equal(outs["loss 1024"], outs[f"loss {chosen}"])
    med = {k: round(statistics.median(v), 4) for k, v in times.items()}
    result = {"what": __doc__.split("\n")[0], "chosen_chunk": chosen, "tokens": args.tokens,
              "loss_tokens": args.loss_tokens, "vocab": args.vocab, "repeats": args.repeats, "median_s": med,
              "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
              "speedup": {w: round(med[f"{w} 1024"] / med[f"{w} {chosen}"], 3) for w in ("metrics", "loss")},
              "bit_identical": {"metrics": same_stats, "loss_gradient": same_grad}, "machine": machine_record()}
    print(json.dumps({k: result[k] for k in ("median_s", "speedup", "bit_identical")}, indent=1))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
