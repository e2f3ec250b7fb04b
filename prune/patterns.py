"""Unstructured sparsity: validating the setting and turning importance scores into keep-masks.

A keep-mask is a bool tensor shaped like the weight, True = keep. Scores are "higher = more important".
Counts are exact: masks are built by sorting/top-k, never by a threshold, so tied scores cannot change
how many weights are pruned. N:M patterns live in core.patterns (NMPattern).
"""
from __future__ import annotations

import torch

from core.errors import SmeltError


def check_sparsity(sparsity: float) -> None:
    """Unstructured sparsity must be in [0, 1): 1.0 would delete the layer. NaN fails too."""
    if not 0.0 <= sparsity < 1.0:
        raise SmeltError(f"sparsity={sparsity} must be in [0, 1)")


def n_pruned(numel: int, sparsity: float) -> int:
    """How many of `numel` weights a `sparsity` fraction prunes: nearest integer (Python round, ties to even)."""
    return round(float(sparsity) * numel)


def topk_mask_unstructured(score: torch.Tensor, sparsity: float, per_row: bool = False) -> torch.Tensor:
    """Keep-mask that prunes the lowest-score `sparsity` fraction.

    per_row=False compares all entries of the matrix (layer-wise); per_row=True compares within each
    row (last dim), as Wanda does per output neuron, so every row gets the same sparsity.
    """
    check_sparsity(sparsity)
    flat = score.reshape(score.shape[0], -1) if per_row else score.reshape(1, -1)
    k = n_pruned(flat.shape[1], sparsity)
    keep = torch.ones(flat.shape, dtype=torch.bool, device=score.device)
    if k:
        # stable sort: ties are broken by position, deterministically, and the count stays exactly k
        lowest = torch.argsort(flat, dim=1, stable=True)[:, :k]
        keep.scatter_(1, lowest, False)
    return keep.reshape(score.shape)
