"""GPyTorch's own exact marginal likelihood, the oracle of the learning-loop tests."""

from __future__ import annotations

import gpytorch
import torch


def exact_mll_value(X: torch.Tensor, y: torch.Tensor, kernel, likelihood, mean: float) -> float:
    """Minus GPyTorch's ``ExactMarginalLogLikelihood`` (per point, priors included) at a constant ``mean``."""

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(X, y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = kernel

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    gp = GP().double().train()
    gp.mean_module.constant.data.fill_(mean)
    with torch.no_grad():
        return -float(gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, gp)(gp(X), y))
