"""One linear's calibration statistics: XᵀX (only the tiles on and above the diagonal formed, each batch's
products in a chosen dtype, summed in a wide one), Σ x² and the token count, and H mirrored from them on
demand: the pure accumulator that core.calibrate's passes feed."""
from __future__ import annotations

import torch

from core.errors import SmeltError

SYM_TILE = 256  # XᵀX tile width: only the tiles on and above the diagonal are formed (narrower: fewer below it)
SQ_CHUNK = 256  # rows per Σ x² chunk: its squares stay in cache (Wanda's statistics: 12.7 -> 4.7 s against a
# whole-batch fp64 copy; results/bench/oneshot-amd)


class LinearStats:
    """Sums over calibration tokens of one linear's inputs x [in]: XᵀX, Σ x_j², token count.

    Linears fed the very same input tensor (wq/wk/wv, w1/w3) share one LinearStats object, so treat it
    as read-only (copy H before modifying it in place).
    """

    def __init__(self, in_features: int, dtype: torch.dtype = torch.float64,
                 device: torch.device | str = "cpu", hessian: bool = True,
                 product_dtype: torch.dtype | None = None):
        # Sums live in `dtype`; each batch's XᵀX is formed in `product_dtype` (default: dtype).
        self.product_dtype = product_dtype or dtype
        self.xtx = torch.zeros(in_features, in_features, dtype=dtype, device=device) if hessian else None
        self.sq_norm = torch.zeros(in_features, dtype=dtype, device=device)
        self.n_tokens = 0
        self._last: torch.Tensor | None = None  # the tensor added last: a shared input is added once
        self._mirrored: torch.Tensor | None = None  # H, symmetrised from the upper tiles (cached)
        self.cross: torch.Tensor | None = None  # Σ x_d xᵀ (teacher targets), [in, in], fp64 sums

    @torch.no_grad()
    def add(self, x: torch.Tensor, x_teacher: torch.Tensor | None = None) -> None:
        """One batch of this linear's inputs x; with x_teacher (the teacher's inputs to it, token for token)
        C = X_dᵀX grows too."""
        if x is self._last:
            return
        self._last = x
        if x_teacher is not None:
            self._add_cross(x_teacher, x)
        x = x.detach().reshape(-1, x.shape[-1])
        if self.xtx is not None:
            xp = x.to(self.product_dtype)
            # XᵀX is symmetric: only the tiles on and above the diagonal are formed (about half the
            # flops for a wide input); H mirrors them.
            d, b = xp.shape[1], SYM_TILE
            for i in range(0, d, b):
                xi = xp[:, i:i + b]
                rest = xp[:, i:]
                if self.product_dtype == self.xtx.dtype:
                    self.xtx[i:i + b, i:].addmm_(xi.T, rest)
                else:  # one batch's products in the narrow type, the running sum in the wide one
                    self.xtx[i:i + b, i:].add_(xi.T @ rest)
            self._mirrored = None
        # Squares in at least fp32 (exact for bf16 inputs), a chunk's sum in that type, the running sum in
        # the wide one: fp32 rounding on a 256-row sum, no fp64 copy of the batch.
        wide = torch.promote_types(x.dtype, torch.float32)
        for chunk in x.split(SQ_CHUNK):
            self.sq_norm.add_(chunk.to(wide).square().sum(0))
        self.n_tokens += x.shape[0]

    def _add_cross(self, x_teacher: torch.Tensor, x: torch.Tensor) -> None:
        xd = x_teacher.detach().reshape(-1, x_teacher.shape[-1]).to(self.product_dtype)
        xm = x.detach().reshape(-1, x.shape[-1]).to(self.product_dtype)
        if self.cross is None:
            self.cross = torch.zeros(xm.shape[1], xm.shape[1], dtype=self.sq_norm.dtype, device=xm.device)
        if self.product_dtype == self.cross.dtype:
            self.cross.addmm_(xd.T, xm)
        else:
            self.cross.add_(xd.T @ xm)

    def end_batch(self) -> None:
        self._last = None  # drop the reference: the batch's activations can be freed

    @property
    def out_dtype(self) -> torch.dtype:
        """H's dtype: its products' (the rank test then uses their epsilon), but never below fp32, where the
        inverse needs it (bf16 products: CalibConfig.check_dampening)."""
        return torch.promote_types(self.product_dtype, torch.float32)

    @property
    def H(self) -> torch.Tensor:
        if self.xtx is None:
            raise SmeltError("these statistics were collected without the Hessian (hessian=False)")
        if self._mirrored is None:
            # Only the tiles on and above the diagonal hold sums (add): each diagonal tile takes its upper
            # triangle, each tile below the diagonal the transpose of its mirror, in place in the output's
            # dtype. Transients: one tile, not three fp64 [in, in] (8B's 14,336-wide down_proj: 4.9 GB).
            H = self.xtx.to(self.out_dtype, copy=True)
            b = SYM_TILE
            for i in range(0, H.shape[0], b):
                tile = H[i:i + b, i:i + b]
                tile.copy_(tile.triu() + tile.triu(1).T)
                H[i + b:, i:i + b] = H[i:i + b, i + b:].T
            self._mirrored = H
        return self._mirrored

    @property
    def C(self) -> torch.Tensor | None:
        """X_dᵀX (teacher targets), in H's dtype; None without teacher targets."""
        return None if self.cross is None else self.cross.to(self.out_dtype)

    @property
    def act_norm(self) -> torch.Tensor:
        """||X_j||₂ per input feature (Wanda's activation norm)."""
        return self.sq_norm.sqrt()
