"""The Nystrom / DTC variance (solvers declaring ``Capabilities(target="nystrom")``, e.g. FALKON).

The DTC / SGPR predictive variance of the latent f on the M centers Z (Titsias 2009, eq. 6;
Quinonero-Candela & Rasmussen 2005, eq. 20b), with ``Q(x, x) = k_Mx^T K_MM^{-1} k_Mx``::

    var f(x) = k(x, x) - Q(x, x) + sigma^2 k_Mx^T (sigma^2 K_MM + K_Mn K_nM)^{-1} k_Mx

           = k(x, x) - ||L^{-1} k_Mx||^2 + sigma^2 ||L_s^{-1} k_Mx||^2,

with ``L L^T = K_MM`` and ``L_s L_s^T = sigma^2 K_MM + K_Mn K_nM``. Building the factors costs one streamed
pass over the training rows (``K_Mn K_nM`` accumulated in row blocks, O(n M^2)) and two M x M Cholesky
factorisations; after that a query row costs O(M^2).

Above ``m = max(GRAM_ROWS_PER_CENTER * M, GRAM_MIN_ROWS)`` rows, ``K_Mn K_nM`` is estimated from a uniform
random subset of m rows, ``(n / m) K_Mm K_mM``, an unbiased estimate whose cost, m M^2, does not grow
with n (the same device FALKON's preconditioner uses with the centers themselves, Rudi et al.
2017, Sec. 3). Only the last term of ``var f`` depends on it; ``k(x, x) - Q(x, x)`` stays exact. On a
draw from an ARD RBF prior (d = 8, 200,000 rows, sigma^2 = 0.01) the predictive std with noise moved by
at most 0.26% (M = 4,000, m = 10 M) and 0.39% (m = 5 M) against the full Gram, whose pass took 3-5x as
long; for a learned GP with M = 11,241 on 1e6 rows, m = 4 M left NLPD and coverage unchanged to 3-4 digits
(:data:`GRAM_ROWS_PER_CENTER`; docs/benchmarks/large-data.md). A distributed fit draws the same global row
numbers; each rank sums the ones it holds, and the all-reduced Gram is the one process's (up to the order of
the sums).

With many rows per center the conditional term ``k(x, x) - Q(x, x)`` overstates the fitted mean's error;
a learned GP scales it by a factor measured on its own residuals (:mod:`.calibration`), kept as
``calibration`` (1: the formula as above).

The factors of a float32 model are built and used in float64 (the inputs and the kernel are cast, the
result rounded back): the variance is the difference of two nearly equal quadratic forms, which float32
resolves to a few percent at best (docs/gp-workflow.md). The cost is the Gram pass at the float64 rate
and M^2 + M float64 numbers (both factors share one array, :class:`NystromFactors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import gpytorch
import torch
from torch import Tensor

from ..linalg import psd_cholesky_in_place
from ..operators import kernel_operator
from ..posterior_checks import PosteriorStateError, cpu_copy
from .base import (
    FactoredVariance,
    FitInputs,
    LoadContext,
    VarianceFactors,
    VarianceStrategy,
    factor_entries,
    variance_terms,
    working_kernel,
)
from .calibration import can_shrink, estimate_calibration, split_terms
from .none import NoVariance

__all__ = [
    "GRAM_MIN_ROWS",
    "GRAM_ROWS_PER_CENTER",
    "NystromFactors",
    "NystromVariance",
    "fold_factors",
    "gram_rows",
    "gram_subset",
    "nystrom_factors",
]

GRAM_ROWS_PER_CENTER = 4
"""Training rows per center above which ``K_Mn K_nM`` is estimated from a subset (module docstring).

