"""The `exact` solver against independent oracles: scikit-learn KernelRidge and GPyTorch ExactGP."""

import gpytorch
import numpy as np
import pytest
import torch
from conftest import load_uci
from sklearn.kernel_ridge import KernelRidge

import kgp
from kgp.linalg import NotPSDError


def _standardize(X, y):
    X = (X - X.mean(0)) / np.where(X.std(0) > 0, X.std(0), 1.0)
    return X, (y - y.mean()) / y.std()


def _synthetic(n=300, d=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = np.sin(X @ rng.normal(size=d)) + 0.1 * rng.normal(size=n)
    return X, y


def _exact_gp_mean(kernel, X, y, noise, X_test):
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)

    class GP(gpytorch.models.ExactGP):
        def __init__(self, likelihood):
            super().__init__(Xt, yt, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = kernel

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    likelihood = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=torch.full_like(yt, noise))
    model = GP(likelihood).double().eval()
    with (
        torch.no_grad(),
        gpytorch.settings.fast_computations(False, False, False),
        gpytorch.settings.max_cholesky_size(10**6),
    ):
        return model(torch.as_tensor(X_test)).mean.numpy()


def _relative(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("noise", [1e-3, 0.1, 1.0])
def test_exact_matches_sklearn_kernel_ridge_synthetic(noise):
    X, y = _synthetic()
    X_test, _ = _synthetic(50, seed=1)
    ls = 1.3
    model = kgp.KernelRegressor("rbf", lengthscale=ls, noise=noise, solver="exact").fit(X, y)
    ref = KernelRidge(alpha=noise, kernel="rbf", gamma=1 / (2 * ls**2)).fit(X, y)
    assert _relative(model.predict(X_test), ref.predict(X_test)) < 1e-6


@pytest.mark.parametrize("kernel_name,sk_kernel", [("laplacian", "laplacian_l2"), ("linear", "linear")])
def test_exact_matches_sklearn_other_kernels(kernel_name, sk_kernel):
    X, y = _synthetic(200, 3)
    ls = 2.0
    model = kgp.KernelRegressor(kernel_name, lengthscale=ls, noise=0.05).fit(X, y)
    if sk_kernel == "laplacian_l2":
        # sklearn's "laplacian" uses the L1 norm; GPyTorch's Matern-1/2 uses L2: pass a callable Gram matrix
        from scipy.spatial.distance import cdist

        K = np.exp(-cdist(X, X) / ls)
        ref = KernelRidge(alpha=0.05, kernel="precomputed").fit(K, y)
        expected = ref.predict(np.exp(-cdist(X[:40], X) / ls))
    else:
        ref = KernelRidge(alpha=0.05, kernel="linear").fit(X, y)
        expected = ref.predict(X[:40])
    assert _relative(model.predict(X[:40]), expected) < 1e-6


def test_exact_matches_exact_gp_posterior_mean_synthetic():
    X, y = _synthetic(250, 3)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=3)).double()
    kernel.base_kernel.lengthscale = torch.tensor([[0.8, 1.5, 2.0]], dtype=torch.float64)
    kernel.outputscale = 1.7
    noise = 0.02
    model = kgp.KernelRegressor(kernel, noise=noise).fit(X, y)
    expected = _exact_gp_mean(kernel, X, y, noise, X[:60] + 0.1)
    assert _relative(model.predict(X[:60] + 0.1), expected) < 1e-6


@pytest.mark.parametrize("name,ls,noise", [("yacht", 2.0, 1e-3), ("concrete", 2.5, 0.05)])
def test_exact_on_real_data_matches_both_oracles(shared_data, name, ls, noise):
    if name == "yacht":
        X, y = load_uci(shared_data, "yacht")
    else:
        z = np.load(shared_data / "concrete.npz")
        X, y = z["X"].astype(np.float64), z["y"].astype(np.float64)
    X, y = _standardize(X, y)
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(y))
    tr, te = idx[: int(0.8 * len(y))], idx[int(0.8 * len(y)) :]
    model = kgp.KernelRegressor("rbf", lengthscale=ls, noise=noise).fit(X[tr], y[tr])
    pred = model.predict(X[te])
    sk = KernelRidge(alpha=noise, kernel="rbf", gamma=1 / (2 * ls**2)).fit(X[tr], y[tr]).predict(X[te])
    kernel = gpytorch.kernels.RBFKernel().double()
    kernel.lengthscale = ls
    gp = _exact_gp_mean(kernel, X[tr], y[tr], noise, X[te])
    assert _relative(pred, sk) < 1e-6
    assert _relative(pred, gp) < 1e-6
    assert model.score(X[te], y[te]) > 0.8  # a real fit, not just agreement


def test_exact_refuses_large_n_with_clear_error():
    X, y = _synthetic(120, 2)
    with kgp.settings.max_exact_size(100):
        with pytest.raises(ValueError, match="max_exact_size"):
            kgp.KernelRegressor(solver="exact").fit(X, y)


def test_exact_not_positive_definite_raises_not_psd_without_jitter():
    # duplicated points, a wide kernel and a noise far below float32's eps: K + noise I is singular in
    # float32. The oracle must not add jitter (it would solve another problem): NotPSDError with a remedy.
    X, y = _synthetic(200, 2)
    X, y = np.concatenate([X, X]).astype(np.float32), np.concatenate([y, y]).astype(np.float32)
    model = kgp.KernelRegressor("rbf", lengthscale=3.0, noise=1e-9, solver="exact")
    with pytest.raises(
        NotPSDError,
        match=r"solver 'exact': K \+ noise\*I with noise=1e-09 \(400 x 400, torch.float32\) is not positive definite; "
        r"increase noise or use float64$",
    ):
        model.fit(X, y)
    assert np.isfinite(model.set_params(dtype="float64", noise=1e-6).fit(X, y).predict(X[:5])).all()


def test_exact_float32_follows_dtype():
    X, y = _synthetic(100, 2)
    model = kgp.KernelRegressor(noise=0.1).fit(X.astype(np.float32), y.astype(np.float32))
    pred = model.predict(X.astype(np.float32))
    assert pred.dtype == np.float32
    ref = kgp.KernelRegressor(noise=0.1).fit(X, y).predict(X)
    assert _relative(pred.astype(np.float64), ref) < 1e-4


def test_multi_output_equals_separate_fits():
    X, y = _synthetic(150, 3)
    Y = np.stack([y, np.cos(X[:, 0]), X[:, 1] ** 2], axis=1)
    joint = kgp.KernelRegressor(noise=0.1).fit(X, Y).predict(X[:30])
    assert joint.shape == (30, 3)
    for j in range(3):
        single = kgp.KernelRegressor(noise=0.1).fit(X, Y[:, j]).predict(X[:30])
        assert _relative(joint[:, j], single) < 1e-10
