"""The exact GP variance (solvers declaring ``Capabilities(target="exact")``).

Rasmussen & Williams (2006), Algorithm 2.1, lines 5-6: with ``L`` the lower Cholesky factor of
``K(X, X) + sigma^2 I`` over the training rows X,

    var f(x) = k(x, x) - ||L^{-1} k_x||^2,        k_x = K(X, x).

The factor is the exact solver's own (handed on with :class:`kgp.plugin.Solution`), or built on the
first variance asked for; it is ``n x n`` and therefore bounded by ``kgp.settings.max_exact_size`` and
``memory_budget``. A model file never stores it: the training rows it is built from are the predictor's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import gpytorch
import torch
from torch import Tensor

from ..linalg import cholesky_in_place
from ..operators import kernel_operator
from ..posterior_checks import PosteriorStateError
from .base import (
    FactoredVariance,
    FitInputs,
    LoadContext,
    VarianceFactors,
    VarianceStrategy,
    check_dense_size,
    factor_entries,
)
from .none import NoVariance

__all__ = ["ExactFactors", "ExactVariance", "exact_factors"]


@dataclass
class ExactFactors(VarianceFactors):
    """The lower Cholesky factor ``chol`` of ``K(points, points) + noise I`` over the training rows ``points``."""

    kind: ClassVar[str] = "exact"
    points: Tensor
    chol: Tensor
    noise: float

    @property
    def dtype(self) -> torch.dtype:
        return self.chol.dtype

    def projections(self, kx: Tensor) -> list[tuple[float, Tensor]]:
        return [(-1.0, torch.linalg.solve_triangular(self.chol, kx, upper=False))]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "points": self.points, "chol": self.chol, "noise": float(self.noise)}


def exact_factors(kernel: gpytorch.kernels.Kernel, X: Tensor, noise: float) -> ExactFactors:
    """Cholesky factor of ``K(X, X) + noise I``, formed over the kernel matrix (one ``n x n`` array at the peak).

    Raises
    ------
    ValueError
        If the dense ``n x n`` matrix exceeds ``kgp.settings.max_exact_size`` or ``memory_budget``.
    kgp.linalg.NotPSDError
        If the matrix is not numerically positive definite.
    """
    check_dense_size(X.shape[0], X.element_size(), "return_std=True on an exact model", X.device)
    with torch.no_grad():
        K = kernel_operator(kernel, X).to_dense()
        K.diagonal().add_(noise)
        L = cholesky_in_place(K, what=f"K + noise*I with noise={noise:g}", remedy="use float64")
    return ExactFactors(X, L, noise)


class ExactVariance(FactoredVariance):
    """The exact GP variance over the training rows ``points`` (the exact predictor's centers).

    Parameters
    ----------
    kernel:
        The fitted kernel.
    points:
        The ``n x d`` training rows.
    noise:
        sigma^2.
    factors:
        The factor, when already computed (by the solver, or stored in an old model file).
    """

    kind: ClassVar[str] = "exact"
    factors_class: ClassVar[type] = ExactFactors

    def __init__(
        self, kernel: gpytorch.kernels.Kernel, points: Tensor, noise: float, factors: ExactFactors | None = None
    ):
        self.kernel = kernel
        self.points = points
        self.noise = float(noise)
        self.factors = factors

    @classmethod
    def for_fit(cls, fit: FitInputs) -> VarianceStrategy:
        # the exact solution is a kernel expansion over the training rows: its centers are them
        points = getattr(fit.predictor, "centers", None)
        if points is None:
            return NoVariance(
                f"solver {fit.solver!r} declares the exact target but its predictor "
                f"({type(fit.predictor).__name__}) does not expose the training rows (centers) the exact "
                "variance is computed on"
            )
        return cls(fit.kernel, points, fit.noise)

    @property
    def factor_points(self) -> Tensor:
        return self.points

    def build(self) -> None:
        if self.factors is None:
            self.factors = exact_factors(self.kernel, self.points, self.noise)

    def build_cost(self) -> tuple[float, int] | None:
        if self.factors is not None:
            return (0.0, 0)
        n = self.points.shape[0]
        return (n**3 / 3, n * n * self.points.element_size())  # the Cholesky factor of the n x n matrix

    def state_dict(self) -> dict[str, Any]:
        # the n x n factor is never stored: the rows it is rebuilt from are the predictor's
        return {"kind": self.kind}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], context: LoadContext) -> VarianceStrategy:
        points = getattr(context.predictor, "centers", None)
        if points is None:
            raise PosteriorStateError(
                f"posterior.variance.kind: {cls.kind!r} needs a predictor over the training rows (with centers); "
                f"predictor kind {context.predictor_kind!r} has none"
            )
        factors = None
        if "factors" in state:  # files written before the Posterior could hold the factor
            factors = _factors_from_state(state["factors"], context)
        return cls(context.kernel, points, context.noise, factors)


def _factors_from_state(raw: Any, context: LoadContext) -> ExactFactors:
    points, factors, noise = factor_entries(raw, context, ExactFactors.kind, ("chol",))
    to = {"device": context.device, "dtype": context.dtype}
    return ExactFactors(points.to(**to), factors["chol"].to(**to), noise)
