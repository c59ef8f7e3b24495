"""The contract between kgp and its solver, center-selector and objective plugins.

Everything a plugin author needs is importable from here (and re-exported by ``kgp``):
:class:`Problem` (what a solver receives), :class:`Solver`, :class:`SelectionRequest`,
:class:`Centers`, :class:`CenterSelector`, :class:`Objective`, :class:`Predictor`, the core
predictor :class:`~kgp.predictors.KernelExpansion`, and what every plugin declares:
:class:`~kgp.capabilities.Capabilities` (what it can do) and :class:`~kgp.options.Option`
(its options). The registry checks the declarations when a plugin registers
(:mod:`kgp.registry.contract`).

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import gpytorch
import torch
from torch import Tensor

from .capabilities import Capabilities
from .monitor import Monitor
from .operators import KernelOperator, kernel_operator
from .options import Option
from .predictors import KernelExpansion
from .problem_data import Centers, RowData

if TYPE_CHECKING:
    from .distributed import Shard
    from .learning import LearningProblem

__all__ = [
    "Capabilities",
    "Centers",
    "CenterSelector",
    "KernelExpansion",
    "Objective",
    "Option",
    "Predictor",
    "Problem",
    "SelectionRequest",
    "Solution",
    "Solver",
    "default_n_centers",
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
class Problem(RowData):
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
        The Nystrom centers / inducing points as a :class:`Centers` (``points``: ``M x d``, not
        necessarily training points; ``weights``: optional diagonal of FALKON's D matrix, weighted
        Nystrom, None meaning D = I; ``indices``: optional positions in ``X``), or None for solvers
        with ``uses_centers=False``. A bare ``M x d`` tensor is accepted and wrapped.
    options:
        Solver options, resolved once by the core (:func:`kgp.resolve_options`): every declared
        option with its validated, normalised value, the solver's ``check_options`` applied. A
        solver reads them and never validates again; a test calling ``fit`` directly passes
        ``kgp.resolve_options("solver 'name'", solver, maxiter=5)``.
    generator:
        Seeded ``torch.Generator`` (on the CPU) for every random draw of the solver.
    monitor:
        Call ``monitor.step(iteration, predictor, **extras)`` once per iteration; stop when it
        returns True.
    shard:
        None for a local fit. In a distributed fit (:mod:`kgp.distributed`) ``X`` and ``y`` are this
        rank's rows only and ``shard`` says where they sit (``n_total``, ``offset``, the collectives);
        ``n`` and ``lam`` then refer to the global problem, ``n_local`` to this rank's rows, and
        ``kernel_operator(X, Z)`` sums its transposed products over all ranks. Only solvers that
        declare ``Capabilities(distributed=True)`` receive a sharded problem.
    want_variance:
        The fitted posterior has a predictive variance (the solver's target is not ``"mean_only"``): a
        solver that computes a factor the variance needs anyway may hand it on by returning a
        :class:`Solution`.
    """

    X: Tensor
    y: Tensor
    kernel: gpytorch.kernels.Kernel
    noise: float
    centers: Centers | None = None
    options: dict[str, Any] = field(default_factory=dict)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    monitor: Monitor = field(default_factory=Monitor)
    shard: Shard | None = None
    want_variance: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.centers, Tensor):
            self.centers = Centers(points=self.centers)
        elif self.centers is not None and not isinstance(self.centers, Centers):
            raise TypeError(
                f"Problem.centers: expected a kgp.Centers, an (M x d) tensor or None, got {type(self.centers).__name__}"
            )

    @property
    def lam(self) -> float:
        """FALKON / BLESS per-sample lambda = sigma^2 / n."""
        return self.noise / self.n

    def kernel_operator(self, x1: Tensor, x2: Tensor | None = None, **kwargs: Any) -> KernelOperator:
        """Lazy ``K(x1, x2)`` through the shared block backend (see :func:`kgp.operators.kernel_operator`).

        In a distributed fit, ``K(problem.X, Z)`` (``x1`` being ``problem.X`` itself) is sharded: its
        transposed products are summed over all ranks. ``kwargs`` go to :func:`kgp.kernel_operator`.
        """
        if self.shard is not None and x1 is self.X and "shard" not in kwargs:
            kwargs["shard"] = self.shard
        return kernel_operator(self.kernel, x1, x2, **kwargs)


