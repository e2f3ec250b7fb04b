"""GPTQ (Frantar et al. 2022): quantise a linear layer column by column, compensating with OBS updates.

Same setting as prune.algorithms.sparsegpt_prune: W [out, in], H = X^T X [in, in] from calibration
inputs, U = upper Cholesky factor of (H + damp I)^-1 (core.obs.dampened_inverse_cholesky). The sweep is
core.obs.obs_column_sweep, shared with SparseGPT: each column is fixed to its quantised value q_i and
its error err_i = (w_i - q_i) / U[i, i] is compensated through U[i, i:] on the later columns.
The result lies exactly on the (scale, zero_point) grid of qat.quantizers, so it exports losslessly.
"""
from __future__ import annotations

import math

import torch

from core.errors import SmeltError
from core.obs import check_hessian, dampened_inverse_cholesky, obs_column_sweep
from qat.quantizers import QuantSpec, check_weight, compute_qparams, work_dtype


def _fq_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Fake-quantise one column [out] with per-row s, z: the same ops, in the same order, as quantizers."""
    x = w / s if z is None else w / s + z
    q = torch.round(x.clamp(spec.qmin, spec.qmax))
    return q * s if z is None else (q - z) * s


def _check_mask(mask: torch.Tensor | None, W: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.shape != W.shape:
        raise SmeltError(f"mask must be a bool keep-mask shaped like the weight {tuple(W.shape)}, "
                         f"got {tuple(mask.shape)} {mask.dtype}")
    return mask.to(W.device)


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    blocksize: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
    static_groups: bool | None = None,
    mask: torch.Tensor | None = None,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ-quantise W; returns (dequantised W in W's dtype, scale [out, n_groups], zero_point or None).

    Quantisation parameters:
    - per-channel (group_size None): one scale per row from the (masked) input W, as the reference does.
    - groups, static_groups=False: each group's qparams are computed when the sweep enters it, from the
      current, error-updated weights (the reference GPTQ behaviour). blocksize is rounded up to a
      multiple of group_size so that every column of the group has received all earlier updates.
    - groups, static_groups=True: all groups' qparams come from the input W before the sweep.

    act_order: columns are swept in descending diag(H) (most-activated inputs first, while the most
    remaining weights can still absorb their error) and un-permuted at the end. Groups stay the
    *contiguous* groups of the original column order, so the checkpoint needs no g_idx (compressed-
    tensors' actorder="weight"): their qparams must exist before the permuted sweep reaches any member,
    hence act_order requires static groups (static_groups=None picks static iff act_order). Dynamic
    groups under act_order would be permuted, non-contiguous groups, which we refuse.

    mask (bool keep-mask, e.g. from SparseGPT 2:4): masked weights come back exactly 0. They are zeroed
    first and excluded from the qparams. Earlier columns' OBS updates do flow into them during the sweep
    (the unconstrained optimum, as SparseGPT's joint sparsify+quantise does); when the sweep reaches a
    masked weight it is set to exactly 0 and the drift it had accumulated is treated as its error and
    propagated to the later columns, so that removal is compensated too. Cutting the updates into
    masked weights instead would silently drop part of the compensation. Inputs never seen in
    calibration (diag H == 0) are zeroed, as in the reference: on the calibration data they cost nothing.
    """
    W = W.detach()
    check_weight(W, spec, name)
    rows, cols = W.shape
    check_hessian(H, cols)
    keep = _check_mask(mask, W)
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize <= 0:
        raise SmeltError(f"blocksize={blocksize} must be a positive integer")
    grouped = spec.group_size is not None
    if static_groups is None:
        static_groups = act_order
    if act_order and grouped and not static_groups:
        raise SmeltError("act_order with dynamic groups would make the groups non-contiguous (needs a g_idx "
                         "the export does not write); use static_groups=True or act_order=False")
    gs = spec.group_width(cols)
    if grouped and not static_groups:
        blocksize = math.ceil(blocksize / gs) * gs

    H = H.to(W.device)
    Wk = W.to(work_dtype(W), copy=True)
    Wk[:, H.diagonal() == 0] = 0
    if keep is not None:
        Wk[~keep] = 0
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        Wk, H = Wk[:, perm], H[perm][:, perm]
        keep = None if keep is None else keep[:, perm]
    U, _ = dampened_inverse_cholesky(H, percdamp)  # dead inputs were zeroed above
    U = U.to(Wk.dtype)

    if static_groups or not grouped:
        orig = Wk if perm is None else Wk[:, torch.argsort(perm)]  # contiguous groups in original order
        scale, zp = compute_qparams(orig, spec, name)
    else:
        scale = torch.empty(rows, spec.n_groups(cols), dtype=Wk.dtype, device=W.device)
        zp = None if spec.symmetric else torch.empty(scale.shape, dtype=torch.int8, device=W.device)
    col_group = torch.arange(cols, device=W.device) if perm is None else perm
    col_group = (col_group // gs).tolist()  # group of each swept column, in original numbering
    per_group = QuantSpec(spec.bits, spec.symmetric, None, spec.scale_init)  # one group = one "channel"

    def quantised_column(W1: torch.Tensor, d1: torch.Tensor, j: int, col: int) -> torch.Tensor:
        g = col_group[col]
        if grouped and not static_groups and col % gs == 0:  # dynamic: qparams of the updated weights
            cur = W1[:, j:j + gs] if keep is None else W1[:, j:j + gs] * keep[:, col:col + gs]
            s, z = compute_qparams(cur, per_group, name)
            scale[:, g:g + 1] = s
            if zp is not None:
                zp[:, g:g + 1] = z
        w = W1[:, j]
        q = _fq_column(w, scale[:, g], None if zp is None else zp[:, g].to(w.dtype), spec)
        if keep is not None:  # masked: exactly 0
            q = torch.where(keep[:, col], q, torch.zeros_like(q))
        return q

    Wk = obs_column_sweep(Wk, U, blocksize, quantised_column)
    if perm is not None:
        Wk = Wk[:, torch.argsort(perm)]
    return Wk.to(W.dtype), scale, zp
