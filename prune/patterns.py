"""Sparsity patterns: validating settings and turning importance scores into keep-masks.

A keep-mask is a bool tensor shaped like the weight, True = keep. Scores are "higher = more important".
Counts are exact: masks are built by sorting/top-k, never by a threshold, so tied scores cannot change
how many weights are pruned.
"""
from __future__ import annotations

import re

import torch

from core.errors import SmeltError


def check_sparsity(sparsity: float) -> None:
    """Unstructured sparsity must be in [0, 1): 1.0 would delete the layer. NaN fails too."""
    if not 0.0 <= sparsity < 1.0:
        raise SmeltError(f"sparsity={sparsity} must be in [0, 1)")


def check_nm(n: int, m: int, in_features: int) -> None:
    """N:M keeps n of every m consecutive input features, so 0 < n < m and m must divide in_features."""
    if not (isinstance(n, int) and isinstance(m, int)) or not 0 < n < m:
        raise SmeltError(f"N:M={n}:{m} is invalid: need integers 0 < N < M (e.g. 2:4 keeps 2 of every 4)")
    if in_features % m:
        raise SmeltError(f"N:M={n}:{m} needs in_features divisible by M={m}, but in_features={in_features}")


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


def nm_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep-mask keeping the n highest scores in each group of m consecutive inputs (last dim) of each row."""
    check_nm(n, m, score.shape[-1])
    groups = score.reshape(*score.shape[:-1], score.shape[-1] // m, m)
    keep = torch.zeros(groups.shape, dtype=torch.bool, device=score.device)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)  # topk returns exactly n even with ties
    return keep.reshape(score.shape)


def mask_is_nm(mask: torch.Tensor, n: int, m: int) -> bool:
    """True when every group of m consecutive inputs has at most n nonzeros (works on masks or weights)."""
    check_nm(n, m, mask.shape[-1])
    groups = (mask != 0).reshape(-1, m)
    return bool((groups.sum(dim=-1) <= n).all())


def parse_pattern(spec: str) -> tuple[int, int]:
    """A pattern such as "2:4" as (n, m), checked 0 < N < M."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not match:
        raise SmeltError(f"--pattern must be N:M (e.g. 2:4), got {spec!r}")
    n, m = int(match.group(1)), int(match.group(2))
    check_nm(n, m, m)  # 0 < N < M; divisibility is checked per module
    return n, m
