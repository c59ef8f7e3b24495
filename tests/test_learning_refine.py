"""The refine stage (``learn_options['refine_subset']``): L-BFGS on a larger random subset after the first stage.

Oracles: GPyTorch's ``ExactMarginalLogLikelihood`` on the rows the stage must use (the first ``subset`` and
``refine_subset`` entries of the permutation that the learning generator draws), and the first stage run on
its own (the refine stage starts at its best point and may only lower the wider subset's objective).
"""

from __future__ import annotations

import copy
import warnings

import gpytorch
import pytest
import torch
from gpytorch_reference import exact_mll_value

import kgp
from kgp.learning import learn_hyperparameters

N, SUBSET, REFINE = 240, 80, 200
# no lengthscale floor: the returned kernel is then exactly the evaluated one (the floor is swapped out after
# learning, which moves the values at the 1e-8 level)
FIRST = {"iterations": 60, "subset": SUBSET, "min_lengthscale": 0.0}  # converged (30 steps are not)


# kgp's and GPyTorch's float64 kernel matrices differ by rounding (eps |x / lengthscale|^2, about 5e-15 an
# entry here), which the quadratic term amplifies by |alpha|_1^2 / n (about 1e6 at this noise): 1e-9 of the
# value. Another set of rows moves the value by more than 1e-3, so 1e-7 still tells the rows apart.
TOL = 1e-7


def _draw(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    X = torch.rand(N, 2, generator=gen, dtype=torch.float64) * 4 - 2
    k = gpytorch.kernels.RBFKernel().double()
    k.lengthscale = 0.6
    with torch.no_grad():
        K = k(X).to_dense() + 1e-8 * torch.eye(N, dtype=torch.float64)
    f = torch.linalg.cholesky(K) @ torch.randn(N, generator=gen, dtype=torch.float64)
    return X, f + 0.1 * torch.randn(N, generator=gen, dtype=torch.float64)


def _kernel():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()


def _value(X, y, rows, kernel, noise: float, mean: float) -> float:
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = noise
    return exact_mll_value(X[rows], y[rows], copy.deepcopy(kernel), likelihood, mean)


def _learn(X, y, options):
    kernel = _kernel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kgp.ConvergenceWarning)  # the unconverged runs below, on purpose
        result = learn_hyperparameters("exact", X, y, kernel, noise=0.5, mean=0.0, options=options)
    return kernel, result


def test_refine_starts_at_the_first_stages_best_point_on_a_superset_of_its_rows():
    X, y = _draw()
    first_kernel, first = _learn(X, y, FIRST)
    kernel, refined = _learn(X, y, {**FIRST, "refine_subset": REFINE, "refine_iterations": 12})
    # the permutation the generator (default seed 0) draws: the first stage's rows, then the wider ones
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    assert first.refine is None
    assert first.best_value == pytest.approx(
        _value(X, y, perm[:SUBSET], first_kernel, first.noise, float(first.mean)), rel=TOL
    )
    stage = refined.refine
    assert stage["subset"] == REFINE and stage["first_evaluation"] == len(first.history) + 1
    assert 1 <= stage["evaluations"] <= 12
    assert refined.history[: len(first.history)] == first.history  # the same first stage
    assert stage["first_stage_best"] == first.best_value
    # the refine stage's first value is the first stage's point on the wider rows (a superset of its rows)
    start = _value(X, y, perm[:REFINE], first_kernel, first.noise, float(first.mean))
    assert stage["start"] == pytest.approx(start, rel=TOL)
    # its returned point is the best it evaluated, measured by GPyTorch on the same wider rows
    assert refined.best_value == pytest.approx(
        _value(X, y, perm[:REFINE], kernel, refined.noise, float(refined.mean)), rel=TOL
    )
    # the least value it evaluated (or the final point's, evaluated once more without a gradient)
    assert refined.best_value <= min(refined.history[len(first.history) :]) + 1e-12
    assert refined.best_value < start - 1e-3  # the wider rows' optimum is elsewhere: L-BFGS moved to it
    assert refined.terms == REFINE


def test_refine_does_not_continue_a_first_stage_that_is_still_falling():
    X, y = _draw()
    short = {**FIRST, "iterations": 30}  # still falling after 30 Adam steps (kgp.learning.outcome)
    _, first = _learn(X, y, short)
    _, result = _learn(X, y, {**short, "refine_subset": REFINE})
    assert result.refine is None and result.history == first.history and result.terms == SUBSET


def test_refine_on_all_rows_in_the_estimator_reports_the_full_likelihood():
    X, y = _draw(seed=4)
    model = kgp.KernelRegressor(
        "rbf",
        learn="exact",
        normalize_X=False,
        normalize_y=False,
        learn_options={**FIRST, "iterations": 100, "refine_subset": 10 * N},  # more than n: all rows
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kgp.ConvergenceWarning)
        model.fit(X, y)
    summary = model.learn_summary_
    assert summary["refine"]["subset"] == N and summary["likelihood_terms"] == N
    reference = _value(X, y, torch.arange(N), model.kernel_, model.noise_, float(model.mean_))
    # scikit-learn's attribute: log p(y) of the rows learning used, here all of them
    assert model.log_marginal_likelihood_value_ == pytest.approx(-reference * N, rel=TOL)


def test_refine_is_skipped_when_the_wider_subset_holds_no_more_rows():
    X, y = _draw()
    _, result = _learn(X[:70], y[:70], {**FIRST, "refine_subset": REFINE})  # both capped at n = 70
    assert result.refine is None and len(result.history) == FIRST["iterations"]


@pytest.mark.parametrize(
    ("objective", "options", "match"),
    [
        ("sgpr", {"refine_subset": 100}, "has no 'subset' option"),
        ("exact", {"refine_subset": 100}, r"must exceed learn_options\['subset'\] \(got None"),
        ("exact", {"subset": 100, "refine_subset": 100}, r"must exceed learn_options\['subset'\] \(got 100"),
    ],
)
def test_refine_options_are_checked_before_any_work(objective, options, match):
    X, y = _draw()
    centers = {"n_centers": 20} if objective == "sgpr" else {}
    model = kgp.KernelRegressor("rbf", learn=objective, learn_options=options, **centers)
    with pytest.raises(ValueError, match=match):
        model.fit(X, y)


def test_a_failing_refine_keeps_the_first_stages_point():
    X, y = _draw()
    first_kernel, first = _learn(X, y, FIRST)
    # a NaN in a row only the refine stage reads: its first evaluation fails, before any L-BFGS update
    X_bad = X.clone()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    X_bad[perm[SUBSET + 5]] = float("nan")
    kernel = _kernel()
    with pytest.warns(kgp.ConvergenceWarning, match="evaluation 61 failed"):
        result = learn_hyperparameters(
            "exact", X_bad, y, kernel, noise=0.5, mean=0.0, options={**FIRST, "refine_subset": REFINE}
        )
    assert result.history[: len(first.history)] == first.history
    assert result.best_value == first.best_value and result.terms == SUBSET
    for mine, theirs in zip(kernel.parameters(), first_kernel.parameters()):
        assert torch.equal(mine, theirs)
