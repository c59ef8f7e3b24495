"""The fit plan: parameters resolved once, options validated once, named random streams."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import kgp
from kgp.fitting import RandomStreams, resolve_plan
from kgp.options import Option

rng = np.random.default_rng(0)
X = rng.normal(size=(150, 3))
Y = np.sin(X[:, 0]) + 0.1 * rng.normal(size=150)


@pytest.fixture
def parse_counts(monkeypatch):
    """How many times each (owner, option) was validated."""
    counts: Counter = Counter()
    original = Option.parse

    def counted(self, owner, name, value):
        counts[(owner, name)] += 1
        return original(self, owner, name, value)

    monkeypatch.setattr(Option, "parse", counted)
    return counts


@pytest.mark.parametrize(
    "params",
    [
        dict(solver="falkon", centers="bless", n_centers=30, solver_options={"maxiter": 5}),
        dict(solver="falkon", n_centers=30, learn="sgpr", learn_options={"iterations": 3}),
        dict(solver="eigenpro", n_centers=40, solver_options={"epochs": 2}),
        dict(solver="dsg", solver_options={"passes": 1}),
        dict(solver="exact", learn="exact", learn_options={"iterations": 3, "subset": 100}),
        dict(learn="auto"),  # the recipe's learn options too
    ],
)
def test_every_option_is_validated_exactly_once_per_fit(parse_counts, params):
    kgp.KernelRegressor(noise=0.1, random_state=0, **params).fit(X, Y)
    repeated = {key: n for key, n in parse_counts.items() if n != 1}
    assert parse_counts and not repeated, f"options validated more than once: {repeated}"


def test_the_plan_resolves_plugins_options_and_capabilities_before_any_data():
    params = kgp.KernelRegressor(solver="falkon", n_centers=20, solver_options={"maxiter": 4}).get_params()
    plan = resolve_plan(params)
    assert plan.solver.name == "falkon" and plan.solver.options["maxiter"] == 4
    assert plan.solver.options["tol"] == 1e-7  # defaults merged
    assert plan.solver.capabilities.uses_centers and plan.solver.capabilities.target == "nystrom"
    assert plan.selector.name == "uniform" and plan.needs_centers and plan.objective is None
    with pytest.raises(ValueError, match="unknown option"):
        resolve_plan({**params, "solver_options": {"maxiters": 4}})
    with pytest.raises(ValueError, match="takes no centers"):
        resolve_plan({**params, "solver": "exact", "solver_options": None})


def test_a_bad_option_fails_before_the_data_are_looked_at():
    model = kgp.KernelRegressor(solver="falkon", solver_options={"maxiter": 0})
    with pytest.raises(ValueError, match="maxiter"):
        model.fit("not an array", None)  # the option error comes first


def test_random_streams_are_named_and_fixed():
    streams = RandomStreams(7)
    draws = {name: torch.rand(3, generator=streams.generator(name)) for name in ("select", "solve", "learn")}
    assert torch.equal(draws["select"], torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(draws["solve"], torch.rand(3, generator=torch.Generator().manual_seed(8)))
    assert torch.equal(draws["learn"], torch.rand(3, generator=torch.Generator().manual_seed(10)))
    assert torch.equal(
        torch.rand(3, generator=streams.generator("solve", chunk=2)),
        torch.rand(3, generator=torch.Generator().manual_seed(10)),
    )
    with pytest.raises(ValueError, match="unknown random stream 'selct'"):
        streams.generator("selct")
