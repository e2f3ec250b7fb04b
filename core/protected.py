"""The protected heads: what prune.heads writes and every structural or sparse pruner respects.

The contract between stages is the `protected` list of a prune.heads JSON: [{"layer": "17", "head": 3,
"why": ["retrieval"]}, ...] (layer keys as the scored model numbered them, head = query head index).
A protected query head pins its KV group (GQA): width pruning keeps both, and the sparse pruners leave
the head's rows of wq and its group's rows of wk and wv dense (`dense_rows`), so the head still attends
where it did. wo mixes every head into each output row, so its 2:4 groups stay sparse.

A structural stage (prune.depth, prune.width) writes `protected.json` into its artifact: the same list,
renumbered for the smaller model, so a later stage reads it like a prune.heads JSON.
"""
from __future__ import annotations

from pathlib import Path

import torch

from core.errors import SmeltError
from core.files import read_json

PROTECTED_FILE = "protected.json"


def read_protected(path: str | Path, layers: list[str], n_heads: int, field: str = "--heads"
                   ) -> list[tuple[str, int]]:
    """[(layer key, query head)] from a prune.heads JSON, checked against the model's layers and heads."""
    data = read_json(path, "a prune.heads JSON")
    if not isinstance(data, dict) or not isinstance(data.get("protected"), list):
        raise SmeltError(f"{field} {path}: no 'protected' list (not a prune.heads JSON?)")
    out = []
    for p in data["protected"]:
        layer, head = str(p.get("layer")), p.get("head")
        if layer not in layers:
            raise SmeltError(f"{field} {path}: layer {layer} is not a layer of this model")
        if not isinstance(head, int) or not 0 <= head < n_heads:
            raise SmeltError(f"{field} {path}: head {head} of layer {layer} is not one of the {n_heads} heads")
        out.append((layer, head))
    return out


def kv_group(head: int, n_heads: int, n_kv_heads: int) -> int:
    """The KV head a query head reads (query heads are grouped consecutively, as in Llama)."""
    return head // (n_heads // n_kv_heads)


def dense_rows(protected: list[tuple[str, int]], n_heads: int, n_kv_heads: int, head_dim: int
               ) -> dict[str, torch.Tensor]:
    """{module name: bool [out_features]} rows that sparse pruning must leave dense."""
    rows: dict[str, torch.Tensor] = {}
    for layer, head in protected:
        g = kv_group(head, n_heads, n_kv_heads)
        for lin, idx, n in (("wq", head, n_heads), ("wk", g, n_kv_heads), ("wv", g, n_kv_heads)):
            r = rows.setdefault(f"layers.{layer}.attention.{lin}", torch.zeros(n * head_dim, dtype=torch.bool))
            r[idx * head_dim:(idx + 1) * head_dim] = True
    return rows
