"""What a plugin can do, declared once in one typed record: :class:`Capabilities`.

Every solver, center selector and objective declares ``capabilities = kgp.Capabilities(...)``; the
registry checks the record when the plugin registers, and the fit plan (:mod:`kgp.fitting.plan`) reads
only this record, never loose attributes. The fields a kind does not use keep their defaults.

The ``target`` of a solver says which posterior its fit approximates, which decides two things:

- the predictive variance ``predict(return_std=True)`` gives (:mod:`kgp.posterior`): ``"exact"`` the
  exact GP variance on the training rows, ``"nystrom"`` the DTC / SGPR variance on the centers,
  ``"mean_only"`` none (the solver approximates the exact mean in a form without a variance, e.g.
  random features);
- the oracle the conformance kit compares the fit with (:mod:`kgp.testing`): the exact posterior mean
  for ``"exact"`` and ``"mean_only"``, the Nystrom estimator on the same centers for ``"nystrom"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["TARGETS", "Capabilities"]

TARGETS = ("exact", "nystrom", "mean_only")
"""Accepted values of :attr:`Capabilities.target`."""


@dataclass(frozen=True)
class Capabilities:
    """A plugin's declared abilities (all fields optional; defaults describe the plainest plugin).

    Attributes
    ----------
    uses_centers:
        Solvers and objectives: the fit needs Nystrom centers / inducing points (``problem.centers``);
        the model selects them with the center selector, and refuses explicit centers when no plugin of
        the fit uses them.
    target:
        Solvers: the posterior the fit approximates, one of :data:`TARGETS` (see the module docstring).
        ``"exact"`` with ``uses_centers=True`` is allowed: centers used only as a preconditioner.
    needs_grad:
        The model runs the plugin's work (``fit``, ``partial_fit``, ``select``) under
        ``torch.no_grad()`` unless this is True.
    distributed:
        The plugin accepts a row-sharded problem (``problem.shard``, :mod:`kgp.distributed`);
        ``fit(..., distributed=True)`` refuses plugins without it, quoting ``distributed_refusal``.
    distributed_refusal:
        Why the plugin is not distributed and what to use instead (one sentence, quoted in the refusal).
    partial_fit:
        Solvers: the plugin implements ``partial_fit(problem, previous)`` (streaming); the registry
        checks that the method exists.
    loop_defaults:
        Objectives: the learning loop's defaults that suit the objective, e.g.
        ``{"optimizer": "lbfgs", "iterations": 50}`` (validated against the loop's options when the
        plan is resolved; ``learn_options`` override them).
    likelihood:
        Objectives: the value is a negative log (marginal) likelihood per (row, output) term, or a
        bound on it. The loop then warns when learning ends above the white-noise model's likelihood,
        and ``-value * terms`` (``terms`` of the :class:`kgp.learning.ObjectiveLoss` that ``prepare``
        returned, its count of terms) is the model's ``log_marginal_likelihood_value_``.
    uses_kernel:
        Selectors: the centers depend on the kernel's hyperparameters (leverage scores, for instance).
        A fit that learns them (``learn=...``) then selects with the learned kernel: after learning
        when the objective needs no centers, and again after learning when it does (its centers are
        selected with the starting kernel). A selector that ignores the kernel (uniform) selects once.
    """

    uses_centers: bool = False
    target: Literal["exact", "nystrom", "mean_only"] = "exact"
    needs_grad: bool = False
    distributed: bool = False
    distributed_refusal: str | None = None
    partial_fit: bool = False
    loop_defaults: Mapping[str, Any] = field(default_factory=dict)
    likelihood: bool = False
    uses_kernel: bool = False

    def __post_init__(self) -> None:
        for name in ("uses_centers", "needs_grad", "distributed", "partial_fit", "likelihood", "uses_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Capabilities.{name}: expected True or False, got {getattr(self, name)!r}")
        if self.target not in TARGETS:
            raise ValueError(f"Capabilities.target: expected one of {TARGETS}, got {self.target!r}")
        if self.distributed_refusal is not None and not isinstance(self.distributed_refusal, str):
            raise TypeError(
                f"Capabilities.distributed_refusal: expected a str or None, got {self.distributed_refusal!r}"
            )
        if self.distributed and self.distributed_refusal is not None:
            raise ValueError(
                "Capabilities.distributed_refusal: says why a plugin is not distributed, but distributed=True; "
                "drop one of them"
            )
        if not isinstance(self.loop_defaults, Mapping):
            raise TypeError(f"Capabilities.loop_defaults: expected a dict, got {type(self.loop_defaults).__name__}")
        if not all(isinstance(key, str) for key in self.loop_defaults):
            raise TypeError(
                f"Capabilities.loop_defaults: expected option names (str) as keys, got {self.loop_defaults}"
            )
        # frozen means frozen: a shared default dict could otherwise be changed through one plugin
        object.__setattr__(self, "loop_defaults", MappingProxyType(dict(self.loop_defaults)))

    def __reduce__(self):
        # a mappingproxy does not pickle: rebuild from a plain dict (a model holding its solver pickles)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return (_rebuild, (fields | {"loop_defaults": dict(self.loop_defaults)},))


def _rebuild(fields: dict[str, Any]) -> Capabilities:
    return Capabilities(**fields)
