"""A Transformer built from a weight source that may hold one block at a time: a model larger than memory runs
(slowly, every forward reading its weights again) in the memory of its largest block.

`source_model(cfg, source)` loads everything once when the fp32 weights fit `RESIDENT_BYTES`; past that each
block's parameters are read just before the block runs and dropped after it, the embedding reads only the
rows of the tokens it is given, and the head multiplies by its weight a block of vocabulary rows at a time.
The same source gives the same numbers either way (tests/test_source_model.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.llama import LlamaConfig, Transformer

RESIDENT_BYTES = 2 << 30  # fp32 weights up to this are loaded once; a larger model streams its blocks


class WeightSource(Protocol):
    """Weights by our parameter names, as fp32 tensors the model computes with."""

    def get(self, name: str) -> torch.Tensor: ...

    def rows(self, name: str, ids: list[int]) -> torch.Tensor: ...

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]: ...


class _RowEmbedding(nn.Module):
    """The token embedding, reading only the rows of the tokens it embeds. `weight` is an empty stand-in that
    says where activations live and in which dtype (caches and buffers are made from it)."""

    def __init__(self, source: WeightSource, name: str, dim: int):
        super().__init__()
        self.source, self.name = source, name
        self.register_buffer("weight", torch.empty(0, dim), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        uniq, inverse = ids.flatten().unique(return_inverse=True)
        rows = self.source.rows(self.name, uniq.tolist())
        return rows[inverse].reshape(*ids.shape, -1)


class _BlockHead(nn.Module):
    """The output head, multiplying by its weight a block of vocabulary rows at a time."""

    def __init__(self, source: WeightSource, name: str):
        super().__init__()
        self.source, self.name = source, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, w) for w in self.source.row_blocks(self.name)], dim=-1)


def _load_block(source: WeightSource, key: str, block: nn.Module) -> None:
    block.load_state_dict({k: source.get(f"layers.{key}.{k}") for k in block.state_dict()}, assign=True)


def fp32_bytes(cfg: LlamaConfig) -> int:
    with torch.device("meta"):
        model = Transformer(cfg)
    return 4 * sum(p.numel() for p in model.parameters())


def source_model(cfg: LlamaConfig, source: WeightSource, resident: bool | None = None) -> Transformer:
    """An eval-mode Transformer computing with `source`'s weights; `resident`: load everything once (default:
    when the fp32 weights fit RESIDENT_BYTES), else stream the blocks, the embedding rows and the head."""
    resident = fp32_bytes(cfg) <= RESIDENT_BYTES if resident is None else resident
    with torch.device("meta"):
        model = Transformer(cfg)
    model.init_rope("cpu")
    model.norm.load_state_dict({"weight": source.get("norm.weight")}, assign=True)
    head = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
    if resident:
        model.tok_embeddings.load_state_dict({"weight": source.get("tok_embeddings.weight")}, assign=True)
        model.output.weight = (model.tok_embeddings.weight if cfg.tie_embeddings
                               else nn.Parameter(source.get(head), requires_grad=False))
        for key, block in model.layers.items():
            _load_block(source, key, block)
        return model.eval().requires_grad_(False)
    model.tok_embeddings = _RowEmbedding(source, "tok_embeddings.weight", cfg.dim)
    model.output = _BlockHead(source, head)
    for key, block in model.layers.items():
        block.register_forward_pre_hook(lambda mod, _, key=key: _load_block(source, key, mod))
        block.register_forward_hook(_drop_block)
    return model.eval().requires_grad_(False)


def _drop_block(block: nn.Module, *_) -> None:
    block.to_empty(device="meta")
