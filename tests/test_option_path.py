"""One option path: every option set, the learning loop's included, is resolved by kgp.resolve_options.

Oracles: the declarations themselves (defaults, rules), the values a learning run reports it used
(``LearnResult.options``), and the closed-form count of terms of the exact likelihood.
"""

from __future__ import annotations

import inspect

import gpytorch
import numpy as np
import pytest
import torch

import kgp
from kgp.fitting.parameters import ESTIMATOR_PARAMETERS
from kgp.fitting.plan import DataShape, resolve_plan
from kgp.learning import LearningProblem, ObjectiveLoss, learn_hyperparameters
from kgp.learning.loop_options import resolve_learn_options
from kgp.models.base import BaseKernelModel
from kgp.options import Option, Requires, resolve_options
from kgp.registry import get_objective
from kgp.testing import options_for


class _Stepper:
    """A plugin-like declaration with one rule: 'extra' steps apply only to method 'a'."""

    option_defaults = {
        "method": Option.choice("a", ("a", "b")),
        "extra": Option.integer(None, minimum=1, allow_none=True),
    }
    option_rules = (
        Requires(
            "extra",
            lambda o: o["method"] == "a",
            lambda owner, o: f"{owner}: 'extra' applies to method 'a', got {o['method']!r}",
        ),
    )


def test_a_suggestion_gives_way_to_the_users_value_and_two_user_values_in_conflict_raise():
    owner = "solver 'stepper'"
    # the suggestion replaces the default; the user's value replaces the suggestion
    assert resolve_options(owner, _Stepper(), None, {"extra": 3}) == {"method": "a", "extra": 3}
    assert resolve_options(owner, _Stepper(), {"extra": 5}, {"extra": 3}) == {"method": "a", "extra": 5}
    # the user's method makes the suggested 'extra' inapplicable: it is switched off, not an error
    assert resolve_options(owner, _Stepper(), {"method": "b"}, {"extra": 3}) == {"method": "b", "extra": None}
    # both values the user's: an error naming both
    with pytest.raises(ValueError, match=r"solver 'stepper': 'extra' applies to method 'a', got 'b'"):
        resolve_options(owner, _Stepper(), {"method": "b", "extra": 3})
    # a suggestion is validated like a user's value
    with pytest.raises(kgp.options.InvalidOptionError, match=r"solver 'stepper' option 'extra'"):
        resolve_options(owner, _Stepper(), None, {"extra": 0})


class _PolishingObjective:
    """A toy objective whose own loop defaults include Adam's polish."""

    option_defaults: dict = {}
    capabilities = kgp.Capabilities(loop_defaults={"polish_iterations": 4})

    def prepare(self, problem):
        return ObjectiveLoss(lambda noise, mean: (noise - 0.3) ** 2 + 0.0 * mean.sum())


def test_an_objectives_loop_default_gives_way_to_the_user_like_a_recipes_value():
    """The same rule for a recipe's polish and an objective's: the user's L-BFGS switches it off."""
    objective = _PolishingObjective()
    assert resolve_learn_options("toy", objective, None).loop["polish_iterations"] == 4
    loop = resolve_learn_options("toy", objective, {"optimizer": "lbfgs"}).loop
    assert loop["optimizer"] == "lbfgs" and loop["polish_iterations"] is None
    recipe = {"optimizer": "adam", "polish_iterations": 20}
    loop = resolve_learn_options("exact", get_objective("exact"), {"optimizer": "lbfgs"}, recipe).loop
    assert loop["optimizer"] == "lbfgs" and loop["polish_iterations"] is None
    with pytest.raises(ValueError, match=r"learn_options\['polish_iterations'\] applies to optimizer='adam'"):
        resolve_learn_options("toy", objective, {"optimizer": "lbfgs", "polish_iterations": 2})


