"""Inverse-Hessian factors for OBS-style pruning and quantisation, and the column sweep SparseGPT and
GPTQ share.

For a linear layer the layer-wise loss ||X W^T - X W_hat^T||^2 has Hessian H = X^T X ([in, in], the
caller accumulates it over calibration tokens). Pruning needs H^-1; we factor in float64 because
X^T X of real activations is badly conditioned and fp32 Cholesky fails or loses the small pivots.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch

from core.device import synchronize
from core.errors import SmeltError

_RETRIES = 4  # with percdamp > 0: try damp, 10x, 100x, 1000x before giving up
_TIMERS: list[dict] = []  # active `timed_inverses` accumulators


@contextlib.contextmanager
def timed_inverses(seconds: dict, key: str = "hessian_inverse_s"):
    """Add the time every inverse-Hessian factorisation takes inside this block to seconds[key], so a
    driver can split it from the column sweeps without touching the pure algorithm functions."""
    seconds.setdefault(key, 0.0)
    entry = {"seconds": seconds, "key": key}
    _TIMERS.append(entry)
    try:
        yield seconds
    finally:
        _TIMERS.remove(entry)


@contextlib.contextmanager
def _clock():
    synchronize()  # queued GPU work before the factorisation is not its time
    t0 = time.perf_counter()
    try:
        yield
    finally:
        synchronize()
        for entry in _TIMERS:
            entry["seconds"][entry["key"]] += time.perf_counter() - t0


def check_hessian(H: torch.Tensor, in_features: int | None = None) -> None:
    """H must be a finite float [in, in] matrix with some calibration signal in it."""
    square = H.ndim == 2 and H.shape[0] == H.shape[1]
    if not square or (in_features is not None and H.shape[0] != in_features):
        want = f"[{in_features}, {in_features}]" if in_features is not None else "[in, in]"
        raise SmeltError(f"Hessian shape {tuple(H.shape)} must be [in_features, in_features] = {want}")
    if not H.is_floating_point():
        raise SmeltError(f"Hessian dtype {H.dtype} must be floating point (fp32 or fp64)")
    if not bool(torch.isfinite(H).all()):
        raise SmeltError("Hessian has NaN/inf entries; check the calibration activations")
    if not bool(H.any()):
        raise SmeltError("no calibration data: the Hessian is all zeros (accumulate X^T X over calibration inputs)")


def _check_percdamp(percdamp: float) -> None:
    if not (math.isfinite(percdamp) and percdamp >= 0):
        raise SmeltError(f"dampening percdamp={percdamp} must be a finite number >= 0 (e.g. 0.01)")


def _factor(H: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower Cholesky factor (float64) of H + damp*I, dead inputs patched; returns (L, dead)."""
    check_hessian(H)
    _check_percdamp(percdamp)
    H64 = H.detach().to(torch.float64, copy=True)
    diag = H64.diagonal()  # a view: writes below patch H64
    # An input that was zero on every calibration token has an all-zero row/column: make it the identity
    # there so H stays invertible; the caller zeros those weights (their removal costs nothing).
    dead = diag == 0
    diag[dead] = 1.0
    scale = diag.mean()
    singular = SmeltError("Hessian is singular; set dampening > 0 (percdamp, e.g. 0.01) or use more "
                          "calibration tokens")
    if percdamp == 0:
        # Cholesky can "succeed" on rounding noise, so use the numerical-rank rule instead: singular when
        # lambda_min <= n * eps(H.dtype) * lambda_max, i.e. within the rounding error H was stored with.
        ev = torch.linalg.eigvalsh(H64)
        if ev[0] <= H.shape[0] * torch.finfo(H.dtype).eps * ev[-1]:
            raise singular
    damp = percdamp * scale
    undamped = diag.clone()  # each try dampens H64 itself: no second [in, in] copy
    for _ in range(_RETRIES):
        diag.copy_(undamped).add_(damp)
        L, info = torch.linalg.cholesky_ex(H64)
        if int(info) == 0:
            return L, dead
        if percdamp == 0:
            raise singular
        damp = damp * 10  # not PD (e.g. an fp16-accumulated H): more damping trades accuracy for stability
    raise SmeltError(f"Hessian is not positive definite even with dampening "
                     f"{float(damp / 10 / scale):.3g} x mean(diag); check the calibration statistics")


