"""Memory of the `exact` solver: the kernel matrix is factored and solved where it lies.

Oracles: ``torch.linalg.cholesky`` / ``torch.cholesky_solve`` on a copy (the factor and the solution).
The deterministic measure of the memory is that the factor occupies the matrix's own buffer; the
resident-set figures (1.03-1.30x the kernel matrix at n = 4,000-16,000) are in docs/solvers/exact.md,
not asserted: a resident-set peak read in a subprocess was not reproducible on the shared machine.
"""

import numpy as np
import pytest
import torch
from kgp_builtins.exact import _solve_in_place

import kgp


def _spd(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=g, dtype=dtype)
    A = torch.exp(-0.5 * torch.cdist(X, X) ** 2)
    A.diagonal().add_(0.1)
    return A, torch.randn(n, 2, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_factor_overwrites_the_matrix_in_place(dtype):
    A, y = _spd(300, dtype)
    reference = torch.linalg.cholesky(A)
    expected = torch.cholesky_solve(y, reference)
    pointer = A.data_ptr()
    alpha, L = _solve_in_place(A, y, noise=0.1)
    tol = 1e-10 if dtype == torch.float64 else 2e-3
    # the buffer now holds the factor: no second n x n array was needed, and the returned factor is it
    assert A.data_ptr() == pointer and L.data_ptr() == pointer
    assert torch.allclose(torch.tril(L), reference, rtol=tol, atol=tol)
    assert torch.allclose(torch.tril(A), reference, rtol=tol, atol=tol)
    assert torch.allclose(alpha, expected, rtol=tol, atol=tol)
    assert alpha.dtype == dtype and alpha.shape == y.shape


def test_entries_whose_products_are_subnormal_are_flushed(cholesky_path):
    # far-apart points: K holds values down to kgp's exp floor (~1e-304), whose products in the Cholesky's
    # GEMMs are float64 subnormals (UCI parkinsons: 21 s instead of 0.6 s on an Intel host). Entries below
    # 2^-511 of the scale are set to 0 first; the solution is the unflushed LAPACK one to float64 rounding,
    # on each path of the Cholesky (the cholesky_path fixture)
    g = torch.Generator().manual_seed(3)
    X = 20 * torch.randn(600, 2, generator=g, dtype=torch.float64)
    K = kgp.kernel_operator(_rbf(), X, X).to_dense().detach()
    K.diagonal().add_(0.1)
    y = torch.randn(600, 1, generator=g, dtype=torch.float64)
    tiny = kgp.linalg.tiny_fraction(torch.float64)
    assert int(((K != 0) & (K.abs() < tiny)).sum()) > 1000  # the matrix has such entries
    expected = torch.cholesky_solve(y, torch.linalg.cholesky(K))
    alpha, L = _solve_in_place(K.clone(), y, noise=0.1)
    assert int(((L != 0) & (L.abs() < torch.finfo(torch.float64).tiny)).sum()) == 0
    assert float((alpha - expected).norm()) <= 1e-12 * float(expected.norm())


def _rbf():
    import gpytorch

    kernel = gpytorch.kernels.RBFKernel().double()
    kernel.lengthscale = 1.0
    return kernel


def test_not_positive_definite_and_nan_are_named():
    A, y = _spd(50, torch.float64)
    A[7, 7] = -1.0
    with pytest.raises(kgp.linalg.NotPSDError, match=r"not positive definite; increase noise"):
        _solve_in_place(A, y, noise=0.1)
    A, y = _spd(50, torch.float64)
    A[3, 9] = A[9, 3] = float("nan")
    with pytest.raises(kgp.linalg.NotPSDError, match=r"(NaN|not positive definite)"):
        _solve_in_place(A, y, noise=0.1)


def test_exact_refuses_a_kernel_matrix_over_the_memory_budget():
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(200, 2)), rng.normal(size=200)
    # 200 x 200 float64 = 320,000 bytes
    with kgp.settings.memory_budget(300_000), pytest.raises(ValueError, match=r"memory_budget=300,000 bytes"):
        kgp.KernelRegressor(solver="exact").fit(X, y)
    with kgp.settings.memory_budget(320_000):
        model = kgp.KernelRegressor(solver="exact").fit(X, y)
    assert np.isfinite(model.predict(X)).all()
