"""Width pruning: fewer attention heads and MLP channels per layer, a dense smaller model that
transformers loads, never cutting a protected head.

    python -m prune.width --teacher smollm2-135m --heads runs/smollm2/heads.json \
        --n-heads 6 --n-kv-heads 3 --ffn 1280 --out runs/smollm2/width

Importance is prune.heads' activation-based (Minitron) score of the model being pruned: per query head
the L2 norm of its output (the input of `wo`), per MLP channel the L2 norm of its activation (the input
of `w2`), over calibration windows of training text. Every layer keeps the same shape (the HF config is
uniform):
- KV groups (GQA): a KV head goes only with all its query heads. Each layer keeps `--n-kv-heads` groups,
  those holding a protected head first, then by the summed importance of their query heads;
- query heads: in each kept group the `--n-heads / --n-kv-heads` most important, protected heads first;
- MLP channels: the `--ffn` most important (w1/w3 rows, w2 columns).
Kept heads and channels stay in their original order. The manifest lists what each layer kept, and
`protected.json` carries the protected set renumbered for the smaller model (what prune.run --protect
and a later prune.heads consumer read).
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from core.artifact import parent_record, write_manifest
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_dir, read_json
from core.protected import PROTECTED_FILE, kv_group, read_protected
from models.hf_io import load_hf, load_tokenizer, save_hf
from models.llama import Transformer, build_model
from models.teacher import resolve_teacher


def check_shape(n_heads: int, n_kv_heads: int, ffn: int, cfg) -> None:
    """The target shape must be a valid GQA layout no larger than the model's."""
    ratio = cfg.n_heads // cfg.n_kv_heads
    if not 1 <= n_kv_heads <= cfg.n_kv_heads:
        raise SmeltError(f"--n-kv-heads {n_kv_heads}: the model has {cfg.n_kv_heads} KV heads; keep 1..{cfg.n_kv_heads}")
    if n_heads < n_kv_heads or n_heads % n_kv_heads or n_heads // n_kv_heads > ratio:
        raise SmeltError(f"--n-heads {n_heads}: with {n_kv_heads} KV heads it must be a multiple of {n_kv_heads} "
                         f"and at most {n_kv_heads * ratio} (a KV group holds {ratio} query heads)")
    if not 1 <= ffn <= cfg.ffn_hidden:
        raise SmeltError(f"--ffn {ffn}: the model has {cfg.ffn_hidden} MLP channels; keep 1..{cfg.ffn_hidden}")


def plan_layer(imp: torch.Tensor, channel_imp: torch.Tensor, mine: set[int], n_heads_old: int,
               n_kv_old: int, n_heads: int, n_kv_heads: int, ffn: int, layer: str = "0") -> dict:
    """What one layer keeps: {"heads", "groups" (KV), "channels"}, each ascending. imp [heads] and
    channel_imp [ffn] are importance scores, `mine` the layer's protected query heads. Pure maths."""
    ratio_old, per_group = n_heads_old // n_kv_old, n_heads // n_kv_heads
    groups = [list(range(g * ratio_old, (g + 1) * ratio_old)) for g in range(n_kv_old)]
    must = sorted({kv_group(h, n_heads_old, n_kv_old) for h in mine})
    if len(must) > n_kv_heads:
        raise SmeltError(f"--n-kv-heads {n_kv_heads}: layer {layer} has protected heads in {len(must)} KV groups "
                         f"({must}); keep at least {len(must)} or protect fewer heads")
    # protected groups first, then by the summed importance of their query heads
    order = sorted(range(n_kv_old), key=lambda g: (g not in must, -float(imp[groups[g]].sum())))
    kept_groups = sorted(order[:n_kv_heads])
    heads = []
    for g in kept_groups:
        pinned = [h for h in groups[g] if h in mine]
        if len(pinned) > per_group:
            raise SmeltError(f"--n-heads {n_heads}: layer {layer} KV group {g} holds {len(pinned)} protected "
                             f"heads {pinned}; keep at least {len(pinned)} query heads per KV head")
        rest = sorted((h for h in groups[g] if h not in mine), key=lambda h: -float(imp[h]))
        heads += sorted(pinned + rest[:per_group - len(pinned)])
    channels = sorted(channel_imp.argsort(descending=True)[:ffn].tolist())
    return {"heads": heads, "groups": kept_groups, "channels": channels}


def plan_width(scores: dict, protected: list[tuple[str, int]], layers: list[str], cfg, n_heads: int,
               n_kv_heads: int, ffn: int) -> list[dict]:
    """plan_layer for every layer, from a prune.heads JSON's importance scores."""
    check_shape(n_heads, n_kv_heads, ffn, cfg)
    head_imp = torch.tensor(scores["head_importance"])
    chan_imp = torch.tensor(scores["channel_importance"])
    if tuple(head_imp.shape) != (len(layers), cfg.n_heads) or tuple(chan_imp.shape) != (len(layers), cfg.ffn_hidden):
        raise SmeltError(f"--heads: its importance scores are {tuple(head_imp.shape)} heads and "
                         f"{tuple(chan_imp.shape)} channels, this model has {len(layers)} layers x {cfg.n_heads} heads "
                         f"and {cfg.ffn_hidden} channels (score this model with prune.heads)")
    return [plan_layer(head_imp[i], chan_imp[i], {h for (k, h) in protected if k == key}, cfg.n_heads,
                       cfg.n_kv_heads, n_heads, n_kv_heads, ffn, key) for i, key in enumerate(layers)]


