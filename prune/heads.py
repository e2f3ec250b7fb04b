"""Score every attention head (sink, retrieval, activation importance) and every MLP channel; pick the
heads that depth and width pruning must not cut.

    python -m prune.heads --teacher smollm2-135m --out runs/smollm2/heads.json [--png heads.png] [--top-k 4]

- sink score per (layer, head): mean attention mass on position 0 (BOS) over the calibration windows'
  query positions (each window starts with BOS, as the model sees text);
- retrieval score per (layer, head), after Wu et al. 2024 ("Retrieval Head Mechanistically Explains
  Long-Context Factuality"): needle prompts (core.needle, haystack = training text) with the answer
  appended, teacher-forced; for every answer token, a head scores when its top-1 attended position lies
  inside the needle and holds the very token being produced. Score = hits / answer tokens;
- importance (Minitron style): the L2 norm of each head's output (the input of `wo`, per head) and of each
  MLP channel (the input of `w2`) over the calibration tokens, from the calibration engine's statistics.

Everything runs through core.calibrate.run_blocks (the block walk) with the model's own attention capture
(`Attention.capture_attn`): no second forward implementation. The protected set is the top-k heads by sink
score and the top-k by retrieval score; the JSON is what the pruning stages read.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch

from core.calibrate import HEADS_CALIB, CalibConfig, add_sampling_arg, run_blocks
from core.data import corpus_tokens, is_corpus_mix
from core.device import default_device, machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_path, atomic_write_text
from core.needle import NeedleConfig, make_prompts
from models.hf_io import load_hf, load_tokenizer
from models.teacher import DEFAULT_TEACHER, resolve_teacher


class _AttentionRecorder:
    """Forward hooks on every layer's Attention: reduce its captured probabilities as they come, then drop
    them (a [B, H, L, L] tensor per layer would not fit for long windows)."""

    def __init__(self, model, reduce):
        self.handles = []
        for key, layer in model.layers.items():
            def hook(mod, args, out, key=key):  # returns None: the block's output is left as it is
                reduce(key, mod.last_attn)
                mod.last_attn = None

            layer.attention.capture_attn = True
            self.handles.append(layer.attention.register_forward_hook(hook))
        self.model = model

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for layer in self.model.layers.values():
            layer.attention.capture_attn = False


def _walk(model, windows: torch.Tensor, reduce, batch_size: int, targets=()) -> dict:
    """One block walk over `windows` with the attention recorder; returns the linears' statistics."""
    stats = {}
    recorder = _AttentionRecorder(model, reduce)
    try:
        run_blocks(model, windows, lambda name, block, s: stats.update(s),
                   CalibConfig(n_windows=len(windows), seq_len=windows.shape[1], batch_size=batch_size,
                               sequential=False, forward="float32"),  # the recorder hooks the model's own blocks
                   targets=list(targets), hessian=False, progress=False)
    finally:
        recorder.close()
    return stats


