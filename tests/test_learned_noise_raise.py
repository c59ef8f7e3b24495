"""A learned noise that leaves the final solve not positive definite is raised, with a warning.

Learning evaluates its objective on a subset; at the noise floor with collapsed lengthscales the solve on
all rows can fail to factor where the subset's did (UCI parkinsons' default GP). The fit then
raises the *learned* noise tenfold at a time (``kgp.fitting.stages.solve_with_a_usable_noise``); a noise
the user fixed is never changed.
"""

from __future__ import annotations

import numpy as np
import pytest
from kgp_builtins.exact import ExactSolver

import kgp
from kgp.diagnostics import ConvergenceWarning
from kgp.linalg import NotPSDError


def data():
    g = np.random.default_rng(0)
    X = g.normal(size=(200, 2))
    return X, np.sin(X[:, 0]) + 0.1 * g.normal(size=200)


@pytest.fixture
def solver_refusing_small_noise(monkeypatch):
    """The exact solver, refusing (as a failed Cholesky would) every noise below a threshold."""
    original = ExactSolver.fit
    state = {"threshold": None, "seen": []}

    def fit(self, problem):
        state["seen"].append(problem.noise)
        if state["threshold"] is not None and problem.noise < state["threshold"]:
            raise NotPSDError(f"solver 'exact': K + noise*I with noise={problem.noise:g} is not positive definite")
        return original(self, problem)

    monkeypatch.setattr(ExactSolver, "fit", fit)
    return state


LEARN = {"iterations": 5, "subset": None}


def test_a_learned_noise_is_raised_tenfold_until_the_solve_factors(solver_refusing_small_noise):
    X, y = data()
    reference = kgp.KernelRegressor("rbf", learn="exact", solver="exact", learn_options=LEARN).fit(X, y)
    learned = reference.noise_
    solver_refusing_small_noise["threshold"] = 50 * learned  # factors from the second raise on (100x)
    solver_refusing_small_noise["seen"].clear()
    with pytest.warns(ConvergenceWarning, match="the learned noise .* instead"):
        model = kgp.KernelRegressor("rbf", learn="exact", solver="exact", learn_options=LEARN).fit(X, y)
    assert solver_refusing_small_noise["seen"] == pytest.approx([learned, 10 * learned, 100 * learned], rel=1e-12)
    assert model.noise_ == pytest.approx(100 * learned, rel=1e-12)
    assert np.isfinite(model.predict(X[:20])).all()


def test_a_noise_the_user_fixed_is_never_raised(solver_refusing_small_noise):
    X, y = data()
    solver_refusing_small_noise["threshold"] = 1.0
    fixed_noise = [
        kgp.KernelRegressor("rbf", noise=0.01, solver="exact"),
        kgp.KernelRegressor(
            "rbf", noise=0.01, learn="exact", solver="exact", learn_options={**LEARN, "learn_noise": False}
        ),
    ]
    for model in fixed_noise:
        solver_refusing_small_noise["seen"].clear()
        with pytest.raises(NotPSDError):
            model.fit(X, y)
        assert len(solver_refusing_small_noise["seen"]) == 1  # one solve, at the user's noise


def test_it_gives_up_after_three_raises(solver_refusing_small_noise):
    X, y = data()
    solver_refusing_small_noise["threshold"] = float("inf")
    with pytest.raises(NotPSDError):
        kgp.KernelRegressor("rbf", learn="exact", solver="exact", learn_options=LEARN).fit(X, y)
    assert len(solver_refusing_small_noise["seen"]) == 4  # the learned noise and three raises
