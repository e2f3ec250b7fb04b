"""Pruning maths: valid patterns, exact counts, the expected quality order, OBS optimality, bad input."""
from __future__ import annotations

import pytest
import torch

from core.errors import SmeltError
from core.obs import dampened_inverse_cholesky, inverse_hessian
from core.patterns import NMPattern
from prune.algorithms import (
    magnitude_prune,
    masked_refit,
    obs_prune,
    reconstruction_error,
    sparsegpt_prune,
    wanda_prune,
)
from prune.patterns import topk_mask_unstructured

METHODS = ["magnitude", "wanda", "sparsegpt", "obs"]


def layer(seed: int, rows: int = 32, cols: int = 64, tokens: int = 512, outliers: int = 4):
    """Calibration inputs with correlated features (X = Z A) and a few high-norm outlier features,
    the regime where activation-aware and second-order pruning beat magnitude."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, cols, generator=g) @ (torch.randn(cols, cols, generator=g) / cols ** 0.5)
    X[:, torch.randperm(cols, generator=g)[:outliers]] *= 10
    return X, torch.randn(rows, cols, generator=g)


def prune(method: str, W, X, **kw):
    if method == "magnitude":
        return magnitude_prune(W, **kw)
    if method == "wanda":
        return wanda_prune(W, X.norm(dim=0), **kw)
    H = X.T @ X
    return sparsegpt_prune(W, H, **kw) if method == "sparsegpt" else obs_prune(W, H, **kw)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("method", METHODS)
def test_nm_masks_keep_exactly_n_per_group(method, n, m):
    X, W = layer(0)
    pattern = NMPattern(n, m)
    Wp, keep = prune(method, W, X, pattern=pattern)
    assert keep.dtype == torch.bool and keep.shape == W.shape
    assert pattern.holds(keep) and pattern.holds(Wp)
    assert bool((keep.reshape(-1, m).sum(-1) == n).all())  # every group keeps exactly n, not fewer
    assert bool((Wp[~keep] == 0).all())
    assert not pattern.holds(torch.ones_like(keep))


@pytest.mark.parametrize("method", METHODS)
def test_unstructured_counts_are_exact(method):
    """'Exact' per method: magnitude round(s*numel) over the layer; wanda and obs round(s*in) in every
    row; sparsegpt round(s*out*blocksize) in every block (block-wide ranking, as the reference)."""
    X, W = layer(1)
    s, bs = 0.3, 16
    kw = {"blocksize": bs} if method == "sparsegpt" else {}
    Wp, keep = prune(method, W, X, sparsity=s, **kw)
    pruned = ~keep
    if method == "magnitude":
        assert int(pruned.sum()) == round(s * W.numel())
    elif method == "sparsegpt":
        for i in range(0, W.shape[1], bs):
            assert int(pruned[:, i:i + bs].sum()) == round(s * W.shape[0] * bs)
    else:
        assert bool((pruned.sum(1) == round(s * W.shape[1])).all())
    assert bool((Wp[pruned] == 0).all())
    if method in ("magnitude", "wanda"):  # no weight update: kept weights are untouched
        assert torch.equal(Wp[keep], W[keep])
    else:  # OBS-style methods move the kept weights to compensate
        assert not torch.equal(Wp[keep], W[keep])


def test_wanda_keeps_small_weights_on_high_norm_inputs():
    _, W = layer(2)
    W[:, 7] = 1e-3  # tiny weights, but on an outlier input feature (score 10 > any other)
    norm = torch.ones(64)
    norm[7] = 1e4
    assert not bool(magnitude_prune(W, 0.5)[1][:, 7].any())
    assert bool(wanda_prune(W, norm, 0.5)[1][:, 7].all())
    assert bool(wanda_prune(W, norm, pattern=NMPattern(2, 4))[1][:, 7].all())


def test_sparsegpt_per_row_ranking_gives_uniform_rows():
    X, W = layer(2)
    _, keep = sparsegpt_prune(W, X.T @ X, sparsity=0.5, blocksize=16, per_row=True)
    for i in range(0, 64, 16):
        assert bool(((~keep[:, i:i + 16]).sum(1) == 8).all())


def test_topk_mask_ties_do_not_change_the_count():
    score = torch.ones(8, 10)
    assert int((~topk_mask_unstructured(score, 0.35)).sum()) == 28
    assert bool(((~topk_mask_unstructured(score, 0.5, per_row=True)).sum(1) == 5).all())


@pytest.mark.parametrize("sparsity,n,m", [(0.5, 0, 0), (0.0, 2, 4)], ids=["50%", "2:4"])
def test_reconstruction_error_order(sparsity, n, m):
    errs = {k: [] for k in METHODS}
    for seed in range(5):
        X, W = layer(seed)
        for method in METHODS:
            Wp, _ = prune(method, W, X, sparsity=sparsity, pattern=NMPattern(n, m) if m else None)
            errs[method].append(reconstruction_error(X, W, Wp, relative=True))
        assert errs["sparsegpt"][-1] < errs["magnitude"][-1], f"seed {seed}: {errs}"
    mean = {k: sum(v) / len(v) for k, v in errs.items()}
    print(f"\nmean relative reconstruction error at {sparsity=} {n}:{m}: {mean}")
    assert mean["obs"] <= mean["sparsegpt"] <= mean["wanda"] <= mean["magnitude"], mean


def test_obs_weights_are_the_least_squares_optimum_for_their_mask():
    """Greedy OBS updates are exact for a quadratic loss, so the result must equal the closed-form
    optimum of (w - w0)^T H_d (w - w0) with the pruned weights fixed at 0 (H_d = damped H)."""
    X, W = layer(3, rows=8, cols=32)
    H = (X.T @ X).double()
    Wp, keep = obs_prune(W.double(), H, sparsity=0.5, percdamp=0.01)
    Hd = H + 0.01 * H.diagonal().mean() * torch.eye(32, dtype=torch.float64)
    for r in range(8):
        K, P = keep[r], ~keep[r]
        want = W[r].double()[K] + torch.linalg.solve(Hd[K][:, K], Hd[K][:, P] @ W[r].double()[P])
        torch.testing.assert_close(Wp[r][K], want, rtol=1e-7, atol=1e-9)


def _masked_optimum(W, H, keep, percdamp=0.01):
    """The closed form per row: kept weights w_K + H_KK^-1 H_KP w_P, pruned ones 0 (fp64)."""
    Hd = H.double() + percdamp * H.double().diagonal().mean() * torch.eye(H.shape[0], dtype=torch.float64)
    out = torch.zeros_like(W, dtype=torch.float64)
    for r in range(W.shape[0]):
        K, P = keep[r], ~keep[r]
        out[r, K] = W[r].double()[K] + torch.linalg.solve(Hd[K][:, K], Hd[K][:, P] @ W[r].double()[P])
    return out


@pytest.mark.parametrize("method", ["sparsegpt", "wanda", "magnitude"])
def test_masked_refit_reaches_the_least_squares_optimum_for_the_mask(method):
    X, W = layer(5, rows=16, cols=64)
    H = X.T @ X
    Wp, keep = prune(method, W, X, pattern=NMPattern(2, 4))
    Wr, info = masked_refit(W, Wp, H, keep)
    assert torch.equal(Wr != 0, keep & (Wr != 0)) and bool((Wr[~keep] == 0).all())  # exact 2:4 kept
    torch.testing.assert_close(Wr.double(), _masked_optimum(W, H, keep), rtol=2e-3, atol=2e-3)
    err_before = reconstruction_error(X, W, Wp, relative=True)
    err_after = reconstruction_error(X, W, Wr, relative=True)
    print(f"\n{method} 2:4 relative error {err_before:.4f} -> refit {err_after:.4f} ({info})")
    assert err_after < err_before and info["loss_after"] < info["loss_before"]
    if method != "sparsegpt":  # no weight update at all before: the refit must gain a lot
        assert err_after < 0.8 * err_before


def test_masked_refit_to_teacher_targets_solves_the_asymmetric_least_squares():
    """With X_d the teacher's inputs and X the pruned model's: min ||X_d wᵀ − X ŵᵀ||² + damp ||ŵ − w||² on the
    mask, closed form per row on its support K: ŵ_K = (H_d)_KK⁻¹ (w C + damp w)_K."""
    X, W = layer(8, rows=12, cols=32)
    Xd = X + 0.3 * torch.randn(X.shape, generator=torch.Generator().manual_seed(9)) * X.std(0)
    H, C = X.T @ X, Xd.T @ X
    Wp, keep = sparsegpt_prune(W, H, pattern=NMPattern(2, 4))
    Wr, info = masked_refit(W, Wp, H, keep, cross=C)
    damp = 0.01 * H.double().diagonal().mean()
    Hd = H.double() + damp * torch.eye(32, dtype=torch.float64)
    b = W.double() @ C.double() + damp * W.double()
    for r in range(12):
        K = keep[r]
        torch.testing.assert_close(Wr[r][K].double(), torch.linalg.solve(Hd[K][:, K], b[r][K]), rtol=2e-3, atol=2e-3)
    assert bool((Wr[~keep] == 0).all()) and info["objective_drop"] > 0 and "loss_before" not in info

    def teacher_error(V):  # what the teacher-target refit minimises (undamped)
        return float(((Xd.double() @ W.double().T - X.double() @ V.double().T) ** 2).sum())
    plain, _ = masked_refit(W, Wp, H, keep)
    assert teacher_error(Wr) < min(teacher_error(plain), teacher_error(Wp))
    with pytest.raises(SmeltError, match="cross shape"):
        masked_refit(W, Wp, H, keep, cross=C[:16])


def test_masked_refit_leaves_the_obs_optimum_where_it_is():
    X, W = layer(6, rows=8, cols=32)
    H = X.T @ X
    Wp, keep = obs_prune(W, H, sparsity=0.5)
    Wr, info = masked_refit(W, Wp, H, keep)
    torch.testing.assert_close(Wr, Wp, rtol=1e-3, atol=1e-3)
    assert info["loss_after"] <= info["loss_before"] * (1 + 1e-6)


def test_masked_refit_freezes_dead_inputs_and_checks_its_arguments():
    X, W = layer(7, rows=8, cols=32)
    X[:, 3] = 0  # an input calibration never saw: its weight stays as the pruner left it
    H = X.T @ X
    Wp, keep = sparsegpt_prune(W, H, pattern=NMPattern(2, 4))
    Wr, _ = masked_refit(W, Wp, H, keep)
    assert torch.equal(Wr[:, 3], Wp[:, 3])
    with pytest.raises(SmeltError, match="keep"):
        masked_refit(W, Wp, H, keep[:, :16])
    with pytest.raises(SmeltError, match="max_iter"):
        masked_refit(W, Wp, H, keep, max_iter=0)


def test_sparsegpt_lazy_block_updates_match_one_block():
    # N:M masks do not depend on the block size, so batching later-column updates must change nothing
    X, W = layer(4)
    H = X.T @ X
    a, keep_a = sparsegpt_prune(W, H, pattern=NMPattern(2, 4), blocksize=8)
    b, keep_b = sparsegpt_prune(W, H, pattern=NMPattern(2, 4), blocksize=64)
    assert torch.equal(keep_a, keep_b)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_zero_sparsity_returns_weights_unchanged():
    X, W = layer(5)
    H = X.T @ X
    H[3, :] = H[:, 3] = 0  # a dead input must not be zeroed when nothing is pruned
    for fn in (sparsegpt_prune, obs_prune):
        Wp, keep = fn(W, H, sparsity=0.0)
        assert torch.equal(Wp, W) and bool(keep.all())


def test_dead_inputs_are_pruned_first():
    X, W = layer(6)
    X[:, [5, 9]] = 0
    for fn in (sparsegpt_prune, obs_prune):
        Wp, keep = fn(W, X.T @ X, sparsity=0.25)
        assert not bool(keep[:, [5, 9]].any()) and bool((Wp[:, [5, 9]] == 0).all())


def test_inputs_untouched_and_dtype_kept():
    X, W = layer(7)
    W = W.to(torch.bfloat16)
    H = X.T @ X
    W0, H0 = W.clone(), H.clone()
    for method in METHODS:
        Wp, _ = prune(method, W, X, pattern=NMPattern(2, 4))
        assert Wp.dtype == torch.bfloat16
    assert torch.equal(W, W0) and torch.equal(H, H0)


def test_inverse_cholesky_factor():
    X, _ = layer(8)
    H = X.T @ X
    U, dead = dampened_inverse_cholesky(H, percdamp=0.01)
    assert U.dtype == torch.float32 and not bool(dead.any())
    assert torch.equal(U, U.triu())
    H64 = H.double()
    want = torch.linalg.inv(H64 + 0.01 * H64.diagonal().mean() * torch.eye(64, dtype=torch.float64))
    torch.testing.assert_close(U.double().T @ U.double(), want, rtol=1e-4, atol=1e-7)
    Hinv, _ = inverse_hessian(H, 0.01, dtype=torch.float64)
    torch.testing.assert_close(Hinv, want)
    Z = torch.randn(512, 64)
    Hw = Z.T @ Z  # well conditioned: percdamp=0 must work
    U0, _ = dampened_inverse_cholesky(Hw, percdamp=0.0)
    torch.testing.assert_close(U0.double().T @ U0.double(), torch.linalg.inv(Hw.double()), rtol=1e-4, atol=1e-7)


def test_indefinite_hessian_retries_with_more_damping():
    v = torch.nn.functional.normalize(torch.randn(16, dtype=torch.float64), dim=0)
    H = torch.eye(16, dtype=torch.float64) - 1.05 * torch.outer(v, v)  # one eigenvalue -0.05
    U, _ = dampened_inverse_cholesky(H, percdamp=0.01)  # 0.01 fails, 0.1 succeeds
    assert bool(torch.isfinite(U).all())
    with pytest.raises(SmeltError, match="not positive definite"):
        dampened_inverse_cholesky(torch.eye(16) - 200 * torch.outer(v, v).float(), percdamp=0.01)


def test_bad_input_names_the_setting():
    X, W = layer(9)
    H = X.T @ X
    for s in (1.0, -0.1):
        for method in METHODS:
            with pytest.raises(SmeltError, match=rf"sparsity={s} must be in \[0, 1\)"):
                prune(method, W, X, sparsity=s)
    W62, X62 = W[:, :62], X[:, :62]
    for method in METHODS:
        with pytest.raises(SmeltError, match=r"N:M=2:4 .*in_features=62"):
            prune(method, W62, X62, pattern=NMPattern(2, 4))
    with pytest.raises(SmeltError, match="N:M=4:4"):
        NMPattern(4, 4)
    with pytest.raises(SmeltError, match="blocksize=6"):
        sparsegpt_prune(W, H, pattern=NMPattern(2, 4), blocksize=6)
    with pytest.raises(SmeltError, match=r"Hessian shape \(62, 62\)"):
        sparsegpt_prune(W, H[:62, :62])
    for tokens in (8, 63):  # fewer tokens than inputs: rank-deficient (63: only fp32 noise hides it)
        few = X[:tokens].T @ X[:tokens]
        for fn in (sparsegpt_prune, obs_prune):
            with pytest.raises(SmeltError, match="Hessian is singular; set dampening > 0"):
                fn(W, few, percdamp=0.0)
            fn(W, few, percdamp=0.01)  # damping makes the same statistics usable
        with pytest.raises(SmeltError, match="no calibration data"):
            fn(W, torch.zeros(64, 64))
    for bad in (None, torch.zeros(64)):
        with pytest.raises(SmeltError, match="no calibration data"):
            wanda_prune(W, bad)
