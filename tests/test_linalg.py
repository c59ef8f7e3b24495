"""kgp.linalg against dense oracles: jittered Cholesky, extreme eigenvalue estimates."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from kgp.kernels import kernel_parameters
from kgp.linalg import NotPSDError, largest_eigenvalue, psd_cholesky, smallest_eigenvalue_from_cholesky

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
