"""N:M semi-structured sparsity: one typed, validated pattern shared by pruning, QAT and the release.

N:M keeps n of every m consecutive input features (last dim) in each row of a weight [out, in]; 2:4 is
the pattern sparse tensor cores run. A spec string ("2:4") is parsed once, where it enters (a CLI flag,
a manifest), into an NMPattern; everything downstream passes the object, never (n, m) ints or strings.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from core.errors import SmeltError

_SPEC = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*")


@dataclass(frozen=True)
class NMPattern:
    """Keep n of every m consecutive inputs; checked 0 < n < m on construction."""

    n: int
    m: int

    def __post_init__(self):
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.n, self.m))
        if not ints or not 0 < self.n < self.m:
            raise SmeltError(f"N:M={self.n}:{self.m} is invalid: need integers 0 < N < M "
                             f"(e.g. 2:4 keeps 2 of every 4)")

    @classmethod
    def parse(cls, spec: str, field: str = "--pattern") -> NMPattern:
        """The one parser of "N:M" strings; errors name the setting (`field`) they came from."""
        match = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
        if not match:
            raise SmeltError(f"{field} must be N:M (e.g. 2:4), got {spec!r}")
        try:
            return cls(int(match.group(1)), int(match.group(2)))
        except SmeltError as e:
            raise SmeltError(f"{field}: {e}") from None

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"  # the spelling manifests and --pattern use

    @property
    def sparsity(self) -> float:
        return 1.0 - self.n / self.m

    def check_fits(self, in_features: int, name: str = "weight") -> None:
        """Groups must tile the input dimension exactly: m must divide in_features."""
        if in_features % self.m:
            raise SmeltError(f"{name}: N:M={self} needs in_features divisible by M={self.m}, "
                             f"but in_features={in_features}")

    def holds(self, mask_or_weight: torch.Tensor, dense_rows: torch.Tensor | None = None) -> bool:
        """True when every group of m consecutive inputs has at most n non-zeros (a keep-mask or a
        weight [out, in]), except in `dense_rows` (bool [out]: rows declared dense, core.masks). A last
        dim that m does not divide cannot follow the pattern: False."""
        if mask_or_weight.shape[-1] % self.m:
            return False
        if dense_rows is not None:
            mask_or_weight = mask_or_weight[~dense_rows.to(mask_or_weight.device)]
        groups = (mask_or_weight != 0).reshape(-1, self.m)
        return bool((groups.sum(dim=-1) <= self.n).all())

    def keep_top(self, score: torch.Tensor) -> torch.Tensor:
        """Keep-mask (bool, True = keep) of the n highest scores in each group of m along the last dim.
        Called per column group inside SparseGPT's sweep, so it only checks that the groups tile."""
        self.check_fits(score.shape[-1], "score")
        groups = score.reshape(*score.shape[:-1], score.shape[-1] // self.m, self.m)
        keep = torch.zeros(groups.shape, dtype=torch.bool, device=score.device)
        keep.scatter_(-1, groups.topk(self.n, dim=-1).indices, True)  # topk returns exactly n even with ties
        return keep.reshape(score.shape)