class Solver(Protocol):
    """What ``register(name, solver)`` in :func:`kgp.hookspecs.register_solvers` expects.

    ``capabilities`` says what it can do (:class:`kgp.Capabilities`): whether ``fit`` needs centers
    (``uses_centers``), which posterior it approximates (``target``), whether it runs without
    ``torch.no_grad()`` (``needs_grad``), accepts a row-sharded problem (``distributed``, else
    ``distributed_refusal``) and implements ``partial_fit(problem, previous)`` (``partial_fit``).
    ``option_defaults`` maps every option to a :class:`kgp.Option`; the optional
    ``check_options(options) -> options`` holds the rules between options.
    """

    capabilities: Capabilities
    option_defaults: Mapping[str, Option]

    def fit(self, problem: Problem) -> Predictor | Solution: ...


@dataclass
class Solution:
    """What a solver may return instead of a bare predictor: the predictor and a factor it hands on.

    ``variance``: the :class:`kgp.variance.VarianceFactors` of the posterior the solver targets (e.g.
    :class:`kgp.variance.ExactFactors`; the variance strategy adopts factors of its own kind), when
    the solve computed them anyway (the exact solver's Cholesky factor of ``K + sigma^2 I``); the fit
    then does not factor the same matrix again for ``predict(return_std=True)``. Only meaningful when
    ``problem.want_variance`` is True; a solver may always return its predictor alone.
    """

    predictor: Predictor
    variance: Any = None


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
        Selector options resolved once by the core (:func:`kgp.resolve_options`).
    shard:
        None, or in a distributed fit where this rank's rows sit (as :attr:`Problem.shard`): ``n``
        is then the global number of rows, and only selectors declaring
        ``Capabilities(distributed=True)`` are asked. Every rank must return the same centers.
    """

    X: Tensor
    n_centers: int | None
    kernel: gpytorch.kernels.Kernel
    noise: float
    generator: torch.Generator
    options: dict[str, Any] = field(default_factory=dict)
    shard: Shard | None = None

    @property
    def n(self) -> int:
        """Training rows of the (global) data set: all ranks' rows in a distributed fit."""
        return self.X.shape[0] if self.shard is None else self.shard.n_total

    @property
    def lam(self) -> float:
        return self.noise / self.n

    def kernel_operator(self, x1: Tensor, x2: Tensor | None = None, **kwargs: Any) -> KernelOperator:
        """As :meth:`Problem.kernel_operator` (sharded when ``x1`` is ``request.X`` in a distributed fit)."""
        if self.shard is not None and x1 is self.X and "shard" not in kwargs:
            kwargs["shard"] = self.shard
        return kernel_operator(self.kernel, x1, x2, **kwargs)


class CenterSelector(Protocol):
    """What ``register(name, selector)`` in :func:`kgp.hookspecs.register_selectors` expects.

    ``capabilities``: as for :class:`Solver`; a selector uses ``needs_grad`` (``select`` runs under
    ``torch.no_grad()`` unless it is True) and ``distributed`` (row-sharded requests, ``request.shard``).
    """

    capabilities: Capabilities
    option_defaults: Mapping[str, Option]

    def select(self, request: SelectionRequest) -> Centers: ...


class Objective(Protocol):
    """What ``register(name, objective)`` in :func:`kgp.hookspecs.register_objectives` expects.

    ``capabilities``: ``uses_centers`` (``problem.centers`` holds the model's centers),
    ``distributed`` (``problem.shard`` in a distributed fit) and ``loop_defaults`` (the learning
    loop's defaults that suit it). ``prepare`` returns ``loss(noise, mean) -> 0-d tensor``, the value
    to minimise per data point, differentiable in the kernel's parameters, ``noise`` and ``mean``.
    """

    capabilities: Capabilities
    option_defaults: Mapping[str, Option]

    def prepare(self, problem: LearningProblem) -> Callable[[Tensor, Tensor], Tensor]: ...


def default_n_centers(n: int) -> int:
    """Default number of Nystrom centers for ``n`` training points: ``min(n, max(100, 5 sqrt(n)))``.

    FALKON's theory asks for M of order sqrt(n) log n (Rudi et al. 2017, Thm. 3); 5 sqrt(n) is
    2,340 centers at n = 219k, in line with the M = 2,000-5,000 used for data of that size.
    """
    import math

    return int(min(n, max(100, math.ceil(5 * math.sqrt(n)))))