def _rows(units: list[int], size: int) -> torch.Tensor:
    return torch.cat([torch.arange(u * size, (u + 1) * size) for u in units])


@torch.no_grad()
def shrink(model: Transformer, plan: list[dict], n_heads: int, n_kv_heads: int, ffn: int) -> Transformer:
    """A new, smaller dense model holding the kept heads and channels of `model` (same device, dtype)."""
    cfg = replace(model.cfg, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_hidden=ffn, head_dim=model.cfg.head_dim,
                  n_layers=len(model.layers))
    w = model.tok_embeddings.weight
    small = build_model(cfg, device=w.device, seed=None).to(w.dtype)
    small.tok_embeddings.weight.copy_(w)
    small.norm.weight.copy_(model.norm.weight)
    if not cfg.tie_embeddings:
        small.output.weight.copy_(model.output.weight)
    hd = cfg.head_dim
    for (key, old), new, p in zip(model.layers.items(), small.layers.values(), plan):
        q, kv, ch = _rows(p["heads"], hd), _rows(p["groups"], hd), torch.tensor(p["channels"])
        a, b = old.attention, new.attention
        b.wq.weight.copy_(a.wq.weight[q])
        b.wk.weight.copy_(a.wk.weight[kv])
        b.wv.weight.copy_(a.wv.weight[kv])
        b.wo.weight.copy_(a.wo.weight[:, q])
        for name, rows in (("wq", q), ("wk", kv), ("wv", kv)):
            bias = getattr(a, name).bias
            if bias is not None:  # Qwen2's q/k/v biases: the kept heads' entries
                getattr(b, name).bias.copy_(bias[rows])
        f, g = old.feed_forward, new.feed_forward
        g.w1.weight.copy_(f.w1.weight[ch])
        g.w3.weight.copy_(f.w3.weight[ch])
        g.w2.weight.copy_(f.w2.weight[:, ch])
        new.attention_norm.weight.copy_(old.attention_norm.weight)
        new.ffn_norm.weight.copy_(old.ffn_norm.weight)
    return small


def renumber_protected(protected: list[tuple[str, int]], layers: list[str], plan: list[dict]) -> list[dict]:
    """The protected set in the smaller model's numbering (layers 0.., heads by position among the kept)."""
    return [{"layer": str(layers.index(k)), "head": plan[layers.index(k)]["heads"].index(h)}
            for k, h in protected]


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m prune.width", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", required=True, help="registered name, .gguf or HF directory (tokenizer)")
    ap.add_argument("--model", help="HF model directory to narrow (default: the teacher)")
    ap.add_argument("--heads", required=True, help="prune.heads JSON of this model: importance + protected set")
    ap.add_argument("--n-heads", type=int, required=True, help="query heads per layer to keep")
    ap.add_argument("--n-kv-heads", type=int, required=True, help="KV heads (GQA groups) per layer to keep")
    ap.add_argument("--ffn", type=int, required=True, help="MLP channels (intermediate size) to keep")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise SmeltError(f"--out {out} already exists")
    teacher_dir = resolve_teacher(args.teacher)
    src = Path(args.model) if args.model else teacher_dir
    model = load_hf(src).eval()
    cfg, layers = model.cfg, list(model.layers)
    check_shape(args.n_heads, args.n_kv_heads, args.ffn, cfg)  # before reading anything else
    protected = read_protected(args.heads, layers, cfg.n_heads)
    plan = plan_width(read_json(args.heads, "a prune.heads JSON"), protected, layers, cfg, args.n_heads,
                      args.n_kv_heads, args.ffn)
    small = shrink(model, plan, args.n_heads, args.n_kv_heads, args.ffn)
    before, after = (sum(p.numel() for p in m.parameters()) for m in (model, small))
    print(f"width: {cfg.n_heads}/{cfg.n_kv_heads} heads -> {args.n_heads}/{args.n_kv_heads}, ffn {cfg.ffn_hidden} -> "
          f"{args.ffn}: {before / 1e6:.1f}M -> {after / 1e6:.1f}M parameters", file=sys.stderr)
    with atomic_dir(out) as tmp:
        save_hf(small, tmp, tokenizer=load_tokenizer(teacher_dir))
        (tmp / PROTECTED_FILE).write_text(json.dumps(
            {"protected": renumber_protected(protected, layers, plan), "source": args.heads}, indent=1) + "\n")
        write_manifest(tmp, stage="width", settings={
            "heads": args.heads, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "ffn": args.ffn},
            metrics={"params_before": before, "params_after": after,
                     "protected": [{"layer": k, "head": h} for k, h in protected],
                     "kept": [{"layer": k, "heads": p["heads"], "kv_groups": p["groups"],
                               "channels": len(p["channels"])} for k, p in zip(layers, plan)]},
            parent=parent_record(src))
    print(out)


if __name__ == "__main__":
    run_cli(main)
