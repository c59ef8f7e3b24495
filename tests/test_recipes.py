"""solver='auto' and learn='auto': the built-in recipe's choices, reported in recipe_."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kgp_builtins.recipes.rule import (
    ADAM_STEPS,
    INITIAL_NOISE_FRACTION,
    MAX_CENTERS,
    POLISH_EVALUATIONS,
    REFINE_EVALUATIONS,
    REFINE_SUBSET,
    SUBSET,
    exact_limit,
    nystrom_centers,
    refine_rows,
)

import kgp
from kgp.recipes import RecipeChoice, RecipeRequest

rng = np.random.default_rng(11)
X = rng.uniform(-2, 2, size=(300, 3))
Y = np.sin(X[:, 0]) + 0.3 * X[:, 1] + 0.05 * rng.normal(size=300)
XQ = rng.uniform(-2, 2, size=(20, 3))


def _request(n, budget=4 * 2**30, max_exact=20_000, dtype=torch.float64, **kw):
    base = dict(
        n=n,
        d=5,
        k=1,
        dtype=dtype,
        device=torch.device("cpu"),
        memory_budget=budget,
        max_exact_size=max_exact,
        distributed=False,
        solver_auto=True,
        learn_auto=True,
    )
    return RecipeRequest(**{**base, **kw})


def test_the_rule_in_closed_form():
    # exact while n^2 itemsize fits the budget and max_exact_size
    assert exact_limit(_request(10, budget=8 * 10_000**2)) == 10_000
    assert exact_limit(_request(10, budget=4 * 10_000**2, dtype=torch.float32)) == 10_000
    assert exact_limit(_request(10, budget=2**40, max_exact=123)) == 123
    # centers: three float64 M x M arrays in the budget, at most MAX_CENTERS (up to the n where FALKON's passes
    # pay for more), at most n, and never fewer as n grows (the variance's Gram is summed over at most
    # GRAM_ROWS_PER_CENTER * M rows)
    assert nystrom_centers(_request(60_000, budget=24 * 9_000**2)) == 9_000
    assert nystrom_centers(_request(60_000, budget=2**40)) == MAX_CENTERS
    assert nystrom_centers(_request(5_000, budget=2**40)) == 5_000
    assert nystrom_centers(_request(219_000, budget=2**40)) == MAX_CENTERS
    assert nystrom_centers(_request(10**6, budget=2**40)) == MAX_CENTERS
    assert nystrom_centers(_request(10**9, budget=2**40)) == math.isqrt(2**40 // 24)  # the memory cap
    budget = 24 * 11_000**2
    sizes = [nystrom_centers(_request(n, budget=budget)) for n in (10**4, 10**5, 10**6, 10**7, 10**8)]
    assert sizes == sorted(sizes) and sizes[-1] == 11_000
    recipe = kgp.registry.get_recipe("auto")
    small = recipe.choose(_request(1_000))
    assert small.solver == "exact" and small.n_centers is None and small.learn == "exact"
    adam = {
        "optimizer": "adam",
        "iterations": ADAM_STEPS,
        "polish_iterations": POLISH_EVALUATIONS,
        "initial_noise_fraction": INITIAL_NOISE_FRACTION,
    }
    assert small.learn_options == adam  # n <= SUBSET: all rows
    big = recipe.choose(_request(60_000, budget=24 * 10_000**2))
    assert big.solver == "falkon" and big.n_centers == 10_000
    refine = {"refine_subset": REFINE_SUBSET, "refine_iterations": REFINE_EVALUATIONS}
    assert big.learn_options == {**adam, "subset": SUBSET, **refine}
    assert f"{REFINE_EVALUATIONS} L-BFGS evaluations on {REFINE_SUBSET:,} rows" in big.reasons["learn"]
    # between SUBSET and REFINE_SUBSET rows the refine stage reads all of them
    middle = recipe.choose(_request(4_000))
    assert middle.learn_options == {**adam, "subset": SUBSET, **refine, "refine_subset": 4_000}
    # its five float64 S x S arrays must fit the budget: S = 4,000 in 640 MB, none when S <= SUBSET
    assert refine_rows(_request(60_000, budget=40 * 4_000**2)) == 4_000
    tight = recipe.choose(_request(60_000, budget=40 * 2_900**2))
    assert "refine_subset" not in tight.learn_options and "subset" in tight.learn_options
    assert set(big.reasons) == {"solver", "n_centers", "learn"}
    given = recipe.choose(_request(1_000, uses_centers_explicitly=True))
    assert given.solver == "falkon" and given.n_centers is None  # the user's centers are kept
    sharded = recipe.choose(_request(1_000, distributed=True))
    assert sharded.solver == "falkon" and sharded.learn_options["subset"] == 1_000


def test_solver_auto_is_the_exact_solve_on_small_data_and_says_why():
    auto = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=0.05).fit(X, Y)
    exact = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=0.05, solver="exact").fit(X, Y)
    assert auto.solver_name_ == "exact" and auto.recipe_["solver"] == "exact"
    assert "fits the memory budget" in auto.recipe_["reasons"]["solver"]
    np.testing.assert_array_equal(auto.predict(XQ), exact.predict(XQ))
    assert exact.recipe_ is None


def test_solver_auto_moves_to_falkon_above_the_exact_limit():
    with kgp.settings.max_exact_size(200), kgp.settings.memory_budget(24 * 150**2):
        model = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=0.05, random_state=0).fit(X, Y)
    assert model.solver_name_ == "falkon" and model.recipe_["n_centers"] == 150 == model.centers_.shape[0]
    assert "n = 300 > 200" in model.recipe_["reasons"]["solver"]
    # the same as naming the choice: falkon on 150 uniform centers
    named = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=0.05, random_state=0, solver="falkon", n_centers=150)
    np.testing.assert_array_equal(model.predict(XQ), named.fit(X, Y).predict(XQ))


def test_learn_auto_is_the_exact_likelihood_by_adam_and_user_options_win():
    model = kgp.KernelRegressor("rbf", learn="auto", random_state=0, learn_options={"iterations": 7}).fit(X, Y)
    assert model.recipe_["learn"] == "exact" and model.recipe_["learn_options"]["optimizer"] == "adam"
    assert len(model.learn_history_) == 7  # the user's budget, not the recipe's
    assert model.posterior_.input_scaling is not None and model.kernel_.base_kernel.lengthscale.shape == (1, 3)
    named = kgp.KernelRegressor(
        "rbf",
        learn="exact",
        random_state=0,
        solver="exact",
        learn_options={"optimizer": "adam", "iterations": 7, "initial_noise_fraction": 0.7},
    ).fit(X, Y)
    np.testing.assert_allclose(model.predict(XQ), named.predict(XQ), rtol=1e-12, atol=1e-12)


def test_auto_refuses_what_it_cannot_decide():
    with pytest.raises(ValueError, match="solver_options: given with solver='auto'"):
        kgp.KernelRegressor(solver_options={"maxiter": 3}).fit(X, Y)
    assert not hasattr(kgp.KernelRegressor(), "partial_fit")  # the recipe never streams
    with pytest.raises(AttributeError, match="solver='auto' does not stream"):
        kgp.KernelRegressor().partial_fit(X, Y)
    with pytest.raises(ValueError, match="unknown option"):
        kgp.KernelRegressor(learn="auto", learn_options={"iteratons": 3}).fit(X, Y)


def test_a_recipe_that_answers_badly_is_named(monkeypatch):
    class Lazy:
        def choose(self, request):
            return RecipeChoice(solver=None)

    monkeypatch.setattr(kgp.registry, "get_recipe", lambda name: Lazy())
    with pytest.raises(TypeError, match="left solver='auto' undecided"):
        kgp.KernelRegressor().fit(X, Y)


def test_the_memory_rule_follows_the_setting():
    budget = 24 * 20_000**2
    assert nystrom_centers(_request(60_000, budget=budget)) == min(MAX_CENTERS, math.isqrt(budget // 24))


def test_learn_auto_starts_the_noise_at_a_fraction_of_the_targets_variance_and_the_user_can_override():
    """GPyTorch's starting noise for standardised targets; from the kernel ridge default 1e-2 the noisy sets
    (protein, airline) settled in a worse, near-interpolating optimum (plugins/kgp_builtins/recipes/rule.py)."""
    start = {"iterations": 1, "learn_noise": False}  # the noise stays where it started
    model = kgp.KernelRegressor("rbf", learn="auto", learn_options=start).fit(X, Y)
    assert model.recipe_["learn_options"]["initial_noise_fraction"] == INITIAL_NOISE_FRACTION == 0.7
    # normalize_y is on with learn: the targets' variance is 1 in the scaled units, so the start is 0.7
    assert model.noise_ == pytest.approx(INITIAL_NOISE_FRACTION, rel=1e-9)
    own = kgp.KernelRegressor("rbf", learn="auto", learn_options={**start, "initial_noise_fraction": 0.2}).fit(X, Y)
    assert own.noise_ == pytest.approx(0.2, rel=1e-9)


@pytest.mark.parametrize(
    ("given", "refine"),
    [
        ({}, REFINE_SUBSET),  # the recipe's
        ({"subset": 4_000}, REFINE_SUBSET),  # still more rows than the user's subset
        ({"subset": REFINE_SUBSET}, None),  # the user's subset holds as many rows: no refine stage
        ({"subset": 8_000}, None),
        ({"subset": 8_000, "refine_subset": 9_000}, 9_000),  # the user's own refine stage
        ({"refine_subset": 6_000, "refine_iterations": 3}, 6_000),
    ],
)
def test_the_recipes_refine_stage_gives_way_to_the_users_subset(given, refine):
    from kgp.fitting.plan import DataShape

    params = {**kgp.KernelRegressor("rbf", learn="auto", learn_options=given or None).get_params()}
    shape = DataShape(n=60_000, d=4, k=1, dtype=torch.float64, device=torch.device("cpu"))
    with kgp.settings.memory_budget(2**33):
        loop = kgp.fitting.resolve_plan(params, shape).learn_options.loop
    assert loop["refine_subset"] == refine
    assert loop["refine_iterations"] == given.get("refine_iterations", REFINE_EVALUATIONS)
