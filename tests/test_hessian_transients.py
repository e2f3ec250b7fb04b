"""H and its inverse with fewer [in, in] temporaries (what models.streamed.footprint counts), bit for bit the
values the plain formulas give: the mirror of XᵀX's upper tiles, and Cholesky retries that dampen H in place."""
from __future__ import annotations

import pytest
import torch

from core.linear_stats import SYM_TILE, LinearStats
from core.obs import dampened_inverse_cholesky, inverse_hessian


@pytest.mark.parametrize("product", [torch.bfloat16, torch.float32, torch.float64])
def test_h_mirrors_the_upper_tiles_exactly_as_the_full_formula(product):
    d = 2 * SYM_TILE + 88  # two full tiles and a ragged one
    st = LinearStats(d, torch.float64, "cpu", product_dtype=product)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        st.add(torch.randn(2, 300, d, generator=g))
        st.end_batch()
    upper = st.xtx.triu()
    want = (upper + upper.triu(1).T).to(st.out_dtype)
    H = st.H
    assert H.dtype == st.out_dtype and torch.equal(H, want) and torch.equal(H, H.T)
    assert st.H is H  # cached


def _reference_factor(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """The Cholesky factor with a fresh dampened copy per try (the code before the in-place tries)."""
    H64 = H.to(torch.float64, copy=True)
    damp = percdamp * H64.diagonal().mean()
    for _ in range(8):
        A = H64.clone()
        A.diagonal().add_(damp)
        L, info = torch.linalg.cholesky_ex(A)
        if int(info) == 0:
            return L
        damp = damp * 10
    raise AssertionError("not positive definite")


@pytest.mark.parametrize("retried", [False, True])
def test_in_place_dampening_gives_the_same_inverse_including_retries(retried):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(400, 96, generator=g, dtype=torch.float64)
    H = X.T @ X
    if retried:  # lambda_min at -2% of mean diag: the first dampening (1%) fails, the second (10%) holds
        H = H - (torch.linalg.eigvalsh(H)[0] + 0.02 * H.diagonal().mean()) * torch.eye(96, dtype=H.dtype)
    H = H.float()
    first = H.double() + 0.01 * H.double().diagonal().mean() * torch.eye(96, dtype=torch.float64)
    assert (int(torch.linalg.cholesky_ex(first)[1]) != 0) == retried
    L = _reference_factor(H, 0.01)
    U, dead = dampened_inverse_cholesky(H, 0.01)
    want_U, _ = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    assert not dead.any() and torch.equal(U, want_U.float())
    Hinv, _ = inverse_hessian(H, 0.01, torch.float64)
    assert torch.equal(Hinv, torch.cholesky_inverse(L))
