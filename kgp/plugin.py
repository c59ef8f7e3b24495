"""The contract between kgp and its solver / center-selector plugins.

Everything a plugin author needs is importable from here (and re-exported by ``kgp``):
:class:`Problem` (what a solver receives), :class:`Solver`, :class:`SelectionRequest`,
:class:`Centers`, :class:`CenterSelector`, :class:`Predictor` and the core predictor
:class:`~kgp.predictors.KernelExpansion`.

Regularisation convention (one for all plugins)
-----------------------------------------------
``problem.noise`` is the GP observation-noise variance sigma^2: the target is the posterior mean
``f(x) = K(x, X) (K(X, X) + sigma^2 I)^{-1} y``, i.e. kernel ridge regression with the
FALKON/BLESS per-sample ``lambda = sigma^2 / n`` (``problem.lam``) on the objective
``(1/n) sum_i (f(x_i) - y_i)^2 + lambda ||f||_H^2``, and with EigenPro's bare ``lambda_EP =
sigma^2``. With centers Z the Nystrom solution is
``(K_nM^T K_nM + sigma^2 K_MM) alpha = K_nM^T y``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import gpytorch
import torch
from torch import Tensor

from .monitor import Monitor
from .operators import KernelOperator, kernel_operator
from .predictors import KernelExpansion

__all__ = [
    "Centers",
    "CenterSelector",
    "KernelExpansion",
    "Predictor",
    "Problem",
    "SelectionRequest",
    "Solver",
    "default_n_centers",
    "merge_options",
]


@runtime_checkable
class Predictor(Protocol):
    """A fitted function. ``predict(X)`` returns an ``n x k`` tensor (k outputs).

    ``state_dict()`` returns only tensors and plain values (int, float, str, bool, None, lists
    and dicts of them) so that a saved model loads with ``torch.load(weights_only=True)``;
    ``from_state(state, kernel)`` is its inverse. ``kind`` names the class in the registry.
    """

    kind: ClassVar[str]

    def predict(self, X: Tensor) -> Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_state(cls, state: Mapping[str, Any], kernel: gpytorch.kernels.Kernel) -> Predictor: ...


@dataclass
class Problem:
    """Everything a solver needs to fit one model.

    Attributes
    ----------
    X:
        ``n x d`` training inputs (floating dtype and device chosen by the user).
    y:
        ``n x k`` targets (always 2-D; k = 1 for a single output).
    kernel:
        GPyTorch kernel, already on ``X``'s device and dtype.
    noise:
        GP noise variance sigma^2 (> 0). See the module docstring for lambda conversions.
    centers:
        ``M x d`` Nystrom centers / inducing points, or None for solvers with ``uses_centers=False``.
        Not necessarily training points.
    center_weights:
        Optional length-M weights: the diagonal of FALKON's D matrix (weighted Nystrom, e.g. from
        leverage-score sampling). None means uniform (D = I).
    center_indices:
        Optional indices of the centers in ``X`` (when they are training points).
    options:
        Solver options, already merged with the solver's ``option_defaults`` and checked for unknown
        names.
    generator:
        Seeded ``torch.Generator`` (on the CPU) for every random draw of the solver.
    monitor:
        Call ``monitor.step(iteration, predictor, **extras)`` once per iteration; stop when it
        returns True.
    """

    X: Tensor
    y: Tensor
    kernel: gpytorch.kernels.Kernel
    noise: float
    centers: Tensor | None = None
    center_weights: Tensor | None = None
    center_indices: Tensor | None = None
    options: dict[str, Any] = field(default_factory=dict)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    monitor: Monitor = field(default_factory=Monitor)

    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def n_outputs(self) -> int:
        return self.y.shape[1]

    @property
    def lam(self) -> float:
        """FALKON / BLESS per-sample lambda = sigma^2 / n."""
        return self.noise / self.n

    @property
    def dtype(self) -> torch.dtype:
        return self.X.dtype

    @property
    def device(self) -> torch.device:
        return self.X.device

    def kernel_operator(self, x1: Tensor, x2: Tensor | None = None) -> KernelOperator:
        """Lazy ``K(x1, x2)`` through the shared block backend (see :func:`kgp.operators.kernel_operator`)."""
        return kernel_operator(self.kernel, x1, x2)


class Solver(Protocol):
    """What ``register(name, solver)`` in :func:`kgp.hookspecs.register_solvers` expects."""

    option_defaults: Mapping[str, Any]
    uses_centers: bool

    def fit(self, problem: Problem) -> Predictor: ...


@dataclass
class SelectionRequest:
    """What a center selector receives.

    Attributes
    ----------
    X:
        ``n x d`` training inputs.
    n_centers:
        Requested number of centers, or None (the selector chooses, e.g. from d_eff).
    kernel, noise:
        As in :class:`Problem`; ``lam = noise / n``.
    generator:
        Seeded ``torch.Generator`` (CPU).
    options:
        Selector options merged with its ``option_defaults``.
    """

    X: Tensor
    n_centers: int | None
    kernel: gpytorch.kernels.Kernel
    noise: float
    generator: torch.Generator
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.X.shape[0]

    @property
    def lam(self) -> float:
        return self.noise / self.n

    def kernel_operator(self, x1: Tensor, x2: Tensor | None = None) -> KernelOperator:
        return kernel_operator(self.kernel, x1, x2)


@dataclass
class Centers:
    """Result of a center selector.

    Attributes
    ----------
    points:
        ``M x d`` centers.
    weights:
        Optional length-M diagonal of FALKON's D (Appendix A, Def. 2); None means D = I.
    indices:
        Optional indices into the training inputs.
    info:
        Diagnostics (e.g. ``"leverage_scores"``, ``"d_eff"``).
    """

    points: Tensor
    weights: Tensor | None = None
    indices: Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)


class CenterSelector(Protocol):
    """What ``register(name, selector)`` in :func:`kgp.hookspecs.register_selectors` expects."""

    option_defaults: Mapping[str, Any]

    def select(self, request: SelectionRequest) -> Centers: ...


def merge_options(owner: str, defaults: Mapping[str, Any], given: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge user options into defaults, rejecting unknown names.

    Raises
    ------
    TypeError
        If ``given`` is not a mapping.
    ValueError
        Naming the unknown options and listing the valid ones.
    """
    if given is None:
        given = {}
    elif not isinstance(given, Mapping):  # checked before converting: dict() would accept a list of pairs
        raise TypeError(f"options for {owner}: expected a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        valid = ", ".join(sorted(defaults)) or "(none)"
        raise ValueError(f"unknown option(s) {unknown} for {owner}; valid options: {valid}")
    return {**defaults, **given}


def default_n_centers(n: int) -> int:
    """Default number of Nystrom centers for ``n`` training points: ``min(n, max(100, 5 sqrt(n)))``.

    FALKON's theory asks for M of order sqrt(n) log n (Rudi et al. 2017, Thm. 3); 5 sqrt(n) is
    2,340 centers at n = 219k, in line with the M = 2,000-5,000 used for data of that size.
    """
    import math

    return int(min(n, max(100, math.ceil(5 * math.sqrt(n)))))
