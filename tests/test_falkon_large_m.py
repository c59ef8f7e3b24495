"""FALKON at M = 16,000, where scipy's OpenBLAS ``?lauum`` kills the process (SIGSEGV): kgp's own blocked routines run.

The preconditioner's factorisations are now blocked and in place (kgp.linalg): two M x M float64 arrays
at the peak. With every training point a center (M = n) the Nystrom problem is exact kernel ridge
regression, so the exact solver is the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import kgp


@pytest.mark.slow
def test_falkon_runs_at_m_16000_and_matches_the_exact_solution():
    n = 16_000
    g = np.random.default_rng(0)
    X = g.uniform(-2, 2, (n, 3))
    y = np.sin(2 * X[:, 0]) * np.cos(X[:, 1]) + 0.3 * X[:, 2] + 0.1 * g.standard_normal(n)
    Xq = g.uniform(-2, 2, (500, 3))
    falkon = kgp.KernelRegressor(
        "rbf", lengthscale=0.7, noise=0.1, solver="falkon", n_centers=n, solver_options={"maxiter": 20}, random_state=0
    ).fit(X, y)
    assert falkon.centers_.shape == (n, 3)
    with kgp.settings.max_exact_size(n):
        exact = kgp.KernelRegressor("rbf", lengthscale=0.7, noise=0.1, solver="exact").fit(X, y)
    expected = exact.predict(Xq)
    # 20 preconditioned CG steps: measured 1.2e-5 of the predictions' scale on the development host; the
    # bound leaves two orders of magnitude for other BLAS paths, far below the model's own test error (~0.1)
    np.testing.assert_allclose(falkon.predict(Xq), expected, rtol=0, atol=1e-3 * np.abs(expected).max())
