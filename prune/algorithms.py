"""Pruning maths as pure functions: weights (+ calibration statistics) -> (pruned weights, keep-mask).

Conventions shared by every function here:
- W is [out, in] like nn.Linear.weight; inputs are never modified in place.
- keep_mask is bool [out, in], True = kept; the pruned weights are exactly 0 where it is False.
- pattern=None means unstructured at `sparsity`; an NMPattern (core.patterns) means N:M (keep n of
  every m consecutive input features in each row, e.g. 2:4), and `sparsity` is then unused.
- Scores and updates run in fp32 (exact OBS in fp64); the result comes back in W's dtype.
- H = X^T X [in, in] and act_norm = ||X_j||_2 [in] summarise the layer's calibration inputs X [tokens, in].
"""
from __future__ import annotations

import torch

from core.errors import SmeltError
from core.obs import check_hessian, dampened_inverse_cholesky, inverse_hessian, obs_column_sweep
from core.patterns import NMPattern
from prune.patterns import check_sparsity, n_pruned, topk_mask_unstructured

_OBS_CHUNK_BYTES = 256 << 20  # exact OBS keeps one [in, in] inverse per row; bound it by row chunks


def _check_weight(W: torch.Tensor, sparsity: float, pattern: NMPattern | None) -> None:
    """Validate the shared arguments (the pattern itself was validated when it was built)."""
    if W.ndim != 2 or not W.is_floating_point():
        raise SmeltError(f"weight must be a 2-D float tensor [out, in], got shape {tuple(W.shape)} {W.dtype}")
    check_sparsity(sparsity)
    if pattern is not None:
        pattern.check_fits(W.shape[1])


