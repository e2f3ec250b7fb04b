"""Evaluate a model against its teacher, per bucket: PPL, per-token KL (mean, P50/P90/P99, max), top-1.

    python -m eval.evaluate                                  # the teacher against itself (PPL; KL = 0)
    python -m eval.evaluate --model runs/pruned --out runs/pruned/eval.json
    python -m eval.evaluate --model DIR --windows en=32,zh=8,code=8 --seq-len 1024

The teacher's log-probabilities over the full vocabulary are computed once per (teacher weights,
windows) and cached under $SMELT_CACHE/teacher_logprobs as fp16 safetensors. fp16 is enough: KL's
error from a log-prob rounding δ is Σ p·δ, and fp16 is precise exactly where p is large; metrics
renormalise the cached rows so KL(teacher‖teacher) is 0.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from configs.schema import build, load_toml
from eval.metrics import cat_stats, per_token_stats, summarize
from models.artifact import atomic_write_text, sha256_file
from models.errors import SmeltError, run_cli
from models.hf_io import load_hf, load_tokenizer
from models.teacher import DEFAULT_TEACHER, cache_root, resolve_teacher
from train.data import BUCKETS, corpus_record, eval_windows


@dataclass
class EvalConfig:
    seq_len: int = 512
    windows: dict = field(default_factory=lambda: {"en": 16, "zh": 8, "code": 8})
    batch_size: int = 4

    def __post_init__(self):
        bad = sorted(set(self.windows) - set(BUCKETS))
        if bad:
            raise SmeltError(f"eval.windows: unknown bucket {bad[0]!r} (known: {', '.join(BUCKETS)})")
        if self.seq_len < 2 or self.batch_size < 1 or any(int(n) < 1 for n in self.windows.values()):
            raise SmeltError("eval: seq_len >= 2, batch_size >= 1 and windows >= 1 per bucket are required")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def weights_fingerprint(model_dir: Path) -> str:
    """Hash of config.json and the safetensors files: the teacher-cache key's model half."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(sha256_file(f).encode())
    return h.hexdigest()


@torch.no_grad()
def _logits(model, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    return model(batch[:, :-1].to(device)).float().cpu()


@torch.no_grad()
def teacher_logprobs_file(teacher_dir: Path, windows: torch.Tensor, get_teacher, batch_size: int = 4,
                          desc: str = "teacher") -> Path:
    """Path of the cached teacher log-probs for `windows` (computed now, with get_teacher(), if missing)."""
    key = hashlib.sha256(weights_fingerprint(teacher_dir).encode() + windows.numpy().tobytes()).hexdigest()
    path = cache_root() / "teacher_logprobs" / f"{key[:32]}.safetensors"
    if path.is_file():
        return path
    device = default_device()
    teacher = get_teacher()
    parts = [torch.log_softmax(_logits(teacher, b, device), dim=-1).half()
             for b in tqdm(windows.split(batch_size), desc=f"{desc} log-probs", leave=False)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({"logprobs": torch.cat(parts), "windows": windows}, str(tmp))
    os.replace(tmp, path)
    return path


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
        cache = teacher_logprobs_file(teacher_dir, windows, get_teacher, cfg.batch_size, desc=bucket)
        parts = []
        with safe_open(str(cache), framework="pt") as f:
            lp_slice = f.get_slice("logprobs")
            for s in tqdm(range(0, len(windows), cfg.batch_size), desc=f"eval {bucket}", leave=False,
                          disable=not progress):
                batch = windows[s:s + cfg.batch_size]
                logits = _logits(model, batch, device)
                if logits.shape[-1] != lp_slice.get_shape()[-1]:
                    raise SmeltError(f"model vocab {logits.shape[-1]} != teacher vocab {lp_slice.get_shape()[-1]}")
                tlp = lp_slice[s:s + len(batch)]
                parts.append(per_token_stats(logits.flatten(0, 1), tlp.flatten(0, 1), batch[:, 1:].flatten()))
        report["buckets"][bucket] = summarize(cat_stats(parts))
    return report


def format_table(report: dict, title: str = "") -> str:
    cols = ["tokens", "ppl", "teacher_ppl", "kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max", "top1_agree"]
    head = f"{'bucket':<7}" + "".join(f"{c:>12}" for c in cols)
    lines = [title, head, "-" * len(head)] if title else [head, "-" * len(head)]
    for b, m in report["buckets"].items():
        cells = "".join(f"{m[c]:>12d}" if isinstance(m[c], int) else f"{m[c]:>12.4f}" for c in cols)
        lines.append(f"{b:<7}" + cells)
    return "\n".join(lines)


def parse_windows(spec: str) -> dict:
    out = {}
    for part in spec.split(","):
        name, _, n = part.partition("=")
        if not n.isdigit():
            raise SmeltError(f"--windows: expected bucket=N, got {part!r}")
        out[name.strip()] = int(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Evaluate a model against its teacher, per bucket.")
    ap.add_argument("--model", help="HF model directory to evaluate (default: the teacher itself)")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="registered name, .gguf or HF directory")
    ap.add_argument("--config", help="TOML file with EvalConfig keys")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--windows", help="per-bucket window counts, e.g. en=16,zh=8,code=8")
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    overrides = {}
    if args.seq_len:
        overrides["seq_len"] = args.seq_len
    if args.windows:
        overrides["windows"] = parse_windows(args.windows)
    cfg = load_toml(EvalConfig, args.config, overrides) if args.config else build(EvalConfig, overrides)
    teacher_dir = resolve_teacher(args.teacher)
    model_dir = Path(args.model) if args.model else teacher_dir
    model = load_hf(model_dir).to(default_device())
    report = evaluate(model, teacher_dir, cfg, teacher=model if model_dir == teacher_dir else None)
    report.update(model=str(model_dir), teacher=str(teacher_dir))
    print(format_table(report, title=f"{model_dir} vs teacher {teacher_dir.name}"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    run_cli(main)
