"""nystrom-direct against independent oracles (scikit-learn, numpy closed forms)."""

from __future__ import annotations

import gpytorch
import numpy as np
import pytest
import torch

import kgp
from kgp.plugin import Problem
from kgp.testing import OracleSpec, dense_nystrom_mean, make_oracle_data


def _data(n=120, d=3, k=1, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, size=(n, d))
    y = np.sin(2 * X[:, :1]) + X[:, 1:2] * np.arange(1, k + 1) + 0.05 * rng.standard_normal((n, k))
    return X, y, rng.uniform(-2, 2, size=(40, d))


def test_all_training_points_as_centers_is_kernel_ridge():
    """With Z = X the Nystrom estimator is KRR: scikit-learn's KernelRidge(alpha=sigma^2)."""
    kr = pytest.importorskip("sklearn.kernel_ridge")
    X, y, Xt = _data()
    noise, ls = 1e-2, 0.8
    perm = np.random.default_rng(1).permutation(len(X))
    model = kgp.KernelRegressor("rbf", lengthscale=ls, noise=noise, solver="nystrom-direct", centers=X[perm])
    pred = model.fit(X, y[:, 0]).predict(Xt)
    ref = kr.KernelRidge(alpha=noise, kernel="rbf", gamma=1 / (2 * ls**2)).fit(X, y[:, 0]).predict(Xt)
    np.testing.assert_allclose(pred, ref, rtol=1e-7, atol=1e-9)


def _matern52(a, b, ls, scale):
    r = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)) / ls
    return scale * (1 + np.sqrt(5) * r + 5 * r**2 / 3) * np.exp(-np.sqrt(5) * r)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-7), (torch.float32, 2e-3)])
def test_scaled_matern_multi_output_matches_numpy(dtype, rtol):
    """Off-data centers, ScaleKernel(Matern 5/2), 3 outputs: the outputscale must enter K_nM^T K_nM squared.

    float64 agrees to ~1e-8 (measured 8.7e-9): both sides solve a system with cond(H) ~ 1e9.
    """
    X, y, Xt = _data(k=3)
    Z = np.random.default_rng(2).uniform(-2, 2, size=(30, 3))
    ls, scale, noise = 1.3, 2.5, 0.05
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))
    kernel.base_kernel.lengthscale = ls
    kernel.outputscale = scale
    model = kgp.KernelRegressor(kernel, noise=noise, solver="nystrom-direct", centers=Z, dtype=dtype)
    pred = model.fit(X, y).predict(Xt)
    knm = _matern52(X, Z, ls, scale)
    alpha = np.linalg.solve(knm.T @ knm + noise * _matern52(Z, Z, ls, scale), knm.T @ y)
    ref = _matern52(Xt, Z, ls, scale) @ alpha
    assert pred.dtype == (np.float64 if dtype == torch.float64 else np.float32)
    assert np.linalg.norm(pred - ref) / np.linalg.norm(ref) < rtol


def test_result_does_not_depend_on_block_size():
    X, y, Xt = _data(n=300)
    Z = X[:50]

    def fit():
        m = kgp.KernelRegressor("rbf", noise=1e-2, solver="nystrom-direct", centers=Z)
        return m.fit(X, y).predict(Xt)

    with kgp.settings.block_rows(7):  # 43 row blocks instead of one
        small = fit()
    np.testing.assert_allclose(small, fit(), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-8), (torch.float32, 1e-2)])
def test_duplicate_centers_give_the_deduplicated_solution(dtype, rtol):
    """Repeated centers make K_MM singular; the predictions are still the Nystrom estimator's."""
    spec = OracleSpec(n_centers=30)
    data = make_oracle_data(spec)
    repeated = torch.cat([data.centers, data.centers[:10]])
    d = data.cast(dtype)
    model = kgp.KernelRegressor("rbf", noise=spec.noise, solver="nystrom-direct", centers=repeated.to(dtype))
    pred = model.fit(d.X, d.y).predict(d.X_test)
    assert torch.isfinite(pred).all()
    ref = dense_nystrom_mean(data)  # the 30 distinct centers
    assert float(torch.linalg.norm(pred.double() - ref) / torch.linalg.norm(ref)) < rtol


def test_bad_options_and_missing_centers():
    X, y, _ = _data()
    with pytest.raises(
        ValueError, match="solver 'nystrom-direct' option 'rcond': expected a finite number >= 0 and < 1 or None, got 2"
    ):
        kgp.KernelRegressor(solver="nystrom-direct", centers=X[:10], solver_options={"rcond": 2}).fit(X, y)
    with pytest.raises(ValueError, match="unknown option.*valid options: rcond"):
        kgp.KernelRegressor(solver="nystrom-direct", solver_options={"tol": 1}).fit(X, y)
    solver = kgp.get_solver("nystrom-direct")
    kernel = gpytorch.kernels.RBFKernel().double()
    options = kgp.resolve_options("solver 'nystrom-direct'", solver)
    problem = Problem(X=torch.as_tensor(X), y=torch.as_tensor(y), kernel=kernel, noise=0.1, options=options)
    with pytest.raises(ValueError, match="needs centers"):
        solver.fit(problem)