def _work_dtype(W: torch.Tensor) -> torch.dtype:
    return torch.promote_types(W.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays fp64


def _unchanged(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return W.clone(), torch.ones(W.shape, dtype=torch.bool, device=W.device)


def magnitude_prune(
    W: torch.Tensor, sparsity: float = 0.5, pattern: NMPattern | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune the smallest |w|. Unstructured is layer-wise (one ranking over the whole matrix, so rows may
    end with different sparsity), the classic baseline; exactly round(sparsity * numel) weights go."""
    W = W.detach()
    _check_weight(W, sparsity, pattern)
    score = W.to(_work_dtype(W)).abs()
    keep = pattern.keep_top(score) if pattern else topk_mask_unstructured(score, sparsity, per_row=False)
    return W.masked_fill(~keep, 0), keep


def wanda_prune(
    W: torch.Tensor, act_norm: torch.Tensor | None, sparsity: float = 0.5, pattern: NMPattern | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wanda (Sun et al. 2023): score |W_ij| * ||X_j||_2, no weight update. Unstructured compares within
    each output row (exactly round(sparsity * in) per row), which the paper found better than layer-wise."""
    W = W.detach()
    _check_weight(W, sparsity, pattern)
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
    keep = pattern.keep_top(score) if pattern else topk_mask_unstructured(score, sparsity, per_row=True)
    return W.masked_fill(~keep, 0), keep


def sparsegpt_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity: float = 0.5,
    pattern: NMPattern | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    per_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT (Frantar & Alistarh 2023): prune columns left to right, compensating with OBS updates.

    The sweep is core.obs.obs_column_sweep (shared with GPTQ): each column is set to w * keep, its error
    propagated to the later columns through U, the upper Cholesky factor of H^-1. Removing weight i
    after columns 0..i-1 were fixed has saliency w^2 / U[i, i]^2.

    Mask selection, made on the already-updated weights:
    - unstructured: at each block start, prune the round(sparsity * out * block_width) lowest-saliency
      weights of the block, ranked across all rows as the reference implementation does (rows adapt);
      per_row=True ranks within each row instead (round(sparsity * block_width) per row).
    - N:M: at every column i with i % m == 0, keep the n highest-saliency of columns i..i+m per row.
    Inputs never seen in calibration (diag H == 0) are zeroed first: on the calibration data they cost
    nothing. sparsity == 0 without N:M returns W unchanged.
    """
    W = W.detach()
    _check_weight(W, sparsity, pattern)
    check_hessian(H, W.shape[1])
    if not isinstance(blocksize, int) or blocksize <= 0:
        raise SmeltError(f"blocksize={blocksize} must be a positive integer")
    if pattern and blocksize % pattern.m:  # a group must not straddle two blocks
        raise SmeltError(f"blocksize={blocksize} must be a multiple of M={pattern.m} for N:M={pattern}")
    if not pattern and sparsity == 0:
        return _unchanged(W)

    U, dead = dampened_inverse_cholesky(H.to(W.device), percdamp)
    U = U.to(_work_dtype(W))
    Wk = W.to(U.dtype, copy=True)
    Wk[:, dead] = 0
    keep = torch.ones(W.shape, dtype=torch.bool, device=W.device)

    def pruned_column(W1: torch.Tensor, d1: torch.Tensor, j: int, col: int) -> torch.Tensor:
        # masks are chosen on the already-updated weights, when the sweep reaches a block or a group
        if pattern is None and j == 0:
            block = topk_mask_unstructured(W1 ** 2 / d1 ** 2, sparsity, per_row=per_row)
            keep[:, col:col + W1.shape[1]] = block
        elif pattern is not None and col % pattern.m == 0:
            m = pattern.m
            keep[:, col:col + m] = pattern.keep_top(W1[:, j:j + m] ** 2 / d1[j:j + m] ** 2)
        return W1[:, j] * keep[:, col]  # pruned entries become exactly 0

    return obs_column_sweep(Wk, U, blocksize, pruned_column).to(W.dtype), keep


def obs_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity: float = 0.5,
    pattern: NMPattern | None = None,
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
    _check_weight(W, sparsity, pattern)
    rows, cols = W.shape
    check_hessian(H, cols)
    if not pattern and sparsity == 0:
        return _unchanged(W)

    Hinv, dead = inverse_hessian(H.to(W.device), percdamp, dtype=torch.float64)
    Wk = W.to(torch.float64, copy=True)
    Wk[:, dead] = 0
    steps = (pattern.m - pattern.n) * (cols // pattern.m) if pattern else n_pruned(cols, sparsity)
    pruned = torch.zeros(W.shape, dtype=torch.bool, device=W.device)
    chunk = max(1, _OBS_CHUNK_BYTES // (cols * cols * 8))
    for r1 in range(0, rows, chunk):
        r2 = min(r1 + chunk, rows)
        Wk[r1:r2], pruned[r1:r2] = _obs_rows(Wk[r1:r2], Hinv, steps, pattern)
    return Wk.to(W.dtype), ~pruned


def _obs_rows(
    Wr: torch.Tensor, Hinv: torch.Tensor, steps: int, pattern: NMPattern | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy OBS on a chunk of rows; pattern None means unstructured. Returns (weights, pruned-mask)."""
    rows, cols = Wr.shape
    Wr = Wr.clone()
    Hr = Hinv.expand(rows, cols, cols).clone()  # every row's inverse diverges after its first downdate
    pruned = torch.zeros(Wr.shape, dtype=torch.bool, device=Wr.device)
    ar = torch.arange(rows, device=Wr.device)
    for _ in range(steps):
        blocked = pruned.clone()
        if pattern:  # a group already down to n weights offers no more candidates
            full = (~pruned).reshape(rows, cols // pattern.m, pattern.m).sum(-1) <= pattern.n
            blocked |= full.repeat_interleave(pattern.m, dim=1)
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


def masked_refit(
    W: torch.Tensor,
    W_hat: torch.Tensor,
    H: torch.Tensor,
    keep: torch.Tensor,
    percdamp: float = 0.01,
    max_iter: int = 200,
    tol: float = 1e-4,
    cross: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The kept weights re-solved to the exact layer-wise optimum for their mask (the mask itself fixed).

    min ||X Wᵀ − X Ŵᵀ||² over Ŵ with Ŵ = 0 where keep is False splits into one least-squares problem per
    row on that row's support: (Ŵ_r − W_r) H_d restricted to the support = 0, with H_d = H + damp·I as
    SparseGPT dampens it. SparseGPT's sweep only compensates columns to the right of each removal, so its
    weights are not that optimum; exact OBS's are (each removal's update is the optimal one), and Wanda
    and magnitude update nothing. Solved by conjugate gradients on all rows at once (each iteration one
    [rows, in] x [in, in] product), Jacobi-preconditioned, starting from W_hat; fp32, as the sweeps.
    Inputs never seen in calibration (diag H == 0) stay as W_hat has them. A row whose layer loss the
    solve did not lower (rounding at convergence) keeps W_hat's row, so the loss never rises.

    cross = X_dᵀX (core.calibrate's teacher targets) matches the teacher's output instead:
    min ||X_d Wᵀ − X Ŵᵀ||² + damp·||Ŵ − W||², X_d the teacher's inputs to this layer and X (H = XᵀX) the
    model's, so the solve also absorbs what earlier blocks' pruning did to X. The right-hand side W H_d
    becomes W C + damp·W; cross = H is the plain refit.
    Returns (Ŵ in W's dtype, exactly 0 off the mask; {iterations, rel_residual, objective_drop (the loss
    removed, ≥ 0), and without `cross` loss_before, loss_after: tr(ΔW H_d ΔWᵀ), and loss_ratio}).
    """
    W, W_hat = W.detach(), W_hat.detach()
    if W.shape != W_hat.shape or keep.shape != W.shape or keep.dtype != torch.bool:
        raise SmeltError(f"shapes do not match: W {tuple(W.shape)}, W_hat {tuple(W_hat.shape)}, keep "
                         f"{tuple(keep.shape)} {keep.dtype} (need three [out, in], keep bool)")
    check_hessian(H, W.shape[1])
    if cross is not None and cross.shape != H.shape:
        raise SmeltError(f"cross shape {tuple(cross.shape)} must be [in_features, in_features] = {tuple(H.shape)}")
    if not (isinstance(max_iter, int) and max_iter > 0 and tol > 0):
        raise SmeltError(f"max_iter={max_iter} must be a positive integer and tol={tol} > 0")
    dt = _work_dtype(W)
    Hd = H.detach().to(device=W.device, dtype=dt, copy=True)
    diag = Hd.diagonal()
    dead = diag == 0
    damp = percdamp * diag.mean()
    diag.add_(damp)
    diag[dead] = 1.0  # those columns are frozen below; 1 keeps the preconditioner finite
    free = keep & ~dead  # the unknowns: kept weights of inputs calibration saw
    w, x = W.to(dt), W_hat.to(dt).masked_fill(~keep, 0)
    b = w @ Hd if cross is None else w @ cross.detach().to(device=W.device, dtype=dt) + damp * w

    def objective(v: torch.Tensor) -> torch.Tensor:  # per row: v H_d vᵀ − 2 v·b, the loss less a constant
        return ((v @ Hd - 2 * b) * v).sum(1)

    before = objective(x)
    r = (b - x @ Hd) * free  # the negative gradient on the support
    z = r / diag
    p = z.clone()
    rz = (r * z).sum(1)
    r0 = r.norm(dim=1).clamp_min(torch.finfo(dt).tiny)
    it, rel = 0, 0.0
    for it in range(1, max_iter + 1):
        Ap = (p @ Hd) * free
        pAp = (p * Ap).sum(1)
        alpha = torch.where(pAp > 0, rz / pAp.clamp_min(torch.finfo(dt).tiny), torch.zeros_like(rz))
        x.add_(alpha[:, None] * p)
        r.sub_(alpha[:, None] * Ap)
        rel = float((r.norm(dim=1) / r0).max())
        if rel < tol:
            break
        z = r / diag
        rz_new = (r * z).sum(1)
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(torch.finfo(dt).tiny), torch.zeros_like(rz))
        p = z + beta[:, None] * p
        rz = rz_new
    after = objective(x)
    worse = after > before
    x[worse] = W_hat.to(dt)[worse].masked_fill(~keep[worse], 0)
    after = torch.where(worse, before, after)
    info = {"iterations": it, "rel_residual": rel, "objective_drop": float((before - after).sum())}
    if cross is None:  # the constant is w H_d wᵀ = b·w: the losses themselves
        const = (b * w).sum(1)
        lb, la = float((before + const).sum()), float((after + const).sum())
        info |= {"loss_before": lb, "loss_after": la, "loss_ratio": la / lb if lb else 1.0}
    return x.masked_fill(~keep, 0).to(W.dtype), info


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
