"""GPyTorch interop: ``kgp.from_gpytorch`` reproduces a trained ExactGP's posterior mean (oracle: GPyTorch)."""

from __future__ import annotations

import gpytorch
import pytest
import torch

import kgp


class _GP(gpytorch.models.ExactGP):
    def __init__(self, X, y, likelihood, mean):
        super().__init__(X, y, likelihood)
        self.mean_module = mean
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=2))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _trained(mean=None):
    gen = torch.Generator().manual_seed(0)
    X = torch.rand(240, 2, generator=gen, dtype=torch.float64) * 4 - 2
    y = torch.sin(2 * X[:, 0]) + 0.3 * X[:, 1] + 3.0 + 0.1 * torch.randn(240, generator=gen, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = _GP(X[:200], y[:200], likelihood, mean or gpytorch.means.ConstantMean()).double()
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        (-mll(model(X[:200]), y[:200])).backward()
        opt.step()
    model.eval()
    likelihood.eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        reference = model(X[200:])
    return model, likelihood, X[200:], reference


@pytest.mark.parametrize("mean", ["constant", "zero"])
def test_from_gpytorch_reproduces_the_posterior_mean_and_variance(mean):
    module = gpytorch.means.ConstantMean() if mean == "constant" else gpytorch.means.ZeroMean()
    model, likelihood, Xq, reference = _trained(module)
    regressor = kgp.from_gpytorch(model, likelihood)
    got_mean, got_std = regressor.predict(Xq, return_std=True)
    scale = float(reference.mean.abs().max())
    assert torch.allclose(got_mean, reference.mean, rtol=1e-6, atol=1e-6 * scale)
    assert torch.allclose(got_std.square(), reference.variance, rtol=1e-6, atol=1e-10)
    if mean == "constant":
        assert abs(float(regressor.mean_[0]) - float(model.mean_module.constant.detach())) < 1e-12
    # the kernel is a copy: the GPyTorch model is untouched
    assert regressor.kernel_ is not model.covar_module


def test_from_gpytorch_errors():
    model, likelihood, _, _ = _trained()
    with pytest.raises(TypeError, match="model: expected a gpytorch.models.ExactGP"):
        kgp.from_gpytorch(object())
    with pytest.raises(TypeError, match="likelihood: expected a gpytorch GaussianLikelihood"):
        kgp.from_gpytorch(model, gpytorch.likelihoods.BernoulliLikelihood())
    with pytest.raises(ValueError, match=r"from_gpytorch sets \['noise'\]"):
        kgp.from_gpytorch(model, noise=0.1)
    model.mean_module = gpytorch.means.LinearMean(2)
    with pytest.raises(TypeError, match="expected a gpytorch ConstantMean or ZeroMean"):
        kgp.from_gpytorch(model)
