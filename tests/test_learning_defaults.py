"""Per-objective defaults of the learning loop (``loop_defaults``): merged, overridable, validated.

Oracle: the loop's declared options (``LEARN_OPTIONS``) and the objective's declared choice, read
back from the options a learning run actually used (``LearnResult.options``).
"""

from __future__ import annotations

import gpytorch
import numpy as np
import pytest
import torch

import kgp
from kgp.learning.loop import LEARN_OPTIONS, learn_hyperparameters, split_learn_options
from kgp.options import InvalidOptionError
from kgp.registry import get_objective


class _Quadratic:
    """A toy objective: (noise - 0.3)^2 + (outputscale - 2)^2, with its own loop defaults."""

    option_defaults: dict = {}

    def __init__(self, loop_defaults):
        self.capabilities = kgp.Capabilities(loop_defaults=loop_defaults)

    def prepare(self, problem):
        def loss(noise, mean):
            return (noise - 0.3) ** 2 + (problem.kernel.outputscale - 2.0) ** 2 + 0.0 * mean.sum()

        return loss


def _kernel():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()


def test_loop_defaults_replace_the_loops_defaults_and_the_user_still_overrides_them():
    objective = _Quadratic({"optimizer": "lbfgs", "iterations": 30})
    loop, _ = split_learn_options("toy", objective, None)
    assert (loop["optimizer"], loop["iterations"]) == ("lbfgs", 30)
    assert loop["min_noise"] == LEARN_OPTIONS["min_noise"].default
    loop, _ = split_learn_options("toy", objective, {"optimizer": "adam"})
    assert (loop["optimizer"], loop["iterations"]) == ("adam", 30)
    kgp.register(_Plugin(objective), name="toy-plugin")
    try:
        X = torch.randn(20, 2, dtype=torch.float64)
        result = learn_hyperparameters("toy-quadratic", X, X[:, 0], _kernel(), noise=1.0)
        assert result.options["optimizer"] == "lbfgs"
        assert len(result.history) <= 30
        assert result.noise == pytest.approx(0.3, abs=1e-4)  # L-BFGS on a quadratic: at the optimum
    finally:
        kgp.unregister("toy-plugin")


class _Plugin:
    def __init__(self, objective):
        self.objective = objective

    @kgp.hookimpl
    def register_objectives(self, register):
        register("toy-quadratic", self.objective)


@pytest.mark.parametrize(
    ("loop_defaults", "error", "match"),
    [
        ({"iteration": 5}, TypeError, r"objective 'toy': loop_defaults names \['iteration'\], which the learning loop"),
        ({"optimizer": "sgd"}, InvalidOptionError, r"objective 'toy' loop_defaults option 'optimizer'"),
        ({"iterations": 0}, InvalidOptionError, r"objective 'toy' loop_defaults option 'iterations'"),
    ],
)
def test_bad_loop_defaults_fail_naming_the_objective(loop_defaults, error, match):
    with pytest.raises(error, match=match):
        split_learn_options("toy", _Quadratic(loop_defaults), None)


def test_builtin_loop_defaults_are_valid_and_documented():
    for name in ("exact", "sgpr", "holdout"):
        objective = get_objective(name)
        loop, _ = split_learn_options(name, objective, None)
        for key, value in objective.capabilities.loop_defaults.items():
            assert loop[key] == value


def test_holdout_defaults_to_the_measured_lbfgs_budget_and_sgpr_exact_keep_the_loops():
    loop, _ = split_learn_options("holdout", get_objective("holdout"), None)
    assert (loop["optimizer"], loop["iterations"]) == ("lbfgs", 50)
    for name in ("sgpr", "exact"):
        loop, _ = split_learn_options(name, get_objective(name), None)
        assert (loop["optimizer"], loop["iterations"]) == (
            LEARN_OPTIONS["optimizer"].default,
            LEARN_OPTIONS["iterations"].default,
        )


def test_initial_noise_fraction_starts_the_noise_at_that_fraction_of_the_targets_variance():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = 3.0 * np.sin(X[:, 0]) + 0.2 * rng.normal(size=60)
    options = {"initial_noise_fraction": 0.4, "learn_noise": False, "iterations": 3}
    model = kgp.KernelRegressor("rbf", learn="exact", normalize_y=False, learn_options=options).fit(X, y)
    assert model.noise_ == pytest.approx(0.4 * np.var(y), rel=1e-12)
    # without it, the model's noise is the start
    options.pop("initial_noise_fraction")
    model = kgp.KernelRegressor("rbf", noise=0.05, learn="exact", normalize_y=False, learn_options=options).fit(X, y)
    assert model.noise_ == pytest.approx(0.05, rel=1e-12)
    # constant targets have no variance to take a fraction of: the model's noise again
    options["initial_noise_fraction"] = 0.4
    model = kgp.KernelRegressor("rbf", noise=0.05, learn="exact", normalize_y=False, learn_options=options)
    assert model.fit(X, np.full(60, 2.0)).noise_ == pytest.approx(0.05, rel=1e-12)


@pytest.mark.parametrize("bad", [0.0, -0.5, "high"])
def test_initial_noise_fraction_is_validated(bad):
    X = np.random.default_rng(0).normal(size=(20, 2))
    model = kgp.KernelRegressor("rbf", learn="exact", learn_options={"initial_noise_fraction": bad})
    with pytest.raises((InvalidOptionError, TypeError, ValueError), match="initial_noise_fraction"):
        model.fit(X, X[:, 0])
