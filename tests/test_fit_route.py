"""The fit route: one function of kgp.fitting from (parameters, rows, communicator) to a fit result.

The estimator converts its inputs and writes the attributes of :class:`kgp.fitting.fit.ModelFit`; the plan is
resolved once, from the data's shape; the solver object is the plan's; the fit's peak memory is estimated,
reported in ``recipe_`` and checked before anything is allocated when the recipe chose the solver.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kgp
import kgp.fitting.fit as fit_module
import kgp.fitting.plan as plan_module
from kgp.fitting.fit import ModelFit, fit_model
from kgp.fitting.memory_estimate import CPU_BLOCK_BYTES
from kgp.registry import get_solver
from kgp.testing.memory import LargestTensor


def _data(n: int, d: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    return X, np.sin(X.sum(1)) + 0.1 * rng.standard_normal(n)


def test_partial_fit_with_learn_auto_raises_the_intended_value_error():
    X, y = _data(50)
    model = kgp.KernelRegressor(solver="dsg", learn="auto")
    with pytest.raises(ValueError, match="learn, normalize_y and normalize_X need the whole training set"):
        model.partial_fit(X, y)
    assert "posterior_" not in model.__dict__


def test_partial_fit_chunks_continue_the_first():
    X, y = _data(120)
    model = kgp.KernelRegressor(solver="dsg", random_state=0)
    model.partial_fit(X[:60], y[:60]).partial_fit(X[60:], y[60:])
    assert model._chunks_seen == 2 and model.solver_ is get_solver("dsg")
    with pytest.raises(ValueError, match="expected chunks of 3 features and 1 output"):
        model.partial_fit(X[:10, :2], y[:10])


def test_parameters_are_checked_once_and_the_plan_resolved_once_from_the_data_shape(monkeypatch):
    checks, shapes = [], []
    check, resolve = plan_module.check_parameters, plan_module.PendingPlan.resolve

    def counted_check(params):
        checks.append(params["solver"])
        return check(params)

    def counted_resolve(self, shape):
        shapes.append(shape)
        return resolve(self, shape)

    monkeypatch.setattr(plan_module, "check_parameters", counted_check)
    monkeypatch.setattr(plan_module.PendingPlan, "resolve", counted_resolve)
    X, y = _data(300)
    model = kgp.KernelRegressor(random_state=0).fit(X, y)
    assert checks == ["auto"] and len(shapes) == 1 and (shapes[0].n, shapes[0].d, shapes[0].k) == (300, 3, 1)
    # the solver attribute is the object the plan resolved, not a second look-up
    assert model.solver_name_ == "exact" and model.solver_ is get_solver("exact")
    # a bad parameter is reported before the data are looked at, once
    with pytest.raises(ValueError, match="maxiter"):
        kgp.KernelRegressor(solver="falkon", solver_options={"maxiter": 0}).fit("not an array", None)
    assert checks == ["auto", "falkon"]


def test_fit_model_returns_the_fit_and_changes_nothing_it_was_given():
    X, y = _data(200)
    model = kgp.KernelRegressor(solver="falkon", n_centers=40, noise=0.05, random_state=3)
    params = model.get_params()
    Xt = torch.as_tensor(X)
    Y = torch.as_tensor(y)[:, None]
    X_before, Y_before, params_before = Xt.clone(), Y.clone(), dict(params)
    fitted = fit_model(params, Xt, Y)
    assert isinstance(fitted, ModelFit) and fitted.solver.plugin is get_solver("falkon")
    assert torch.equal(Xt, X_before) and torch.equal(Y, Y_before) and params == params_before
    # the estimator's fit is this function's result written as attributes
    model.fit(X, y)
    np.testing.assert_array_equal(fitted.result.posterior.mean(Xt)[:, 0].numpy(), model.predict(X))
    assert fitted.seed == model.seed_ == 3


def test_validation_metric_is_in_target_units_with_the_learned_mean():
    # learning moves the constant mean away from 0: the solver's validation predictions are offset by it
    X, y = _data(400, seed=1)
    y = y + 5.0
    Xv, yv = _data(100, seed=2)
    yv = yv + 5.0
    model = kgp.KernelRegressor(
        solver="falkon",
        n_centers=60,
        learn="exact",
        learn_options={"iterations": 5},
        random_state=0,
        normalize_y=False,
    )
    model.fit(X, y, validation_data=(Xv, yv))
    assert abs(float(model.mean_)) > 1.0
    reported = [info.metric for info in model.history_ if info.metric is not None]
    assert reported, "FALKON reports its iterations"
    mse = float(np.mean((model.predict(Xv) - yv) ** 2))
    # the last iteration's predictor is the fitted one; float64 sums of 100 squares
    assert reported[-1] == pytest.approx(mse, rel=1e-9)


def _centers_estimate(n: int, m: int, budget: int) -> int:
    """Peak bytes of a float64 fit on n x d rows, one target, M centers, no learning, from the module
    docstring's parts: the targets' copy, then the solve (stored K_nM within the budget, two row blocks of
    at least one row, FALKON's three M x M arrays)."""
    rows = n * 8
    solve = min(n * m * 8, budget) + 2 * max(CPU_BLOCK_BYTES, m * 8) + 3 * m * m * 8
    return rows + solve


def test_recipe_reports_the_memory_estimate():
    X, y = _data(500)
    budget = int(kgp.settings.memory_budget.value(torch.device("cpu")))
    model = kgp.KernelRegressor(n_centers=120, random_state=0).fit(X, y)
    assert model.solver_name_ == "falkon"  # centers given: the recipe fits FALKON on them
    memory = model.recipe_["memory"]
    assert memory["peak"] == _centers_estimate(500, 120, budget)
    assert memory["solver_factors"] == 3 * 120 * 120 * 8 and memory["largest_phase"] == "solve"
    # the exact solve: one n x n matrix, factored in place, and one row block
    exact = kgp.KernelRegressor(random_state=0).fit(X, y)
    assert exact.solver_name_ == "exact"
    assert exact.recipe_["memory"]["peak"] == 500 * 8 + 500 * 500 * 8 + CPU_BLOCK_BYTES
    # a named solver leaves nothing to the recipe
    assert kgp.KernelRegressor(solver="falkon", n_centers=120).fit(X, y).recipe_ is None


def test_centers_beyond_the_available_memory_are_refused_before_any_allocation(monkeypatch):
    n, m = 2000, 1500
    X, y = _data(n, d=4)
    budget = int(kgp.settings.memory_budget.value(torch.device("cpu")))
    peak = _centers_estimate(n, m, budget)
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(peak - 1))
    model = kgp.KernelRegressor(n_centers=m, random_state=0)
    scale_inputs = fit_module.scale_inputs

    def not_reached(*args, **kwargs):
        raise AssertionError("the fit scaled its inputs before the memory check")

    monkeypatch.setattr(fit_module, "scale_inputs", not_reached)
    with LargestTensor() as probe, pytest.raises(kgp.InsufficientMemoryError) as info:
        model.fit(X, y)
    message = str(info.value)
    assert f"n_centers={m:,}" in message and f"{peak:,} bytes" in message and "lower n_centers" in message
    assert probe.largest <= n * 4  # nothing beyond the converted rows: no K_nM, no M x M array
    assert "posterior_" not in model.__dict__
    monkeypatch.setattr(fit_module, "scale_inputs", scale_inputs)
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(peak))
    assert model.fit(X, y).recipe_["memory"]["peak"] == peak


def test_an_exact_solve_beyond_the_available_memory_names_the_settings_that_choose_it(monkeypatch):
    n = 600
    X, y = _data(n)
    peak = n * 8 + n * n * 8 + CPU_BLOCK_BYTES  # the targets, the n x n matrix and one row block
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(peak - 1))
    with pytest.raises(kgp.InsufficientMemoryError) as info:
        kgp.KernelRegressor(random_state=0).fit(X, y)
    message = str(info.value)
    assert f"{peak:,} bytes" in message and "solver 'exact' on n=600 rows" in message
    assert "kgp.settings.max_exact_size" in message
    # what the message advises: below n, the recipe fits FALKON on centers
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(2**40))
    with kgp.settings.max_exact_size(n - 1):
        model = kgp.KernelRegressor(random_state=0).fit(X, y)
    assert model.solver_name_ == "falkon" and model.recipe_["memory"]["solver_factors"] > 0
