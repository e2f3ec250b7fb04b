"""Needle in a haystack: can the model still copy a fact from far back in its context?

Perplexity barely notices when a pruned model stops retrieving: this is the ruler for that damage.

    python -m eval.needle --model DIR --out needle.json [--png needle.png] [--compare teacher.json ...]
    python -m eval.needle --model runs/smollm2/release ...    # a release: decompressed on load (models.load)
    python -m eval.evaluate --model DIR --needle ...    # the same, inside the evaluation report

A prompt of exactly `length` tokens (core.needle) is BOS + evaluation text (the bucket's own text:
WikiText-2 test for `en`, the zh notes for `zh`; never training text) with a needle sentence inserted at
`depth` (0 = right after BOS, 1 = just before the question), then a completion-style question:

    ... The secret number of Talvor Emsk is 4821. ...  Question: What is the secret number of Talvor
    Emsk? Answer: The secret number of Talvor Emsk is

The name (made-up syllables) and the 4-digit value are drawn from a seeded generator, as is where in the
bucket the haystack starts. Greedy decoding with the KV cache (models.generate.sample); a prompt counts
as retrieved when the first number in the continuation is the value. Every (length, depth) cell holds
`samples` prompts; the JSON keeps each cell's count and each prompt's answer.
"""
from __future__ import annotations

import copy
import json
import re
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from configs.schema import build
from core.data import BUCKETS, corpus_tokens
from core.device import default_device, machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_path, atomic_write_text, read_json
from core.needle import NeedleConfig, make_prompts
from models.generate import sample
from models.hf_io import load_tokenizer
from models.load import load_model
from models.teacher import DEFAULT_TEACHER, resolve_teacher


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


@torch.no_grad()
def run_needle(model, tokenizer, cfg: NeedleConfig | None = None, progress: bool = True) -> dict:
    """Accuracy per language, length and depth (the JSON the report and the heatmap read)."""
    cfg = cfg or NeedleConfig()
    longest = max(cfg.lengths) + cfg.max_new_tokens
    if longest > model.cfg.max_seq_len:
        raise SmeltError(f"needle length {max(cfg.lengths)} + {cfg.max_new_tokens} new tokens exceeds the "
                         f"model's context ({model.cfg.max_seq_len})")
    weight = next(model.parameters())
    device, dtype = weight.device, getattr(torch, cfg.dtype)
    if weight.is_floating_point() and weight.dtype != dtype:
        model = copy.deepcopy(model).to(dtype)  # the caller's model stays as it is
    result = {"settings": asdict(cfg), "languages": {}}
    for lang in cfg.languages:
        haystack = corpus_tokens(tokenizer, BUCKETS[lang])  # evaluation text: this is the evaluation
        prompts = [p for n in cfg.lengths for p in make_prompts(tokenizer, cfg, lang, n, haystack)]
        bar = tqdm(total=len(prompts), desc=f"needle {lang}", leave=False, disable=not progress)
        for n in cfg.lengths:
            batch = [p for p in prompts if p["length"] == n]
            for s in range(0, len(batch), cfg.batch_size):
                part = batch[s:s + cfg.batch_size]
                ids = torch.tensor([p["ids"] for p in part], device=device)
                new = sample(model, ids, cfg.max_new_tokens, temperature=0.0)[:, ids.shape[1]:]
                for p, row in zip(part, new.tolist()):
                    p["answer"] = tokenizer.decode(row)
                    p["correct"] = first_number(p["answer"]) == str(p["value"])
                bar.update(len(part))
        bar.close()
        cells = [{"length": n, "depth": d,
                  "correct": sum(p["correct"] for p in prompts if p["length"] == n and p["depth"] == d),
                  "total": cfg.samples} for n in cfg.lengths for d in cfg.depths]
        result["languages"][lang] = {
            "accuracy": sum(p["correct"] for p in prompts) / len(prompts),
            "by_length": {str(n): sum(p["correct"] for p in prompts if p["length"] == n)
                          / sum(p["length"] == n for p in prompts) for n in cfg.lengths},
            "cells": cells,
            "prompts": [{k: p[k] for k in ("length", "depth", "name", "value", "answer", "correct")}
                        for p in prompts],
        }
    return result


