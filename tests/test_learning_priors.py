"""Learning on GPyTorch's own parts: the noise prior (``learn_options['noise_prior']``) and its validation.

Oracles: GPyTorch's ``ExactMarginalLogLikelihood`` on an ``ExactGP`` whose ``GaussianLikelihood``
carries the same noise prior (what the loop minimises at its first step), the prior's log-density
computed by hand with ``torch.distributions.Gamma``, and the mode of a strong prior.
"""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch_reference import exact_mll_value

import kgp
from kgp.learning import learn_hyperparameters
from kgp.options import InvalidOptionError


def _data(n: int, seed: int, noise: float = 0.01):
    gen = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=gen, dtype=torch.float64) * 4 - 2
    f = torch.sin(1.3 * X[:, 0]) + 0.5 * torch.cos(X[:, 1])
    return X, f + noise**0.5 * torch.randn(n, generator=gen, dtype=torch.float64)


def _kernel():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()


def _gamma_log_prob(prior: gpytorch.priors.GammaPrior, value: float) -> float:
    """The Gamma log-density from its formula (not through GPyTorch)."""
    a, b = float(prior.concentration), float(prior.rate)
    return a * math.log(b) - math.lgamma(a) + (a - 1) * math.log(value) - b * value


def test_first_step_is_minus_gpytorch_mll_with_a_noise_prior():
    X, y = _data(120, seed=0)
    kernel = _kernel()
    prior = gpytorch.priors.GammaPrior(3.0, 20.0)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_prior=prior).double()
    likelihood.noise = 0.2

    reference = exact_mll_value(X, y, kernel, likelihood, 0.25)
    noise = float(likelihood.noise.detach())  # 0.2 through GPyTorch's float32 constraint bound
    result = learn_hyperparameters(
        "exact", X, y, kernel, noise=noise, mean=0.25, options={"iterations": 1, "noise_prior": prior}
    )
    assert abs(result.history[0] - reference) < 1e-10 * abs(reference)
    # the same step without the prior differs by exactly the prior's log-density / n
    plain = learn_hyperparameters("exact", X, y, _kernel(), noise=noise, mean=0.25, options={"iterations": 1})
    by_hand = plain.history[0] - _gamma_log_prob(prior, noise) / X.shape[0]
    assert abs(result.history[0] - by_hand) < 1e-12 * abs(by_hand)


def test_a_strong_noise_prior_pulls_the_noise_to_its_mode_and_the_value_says_so():
    X, y = _data(200, seed=1, noise=0.01)
    options = {"optimizer": "lbfgs", "iterations": 60}
    free = learn_hyperparameters("exact", X, y, _kernel(), noise=0.1, options=options)
    # mode (a - 1) / b = 0.5, standard deviation sqrt(a) / b = 0.007: its curvature a / 0.5^2 = 2e4 is 100 times
    # the likelihood's slope at 0.5 (about n / (2 * 0.5) = 200), which moves the optimum by about 0.01
    prior = gpytorch.priors.GammaPrior(5001.0, 10000.0)
    kernel = _kernel()
    held = learn_hyperparameters("exact", X, y, kernel, noise=0.1, options={**options, "noise_prior": prior})
    assert free.noise < 0.03  # the data's noise is 0.01
    assert abs(held.noise - 0.5) < 0.03, held.noise
    # the reported value: the exact NLL per point at the returned point minus the prior's log-density / n
    n = X.shape[0]
    with torch.no_grad():
        K = kernel(X).to_dense() + held.noise * torch.eye(n, dtype=torch.float64)
        r = y - held.mean[0]
        nll = float(-torch.distributions.MultivariateNormal(torch.zeros(n, dtype=K.dtype), K).log_prob(r)) / n
    expected = nll - _gamma_log_prob(prior, held.noise) / n
    assert abs(held.best_value - expected) < 1e-9 * abs(expected)


def test_noise_prior_is_validated_before_any_work_and_the_users_prior_is_left_alone(tmp_path):
    X, y = _data(60, seed=2)
    with pytest.raises(
        InvalidOptionError,
        match=r"learn 'exact' option 'noise_prior': expected a gpytorch.priors.Prior on the noise variance .* got 0.5",
    ):
        kgp.KernelRegressor(learn="exact", learn_options={"noise_prior": 0.5}).fit(X, y)
    prior = gpytorch.priors.GammaPrior(2.0, 20.0)
    with pytest.raises(ValueError, match=r"learn_options\['noise_prior'\] .* learn_options\['learn_noise'\] is False"):
        kgp.KernelRegressor(learn="exact", learn_options={"noise_prior": prior, "learn_noise": False}).fit(X, y)
    model = kgp.KernelRegressor(
        learn="exact", dtype="float64", learn_options={"noise_prior": prior, "iterations": 5}
    ).fit(X, y)
    # the loop works on a float64 copy: the estimator's parameter is the user's float32 object, unchanged
    assert model.learn_options["noise_prior"] is prior and prior.concentration.dtype == torch.float32
    # a model file holds plain data only: the prior is left out (it shaped the learning, not the posterior)
    model.save(tmp_path / "m.pt")
    loaded = kgp.load(tmp_path / "m.pt")
    Xq = X[:10].numpy() + 0.1
    np.testing.assert_array_equal(loaded.predict(Xq), model.predict(Xq))
    assert loaded.noise_ == model.noise_ and loaded.learn_options == {"iterations": 5}
