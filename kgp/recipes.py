"""Recipes: the parameters a fit leaves to ``"auto"``, chosen from the data's size by a plugin.

``KernelRegressor(solver="auto")`` (the default) and ``learn="auto"`` ask the recipe plugin named
``"auto"`` (hook ``register_recipes``) what to run: which solver and how many centers, which objective
with which options. The core names no built-in solver; the built-in recipe (``kgp_builtins.recipes``)
holds the measured rule (docs/gp-workflow.md).

The recipe sees the data's shape and the machine's limits, never the data (:class:`RecipeRequest`),
and answers with the values it chose and one line of reason each (:class:`RecipeChoice`); the fitted
model reports them in ``recipe_``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["Recipe", "RecipeChoice", "RecipeRequest"]


@dataclass(frozen=True)
class RecipeRequest:
    """What a recipe decides from.

    Attributes
    ----------
    n, d, k:
        Training rows (all ranks' in a distributed fit), features, outputs.
    dtype, device:
        Of the fit.
    memory_budget, max_exact_size:
        ``kgp.settings`` values in force.
    distributed:
        Whether the fit is row-sharded over ranks.
    solver_auto, learn_auto:
        Which of ``solver`` and ``learn`` the user left to the recipe.
    uses_centers_explicitly:
        The user gave ``centers`` or ``n_centers`` (the recipe keeps them).
    kernel_has_lengthscale:
        The kernel has lengthscales to learn (not ``"linear"``).
    device_flops:
        ``kgp.settings.device_flops`` in force: the device's float64 matrix-product rate in flop/s that the
        user pinned, or None.
    measure_flops:
        Measures the device's float64 matrix-product rate in flop/s (:func:`kgp.device_speed.measured_flops`:
        a short timed product on the first call in the process, the kept value after; None where the device
        cannot run it). A recipe calls it only when the rate decides something, so that fits that do not
        need it never pay for the probe. None: no rate can be measured (a request built by hand).
    """

    n: int
    d: int
    k: int
    dtype: torch.dtype
    device: torch.device
    memory_budget: int
    max_exact_size: int
    distributed: bool
    solver_auto: bool
    learn_auto: bool
    uses_centers_explicitly: bool = False
    kernel_has_lengthscale: bool = True
    device_flops: float | None = None
    measure_flops: Callable[[], float | None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RecipeChoice:
    """A recipe's answer. ``None`` leaves a value as the user gave it.

    Attributes
    ----------
    solver, solver_options:
        The solver plugin name and its options (validated by the plan like a user's).
    n_centers:
        Centers for solvers or objectives that use them (the user's ``n_centers`` wins).
    learn, learn_options:
        The objective plugin name and the learning options (``learn_auto`` only). The options are
        suggestions (:func:`kgp.resolve_options`): the user's ``learn_options`` override them, and one
        that a user's value makes inapplicable (``polish_iterations`` under the user's L-BFGS, a
        ``refine_subset`` no larger than the user's ``subset``) is switched off, not an error.
    reasons:
        One line per chosen value, e.g. ``{"solver": "n = 32,000 > 20,000: exact needs 8.2 GB"}``.
    device:
        Plain values (numbers, strings, None) on the device the choice was sized for, e.g. its float64 rate
        and the center caps it set; reported as ``recipe_["device"]``.
    """

    solver: str | None = None
    solver_options: Mapping[str, Any] | None = None
    n_centers: int | None = None
    learn: str | None = None
    learn_options: Mapping[str, Any] | None = None
    reasons: Mapping[str, str] = field(default_factory=dict)
    device: Mapping[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain values, as the fitted attribute ``recipe_`` and model files keep them."""
        out: dict[str, Any] = {}
        for name in ("solver", "solver_options", "n_centers", "learn", "learn_options"):
            value = getattr(self, name)
            if value is not None:
                out[name] = dict(value) if isinstance(value, Mapping) else value
        out["reasons"] = dict(self.reasons)
        if self.device is not None:
            out["device"] = dict(self.device)
        return out


class Recipe(Protocol):
    """What ``register(name, recipe)`` in :func:`kgp.hookspecs.register_recipes` expects."""

    def choose(self, request: RecipeRequest) -> RecipeChoice: ...
