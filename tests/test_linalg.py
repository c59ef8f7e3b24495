"""kgp.linalg against dense oracles: jittered Cholesky, extreme eigenvalue estimates."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from kgp.kernels import kernel_parameters
from kgp.linalg import (
    NotPSDError,
    largest_eigenvalue,
    psd_cholesky,
    psd_cholesky_in_place,
    smallest_eigenvalue_from_cholesky,
)
from kgp.linalg.lapack import potrf_applies

F64 = torch.float64


def _spd(m: int, cond: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=F64)).Q
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), m, dtype=F64)
    return (Q * s) @ Q.T


def test_psd_cholesky_plain_and_jittered():
    A = _spd(50, 1e3)
    L = psd_cholesky(A)
    torch.testing.assert_close(L @ L.T, A, rtol=1e-10, atol=1e-12)
    # rank-deficient PSD: plain Cholesky fails, a tiny jitter fixes it
    g = torch.Generator().manual_seed(1)
    B = torch.randn(40, 5, generator=g, dtype=F64)
    P = B @ B.T
    assert int(torch.linalg.cholesky_ex(P).info) != 0
    L = psd_cholesky(P)
    assert float((L @ L.T - P).abs().max()) < 1e-9 * float(P.diagonal().mean())


def test_psd_cholesky_raises_not_psd_error_naming_the_matrix():
    A = -torch.eye(4, dtype=F64)
    with pytest.raises(NotPSDError, match=r"K_MM \(4 x 4, torch.float64\) is not positive definite.*use float64"):
        psd_cholesky(A, what="K_MM", remedy="use float64")
    with pytest.raises(NotPSDError, match="not positive definite$"):
        psd_cholesky(A, max_tries=0)
    with pytest.raises(NotPSDError, match="contains NaN"):
        psd_cholesky(torch.full((3, 3), float("nan"), dtype=F64))


def _rank_deficient(m: int, rank: int, seed: int, dtype=F64) -> torch.Tensor:
    B = torch.randn(m, rank, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return (B @ B.T).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_psd_cholesky_in_place_is_psd_cholesky_without_a_copy(dtype):
    A = _spd(80, 1e3).to(dtype)
    expected = psd_cholesky(A)
    below = torch.ones(80, 80, dtype=torch.bool).tril(-1)
    work = A.masked_fill(below, float("nan"))  # NaN below the diagonal: only the upper triangle is read
    pointer = work.data_ptr()
    L = psd_cholesky_in_place(work)
    assert L.data_ptr() == pointer and torch.equal(L, L.tril())
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(L, expected, rtol=100 * eps * 1e3**0.5, atol=100 * eps)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_psd_cholesky_in_place_restores_the_matrix_between_jitters(dtype):
    # a positive definite leading block, then a rank-deficient tail: the plain try fails late, after LAPACK
    # overwrote most of the lower triangle, and each retry must factor the original matrix plus its jitter,
    # the same jitter psd_cholesky adds
    m = 60
    P = torch.zeros(m, m, dtype=F64)
    P[:40, :40] = _spd(40, 10.0, seed=2)
    P[40:, 40:] = _rank_deficient(20, 3, seed=5)
    P = P.to(dtype)
    assert int(torch.linalg.cholesky_ex(P).info) > 30
    L = psd_cholesky_in_place(P.clone())
    reference = psd_cholesky(P)
    added = (L.double() @ L.double().T - P.double()).diagonal()
    expected = (reference.double() @ reference.double().T - P.double()).diagonal()
    eps = torch.finfo(dtype).eps
    scale = float(P.diagonal().abs().mean())
    # the reconstruction is P plus a jitter on the diagonal (rounding of the product aside) ...
    off = L.double() @ L.double().T - P.double()
    off.diagonal().zero_()
    assert float(off.abs().max()) < 50 * eps * scale
    # ... from psd_cholesky's ladder (eps * mean(diag) growing tenfold): the same rung, or the next one on
    # either side where rounding decides whether a borderline jitter suffices (the in-place factor reads the
    # upper triangle, psd_cholesky the lower; MKL's code path and thread count move that decision)
    assert float(added.mean()) > eps * scale / 2
    ratio = float(added.mean() / expected.mean())
    assert 1 / 15 < ratio < 15, ratio


def test_psd_cholesky_in_place_errors_name_the_matrix():
    with pytest.raises(NotPSDError, match=r"K_MM \(4 x 4, torch.float64\) is not positive definite.*use float64"):
        psd_cholesky_in_place(-torch.eye(4, dtype=F64), what="K_MM", remedy="use float64")
    with pytest.raises(NotPSDError, match="not positive definite$"):
        psd_cholesky_in_place(-torch.eye(4, dtype=F64), max_tries=0)
    A = _spd(6, 10.0)
    A[0, 3] = float("nan")
    with pytest.raises(NotPSDError, match="K_MM contains NaN or infinite entries"):
        psd_cholesky_in_place(A, what="K_MM")


def test_psd_cholesky_in_place_off_lapack_copies_the_factor_back():
    # a non-contiguous matrix cannot go to LAPACK on its own memory: psd_cholesky factors a copy
    A = _spd(30, 1e2)
    storage = torch.empty(30, 30, dtype=F64)
    view = storage.mT
    view.copy_(A.triu() + torch.full((30, 30), 7.0, dtype=F64).tril(-1))  # only the upper triangle counts
    assert not potrf_applies(view)
    L = psd_cholesky_in_place(view)
    assert L.data_ptr() == storage.data_ptr()
    torch.testing.assert_close(L, psd_cholesky(A), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("m", [30, 300])
def test_extreme_eigenvalues_match_eigvalsh(m):
    A = _spd(m, 1e4, seed=m)
    exact = torch.linalg.eigvalsh(A)
    top = largest_eigenvalue(A)
    assert top <= float(exact[-1]) * (1 + 1e-12) and top == pytest.approx(float(exact[-1]), rel=1e-5)
    low = smallest_eigenvalue_from_cholesky(torch.linalg.cholesky(A))
    assert float(exact[0]) * (1 - 1e-9) <= low <= 2 * float(exact[0])


def test_kernel_parameters_reads_ard_and_scale():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=3))
    k.outputscale = 2.5
    k.base_kernel.lengthscale = torch.tensor([[1.0, 2.0, 3.0]])
    p = kernel_parameters(k)
    assert p.family == "matern32" and p.is_stationary and p.outputscale == pytest.approx(2.5)
    torch.testing.assert_close(p.shape, torch.tensor([1.0, 2.0, 3.0]))
    assert not p.shape.requires_grad
    assert kernel_parameters(gpytorch.kernels.PeriodicKernel()).family == "generic"