Learned GPs at M = 11,241 (FALKON, the default recipe), the factors rebuilt from m uniform rows against the
default's 100,000 (docs/benchmarks/large-data.md, "How many rows the variance's Gram needs"): on the 1e6-row
synthetic set, m = 4 M moved the predictive std by 0.05% (median) and 0.85% (max) and left NLPD and coverage
at -0.4249 / 0.9638 against -0.4250 / 0.9637, in half the Gram pass's time; m = 2 M moved it by up to 4%
(NLPD -0.4245), m = M by up to 27% (NLPD -0.4172)."""
GRAM_MIN_ROWS = 20_000
"""Below this many rows the Gram is always summed over all of them: for few centers (M < 5,000) the floor
keeps the subset from getting small, at a pass of at most 2e4 M^2 multiply-adds (seconds at M = 5,000)."""


def gram_subset(n: int, n_centers: int) -> tuple[Tensor | None, float]:
    """The global row numbers the Gram ``K_Mn K_nM`` is summed over, and the factor ``n / m`` that scales it.

    ``None`` (all rows, factor 1) up to ``m = max(GRAM_ROWS_PER_CENTER * n_centers, GRAM_MIN_ROWS)`` rows;
    above, m row numbers drawn uniformly without replacement by a generator of fixed seed (the variance is
    a function of the data, the centers and the kernel only), in ascending order. A function of n and M
    only: one process and every rank of a distributed fit draw the same rows.
    """
    m = max(GRAM_ROWS_PER_CENTER * max(int(n_centers), 1), GRAM_MIN_ROWS)
    if n <= m:
        return None, 1.0
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))[:m].sort().values, n / m


def gram_rows(X: Tensor, n_centers: int, shard: Any = None) -> tuple[Tensor, float]:
    """The rows of ``X`` the Gram ``K_Mn K_nM`` is summed over (:func:`gram_subset`), and their scale ``n / m``.

    All of ``X`` (factor 1) up to m rows; above, the subset's rows, copied, so that ``X`` itself need not be
    kept. ``shard``: ``X`` is this rank's rows of a distributed fit: n is all ranks' rows, and the rows kept
    are those of the global subset this rank holds (their Gram, summed over the ranks, is the one process's).
    """
    n = X.shape[0] if shard is None else shard.n_total
    chosen, scale = gram_subset(n, n_centers)
    if chosen is None:
        return X, 1.0
    if shard is not None:
        chosen = shard.local_rows(chosen)[1]
    return X[chosen.to(X.device)], scale


@dataclass
class NystromFactors(VarianceFactors):
    """The two Cholesky factors of the DTC variance on ``points`` = Z, in one ``M x M`` array.

    With ``L L^T = K_MM`` and ``L_s L_s^T = noise K_MM + K_Mn K_nM``, written ``L_s = U diag(s)`` (U unit
    lower triangular, s = ``chol_s_diagonal``): ``triangles`` holds L on and below its diagonal and
    ``U^T``'s strict upper triangle above it. Each triangular solve reads only its own triangle, so one array
    serves both: ``L^{-1} k`` from the lower one, ``L_s^{-1} k = diag(s)^{-1} U^{-1} k`` from the upper one
    read as ``U`` (the transposed view, unit diagonal). Half of two square factors' memory, model file and
    checksum, at the cost of rounding U's entries once (a relative perturbation of one unit in the last place,
    the size of the factorisation's own).
    """

    kind: ClassVar[str] = "nystrom"
    points: Tensor
    triangles: Tensor
    chol_s_diagonal: Tensor
    noise: float

    @property
    def dtype(self) -> torch.dtype:
        return self.triangles.dtype

    def projections(self, kx: Tensor) -> list[tuple[float, Tensor]]:
        conditional = torch.linalg.solve_triangular(self.triangles, kx, upper=False)
        data = torch.linalg.solve_triangular(self.triangles.mT, kx, upper=False, unitriangular=True)
        return [(-1.0, conditional), (self.noise, data.div_(self.chol_s_diagonal.unsqueeze(1)))]

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "points": self.points,
            "triangles": self.triangles,
            "chol_s_diagonal": self.chol_s_diagonal,
            "noise": float(self.noise),
        }


_FOLD_COLUMNS = 512
"""Columns of ``L_s`` folded at a time by :func:`fold_factors`: a 512 x M temporary instead of an M x M one."""


def fold_factors(chol: Tensor, chol_s: Tensor) -> tuple[Tensor, Tensor]:
    """``(triangles, chol_s_diagonal)`` of :class:`NystromFactors` from two lower Cholesky factors.

    ``chol``'s strict upper triangle is overwritten (``chol`` becomes ``triangles``); ``chol_s`` is only read
    (its lower triangle) and may be dropped afterwards.
    """
    m = chol.shape[0]
    diagonal = chol_s.diagonal().clone()
    for start in range(0, m, _FOLD_COLUMNS):
        stop = min(start + _FOLD_COLUMNS, m)
        # rows start..stop of U^T, columns start..m: U[c, r] = L_s[c, r] / s_r for c > r
        block = (chol_s[start:, start:stop] / diagonal[start:stop]).mT
        upper = torch.ones_like(block, dtype=torch.bool).triu(diagonal=1)
        target = chol[start:stop, start:]
        target.copy_(torch.where(upper, block, target))
    return chol, diagonal


def nystrom_factors(
    kernel: gpytorch.kernels.Kernel,
    X: Tensor,
    Z: Tensor,
    noise: float,
    shard: Any = None,
    gram_scale: float = 1.0,
) -> NystromFactors:
    """Cholesky factors of ``K_MM`` and ``noise K_MM + gram_scale K_Mn K_nM`` (one streamed pass over X),
    float64 for float32, folded into one array (:class:`NystromFactors`).

    ``shard``: in a distributed fit, ``X`` is this rank's rows and ``K_Mn K_nM`` is summed over all
    ranks' rows (one all-reduce of ``M x M``); every rank then holds the same factors. ``gram_scale``:
    ``n / m`` when ``X`` is a subset of ``m`` of the ``n`` training rows (:func:`gram_rows`).

    Raises
    ------
    kgp.linalg.NotPSDError
        If a factor fails after up to 12 tenfold jitters.
    """
    if X.dtype == torch.float32:
        kernel, X, Z = working_kernel(kernel, torch.float64), X.double(), Z.double()
    with torch.no_grad():
        # two M x M arrays at most: the Gram, then K_MM, each factored over itself (the Gram pass's row
        # blocks come and go before K_MM is built)
        S = kernel_operator(kernel, X, Z, shard=shard).gram()
        if gram_scale != 1.0:
            S.mul_(gram_scale)
        kmm = kernel_operator(kernel, Z).to_dense()
        S.add_(kmm, alpha=noise)
        # up to 12 tenfold jitters, from eps to ~1e-5 of the mean diagonal: a learned GP with M = 11,241
        # (UCI keggdirected, float64) needed the sixth; a jitter that size moves the std only in
        # directions the centers cannot tell apart, which rounding already blurs. Each matrix is its upper
        # triangle (psd_cholesky_in_place), which makes K_MM, symmetric only to rounding, exactly so
        remedy = "use fewer or better-spread centers (n_centers) or a larger noise"
        L = psd_cholesky_in_place(kmm, max_tries=12, what="K_MM of the centers", remedy=remedy)
        L_s = psd_cholesky_in_place(S, max_tries=12, what="noise*K_MM + K_Mn K_nM", remedy=remedy)
        triangles, diagonal = fold_factors(L, L_s)
        del S, L_s  # the second square array goes: the factors hold one
    return NystromFactors(Z, triangles, diagonal, noise)


class NystromVariance(FactoredVariance):
    """The DTC variance on the centers (module docstring).

    Parameters
    ----------
    kernel:
        The fitted kernel.
    centers:
        The ``M x d`` centers Z.
    noise:
        sigma^2.
    train_X:
        The training rows the factors are built from (one pass), or None when the factors are given.
        :meth:`for_fit` passes a subset of a large fit's rows (:func:`gram_rows`).
    shard:
        In a distributed fit: ``train_X`` is this rank's rows and the build sums over all ranks. The
        all-ranks pass runs once, at fit; the rows are dropped after it.
    factors:
        The factors, when already computed (at fit, or stored in a model file).
    gram_scale:
        ``n / m`` when ``train_X`` holds ``m`` of the fit's ``n`` rows (:func:`gram_rows`), else 1.
    calibration:
        The factor c in ``[0, 1]`` on the conditional term (:mod:`.calibration`): 1 until :meth:`calibrate`
        measures it.
    """

    kind: ClassVar[str] = "nystrom"
    factors_class: ClassVar[type] = NystromFactors

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel,
        centers: Tensor,
        noise: float,
        *,
        train_X: Tensor | None = None,
        shard: Any = None,
        factors: NystromFactors | None = None,
        gram_scale: float = 1.0,
        calibration: float = 1.0,
    ):
        if not 0.0 <= calibration <= 1.0:
            raise ValueError(f"calibration: expected a factor in [0, 1], got {calibration!r}")
        self.calibration = float(calibration)
        self.kernel = kernel
        self.gram_scale = float(gram_scale)
        self.centers = centers
        self.noise = float(noise)
        self.train_X = train_X
        self.shard = shard
        self.factors = factors

    @classmethod
    def for_fit(cls, fit: FitInputs) -> VarianceStrategy:
        if fit.centers is None:
            return NoVariance(f"solver {fit.solver!r} declares a Nystrom target but the fit has no centers")
        if fit.shard is not None and not fit.learns:
            # this rank's rows alone would give a variance of the wrong data set, silently; the all-ranks
            # pass runs at fit, and only for a GP fit (learn=...)
            return NoVariance(
                f"after a distributed fit without learn (solver {fit.solver!r}): the Nystrom variance needs "
                "K_Mn K_nM summed over all ranks' rows, which a distributed fit computes only when it learns the "
                "GP (learn=..., e.g. learn='sgpr'); one process computes it on first use"
            )
        train_X, scale = fit.train_X, 1.0
        if train_X is not None:
            train_X, scale = gram_rows(train_X, fit.centers.shape[0], shard=fit.shard)
        return cls(fit.kernel, fit.centers, fit.noise, train_X=train_X, shard=fit.shard, gram_scale=scale)

    @property
    def factor_points(self) -> Tensor:
        return self.centers

    def build(self) -> None:
        if self.factors is not None:
            return
        if self.train_X is None:
            raise ValueError(
                "return_std=True: the Nystrom variance needs one pass over the training rows, which this "
                "posterior no longer holds"
            )
        try:
            self.factors = nystrom_factors(
                self.kernel, self.train_X, self.centers, self.noise, shard=self.shard, gram_scale=self.gram_scale
            )
        finally:
            if self.shard is not None:  # the collective pass runs on every rank at fit, never later on one
                self.train_X = self.shard = None

    def can_calibrate(self, n: int) -> bool:
        return can_shrink(n, self.centers.shape[0])

    def calibrate(self, X: Tensor, residual_square: Tensor, n: int, gather: Any = None) -> float:
        """Measure and keep the factor c on the conditional term (:mod:`.calibration`); returns it.

        ``X``: training rows; ``residual_square``: their residuals' mean square over the outputs, in the
        units the kernel works in; ``n``: all training rows. In a distributed fit ``X`` is this rank's part of
        the global draw and ``gather`` maps this rank's per-row table to the whole draw's (the same on every
        rank, so every rank keeps the same c). Builds the factors first.
        """
        self.build()
        if not can_shrink(n, self.centers.shape[0]):
            self.calibration = 1.0
            return self.calibration
        a, b = split_terms(*variance_terms(self.kernel, X, self.factors))
        values = torch.stack([residual_square.to(a), a, b], dim=1)
        if gather is not None:
            values = gather(values)
        self.calibration = estimate_calibration(*values.unbind(1), self.noise, n, self.centers.shape[0])
        return self.calibration

    def build_cost(self) -> tuple[float, int] | None:
        if self.factors is not None:
            return (0.0, 0)
        if self.train_X is None:
            return None
        n, m = self.train_X.shape[0], self.centers.shape[0]
        # the Gram pass K_Mn K_nM and two M x M factors (their peak: the Gram and K_MM), float64 (module docstring)
        return (n * m * m + m**3, 16 * m * m)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kind": self.kind, "centers": cpu_copy(self.centers)}
        if self.calibration != 1.0:
            state["calibration"] = self.calibration
        # Built factors are kept whatever their size (M^2 + M float64 numbers): a loaded model then serves its
        # std at O(M^2) a row without the m M^2 Gram pass (minutes at M = 10,000). Unbuilt ones (a fit that
        # never asked for a std) are stored as the rows they would be built from, at most
        # max(GRAM_ROWS_PER_CENTER M, GRAM_MIN_ROWS) of them.
        if self.factors is not None:
            state["factors"] = self.factors.to_cpu()
        elif self.train_X is not None:
            state["train_X"] = cpu_copy(self.train_X)
            if self.gram_scale != 1.0:
                state["gram_scale"] = self.gram_scale
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any], context: LoadContext) -> VarianceStrategy:
        check = context.check
        centers = check.points(state.get("centers"), "variance.centers", cols=context.n_features)
        centers = centers.to(device=context.device, dtype=context.dtype)
        factors = train_X = None
        if "factors" in state:
            factors = _factors_from_state(state["factors"], context)
            if factors.points.shape != centers.shape or not torch.equal(factors.points.to(centers), centers):
                raise PosteriorStateError(
                    f"posterior.variance.factors.points: expected the {centers.shape[0]} centers of "
                    "posterior.variance.centers (the factors are built on them), got other rows"
                )
        gram_scale = 1.0
        if "factors" not in state and "train_X" in state:
            train_X = check.points(state["train_X"], "variance.train_X", cols=context.n_features)
            train_X = train_X.to(context.device, context.dtype)
            if "gram_scale" in state:
                gram_scale = check.positive_number(state["gram_scale"], "variance.gram_scale")
                if gram_scale < 1.0:
                    raise PosteriorStateError(
                        f"posterior.variance.gram_scale: expected n / m >= 1 (the training rows per stored row), "
                        f"got {gram_scale!r}"
                    )
        calibration = 1.0
        if "calibration" in state:
            calibration = state["calibration"]
            if isinstance(calibration, bool) or not isinstance(calibration, (int, float)) or not 0 <= calibration <= 1:
                raise PosteriorStateError(
                    f"posterior.variance.calibration: expected a factor in [0, 1] (kgp.variance.calibration), "
                    f"got {calibration!r}"
                )
        return cls(
            context.kernel,
            centers,
            context.noise,
            train_X=train_X,
            factors=factors,
            gram_scale=gram_scale,
            calibration=float(calibration),
        )

    @classmethod
    def legacy_state(cls, factors: Mapping[str, Any] | None, predictor_centers: Any) -> dict[str, Any]:
        state = super().legacy_state(factors, predictor_centers)
        state["centers"] = factors.get("points") if factors is not None else predictor_centers
        return state


def _factors_from_state(raw: Any, context: LoadContext) -> NystromFactors:
    """The checked factors of a model file: ``triangles`` and ``chol_s_diagonal`` (:class:`NystromFactors`),
    or the two square factors ``chol`` and ``chol_s`` that files of format version 3 and before hold (folded
    on loading)."""
    check = context.check
    state = check.mapping(raw, "variance.factors")
    if "triangles" not in state:
        points, squares, noise = factor_entries(raw, context, NystromFactors.kind, ("chol", "chol_s"))
        triangles, diagonal = fold_factors(squares["chol"].clone(), squares["chol_s"])
    else:
        points, arrays, noise = factor_entries(raw, context, NystromFactors.kind, ())
        p = points.shape[0]
        triangles = check.matrix(state.get("triangles"), "variance.factors.triangles", rows=p, cols=p)
        if not bool((triangles.diagonal() > 0).all()):
            raise PosteriorStateError(
                "posterior.variance.factors.triangles: expected the Cholesky factor of K_MM on and below the "
                "diagonal, with a positive diagonal"
            )
        diagonal = check.vector(state.get("chol_s_diagonal"), "variance.factors.chol_s_diagonal", (p,))
        if not bool((diagonal > 0).all()):
            raise PosteriorStateError(
                "posterior.variance.factors.chol_s_diagonal: expected the positive diagonal of a Cholesky factor"
            )
        if diagonal.dtype != triangles.dtype:
            raise PosteriorStateError(
                f"posterior.variance.factors.chol_s_diagonal: expected the dtype of factors.triangles "
                f"({triangles.dtype}), got {diagonal.dtype}"
            )
    # the factors were built with the posterior's noise: a file where the two differ was edited
    if not math.isclose(noise, context.noise, rel_tol=1e-12):
        raise PosteriorStateError(
            f"posterior.variance.factors.noise: expected the posterior's noise {context.noise!r} (the factors "
            f"are built with it), got {noise!r}"
        )
    # a float32 model's factors are float64 (module docstring): keep what the file holds if it is wider
    work = torch.float64 if triangles.dtype == torch.float64 else context.dtype
    to = {"device": context.device, "dtype": work}
    return NystromFactors(points.to(**to), triangles.to(**to), diagonal.to(**to), noise)
