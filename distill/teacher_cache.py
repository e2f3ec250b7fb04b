"""Build the teacher's top-k cache (core.teacher_topk): run the teacher once over the training windows, so
distillation and QAT steps read its distribution instead of running it.

    python -m distill.teacher_cache --teacher smollm2-135m --source wikitext2-valid+code-train+zh-train \\
        --seq-len 256 --windows 240 --top-k 64 --ranks 2 --local-batch 2 --out runs/smollm2/teacher-top64
    torchrun ... -m train.run ... --dataloader.teacher_cache runs/smollm2/teacher-top64   # no teacher forward

The windows are the text stream's (core.text_source, the same source, seed and shuffle as the trainer's
`--dataloader.*`), drawn in the order `ranks` data-parallel ranks reading `local_batch` windows each would
read them; a run past the cache's end starts it again (epochs over the same windows: where a cache pays
most). k: 1 <= k <= vocab; the cost of a small k is measured by the KL it reports as kept mass.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from core.artifact import weights_fingerprint, write_manifest
from core.data import corpus_record, is_corpus_mix
from core.device import default_device, machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_dir, atomic_save_safetensors
from core.teacher_topk import STAGE, TOPK_FILE, topk_from_logits
from core.text_source import PackedTextStream, TextSourceConfig
from models.hf_io import config_from_hf, load_hf, load_tokenizer, read_hf_config
from models.teacher import DEFAULT_TEACHER, resolve_teacher

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def text_settings(source: TextSourceConfig) -> dict:
    """The stream settings besides source and seed that decide the windows (a run must match them)."""
    return {k: getattr(source, k) for k in ("text_field", "split", "shuffle_buffer", "sample_by")}


def stream_windows(source: TextSourceConfig, tokenizer, seq_len: int, n: int, ranks: int,
                   local_batch: int) -> torch.Tensor:
    """[n, seq_len + 1]: round by round, rank 0's local batch, rank 1's, ... of the ranks' text streams."""
    streams = [PackedTextStream(source, tokenizer, seq_len, dp_rank=r, dp_world_size=ranks) for r in range(ranks)]
    rows: list[torch.Tensor] = []
    while len(rows) < n:
        for s in streams:
            rows.extend(s.next_batch(local_batch))
    return torch.stack(rows[:n])


@torch.no_grad()
def build_cache(teacher_dir: Path, windows: torch.Tensor, top_k: int, dtype: torch.dtype,
                batch_size: int = 8) -> dict[str, torch.Tensor]:
    """The cache's tensors for `windows` (core.teacher_topk's layout)."""
    device = default_device()
    teacher = load_hf(teacher_dir, dtype=dtype, device=str(device)).eval()
    parts = []
    for b in tqdm(windows.split(batch_size), desc=f"teacher top-{top_k}"):
        t = topk_from_logits(teacher(b[:, :-1].to(device)).float(), top_k)
        parts.append((t.ids.cpu(), t.logprobs.cpu(), t.rest.cpu()))
    ids, logprobs, rest = (torch.cat(x) for x in zip(*parts))
    return {"tokens": windows.to(torch.int32), "ids": ids, "logprobs": logprobs, "rest": rest}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m distill.teacher_cache", description="Cache the teacher's top-k log-probs.")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="registered name, .gguf or HF directory")
    ap.add_argument("--source", default="wikitext2-valid", help="training text (the trainer's --dataloader.source)")
    ap.add_argument("--seed", type=int, default=0, help="the stream's shuffle seed (--dataloader.seed)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per window (--training.seq_len)")
    ap.add_argument("--windows", type=int, required=True, help="windows to cache (steps x global batch)")
    ap.add_argument("--top-k", type=int, default=64, help="log-probs kept per position (1 <= k <= vocab)")
    ap.add_argument("--ranks", type=int, default=1, help="data-parallel ranks of the runs that will read it")
    ap.add_argument("--local-batch", type=int, default=1, help="their --training.local_batch_size")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32",
                    help="the teacher's compute dtype (bfloat16: what a bf16 trainer's teacher computes in)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per teacher forward")
    ap.add_argument("--out", required=True, help="cache directory to write (must not exist)")
    args = ap.parse_args(argv)
    for name in ("seq_len", "windows", "ranks", "local_batch", "batch_size"):
        if getattr(args, name) < 1:
            raise SmeltError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    teacher_dir = resolve_teacher(args.teacher)
    vocab = config_from_hf(read_hf_config(teacher_dir)).vocab_size
    if not 1 <= args.top_k <= vocab:
        raise SmeltError(f"--top-k={args.top_k} must be in [1, {vocab}] (the teacher's vocabulary)")
    if Path(args.out).exists():
        raise SmeltError(f"--out {args.out} already exists; a cache is never overwritten (remove it first)")
    source = TextSourceConfig(source=args.source, seed=args.seed)
    tokenizer = load_tokenizer(teacher_dir)
    t0 = time.perf_counter()
    windows = stream_windows(source, tokenizer, args.seq_len, args.windows, args.ranks, args.local_batch)
    tensors = build_cache(teacher_dir, windows, args.top_k, DTYPES[args.dtype], args.batch_size)
    seconds = time.perf_counter() - t0
    kept = tensors["logprobs"].float().exp().sum(-1).flatten()  # top-k mass per position
    p01 = float(kept.kthvalue(max(1, kept.numel() // 100)).values)  # kthvalue: no size limit (quantile has one)
    with atomic_dir(args.out) as tmp:
        atomic_save_safetensors(tensors, tmp / TOPK_FILE)
        write_manifest(tmp, stage=STAGE, settings={
            "teacher": str(teacher_dir), "teacher_fingerprint": weights_fingerprint(teacher_dir),
            "source": args.source, "corpora": corpus_record(args.source) if is_corpus_mix(args.source) else None,
            "seed": args.seed, "text": text_settings(source), "seq_len": args.seq_len, "windows": args.windows, "top_k": args.top_k,
            "vocab_size": vocab, "ranks": args.ranks, "local_batch": args.local_batch, "dtype": args.dtype,
        }, metrics={
            "positions": kept.numel(), "kept_mass_mean": float(kept.mean()),
            "kept_mass_p01": p01, "kept_mass_min": float(kept.min()),
            "seconds": round(seconds, 1), "machine": machine_record(),
        })
    print(f"{args.out}: {args.windows} windows x {args.seq_len} tokens, top-{args.top_k} "
          f"(kept mass mean {kept.mean():.4f}, P1 {p01:.4f}), {seconds:.0f} s")


if __name__ == "__main__":
    run_cli(main)
