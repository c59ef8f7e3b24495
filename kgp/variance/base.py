"""The interface of a variance strategy, and the computations the factored strategies share.

A :class:`VarianceStrategy` owns one kind of predictive variance of a fitted GP: how it is built from
the fit, the latent variance and covariance at query rows, the state a model file keeps of it and the
checks of that state on loading. :class:`kgp.Posterior` holds one and never asks which kind it is.

The factored strategies (exact, Nystrom) share one form: the latent covariance of the query rows
``Xq`` is

    cov(f(Xq)) = K(Xq, Xq) + sum_i w_i P_i^T P_i,        P_i = L_i^{-1} K(points, Xq),

with one lower Cholesky factor ``L_i`` and weight ``w_i`` per term (:meth:`VarianceFactors.projections`).
Every entry of it is computed from the two rows it belongs to only: ``K(Xq, Xq)`` from the rows'
pairwise differences (never from a distance expansion centred on the batch) and ``K(points, Xq)`` with
the stored points as the operator's columns. A far row joining the batch therefore changes no other
entry, and the diagonal is the per-row variance of :func:`latent_variance` (the std of ``predict``).
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import gpytorch
import torch
from torch import Tensor

from ..linalg import flush_below_scale
from ..operators import kernel_operator, plan_block_rows, row_slices
from ..posterior_checks import PosteriorStateError, StateChecker
from .calibration import conditional_scale

__all__ = [
    "FactoredVariance",
    "FitInputs",
    "LoadContext",
    "VarianceFactors",
    "VarianceStrategy",
    "check_dense_size",
    "cross_kernel",
    "latent_covariance",
    "latent_variance",
    "pair_kernel",
    "variance_terms",
    "working_kernel",
]


def check_dense_size(
    n: int, itemsize: int, what: str, device: torch.device | None = None, *, instead: str = "use fewer rows"
) -> None:
    """Refuse a dense ``n x n`` matrix (on ``device``) above ``kgp.settings.max_exact_size`` or ``memory_budget``.

    Parameters
    ----------
    n, itemsize:
        The matrix's side and bytes per entry.
    what:
        What needs the matrix (the message's subject), e.g. ``"solver 'exact'"``.
    device:
        Where the matrix would live (the memory budget is per device).
    instead:
        The alternative to raising the settings, ending the message.

    Raises
    ------
    ValueError
        Naming ``what``, the matrix's size, both settings and how to raise them (in Python and in the
        environment), and ``instead``.
    """
    from .. import settings

    limit = settings.max_exact_size.value()
    budget = settings.memory_budget.value(device)
    if n > limit or n * n * itemsize > budget:
        raise ValueError(
            f"{what} needs a dense {n:,} x {n:,} matrix ({n * n * itemsize / 2**20:,.0f} MiB); "
            f"kgp.settings.max_exact_size={limit:,}, kgp.settings.memory_budget={budget:,} bytes. Raise them "
            f"(kgp.settings.max_exact_size({n}), kgp.settings.memory_budget(bytes); environment "
            f"KGP_MAX_EXACT_SIZE={n}, KGP_MEMORY_BUDGET=bytes) or {instead}"
        )


@dataclass(frozen=True)
class FitInputs:
    """What a fit offers the variance strategy it chooses (:func:`kgp.variance.for_fit`).

    Attributes
    ----------
    solver:
        The solver's registered name (quoted in the reason of a missing variance).
    kernel:
        The fitted kernel (learned hyperparameters included), in the units the kernel works in.
    noise:
        The noise variance sigma^2 of the fit.
    predictor:
        The solver's predictor (an exact-target solver's predictor expands over the training rows, its
        ``centers``).
    centers:
        The fit's ``M x d`` centers, or None.
    train_X:
        The training rows the fit solved on (this rank's rows in a distributed fit), or None.
    shard:
        The :class:`kgp.distributed.Shard` of a distributed fit, or None.
    learns:
        True for a GP fit (``learn=...``): its variance is built at fit time.
    """

    solver: str
    kernel: gpytorch.kernels.Kernel
    noise: float
    predictor: Any
    centers: Tensor | None = None
    train_X: Tensor | None = None
    shard: Any = None
    learns: bool = False


@dataclass(frozen=True)
class LoadContext:
    """What a strategy's :meth:`VarianceStrategy.from_state` may use besides its own state entry.

    Attributes
    ----------
    kernel, noise, predictor:
        The loaded posterior's kernel, noise and predictor.
    predictor_kind:
        The predictor's registered kind (quoted in errors).
    n_features:
        Columns every stored point must have.
    device, dtype:
        Where the loaded model lives.
    check:
        The entry checker (its messages name ``posterior.variance...``).
    """

    kernel: gpytorch.kernels.Kernel
    noise: float
    predictor: Any
    predictor_kind: Any
    n_features: int
    device: torch.device
    dtype: torch.dtype
    check: StateChecker


class VarianceFactors(abc.ABC):
    """What a factored variance needs besides the kernel: stored points and lower Cholesky factors.

    Subclasses are dataclasses with at least ``points`` (``p x d``) and ``noise`` (sigma^2), and say in
    :attr:`dtype` which dtype their factors (and so the variance's arithmetic) are in; ``kind`` is the tag
    their :meth:`state_dict` carries.
    """

    kind: ClassVar[str]
    points: Tensor
    noise: float

    @property
    @abc.abstractmethod
    def dtype(self) -> torch.dtype:
        """The factors' dtype: the variance is computed in it."""

    @abc.abstractmethod
    def projections(self, kx: Tensor) -> list[tuple[float, Tensor]]:
        """The terms ``(w_i, L_i^{-1} kx)`` of the latent covariance, for ``kx = K(points, Xq)`` (``p x q``)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values, tagged with ``kind``."""

    def to_cpu(self) -> dict[str, Any]:
        """:meth:`state_dict` with its tensors detached, on the CPU and row-major (a model file's entry).

        Row-major because the file's checksum hashes a tensor's entries in that order: a LAPACK factor
        (a column-major view) stored as it is would be copied by every load to be hashed (a second at
        M = 11,241); the triangular solves run at the same speed on either layout.
        """
        return {k: (v.detach().cpu().contiguous() if torch.is_tensor(v) else v) for k, v in self.state_dict().items()}


class VarianceStrategy(abc.ABC):
    """One kind of predictive variance of a fitted GP, in the units the kernel works in.

    Subclasses set :attr:`kind` (the tag a model file stores in ``posterior.variance.kind``) and
    implement the methods below; :mod:`kgp.variance` maps solver targets and tags to them in one place.
    """

    kind: ClassVar[str]
    """The serialised tag of the strategy."""

    has_variance: ClassVar[bool] = True
    """Whether :meth:`latent_variance` can give a variance (False: it raises with the reason)."""

    @classmethod
    @abc.abstractmethod
    def for_fit(cls, fit: FitInputs) -> VarianceStrategy:
        """The strategy of a fit whose solver declares this strategy's target.

        May return another strategy (a :class:`~kgp.variance.NoVariance` with the reason) when the fit
        lacks what this one needs.
        """

    @property
    @abc.abstractmethod
    def built(self) -> bool:
        """Whether what the variance needs has been computed."""

    @abc.abstractmethod
    def build(self) -> None:
        """Compute what the variance needs now (it is otherwise computed on the first variance asked for).

        Raises
        ------
        ValueError
            Where the strategy cannot give a variance, or no longer holds what it needs.
        kgp.linalg.NotPSDError
            Where a factorisation fails.
        """

    def build_cost(self) -> tuple[float, int] | None:
        """The floating-point operations and bytes :meth:`build` would take now.

        ``(0, 0)`` when built; None when it cannot build (no variance, or what it needs is gone).
        """
        return (0.0, 0) if self.built else None

    def adopt(self, factors: Any) -> bool:
        """Take factors the solver computed anyway (:class:`kgp.plugin.Solution`); False where they do not fit."""
        return False

    def can_calibrate(self, n: int) -> bool:
        """Whether :meth:`calibrate` could move the variance of a fit on ``n`` training rows (all ranks').

        False (the default) where the kind has no factor, or where the factor would stay 1 whatever the
        residuals (the Nystrom variance with ``n <= 2 M``): the fit then skips the residuals' pass.
        """
        return False

    def calibrate(self, X: Tensor, residual_square: Tensor, n: int, gather: Any = None) -> float:
        """Measure the variance's calibration on training rows ``X`` with residuals' mean squares ``residual_square``.

        ``n``: the fit's training rows (all ranks'); ``gather``: in a distributed fit, ``X`` is this rank's part
        of a global draw of rows and ``gather`` maps a per-row table of it to the whole draw's, on every rank.
        Returns the factor kept (1 for a kind that has none).
        """
        return 1.0

    @abc.abstractmethod
    def latent_variance(self, Xq: Tensor) -> Tensor:
        """Variance of the latent f at the rows of ``Xq`` (length q), clamped at 0, in ``Xq``'s dtype."""

    @abc.abstractmethod
    def latent_covariance(self, Xq: Tensor) -> Tensor:
        """Covariance of the latent f between the rows of ``Xq`` (``q x q``), in the working dtype.

        Its diagonal is :meth:`latent_variance`; entry ``(i, j)`` depends on rows i and j only.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The ``posterior.variance`` entry of a model file: CPU tensors and plain values, with ``kind``."""

    @classmethod
    @abc.abstractmethod
    def from_state(cls, state: Mapping[str, Any], context: LoadContext) -> VarianceStrategy:
        """Rebuild the strategy from :meth:`state_dict`, checking every entry before using it.

        Raises
        ------
        kgp.posterior_checks.PosteriorStateError
            Naming the entry and what was expected.
        """

    @classmethod
    def legacy_state(cls, factors: Mapping[str, Any] | None, predictor_centers: Any) -> dict[str, Any]:
        """The ``posterior.variance`` entry of a file written before the Posterior (format versions 1 and 2).

        ``factors``: the factors such a file stored (its ``fitted.gp.variance``), or None.
        """
        state: dict[str, Any] = {"kind": cls.kind}
        if factors is not None:
            state["factors"] = factors
        return state


class FactoredVariance(VarianceStrategy):
    """A strategy whose variance comes from :class:`VarianceFactors` built once (exact, Nystrom).

    Subclasses set :attr:`factors_class`, hold ``kernel`` and ``factors`` (None until built) and say which
    points the factors are built on (:attr:`factor_points`); adopting a solver's factors and the latent
    variance and covariance are the same for all of them.
    """

    factors_class: ClassVar[type[VarianceFactors]]
    kernel: gpytorch.kernels.Kernel
    factors: VarianceFactors | None

    @property
    @abc.abstractmethod
    def factor_points(self) -> Tensor:
        """The points the factors are built on (the training rows, or the centers)."""

    @property
    def built(self) -> bool:
        return self.factors is not None

    def adopt(self, factors: Any) -> bool:
        if not isinstance(factors, self.factors_class) or factors.points.shape != self.factor_points.shape:
            return False
        self.factors = factors
        return True

    calibration: float = 1.0
    """The factor c on the conditional term (:mod:`kgp.variance.calibration`); 1 leaves the variance as it is."""

    def latent_variance(self, Xq: Tensor) -> Tensor:
        self.build()
        return latent_variance(self.kernel, Xq, self.factors, calibration=self.calibration)

    def latent_covariance(self, Xq: Tensor) -> Tensor:
        self.build()
        return latent_covariance(self.kernel, Xq, self.factors, calibration=self.calibration)


# ---------------------------------------------------------------------- the factored computations
def working_kernel(kernel: gpytorch.kernels.Kernel, dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    """The kernel in ``dtype`` (a copy when it differs; GPyTorch kernels are small modules)."""
    current = next((p.dtype for p in kernel.parameters()), dtype)
    return kernel if current == dtype else copy.deepcopy(kernel).to(dtype)


def cross_kernel(kernel: gpytorch.kernels.Kernel, Xq: Tensor, points: Tensor, prior: Tensor) -> Tensor:
    """``K(points, Xq)`` (``p x q``, a transposed view) for the variance's triangular solves.

    The stored points are the operator's columns: a stationary kernel centres distances on the
    columns' mean, which must not depend on the query batch (a far query row would shift it and cancel
    the other rows' variances). Entries below :func:`kgp.linalg.tiny_fraction` of the kernel's scale
    (the largest of ``prior``, the query rows' ``k(x, x)``, and of the block) are set to 0: with short
    lengthscales most query-to-data values are far below it, and the solves' products of them are
    subnormal, which some CPUs process 10-100x slower (docs/gp-workflow.md). A dropped entry moves the
    variance by less than ``1e-150`` of the kernel's scale (float64).
    """
    dense = kernel_operator(kernel, Xq, points).to_dense()
    flush_below_scale(dense, max(_largest(prior), _largest(dense)))
    return dense.mT


def _largest(X: Tensor) -> float:
    return float(X.abs().max()) if X.numel() else 0.0


def pair_kernel(kernel: gpytorch.kernels.Kernel, A: Tensor, B: Tensor) -> Tensor:
    """``K(A, B)`` (``a x b``) with every entry from its two rows' difference, streamed in row blocks.

    The kernel operator's dense blocks expand squared distances around the columns' mean, so a far row
    among the columns moves every entry of the block by rounding; here entry ``(i, j)`` is the kernel's
    elementwise value at ``(A_i, B_j)`` (the operator's diagonal), as the per-row prior ``k(x, x)`` is.
    """
    a, b = A.shape[0], B.shape[0]
    d = A.shape[1]
    out = torch.empty(a, b, dtype=A.dtype, device=A.device)
    # per block row: two expanded copies of the inputs (b x d each), the differences and the values
    rows = plan_block_rows(a, b, A.element_size(), 2 * d + 2, device=A.device)
    for sl in row_slices(0, a, rows):
        n = sl.stop - sl.start
        left = A[sl].repeat_interleave(b, dim=0)
        right = B.repeat(n, 1)
        out[sl] = kernel_operator(kernel, left, right).diagonal().reshape(n, b)
    return out


def _query_blocks(
    kernel: gpytorch.kernels.Kernel, Xq: Tensor, factors: VarianceFactors
) -> Iterator[tuple[slice, Tensor, list[tuple[float, Tensor]]]]:
    """Per block of query rows (in the factors' dtype): the rows, their prior ``k(x, x)`` and the projections."""
    p = factors.points.shape[0]
    work = factors.dtype
    # p x b cross-kernel block plus two solves of the same size per query block
    rows = plan_block_rows(Xq.shape[0], p, work.itemsize, 3, device=Xq.device)
    for sl in row_slices(0, Xq.shape[0], rows):
        xq = Xq[sl].to(work)
        prior = kernel_operator(kernel, xq, xq).diagonal()
        kx = cross_kernel(kernel, xq, factors.points, prior)  # p x b
        yield sl, prior, factors.projections(kx)


def _variance_of(
    prior: Tensor, projections: list[tuple[float, Tensor]], calibration: float = 1.0
) -> tuple[Tensor, Tensor | None]:
    """Per row: the variance, clamped at 0, and the conditional term's scale ``g`` (None when c = 1)."""
    conditional, rest = _terms(prior, projections)
    scale = None
    if calibration != 1.0:
        scale = conditional_scale(prior, conditional, calibration)
        conditional = conditional * scale
    var = conditional if rest is None else conditional + rest
    # rounding can leave a variance slightly negative where the data pin f down; scikit-learn's
    # GaussianProcessRegressor clamps (and warns) too: the clamp removes only noise below eps * k(x, x)
    return var.clamp_min(0.0), scale


def _terms(prior: Tensor, projections: list[tuple[float, Tensor]]) -> tuple[Tensor, Tensor | None]:
    """Per row: the conditional term ``k(x, x) + w_0 ||P_0||^2`` and the sum of the others (None if none)."""
    (weight, P), others = projections[0], projections[1:]
    conditional = prior + weight * P.square().sum(0)
    rest = None
    for weight, P in others:
        term = weight * P.square().sum(0)
        rest = term if rest is None else rest + term
    return conditional, rest


def variance_terms(kernel: gpytorch.kernels.Kernel, Xq: Tensor, factors: VarianceFactors) -> tuple[Tensor, ...]:
    """Per row of ``Xq`` (the factors' dtype): ``k(x, x)``, the conditional term and the sum of the others.

    The terms :func:`latent_variance` combines, unclamped, for :mod:`kgp.variance.calibration`.
    """
    work = factors.dtype
    kernel = working_kernel(kernel, work)
    q = Xq.shape[0]
    prior_all, conditional_all, rest_all = (torch.zeros(q, dtype=work, device=Xq.device) for _ in range(3))
    with torch.no_grad():
        for sl, prior, projections in _query_blocks(kernel, Xq, factors):
            conditional, rest = _terms(prior, projections)
            prior_all[sl], conditional_all[sl] = prior, conditional
            if rest is not None:
                rest_all[sl] = rest
    return prior_all, conditional_all, rest_all


def latent_variance(
    kernel: gpytorch.kernels.Kernel, Xq: Tensor, factors: VarianceFactors, *, calibration: float = 1.0
) -> Tensor:
    """Variance of the latent f at the rows of ``Xq`` (length ``q``, ``Xq``'s dtype), clamped at 0.

    ``k(x, x) + sum_i w_i ||L_i^{-1} k_x||^2`` in the factors' dtype, in query blocks under
    ``kgp.settings.memory_budget`` (see the module docstring); with ``calibration`` c below 1 the
    conditional term (i = 0) is scaled by :func:`kgp.variance.calibration.conditional_scale`.
    """
    out = torch.empty(Xq.shape[0], dtype=Xq.dtype, device=Xq.device)
    kernel = working_kernel(kernel, factors.dtype)
    with torch.no_grad():
        for sl, prior, projections in _query_blocks(kernel, Xq, factors):
            out[sl] = _variance_of(prior, projections, calibration)[0]
    return out


def latent_covariance(
    kernel: gpytorch.kernels.Kernel, Xq: Tensor, factors: VarianceFactors, *, calibration: float = 1.0
) -> Tensor:
    """Covariance of the latent f between the rows of ``Xq`` (``q x q``, the factors' dtype).

    ``K(Xq, Xq) + sum_i w_i P_i^T P_i`` (the module docstring), symmetrised, with the diagonal set to
    :func:`latent_variance`'s values (computed from the same projections). Dense in q. With
    ``calibration`` c below 1 the conditional part ``K(Xq, Xq) + w_0 P_0^T P_0`` is scaled to
    ``G^{1/2} (.) G^{1/2}`` (:mod:`kgp.variance.calibration`), which keeps it positive semi-definite.
    """
    work = factors.dtype
    kernel = working_kernel(kernel, work)
    q = Xq.shape[0]
    with torch.no_grad():
        Xw = Xq.to(work)
        cov = pair_kernel(kernel, Xw, Xw)
        var = torch.empty(q, dtype=work, device=Xq.device)
        blocks: list[list[Tensor]] = []
        weights: list[float] = []
        scale = torch.ones(q, dtype=work, device=Xq.device)
        for sl, prior, projections in _query_blocks(kernel, Xq, factors):
            var[sl], block_scale = _variance_of(prior, projections, calibration)
            if block_scale is not None:
                scale[sl] = block_scale.sqrt()
            weights = [w for w, _ in projections]
            blocks.append([P for _, P in projections])
        for i, weight in enumerate(weights):
            P = torch.cat([block[i] for block in blocks], dim=1)
            cov.addmm_(P.mT, P, alpha=weight)
            if i == 0 and calibration != 1.0:
                cov.mul_(scale.unsqueeze(0)).mul_(scale.unsqueeze(1))
        cov = 0.5 * (cov + cov.mT)
        cov.diagonal().copy_(var)
    return cov


def factor_entries(
    raw: Any, context: LoadContext, kind: str, factor_names: tuple[str, ...]
) -> tuple[Tensor, dict[str, Tensor], float]:
    """The checked entries of a stored ``posterior.variance.factors``: its points, its lower Cholesky factors
    named ``factor_names`` (square, one row and column per point) and its noise.

    Raises
    ------
    PosteriorStateError
        Naming the entry: another kind, points that are not inputs of the kernel, a factor of another shape
        or not lower triangular with a positive diagonal, a noise that is not a positive number.
    """
    check = context.check
    state = check.mapping(raw, "variance.factors")
    if state.get("kind") != kind:
        raise PosteriorStateError(
            f"posterior.variance.factors.kind: expected {kind!r} (the variance kind), got {state.get('kind')!r}"
        )
    points = check.points(state.get("points"), "variance.factors.points", cols=context.n_features)
    p = points.shape[0]
    factors = {}
    for name in factor_names:
        factors[name] = check.matrix(state.get(name), f"variance.factors.{name}", rows=p, cols=p)
        check_cholesky(factors[name], f"variance.factors.{name}")
    noise = check.positive_number(state.get("noise"), "variance.factors.noise")
    return points, factors, noise


_PANEL = 512
"""Columns per panel of :func:`check_cholesky`'s scan of the upper triangle."""


def check_cholesky(L: Tensor, where: str) -> None:
    """A lower Cholesky factor: lower triangular with a positive diagonal (a zero one would give NaN).

    Raises
    ------
    PosteriorStateError
        Naming ``posterior.<where>``.
    """
    if not bool((L.diagonal() > 0).all()):
        raise PosteriorStateError(f"posterior.{where}: expected a Cholesky factor with a positive diagonal")
    # the strict upper triangle, by panels of columns: no M x M temporary (1 GB at M = 11,241)
    for start in range(0, L.shape[1], _PANEL):
        panel = L[: start + _PANEL, start : start + _PANEL]
        if bool(torch.triu(panel, diagonal=1 - start).ne(0).any()):
            raise PosteriorStateError(f"posterior.{where}: expected a lower-triangular Cholesky factor")
