"""Hyperparameter objectives ``exact`` and ``sgpr`` against GPyTorch, and their memory contract.

Oracles: GPyTorch's ``ExactGP`` and SGPR (``InducingPointKernel`` with the same inducing points held
fixed), both scored by ``ExactMarginalLogLikelihood`` (value per point, priors included), and their
gradients by autograd through GPyTorch's dense algebra. kgp's objectives share the very same kernel,
likelihood noise and mean tensors, so the gradients are compared leaf by leaf.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch
from conftest import LargestOutput

import kgp
from kgp import settings
from kgp.learning import LearningProblem
from kgp.registry import UnknownPluginError, get_objective
from kgp.testing import options_for

N, D, M = 300, 3, 25


def _data(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=gen, dtype=torch.float64)
    y = torch.sin(X.sum(1)) + 0.1 * torch.randn(N, generator=gen, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def _kernel(kind: str) -> gpytorch.kernels.Kernel:
    if kind == "rbf_ard":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=D))
        k.base_kernel.lengthscale = torch.tensor([0.8, 1.2, 1.5])
    elif kind == "matern52":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))
        k.base_kernel.lengthscale = 1.1
    else:  # a prior, added by the loop, not by the objective: checked in test_learning.py
        raise KeyError(kind)
    k.outputscale = 1.3
    return k.double()


class _GP(gpytorch.models.ExactGP):
    def __init__(self, X, y, likelihood, covar):
        super().__init__(X, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = covar

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _compare(objective: str, kind: str):
    X, y = _data()
    kernel = _kernel(kind)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.05
    Z = X[:M].clone()
    covar = kernel
    if objective == "sgpr":
        covar = gpytorch.kernels.InducingPointKernel(kernel, inducing_points=Z, likelihood=likelihood)
    model = _GP(X, y, likelihood, covar).double()
    model.mean_module.constant.data.fill_(0.3)
    if objective == "sgpr":
        model.covar_module.inducing_points.requires_grad_(False)
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    leaves = [*kernel.parameters(), likelihood.raw_noise, model.mean_module.constant]
    reference = -mll(model(X), y)
    ref_grads = torch.autograd.grad(reference, leaves)
    reference = reference.detach()

    centers = kgp.Centers(Z) if objective == "sgpr" else None
    loss = get_objective(objective).prepare(
        LearningProblem(X, y[:, None], kernel, centers=centers, options=options_for("objective", objective))
    )
    value = loss(likelihood.noise.reshape(()), model.mean_module.constant.reshape(1))
    grads = torch.autograd.grad(value, leaves)
    value = value.detach()
    return reference, value, ref_grads, grads


@pytest.mark.parametrize("kind", ["rbf_ard", "matern52"])
def test_sgpr_equals_gpytorch_sgpr_value_and_gradients(kind):
    reference, value, ref_grads, grads = _compare("sgpr", kind)
    assert abs(float(value - reference)) <= 1e-6 * abs(float(reference))
    for ref, got in zip(ref_grads, grads):
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max())), (ref, got)


@pytest.mark.parametrize("kind", ["rbf_ard", "matern52"])
def test_exact_equals_gpytorch_exact_mll_value_and_gradients(kind):
    reference, value, ref_grads, grads = _compare("exact", kind)
    assert abs(float(value - reference)) <= 1e-8 * abs(float(reference))
    for ref, got in zip(ref_grads, grads):
        assert torch.allclose(got, ref, rtol=1e-8, atol=1e-8 * float(ref.abs().max())), (ref, got)


def test_sgpr_with_all_points_as_centers_is_the_exact_likelihood():
    # Q = K when Z = X: the trace term vanishes and the bound is tight (Titsias 2009, section 3)
    X, y = _data()
    X, y = X[:80], y[:80]
    kernel = _kernel("rbf_ard")
    noise, mean = torch.tensor(0.05, dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)
    exact = get_objective("exact").prepare(
        LearningProblem(X, y[:, None], kernel, options=options_for("objective", "exact"))
    )(noise, mean)
    sgpr = get_objective("sgpr").prepare(
        LearningProblem(X, y[:, None], kernel, centers=kgp.Centers(X), options=options_for("objective", "sgpr"))
    )(noise, mean)
    assert abs(float((exact - sgpr).detach())) < 1e-7 * abs(float(exact.detach()))


def test_exact_subset_is_the_exact_likelihood_of_the_drawn_rows():
    X, y = _data()
    kernel = _kernel("rbf_ard")
    noise, mean = torch.tensor(0.05, dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    problem = LearningProblem(
        X, y[:, None], kernel, options=options_for("objective", "exact", subset=50), generator=gen
    )
    value = get_objective("exact").prepare(problem)(noise, mean)
    rows = torch.randperm(N, generator=torch.Generator().manual_seed(3))[:50]
    with torch.no_grad():
        cov = kernel(X[rows]).to_dense() + noise * torch.eye(50, dtype=torch.float64)
        ref = -torch.distributions.MultivariateNormal(torch.zeros(50, dtype=torch.float64), cov).log_prob(y[rows]) / 50
    assert abs(float(value - ref)) < 1e-10 * abs(float(ref))


def test_exact_refuses_more_rows_than_the_exact_size_limit():
    X, y = _data()
    problem = LearningProblem(X, y[:, None], _kernel("rbf_ard"), options=options_for("objective", "exact"))
    with (
        settings.max_exact_size(100),
        pytest.raises(ValueError, match=r"n=300 exceeds kgp.settings.max_exact_size=100"),
    ):
        get_objective("exact").prepare(problem)
    problem.options = options_for("objective", "exact", subset=100)
    with settings.max_exact_size(100):
        get_objective("exact").prepare(problem)  # a subset within the limit is fine


def test_unknown_objective_lists_the_available_ones():
    with pytest.raises(
        UnknownPluginError, match=r"unknown objective 'sgrp'; available objectives: exact, holdout, sgpr"
    ):
        get_objective("sgrp")


def test_sgpr_at_large_n_never_allocates_n_by_m_forward_or_backward():
    n, m, d = 200_000, 100, 3
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, d, generator=gen)
    y = torch.randn(n, 1, generator=gen)
    Z = X[:m].clone()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    budget = 8 * 2**20  # n x M float32 is 80 MB
    noise = torch.tensor(0.1, requires_grad=True)
    mean = torch.zeros(1, requires_grad=True)
    with settings.memory_budget(budget), settings.kernel_cache("auto"):
        loss = get_objective("sgpr").prepare(
            LearningProblem(X, y, kernel, centers=kgp.Centers(Z), options=options_for("objective", "sgpr"))
        )
        with LargestOutput() as rec:
            value = loss(noise, mean)
            value.backward()
    # row blocks of at most the budget are the largest objects (n x M would be 10x the budget)
    assert rec.largest < n * m and rec.largest * 4 <= budget, (rec.largest, rec.op)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in kernel.parameters())
    assert noise.grad is not None and mean.grad is not None


def test_sgpr_batch_rows_is_the_full_bound_at_full_batch_and_unbiased_in_its_row_sums():
    X, y = _data()
    kernel = _kernel("rbf_ard")
    noise, mean = torch.tensor(0.05, dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64)
    centers = kgp.Centers(X[:M].clone())

    def objective(batch_rows, seed=0):
        problem = LearningProblem(
            X,
            y[:, None],
            kernel,
            centers=centers,
            options=options_for("objective", "sgpr", batch_rows=batch_rows),
            generator=torch.Generator().manual_seed(seed),
        )
        return get_objective("sgpr").prepare(problem)

    with torch.no_grad():
        full = float(objective(None)(noise, mean))
        assert float(objective(N)(noise, mean)) == full  # a batch of all rows is no batch
        loss = objective(150)
        draws = torch.tensor([float(loss(noise, mean)) for _ in range(40)])
    assert draws.std() > 0  # a fresh sample per evaluation
    # the bound is nonlinear in the estimated sums: close on average, biased low (Jensen); measured at half
    # the rows: mean of 40 draws 3.5 % below the full bound, spread of one draw 6 %
    assert abs(float(draws.mean()) - full) < 0.06 * abs(full)


def test_gaussian_nll_with_subnormal_products_equals_autograd_through_lapack():
    # far-apart points: K holds values near kgp's exp floor (~1e-304) whose products in the factorization's
    # and the backward inverse's GEMMs are float64 subnormals (slow on Intel hosts). They are flushed
    # (kgp.linalg.tiny_fraction); value and gradients stay those of the unflushed matrix to float64 rounding.
    from kgp_builtins.objectives.gaussian_nll import gaussian_nll

    g = torch.Generator().manual_seed(2)
    X = 20 * torch.randn(400, 2, generator=g, dtype=torch.float64)
    kernel = gpytorch.kernels.RBFKernel().double()
    kernel.lengthscale = 1.0
    K0 = kernel(X).to_dense().detach()
    tiny = kgp.linalg.tiny_fraction(torch.float64)
    assert int(((K0 != 0) & (K0.abs() < tiny)).sum()) > 1000
    R = torch.randn(400, 2, generator=g, dtype=torch.float64)
    grads = []
    for ours in (True, False):
        K = K0.clone().requires_grad_(True)
        noise = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
        if ours:
            value = gaussian_nll(K, noise, R, what="C", remedy="")
        else:
            L = torch.linalg.cholesky(K + noise * torch.eye(400, dtype=torch.float64))
            value = 0.5 * (R * torch.cholesky_solve(R, L)).sum() + R.shape[1] * torch.log(L.diagonal()).sum()
        value.backward()
        grads.append((value.detach(), K.grad, noise.grad))
    (v1, gk1, gn1), (v2, gk2, gn2) = grads
    assert abs(float(v1 - v2)) <= 1e-12 * abs(float(v2))
    # the gradient dC is symmetric; autograd's through the lower triangle is not: compare symmetric parts
    sym1, sym2 = gk1 + gk1.mT, gk2 + gk2.mT
    assert float((sym1 - sym2).norm()) <= 1e-10 * float(sym2.norm())
    assert abs(float(gn1 - gn2)) <= 1e-10 * abs(float(gn2))


def test_gaussian_nll_backward_in_the_factors_memory_gives_the_same_gradient_twice():
    # the backward forms C^{-1} in the factor's own memory (no fresh n x n arrays for it); a second backward
    # through the same graph (retain_graph=True, as gradcheck does) must give the same gradient again
    from kgp_builtins.objectives.gaussian_nll import gaussian_nll

    g = torch.Generator().manual_seed(5)
    X = torch.randn(300, 3, generator=g, dtype=torch.float64)
    K0 = torch.exp(-0.5 * torch.cdist(X, X).square())
    R = torch.randn(300, 1, generator=g, dtype=torch.float64)
    K = K0.clone().requires_grad_(True)
    value = gaussian_nll(K * 1.0, torch.tensor(0.1, dtype=torch.float64), R, what="C", remedy="")
    value.backward(retain_graph=True)
    first = K.grad.clone()
    # R&W eq. 5.9 in closed form, dense float64: dC = (C^{-1} - alpha alpha^T) / 2
    C_inv = torch.linalg.inv(K0 + 0.1 * torch.eye(300, dtype=torch.float64))
    alpha = C_inv @ R
    expected = 0.5 * (C_inv - alpha @ alpha.T)
    # cond(C) <= 1 + 300 / 0.1: rounding of the inverse to a small multiple of n eps cond
    assert float((first - expected).abs().max()) <= 300 * 3001 * 2.3e-16 * float(expected.abs().max())
    value.backward()
    assert torch.equal(K.grad, 2 * first)
