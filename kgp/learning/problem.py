"""What an objective plugin receives (:class:`LearningProblem`) and returns (:class:`ObjectiveLoss`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gpytorch
import torch
from torch import Tensor

from ..operators import KernelOperator, kernel_operator
from ..problem_data import Centers, RowData

__all__ = ["LearningProblem", "ObjectiveLoss"]


@dataclass
class LearningProblem(RowData):
    """Everything a hyperparameter objective needs (see the ``register_objectives`` hook).

    Attributes
    ----------
    X:
        ``n x d`` training inputs.
    y:
        ``n x k`` training targets (2-D; each column is an independent GP sharing the hyperparameters).
    kernel:
        The GPyTorch kernel being trained, on ``X``'s device and dtype. Its parameters change between
        calls of the loss; read them (e.g. through :meth:`kernel_operator`) inside the loss.
    centers:
        Inducing points / Nystrom centers (:class:`kgp.Centers`) for objectives with
        ``Capabilities(uses_centers=True)``, else None. Held fixed during learning.
    options:
        The objective's options, validated once and merged with its ``option_defaults`` (a
        :class:`kgp.options.ResolvedOptions`; the loop's own options removed): the objective reads
        them and never validates again. A test calling ``prepare`` directly builds them with
        ``kgp.testing.options_for("objective", name, ...)``.
    generator:
        Seeded CPU ``torch.Generator``: the only source of randomness.
    shard:
        None, or in a distributed fit (:mod:`kgp.distributed`) where this rank's rows of ``X`` and
        ``y`` sit: ``n`` is then the global number of rows. Only objectives with
        ``Capabilities(distributed=True)`` receive one (they sum their row sums over the ranks, e.g.
        with :func:`kgp.distributed.differentiable_sum`).
    """

    X: Tensor
    y: Tensor
    kernel: gpytorch.kernels.Kernel
    centers: Centers | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    shard: Any = None

    def kernel_operator(self, x1: Tensor, x2: Tensor | None = None) -> KernelOperator:
        """Lazy ``K(x1, x2)`` with the kernel's current hyperparameters (differentiable under autograd)."""
        return kernel_operator(self.kernel, x1, x2)


@dataclass
class ObjectiveLoss:
    """What an objective's ``prepare(problem)`` returns: the loss and, for a likelihood, its count of terms.

    Attributes
    ----------
    loss:
        ``loss(noise, mean) -> Tensor``: the differentiable 0-d value to minimise, per data point (see the
        ``register_objectives`` hook).
    terms:
        For an objective declaring ``Capabilities(likelihood=True)``: the number of (row, output) terms
        the value averages, so that ``-value * terms`` is the log marginal likelihood of the rows used
        (the model's ``log_marginal_likelihood_value_``); None otherwise.

    An ``ObjectiveLoss`` is itself callable as ``loss(noise, mean)``. A third-party objective may still
    return a bare function instead, with an optional ``terms`` attribute set on it:
    :meth:`from_prepared` reads both forms.
    """

    loss: Callable[[Tensor, Tensor], Tensor]
    terms: int | None = None

    def __call__(self, noise: Tensor, mean: Tensor) -> Tensor:
        return self.loss(noise, mean)

    @classmethod
    def from_prepared(cls, prepared: Any, objective: str = "objective") -> ObjectiveLoss:
        """``prepared`` as an :class:`ObjectiveLoss`: itself, or a bare callable and its ``terms`` attribute.

        Raises
        ------
        TypeError
            ``prepared`` is neither (naming ``objective``, e.g. ``"objective 'exact'"``).
        """
        if isinstance(prepared, cls):
            return prepared
        if not callable(prepared):
            raise TypeError(
                f"{objective}: prepare(problem) must return a kgp.learning.ObjectiveLoss or a callable "
                f"loss(noise, mean), got {type(prepared).__name__}"
            )
        return cls(prepared, getattr(prepared, "terms", None))