def grid(result: dict, lang: str) -> tuple[list[int], list[float], list[list[float]]]:
    """(lengths, depths, accuracy[length][depth]) of one language."""
    cells = result["languages"][lang]["cells"]
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    acc = {(c["length"], c["depth"]): c["correct"] / c["total"] for c in cells}
    return lengths, depths, [[acc[(n, d)] for d in depths] for n in lengths]


def heatmap(results: dict[str, dict], out: Path) -> None:
    """One panel per (model, language), side by side: accuracy per (length, depth)."""
    import matplotlib  # here, not at the top: slow to import, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(label, lang) for label, r in results.items() for lang in r["languages"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1.2, 3.4), squeeze=False,
                             constrained_layout=True)
    for i, (ax, (label, lang)) in enumerate(zip(axes[0], panels)):
        lengths, depths, acc = grid(results[label], lang)
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths] if i == 0 else [])
        ax.set_xlabel("needle depth")
        if i == 0:
            ax.set_ylabel("prompt tokens")
        total = results[label]["languages"][lang]["accuracy"]
        ax.set_title(f"{label} ({lang}): {total:.0%}", fontsize=9)
        for i, row in enumerate(acc):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="retrieved")
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _parse_list(text: str, kind, flag: str) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError:
        raise SmeltError(f"{flag} {text!r}: expected comma-separated {kind.__name__} values") from None


def needle_config(args) -> NeedleConfig:
    """The grid the flags ask for; a bad value is one line naming its flag (NeedleConfig's own checks)."""
    flags = {"lengths": ("--lengths", int), "depths": ("--depths", float), "languages": ("--languages", str),
             "samples": ("--samples", None), "dtype": ("--dtype", None)}
    overrides = {}
    for field, (flag, kind) in flags.items():
        raw = getattr(args, field)
        if raw is None:  # not given: the default (0 and "" are given, and checked)
            continue
        value = _parse_list(raw, kind, flag) if kind else raw
        try:
            build(NeedleConfig, {field: value})
        except SmeltError as e:
            raise SmeltError(f"{flag} {raw!r}: {e}") from None
        overrides[field] = value
    return build(NeedleConfig, overrides)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.needle", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="artifact or release directory (default: the teacher itself)")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="whose tokenizer; the default model")
    ap.add_argument("--lengths", help="prompt lengths in tokens, e.g. 256,512,1024,2048")
    ap.add_argument("--depths", help="needle depths in [0, 1], e.g. 0,0.5,1")
    ap.add_argument("--samples", type=int, help="prompts per (length, depth) cell")
    ap.add_argument("--languages", help="en, zh or en,zh")
    ap.add_argument("--dtype", help="float32 (default) or bfloat16: the prompts run through a bf16 copy")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--png", help="write the heatmap here")
    ap.add_argument("--compare", nargs="*", default=[], help="other needle JSONs to draw beside this one")
    args = ap.parse_args(argv)
    cfg = needle_config(args)
    others = {Path(p).stem: read_json(p, "a needle JSON") for p in args.compare}  # checked before the run
    teacher_dir = resolve_teacher(args.teacher)
    model_dir = Path(args.model) if args.model else teacher_dir
    model = load_model(model_dir, device=default_device()).eval()
    result = run_needle(model, load_tokenizer(teacher_dir), cfg)
    result.update(model=str(model_dir), machine=machine_record(),
                  command=shlex.join(["python", "-m", "eval.needle", *(sys.argv[1:] if argv is None else argv)]))
    for lang, r in result["languages"].items():
        print(f"{model_dir.name} {lang}: {r['accuracy']:.0%} retrieved; by length "
              + ", ".join(f"{n}: {a:.0%}" for n, a in r["by_length"].items()))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    if args.png:
        heatmap({model_dir.name: result, **others}, Path(args.png))


if __name__ == "__main__":
    run_cli(main)