@torch.no_grad()
def sink_and_importance(model, windows: torch.Tensor, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """sink [layers, heads], head_importance [layers, heads], channel_importance [layers, ffn]."""
    keys = list(model.layers)
    sink = torch.zeros(len(keys), model.cfg.n_heads, dtype=torch.float64)
    count = torch.zeros(len(keys), dtype=torch.float64)

    def reduce(key, probs):  # probs [B, H, L, L]; query 0 attends only to itself: left out
        i = keys.index(key)
        sink[i] += probs[:, :, 1:, 0].double().sum((0, 2)).cpu()
        count[i] += probs.shape[0] * (probs.shape[2] - 1)

    targets = [f"layers.{k}.{lin}" for k in keys for lin in ("attention.wo", "feed_forward.w2")]
    stats = _walk(model, windows, reduce, batch_size, targets)
    hd = model.cfg.head_dim
    heads = torch.stack([stats[f"layers.{k}.attention.wo"].sq_norm.view(-1, hd).sum(-1) for k in keys])
    channels = torch.stack([stats[f"layers.{k}.feed_forward.w2"].sq_norm for k in keys])
    return {"sink": (sink / count[:, None]).float(), "head_importance": heads.sqrt().float(),
            "channel_importance": channels.sqrt().float()}


@torch.no_grad()
def retrieval(model, tokenizer, haystack: torch.Tensor, cfg: NeedleConfig, batch_size: int = 2
              ) -> torch.Tensor:
    """[layers, heads]: the share of answer tokens each head copies from the needle (top-1 attention)."""
    keys = list(model.layers)
    hits = torch.zeros(len(keys), model.cfg.n_heads, dtype=torch.float64)
    total = 0
    for length in cfg.lengths:
        prompts = make_prompts(tokenizer, cfg, "en", length, haystack)
        answers = [tokenizer(f" {p['value']}", add_special_tokens=False)["input_ids"] for p in prompts]
        width = max(map(len, answers))
        for s in range(0, len(prompts), batch_size):
            part, ans = prompts[s:s + batch_size], answers[s:s + batch_size]
            ids = torch.tensor([p["ids"] + a + [a[-1]] * (width - len(a)) for p, a in zip(part, ans)])
            rows = [(b, length + j) for b, a in enumerate(ans) for j in range(len(a))]  # answer positions

            def reduce(key, probs, ids=ids, rows=rows, part=part):
                i = keys.index(key)
                for b, pos in rows:
                    top = probs[b, :, pos - 1].argmax(-1).cpu()  # the query that produces token `pos`
                    start, end = part[b]["needle_span"]
                    hits[i] += ((top >= start) & (top < end) & (ids[b, top] == ids[b, pos])).double()

            _walk(model, ids.to(model.tok_embeddings.weight.device), reduce, batch_size)
            total += len(rows)
    return (hits / max(total, 1)).float()


def protected_heads(scores: dict[str, torch.Tensor], keys: list[str], top_k: int) -> list[dict]:
    """The top-k heads by sink score and the top-k by retrieval score (one entry per head, reasons joined)."""
    chosen: dict[tuple[str, int], list[str]] = {}
    for what in ("sink", "retrieval"):
        flat = scores[what].flatten()
        for idx in flat.argsort(descending=True)[:top_k].tolist():
            layer, head = divmod(idx, scores[what].shape[1])
            chosen.setdefault((keys[layer], head), []).append(what)
    order = sorted(chosen.items(), key=lambda item: (int(item[0][0]), item[0][1]))
    return [{"layer": k, "head": h, "why": why} for (k, h), why in order]


def plot(scores: dict[str, torch.Tensor], out: Path, title: str) -> None:
    import matplotlib  # here, not at the top: slow to import, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ("sink", "retrieval", "head_importance")
    fig, axes = plt.subplots(1, 3, figsize=(12, 5))
    for ax, name in zip(axes, names):
        im = ax.imshow(scores[name].numpy(), aspect="auto", cmap="viridis")
        ax.set_title(name.replace("_", " "), fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title, fontsize=10)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m prune.heads", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="registered name, .gguf or HF directory")
    ap.add_argument("--model", help="HF model directory to score (default: the teacher)")
    ap.add_argument("--calib-windows", type=int, default=HEADS_CALIB.n_windows,
                    help="windows for sink and importance scores")
    ap.add_argument("--calib-seq-len", type=int, default=HEADS_CALIB.seq_len)
    ap.add_argument("--calib-corpus", default=HEADS_CALIB.corpus, help="training text (never evaluation text)")
    add_sampling_arg(ap)
    ap.add_argument("--needle-lengths", default="512,1024", help="prompt lengths of the retrieval probe")
    ap.add_argument("--needle-samples", type=int, default=4, help="prompts per (length, depth)")
    ap.add_argument("--top-k", type=int, default=4, help="protected heads per score (sink, retrieval)")
    ap.add_argument("--out", required=True, help="the scores JSON")
    ap.add_argument("--png", help="layer x head maps")
    args = ap.parse_args(argv)
    calib = CalibConfig(n_windows=args.calib_windows, seq_len=args.calib_seq_len, corpus=args.calib_corpus,
                        sampling=args.calib_sampling)
    try:
        lengths = tuple(int(n) for n in args.needle_lengths.split(","))
    except ValueError:
        raise SmeltError(f"--needle-lengths {args.needle_lengths!r}: expected comma-separated integers") from None
    needle = NeedleConfig(lengths=lengths, samples=args.needle_samples)
    if args.top_k < 1:
        raise SmeltError(f"--top-k {args.top_k} must be >= 1")
    if not is_corpus_mix(calib.corpus):
        raise SmeltError(f"--calib-corpus {calib.corpus!r}: head scoring takes project training corpora")
    teacher_dir = resolve_teacher(args.teacher)
    model_dir = Path(args.model) if args.model else teacher_dir
    model = load_hf(model_dir).to(default_device()).eval()
    if max(lengths) > model.cfg.max_seq_len - 8:
        raise SmeltError(f"--needle-lengths {max(lengths)} exceeds the model's context ({model.cfg.max_seq_len})")
    tokenizer = load_tokenizer(teacher_dir)
    scores = sink_and_importance(model, calib.windows(tokenizer))
    # Training text for the haystack: scoring heads is calibration, and evaluation text is never calibrated on.
    haystack = torch.cat([corpus_tokens(tokenizer, n) for n in calib.corpus.split("+")])
    scores["retrieval"] = retrieval(model, tokenizer, haystack, needle)
    keys = list(model.layers)
    result = {"model": str(model_dir), "layers": keys, "n_heads": model.cfg.n_heads,
              "settings": {"calibration": calib.record(), "needle_lengths": list(lengths),
                           "needle_samples": args.needle_samples, "top_k": args.top_k},
              "protected": protected_heads(scores, keys, args.top_k),
              **{k: v.tolist() for k, v in scores.items()}, "machine": machine_record(),
              "command": shlex.join(["python", "-m", "prune.heads", *(sys.argv[1:] if argv is None else argv)])}
    atomic_write_text(args.out, json.dumps(result) + "\n")
    for p in result["protected"]:
        print(f"protected: layer {p['layer']} head {p['head']} ({', '.join(p['why'])})")
    if args.png:
        plot(scores, Path(args.png), f"{model_dir.name}: head scores")


if __name__ == "__main__":
    run_cli(main)