def test_the_recipes_learn_options_are_suggestions_resolved_once_with_the_users():
    params = kgp.KernelRegressor("rbf", learn="auto", learn_options={"iterations": 9}).get_params()
    shape = DataShape(n=60_000, d=4, k=1, dtype=torch.float64, device=torch.device("cpu"))
    with kgp.settings.memory_budget(2**33):
        plan = resolve_plan(params, shape)
    recipe = plan.recipe.learn_options
    loop = plan.learn_options.loop
    assert loop["iterations"] == 9 != recipe["iterations"]  # the user's
    for key in ("polish_iterations", "initial_noise_fraction", "refine_subset", "refine_iterations"):
        assert loop[key] == recipe[key]  # the recipe's, where the user said nothing
    assert plan.learn_options.objective == {"subset": recipe["subset"]}
    assert plan.learn_options.objective.owner == "objective 'exact'"


def _subset_problem(n=40, subset=10):
    rng = np.random.default_rng(3)
    X = torch.as_tensor(rng.normal(size=(n, 2)))
    y = torch.sin(X[:, :1]) + 0.1 * torch.as_tensor(rng.normal(size=(n, 1)))
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    options = options_for("objective", "exact", subset=subset)
    return LearningProblem(X=X, y=y, kernel=kernel, options=options)


def test_the_builtin_objectives_return_a_typed_loss_with_its_terms():
    problem = _subset_problem(n=40, subset=10)
    loss = get_objective("exact").prepare(problem)
    assert isinstance(loss, ObjectiveLoss) and loss.terms == 10  # 10 rows x 1 output
    noise, mean = torch.tensor(0.1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    assert torch.equal(loss(noise, mean), loss.loss(noise, mean))


class _BareObjective:
    """A third-party objective in the older form: a bare function with a ``terms`` attribute."""

    option_defaults: dict = {}
    capabilities = kgp.Capabilities(likelihood=True)

    def prepare(self, problem):
        def loss(noise, mean):
            value = (noise - 0.3) ** 2 + (problem.kernel.outputscale - 2.0) ** 2 + 0.0 * mean.sum()
            return value

        loss.terms = 17
        return loss


class _NotALoss(_BareObjective):
    def prepare(self, problem):
        return 3.0


class _Plugin:
    @kgp.hookimpl
    def register_objectives(self, register):
        register("bare-terms", _BareObjective())
        register("not-a-loss", _NotALoss())


def test_a_bare_function_still_works_and_anything_else_is_refused_naming_the_objective():
    X = torch.randn(20, 2, dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kgp.register(_Plugin(), name="bare-objectives")
    try:
        result = learn_hyperparameters("bare-terms", X, X[:, 0], kernel, noise=1.0, options={"iterations": 3})
        assert result.terms == 17
        with pytest.raises(TypeError, match=r"objective 'not-a-loss': prepare\(problem\) must return"):
            learn_hyperparameters("not-a-loss", X, X[:, 0], kernel, noise=1.0, options={"iterations": 3})
    finally:
        kgp.unregister("bare-objectives")


def test_every_estimator_parameter_is_declared():
    names = [p for p in inspect.signature(BaseKernelModel.__init__).parameters if p != "self"]
    assert sorted(names) == sorted(ESTIMATOR_PARAMETERS)


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        ({"centers": 3}, TypeError, r"^centers: expected a selector name, an \(M x d\) array/tensor or None, got int$"),
        ({"learn": 3}, TypeError, r"^learn: expected an objective plugin name \(str\), 'auto' or None, got 3$"),
        ({"random_state": True}, TypeError, r"^random_state: expected an int or None, got True$"),
        ({"selector_options": "fast"}, TypeError, r"^selector_options: expected a dict or None, got str$"),
        ({"callback": 1}, TypeError, r"^callback: expected a callable taking an IterationInfo$"),
        ({"ard": 1}, TypeError, r"^ard: expected True, False or None \(on when learning\), got 1$"),
    ],
)
def test_declared_parameters_are_refused_naming_what_was_expected(params, error, match):
    model = kgp.KernelRegressor(**params)
    with pytest.raises(error, match=match):
        resolve_plan(model.get_params())
