"""Pruning maths as pure functions: weights (+ calibration statistics) -> (pruned weights, keep-mask).

Conventions shared by every function here:
- W is [out, in] like nn.Linear.weight; inputs are never modified in place.
- keep_mask is bool [out, in], True = kept; the pruned weights are exactly 0 where it is False.
- n = m = 0 means unstructured at `sparsity`; n, m > 0 means N:M (keep n of every m consecutive input
  features in each row, the 2:4 pattern sparse tensor cores run), and `sparsity` is then unused.
- Scores and updates run in fp32 (exact OBS in fp64); the result comes back in W's dtype.
- H = X^T X [in, in] and act_norm = ||X_j||_2 [in] summarise the layer's calibration inputs X [tokens, in].
"""
from __future__ import annotations

import torch

from core.errors import SmeltError
from core.obs import check_hessian, dampened_inverse_cholesky, inverse_hessian
from prune.patterns import check_nm, check_sparsity, n_pruned, nm_mask, topk_mask_unstructured

_OBS_CHUNK_BYTES = 256 << 20  # exact OBS keeps one [in, in] inverse per row; bound it by row chunks


def _check_weight(W: torch.Tensor, sparsity: float, n: int, m: int) -> bool:
    """Validate the shared arguments; returns True for N:M, False for unstructured."""
    if W.ndim != 2 or not W.is_floating_point():
        raise SmeltError(f"weight must be a 2-D float tensor [out, in], got shape {tuple(W.shape)} {W.dtype}")
    check_sparsity(sparsity)
    if n or m:
        check_nm(n, m, W.shape[1])
        return True
    return False