def dampened_inverse_cholesky(H: torch.Tensor, percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor U of (H + damp*I)^-1 (so H^-1 = U^T U), damp = percdamp * mean(diag H).

    Row i of U, scaled by 1/U[i, i], is the OBS update for removing weight i after weights 0..i-1 were
    already removed, which is what lets SparseGPT/GPTQ sweep columns left to right. Computed in float64,
    returned as float32 on H's device, together with the bool `dead` mask of inputs whose diag was 0
    (the caller should zero those weight columns).
    """
    with _clock():  # int(info) syncs an accelerator, so the factorisation's time lands inside the clock
        L, dead = _factor(H, percdamp)
        inverse = torch.cholesky_inverse(L)
        del L  # two fp64 [in, in] at a time (models.streamed.footprint counts them)
        U, info = torch.linalg.cholesky_ex(inverse, upper=True)
        del inverse
        failed = int(info) != 0
    if failed:
        raise SmeltError("inverse Hessian is not positive definite in float64; increase dampening (percdamp)")
    return U.to(torch.float32), dead


def inverse_hessian(
    H: torch.Tensor, percdamp: float = 0.01, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (H + damp*I)^-1 in `dtype` (float64 suits exact OBS, whose many downdates compound error)."""
    with _clock():
        L, dead = _factor(H, percdamp)
        return torch.cholesky_inverse(L).to(dtype), dead


def obs_column_sweep(
    W: torch.Tensor,
    U: torch.Tensor,
    blocksize: int,
    column_value: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor],
) -> torch.Tensor:
    """Fix W's columns left to right to the values `column_value` picks, compensating each with OBS.

    With U the upper Cholesky factor of H^-1 (dampened_inverse_cholesky), fixing column i to q_i after
    columns 0..i-1 were fixed is best compensated by subtracting err_i * U[i, i:] from columns i.., with
    err_i = (w_i - q_i) / U[i, i]. Columns are swept in blocks of `blocksize`: updates inside the block
    are applied eagerly, those to later columns are batched into one matmul per block (the "lazy" update).

    column_value(W1, d1, j, col) returns column col's new value q [out]: W1 is the current block (the
    columns before j already fixed, the rest already updated), d1 = diag of the block's U, j the
    block-local and col the global column index. It may read W1 (e.g. to choose a mask or qparams from
    the updated weights at a block or group start) but must not write it. Returns a new tensor with
    every column set exactly to its q; W and U are not modified.
    """
    Wk = W.clone()
    cols = Wk.shape[1]
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        # The block is held transposed, [block, rows]: each column's rank-1 update then streams through
        # contiguous rows (SparseGPT's sweeps 21.0 -> 9.1 s against the column-strided layout;
        # results/bench/oneshot-amd).
        W1t = Wk[:, i1:i2].T.contiguous()
        W1 = W1t.T  # the [rows, block] view column_value reads
        U1 = U[i1:i2, i1:i2]
        d1 = U1.diagonal()
        Err1t = torch.zeros_like(W1t)
        for j in range(i2 - i1):
            q = column_value(W1, d1, j, i1 + j)
            err = (W1t[j] - q) / d1[j]
            W1t[j + 1:].addr_(U1[j, j + 1:], err, alpha=-1)
            W1t[j] = q  # set, not updated, so the value is exactly q (e.g. a pruned 0, a grid point)
            Err1t[j] = err
        Wk[:, i1:i2] = W1
        Wk[:, i2:].addmm_(Err1t.T, U[i1:i2, i2:], alpha=-1)  # lazy batched update of every later column
    return Wk
