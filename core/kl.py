"""Per-token KL divergence: the one formula distillation trains on and evaluation reports."""
from __future__ import annotations

import torch


def kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probabilities [..., V] -> [...]; 0 * log 0 counts as 0 (exp(-inf) = 0)."""
    return (logp.exp() * (logp - logq)).sum(-1)