def _work_dtype(W: torch.Tensor) -> torch.dtype:
    return torch.promote_types(W.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays fp64


def _unchanged(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return W.clone(), torch.ones(W.shape, dtype=torch.bool, device=W.device)


def magnitude_prune(
    W: torch.Tensor, sparsity: float = 0.5, n: int = 0, m: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune the smallest |w|. Unstructured is layer-wise (one ranking over the whole matrix, so rows may
    end with different sparsity), the classic baseline; exactly round(sparsity * numel) weights go."""
    W = W.detach()
    nm = _check_weight(W, sparsity, n, m)
    score = W.to(_work_dtype(W)).abs()
    keep = nm_mask(score, n, m) if nm else topk_mask_unstructured(score, sparsity, per_row=False)
    return W.masked_fill(~keep, 0), keep


def wanda_prune(
    W: torch.Tensor, act_norm: torch.Tensor | None, sparsity: float = 0.5, n: int = 0, m: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wanda (Sun et al. 2023): score |W_ij| * ||X_j||_2, no weight update. Unstructured compares within
    each output row (exactly round(sparsity * in) per row), which the paper found better than layer-wise."""
    W = W.detach()
    nm = _check_weight(W, sparsity, n, m)
    if act_norm is None:
        raise SmeltError("no calibration data: wanda needs act_norm, the per-input-feature L2 norm of X")
    if act_norm.shape != (W.shape[1],):
        raise SmeltError(f"act_norm shape {tuple(act_norm.shape)} must be [in_features] = [{W.shape[1]}]")
    norm = act_norm.detach().to(device=W.device, dtype=_work_dtype(W))
    if not bool(torch.isfinite(norm).all()) or bool((norm < 0).any()):
        raise SmeltError("act_norm must be finite and >= 0 (an L2 norm per input feature)")
    if not bool(norm.any()):
        raise SmeltError("no calibration data: act_norm is all zeros")
    score = W.to(norm.dtype).abs() * norm
    keep = nm_mask(score, n, m) if nm else topk_mask_unstructured(score, sparsity, per_row=True)
    return W.masked_fill(~keep, 0), keep


def sparsegpt_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity: float = 0.5,
    n: int = 0,
    m: int = 0,
    blocksize: int = 128,
    percdamp: float = 0.01,
    per_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT (Frantar & Alistarh 2023): prune columns left to right, compensating with OBS updates.

    With U the upper Cholesky factor of H^-1, removing column i (after 0..i-1 were fixed) is best
    compensated by subtracting err_i * U[i, i:] from columns i.. with err_i = (w_i - q_i) / U[i, i], and
    its saliency is w^2 / U[i, i]^2. Columns are swept in blocks: updates inside the block are applied
    eagerly, those to later columns are batched into one matmul per block (the "lazy" update).

    Mask selection, made on the already-updated weights:
    - unstructured: at each block start, prune the round(sparsity * out * block_width) lowest-saliency
      weights of the block, ranked across all rows as the reference implementation does (rows adapt);
      per_row=True ranks within each row instead (round(sparsity * block_width) per row).
    - N:M: at every column i with i % m == 0, keep the n highest-saliency of columns i..i+m per row.
    Inputs never seen in calibration (diag H == 0) are zeroed first: on the calibration data they cost
    nothing. sparsity == 0 without N:M returns W unchanged.
    """
    W = W.detach()
    nm = _check_weight(W, sparsity, n, m)
    cols = W.shape[1]
    check_hessian(H, cols)
    if not isinstance(blocksize, int) or blocksize <= 0:
        raise SmeltError(f"blocksize={blocksize} must be a positive integer")
    if nm and blocksize % m:
        raise SmeltError(f"blocksize={blocksize} must be a multiple of M={m} for N:M={n}:{m}")
    if not nm and sparsity == 0:
        return _unchanged(W)

    U, dead = dampened_inverse_cholesky(H.to(W.device), percdamp)
    U = U.to(_work_dtype(W))
    Wk = W.to(U.dtype, copy=True)
    Wk[:, dead] = 0
    keep = torch.ones(W.shape, dtype=torch.bool, device=W.device)

    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = Wk[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        d1 = U1.diagonal()
        keep1 = keep[:, i1:i2]  # a view: filling it fills `keep`
        Err1 = torch.zeros_like(W1)
        if not nm:
            keep1.copy_(topk_mask_unstructured(W1 ** 2 / d1 ** 2, sparsity, per_row=per_row))
        for j in range(i2 - i1):
            if nm and j % m == 0:  # i1 is a multiple of m, so block-local j % m == global column % m
                keep1[:, j:j + m] = nm_mask(W1[:, j:j + m] ** 2 / d1[j:j + m] ** 2, n, m)
            w = W1[:, j]
            q = w * keep1[:, j]
            err = (w - q) / d1[j]
            W1[:, j + 1:] -= err[:, None] * U1[j, j + 1:][None, :]
            W1[:, j] = q  # set, not updated, so pruned entries are exactly 0
            Err1[:, j] = err
        Wk[:, i1:i2] = W1
        Wk[:, i2:] -= Err1 @ U[i1:i2, i2:]  # lazy batched update of every later column

    return Wk.to(W.dtype), keep


def obs_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity: float = 0.5,
    n: int = 0,
    m: int = 0,
    percdamp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact greedy Optimal Brain Surgeon, one weight at a time per row: the slow reference.

    The layer loss splits into one quadratic per output row, so each row is pruned independently: take
    the remaining weight q with the lowest w_q^2 / Hinv_qq, move the other weights by
    -w_q / Hinv_qq * Hinv[:, q] (the optimal compensation), then remove q from the inverse with
    Hinv -= Hinv[:, q] Hinv[q, :] / Hinv_qq. Each row prunes exactly round(sparsity * in) weights (N:M:
    only groups still holding more than n weights are candidates). Rows are batched ([rows, in, in]
    inverses, fp64), chunked to bound memory; cost is O(out * in^3), so keep it to small layers.
    """
    W = W.detach()
    nm = _check_weight(W, sparsity, n, m)
    rows, cols = W.shape
    check_hessian(H, cols)
    if not nm and sparsity == 0:
        return _unchanged(W)

    Hinv, dead = inverse_hessian(H.to(W.device), percdamp, dtype=torch.float64)
    Wk = W.to(torch.float64, copy=True)
    Wk[:, dead] = 0
    steps = (m - n) * (cols // m) if nm else n_pruned(cols, sparsity)
    pruned = torch.zeros(W.shape, dtype=torch.bool, device=W.device)
    chunk = max(1, _OBS_CHUNK_BYTES // (cols * cols * 8))
    for r1 in range(0, rows, chunk):
        r2 = min(r1 + chunk, rows)
        Wk[r1:r2], pruned[r1:r2] = _obs_rows(Wk[r1:r2], Hinv, steps, n, m if nm else 0)
    return Wk.to(W.dtype), ~pruned


def _obs_rows(
    Wr: torch.Tensor, Hinv: torch.Tensor, steps: int, n: int, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy OBS on a chunk of rows; m == 0 means unstructured. Returns (weights, pruned-mask)."""
    rows, cols = Wr.shape
    Wr = Wr.clone()
    Hr = Hinv.expand(rows, cols, cols).clone()  # every row's inverse diverges after its first downdate
    pruned = torch.zeros(Wr.shape, dtype=torch.bool, device=Wr.device)
    ar = torch.arange(rows, device=Wr.device)
    for _ in range(steps):
        blocked = pruned.clone()
        if m:  # a group already down to n weights offers no more candidates
            full = (~pruned).reshape(rows, cols // m, m).sum(-1) <= n
            blocked |= full.repeat_interleave(m, dim=1)
        # removed weights have Hinv_qq == 0 (0/0 = nan); masked_fill overwrites those entries
        saliency = (Wr ** 2 / Hr.diagonal(dim1=1, dim2=2)).masked_fill(blocked, float("inf"))
        q = saliency.argmin(dim=1)
        hq = Hr[ar, :, q]  # column q of each row's inverse, [rows, in]
        dq = hq[ar, q]
        Wr -= (Wr[ar, q] / dq)[:, None] * hq
        Hr -= hq[:, :, None] * hq[:, None, :] / dq[:, None, None]  # symmetric: Hinv[q, :] = Hinv[:, q]
        pruned[ar, q] = True
    # later updates leave rounding-level residue at removed positions; they are removed, so exactly 0
    return Wr.masked_fill(pruned, 0), pruned


def reconstruction_error(
    X: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor, relative: bool = False
) -> float:
    """||X W^T - X W_hat^T||_F^2 over calibration inputs X [..., in], in fp64: the layer-wise loss every
    method here minimises. relative=True divides by ||X W^T||_F^2 (0 = perfect, 1 = as bad as W_hat = 0)."""
    if W.shape != W_hat.shape or X.shape[-1] != W.shape[1]:
        raise SmeltError(f"shapes do not match: X {tuple(X.shape)}, W {tuple(W.shape)}, "
                         f"W_hat {tuple(W_hat.shape)} (need X [..., in], W and W_hat [out, in])")
    X64 = X.detach().reshape(-1, X.shape[-1]).to(torch.float64)
    Y = X64 @ W.detach().to(torch.float64).T
    err = float(((Y - X64 @ W_hat.detach().to(torch.float64).T) ** 2).sum())
    return err / float((Y ** 2).sum()) if relative else err
