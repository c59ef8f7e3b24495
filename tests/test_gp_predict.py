"""``predict(X, return_std=True)`` against GPyTorch's ExactGP and SGPR predictive distributions.

Oracles (float64): GPyTorch ``ExactGP`` in eval mode (latent f: ``model(X).variance``), and GPyTorch's
SGPR (``InducingPointKernel``) with ``sgpr_diagonal_correction(False)``, whose predictive covariance is
the subset-of-regressors one, ``Q_** - Q_*n (Q_nn + s^2 I)^{-1} Q_n*``; kgp returns the DTC / Titsias
variance, which adds ``k(x, x) - Q(x, x)`` (computed here densely with GPyTorch's kernel).
scikit-learn's ``GaussianProcessRegressor`` checks the ``normalize_y`` convention.
"""

from __future__ import annotations

import gpytorch
import numpy as np
import pytest
import torch

import kgp

N, D, M, Q = 250, 3, 30, 60
NOISE = 0.04


def _data():
    gen = torch.Generator().manual_seed(1)
    X = torch.rand(N + Q, D, generator=gen, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * X[:, 0]) * torch.cos(X[:, 1]) + 0.2 * torch.randn(N + Q, generator=gen, dtype=torch.float64)
    return X[:N], y[:N], X[N:]


def _kernel():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=D)).double()
    k.base_kernel.lengthscale = torch.tensor([0.7, 1.1, 1.6])
    k.outputscale = 1.7
    return k


class _GP(gpytorch.models.ExactGP):
    def __init__(self, X, y, likelihood, covar):
        super().__init__(X, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = covar

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _gpytorch(covar, X, y, Xq):
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = NOISE
    model = _GP(X, y, likelihood, covar).double().eval()
    likelihood.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False), gpytorch.settings.max_cholesky_size(10_000):
        f = model(Xq)
        return f.mean, f.variance


def test_exact_std_equals_gpytorch_exactgp():
    X, y, Xq = _data()
    mean, var = _gpytorch(_kernel(), X, y, Xq)
    model = kgp.KernelRegressor(_kernel(), noise=NOISE, solver="exact").fit(X, y)
    got_mean, got_std = model.predict(Xq, return_std=True)
    assert torch.allclose(got_mean, mean, rtol=1e-6, atol=1e-6 * float(mean.abs().max()))
    assert torch.allclose(got_std.square(), var, rtol=1e-6, atol=1e-9)
    _, std_y = model.predict(Xq, return_std=True, include_noise=True)
    assert torch.allclose(std_y.square(), var + NOISE, rtol=1e-9)


def test_nystrom_std_equals_gpytorch_sgpr_plus_dtc_correction():
    X, y, Xq = _data()
    Z = X[:M].clone()
    base = _kernel()
    covar = gpytorch.kernels.InducingPointKernel(base, inducing_points=Z, likelihood=None)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = NOISE
    covar.likelihood = likelihood
    model = _GP(X, y, likelihood, covar).double().eval()
    # without GPyTorch's default FITC-style diagonal correction, its SGPR prediction is the plain
    # subset-of-regressors one that the DTC variance extends
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False), gpytorch.settings.sgpr_diagonal_correction(False):
        f = model(Xq)
        sor_mean, sor_var = f.mean, f.variance
        kqm, kmm = base(Xq, Z).to_dense(), base(Z).to_dense()
        q_diag = (kqm * torch.linalg.solve(kmm, kqm.T).T).sum(1)
        dtc_var = sor_var + base(Xq, diag=True) - q_diag
    reg = kgp.KernelRegressor(_kernel(), noise=NOISE, solver="falkon", centers=Z, solver_options={"maxiter": 200})
    got_mean, got_std = reg.fit(X, y).predict(Xq, return_std=True)
    assert torch.allclose(got_std.square(), dtc_var, rtol=1e-6, atol=1e-9)
    assert torch.allclose(got_mean, sor_mean, rtol=1e-5, atol=1e-5 * float(sor_mean.abs().max()))  # FALKON: iterative
    # the variance is kept by save/load once computed (model files hold no training data)
    assert (dtc_var > 0).all()


def test_normalize_y_matches_scikit_learn_gaussian_process_regressor():
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF

    X, y, Xq = (t.numpy() for t in _data())
    y = 3.0 * y + 10.0
    sk = GaussianProcessRegressor(RBF(0.9), alpha=NOISE, optimizer=None, normalize_y=True).fit(X, y)
    ref_mean, ref_std = sk.predict(Xq, return_std=True)
    model = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=NOISE, solver="exact", normalize_y=True).fit(X, y)
    mean, std = model.predict(Xq, return_std=True)
    assert isinstance(mean, np.ndarray) and isinstance(std, np.ndarray)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-8, atol=1e-8 * np.abs(ref_mean).max())
    np.testing.assert_allclose(std, ref_std, rtol=1e-6, atol=1e-9)


def test_multi_output_std_is_scaled_per_output():
    X, y, Xq = _data()
    Y = torch.stack([y, 5 * y + 1], dim=1)
    model = kgp.KernelRegressor(_kernel(), noise=NOISE, solver="exact", normalize_y=True).fit(X, Y)
    mean, std = model.predict(Xq, return_std=True)
    assert mean.shape == std.shape == (Q, 2)
    ratio = float(Y[:, 1].std(correction=0) / y.std(correction=0))
    assert torch.allclose(std[:, 1] / std[:, 0], torch.full((Q,), ratio, dtype=torch.float64), rtol=1e-12)


def test_save_load_keeps_the_variance_once_computed(tmp_path):
    X, y, Xq = _data()
    model = kgp.KernelRegressor(_kernel(), noise=NOISE, solver="falkon", centers=X[:M].clone()).fit(X, y)
    _, std = model.predict(Xq, return_std=True)
    model.save(tmp_path / "m.pt")
    loaded = kgp.load(tmp_path / "m.pt")
    _, std2 = loaded.predict(Xq, return_std=True)
    assert torch.allclose(std, std2, rtol=1e-12)


def test_return_std_errors():
    X, y, Xq = _data()
    model = kgp.KernelRegressor(_kernel(), noise=NOISE, solver="falkon", centers=X[:M].clone())
    with pytest.raises(RuntimeError, match="not fitted yet"):
        model.predict(Xq, return_std=True)
    model.fit(X, y)
    with pytest.raises(ValueError, match="include_noise=True needs return_std=True"):
        model.predict(Xq, include_noise=True)
    with pytest.raises(TypeError, match="return_std: expected True or False"):
        model.predict(Xq, return_std="yes")
    dsg = kgp.KernelRegressor(_kernel(), noise=NOISE, solver="dsg", random_state=0).fit(X, y)
    with pytest.raises(ValueError, match=r"solver 'dsg' gives no predictive variance"):
        dsg.predict(Xq, return_std=True)
    fresh = kgp.KernelRegressor(_kernel(), noise=NOISE, solver="falkon", centers=X[:M].clone()).fit(X, y)
    import tempfile

    # a model file written before any return_std call keeps the training rows: its std comes on demand
    with tempfile.TemporaryDirectory() as d:
        fresh.save(f"{d}/m.pt")
        _, std_loaded = kgp.load(f"{d}/m.pt").predict(Xq, return_std=True)
    _, std = fresh.predict(Xq, return_std=True)
    assert torch.allclose(std_loaded, std, rtol=1e-12)
