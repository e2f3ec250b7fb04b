"""Evaluate a model against its teacher, per bucket: PPL, per-token KL (mean, P50/P90/P99, max), top-1.

    python -m eval.evaluate                                  # the teacher against itself (PPL; KL = 0)
    python -m eval.evaluate --model runs/pruned --out runs/pruned/eval.json
    python -m eval.evaluate --model DIR --windows en=32,zh=8,code=8 --seq-len 1024
    python -m eval.evaluate --model runs/smollm2/release      # a release: decompressed on load (models.load)

The teacher's log-probabilities over the full vocabulary are computed once per (teacher weights,
windows) and cached under $SMELT_CACHE/teacher_logprobs as fp16 safetensors. fp16 is enough: KL's
error from a log-prob rounding δ is Σ p·δ, and fp16 is precise exactly where p is large; metrics
renormalise the cached rows so KL(teacher‖teacher) is 0.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shlex
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from configs.schema import build, load_toml
from core.artifact import training_step, weights_fingerprint
from core.data import BUCKETS, EvalConfig, corpus_record, eval_windows, parse_windows
from core.device import default_device, machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.fetch import cache_root
from core.files import atomic_save_safetensors, atomic_write_text, safetensors_metadata
from core.needle import NeedleConfig
from core.tracking import log_evaluation
from eval.metrics import cat_stats, per_token_stats, summarize
from eval.needle import run_needle
from models.hf_io import load_hf, load_tokenizer
from models.load import load_model
from models.teacher import DEFAULT_TEACHER, resolve_teacher


@torch.no_grad()
def _logits(model, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    return model(batch[:, :-1].to(device)).float().cpu()


@torch.no_grad()
def teacher_logprobs_file(teacher_dir: Path, windows: torch.Tensor, get_teacher, batch_size: int = 4,
                          desc: str = "teacher", on_batch=None) -> Path:
    """Path of the cached teacher log-probs for `windows` (computed now, with get_teacher(), if missing).

    on_batch(batch, teacher_logits, cached_logprobs), if given, sees every batch while the cache is built:
    the teacher evaluated against itself takes its statistics from this one forward instead of a second."""
    key = hashlib.sha256(weights_fingerprint(teacher_dir).encode() + windows.numpy().tobytes()).hexdigest()
    path = cache_root() / "teacher_logprobs" / f"{key[:32]}.safetensors"
    if path.is_file():
        try:
            safetensors_metadata(path)  # a cache cut short (disk full, killed run) is rebuilt, not trusted
            return path
        except SmeltError:
            path.unlink()
    device = default_device()
    teacher = get_teacher()
    parts = []
    for b in tqdm(windows.split(batch_size), desc=f"{desc} log-probs", leave=False):
        logits = _logits(teacher, b, device)
        parts.append(torch.log_softmax(logits, dim=-1).half())
        if on_batch is not None:
            on_batch(b, logits, parts[-1])
    atomic_save_safetensors({"logprobs": torch.cat(parts), "windows": windows}, path)
    return path


def _stats(logits: torch.Tensor, teacher_logprobs: torch.Tensor, batch: torch.Tensor) -> dict:
    if logits.shape[-1] != teacher_logprobs.shape[-1]:
        raise SmeltError(f"model vocab {logits.shape[-1]} != teacher vocab {teacher_logprobs.shape[-1]}")
    return per_token_stats(logits.flatten(0, 1), teacher_logprobs.flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def token_stats(model, windows: torch.Tensor, cache: Path, batch_size: int, device: torch.device,
                desc: str = "eval", progress: bool = True) -> dict[str, torch.Tensor]:
    """Per-token stats (eval.metrics.per_token_stats) of `model` on `windows` against the cached teacher log-probs."""
    parts = []
    with safe_open(str(cache), framework="pt") as f:
        lp_slice = f.get_slice("logprobs")
        for s in tqdm(range(0, len(windows), batch_size), desc=desc, leave=False, disable=not progress):
            batch = windows[s:s + batch_size]
            parts.append(_stats(_logits(model, batch, device), lp_slice[s:s + len(batch)], batch))
    return cat_stats(parts)


@torch.no_grad()
def evaluate(model, teacher_dir: str | Path, cfg: EvalConfig | None = None, tokenizer=None,
             teacher=None, progress: bool = True) -> dict:
    """Compare `model` (our Transformer or anything mapping tokens -> logits) with the teacher."""
    cfg = cfg or EvalConfig()
    teacher_dir = Path(teacher_dir)
    tokenizer = tokenizer or load_tokenizer(teacher_dir)
    device = next(model.parameters()).device
    model.eval()

    @functools.cache
    def get_teacher():  # loaded at most once, and only if some bucket's cache is missing
        return teacher if teacher is not None else load_hf(teacher_dir).to(default_device()).eval()

    report = {"settings": {"seq_len": cfg.seq_len, "windows": dict(cfg.windows),
                           "corpora": {b: corpus_record(BUCKETS[b]) for b in cfg.windows}},
              "buckets": {}}
    for bucket, n in cfg.windows.items():
        windows = eval_windows(tokenizer, bucket, int(n), cfg.seq_len)
        parts = []
        # The teacher against itself, cache not yet built: its statistics come from the cache's own forward.
        own = (lambda b, logits, lp: parts.append(_stats(logits, lp, b))) if teacher is model else None
        cache = teacher_logprobs_file(teacher_dir, windows, get_teacher, cfg.batch_size, desc=bucket, on_batch=own)
        stats = cat_stats(parts) if parts else token_stats(model, windows, cache, cfg.batch_size, device,
                                                             desc=f"eval {bucket}", progress=progress)
        report["buckets"][bucket] = summarize(stats)
    return report


def format_table(report: dict, title: str = "") -> str:
    cols = ["tokens", "ppl", "teacher_ppl", "kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1_agree"]
    head = f"{'bucket':<7}" + "".join(f"{c:>12}" for c in cols)
    lines = [title, head, "-" * len(head)] if title else [head, "-" * len(head)]
    for b, m in report["buckets"].items():
        cells = "".join(f"{m[c]:>12d}" if isinstance(m[c], int) else f"{m[c]:>12.4f}" for c in cols)
        lines.append(f"{b:<7}" + cells)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.evaluate", description="Evaluate a model against its teacher, per bucket.")
    ap.add_argument("--model", help="artifact or release directory to evaluate (default: the teacher itself)")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="registered name, .gguf or HF directory")
    ap.add_argument("--config", help="TOML file with EvalConfig keys")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--windows", help="per-bucket window counts, e.g. en=16,zh=8,code=8")
    ap.add_argument("--batch-size", type=int, help="windows per forward (EvalConfig default)")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--needle", action="store_true",
                    help="also run the needle-in-a-haystack evaluation (eval.needle, its default grid) into "
                         "the report's 'needle' section")
    ap.add_argument("--needle-dtype", help="with --needle: float32 (default), bfloat16 (a bf16 copy runs "
                                           "the prompts; the KL evaluation stays fp32) or auto (bfloat16 where the "
                                           "hardware has bf16 units)")
    ap.add_argument("--wandb", action="store_true",
                    help="also log the metrics and table to the stage's wandb run (core.tracking; offline "
                         "unless WANDB_MODE=online)")
    args = ap.parse_args(argv)
    overrides = {}
    for flag, value, least in (("--seq-len", args.seq_len, 2), ("--batch-size", args.batch_size, 1)):
        if value is not None and value < least:  # 0 is a value given, not the default
            raise SmeltError(f"{flag} {value} must be >= {least}")
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    if args.windows is not None:
        overrides["windows"] = parse_windows(args.windows)
    if args.batch_size is not None:
        overrides["batch_size"] = args.batch_size
    if args.needle_dtype is not None:
        overrides["needle_dtype"] = args.needle_dtype
    cfg = load_toml(EvalConfig, args.config, overrides) if args.config else build(EvalConfig, overrides)
    teacher_dir = resolve_teacher(args.teacher)
    model_dir = Path(args.model) if args.model else teacher_dir
    model = load_model(model_dir, device=default_device())
    report = evaluate(model, teacher_dir, cfg, teacher=model if model_dir == teacher_dir else None)
    if args.needle:
        report["needle"] = run_needle(model, load_tokenizer(teacher_dir), NeedleConfig(dtype=cfg.needle_dtype))
    report.update(model=str(model_dir), teacher=str(teacher_dir), machine=machine_record(),
                  command=shlex.join(["python", "-m", "eval.evaluate", *(sys.argv[1:] if argv is None else argv)]))
    print(format_table(report, title=f"{model_dir} vs teacher {teacher_dir.name}"))
    for lang, r in report.get("needle", {}).get("languages", {}).items():
        print(f"needle {lang}: {r['accuracy']:.0%} retrieved; by length "
              + ", ".join(f"{n}: {a:.0%}" for n, a in r["by_length"].items()))
    if args.out:
        atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    if args.wandb:
        log_evaluation(report, Path(args.out).parent if args.out else Path("."), name=str(model_dir),
                       step=training_step(model_dir))


if __name__ == "__main__":
    run_cli(main)
