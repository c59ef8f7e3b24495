"""A numerical floor on the lengthscales while they are learned.

The kernel backend computes squared distances in the expanded form ``|u|^2 + |v|^2 - 2 u.v`` with
``u = x / lengthscale`` (one GEMM; docs/backend.md). Its absolute rounding error is about
``eps |u|^2``, so once a lengthscale falls far below the size of its feature's values the kernel
matrix the objective sees is no longer positive semi-definite. Measured: the ``holdout`` objective on
UCI pol drove one lengthscale to 0 within 50 L-BFGS evaluations, where K_ZZ had an eigenvalue of
-0.65 (of 125) and the fit stopped with NotPSDError (docs/benchmarks/gp-hyperparameters.md, section 8.3).

While learning, every lengthscale gets the GPyTorch constraint ``GreaterThan(floor)`` (softplus, as
GPyTorch's default ``Positive``), per input dimension for ARD kernels, with

    floor_j = max_i |x_ij| * sqrt(eps / DISTANCE_TOLERANCE)

so that ``eps |u|^2`` stays below ``DISTANCE_TOLERANCE`` per dimension: 4.7e-7 max|x_j| in
float64, 1.1e-2 max|x_j| in float32. The kernel's own constraint is put back afterwards (the
learned kernel is the user's kernel type with its own constraints); a lengthscale that ended on its
floor is reported with a warning, never silently.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import gpytorch
import torch
from torch import Tensor

from ..diagnostics import ConvergenceWarning

__all__ = ["DISTANCE_TOLERANCE", "LengthscaleFloors"]

DISTANCE_TOLERANCE = 1e-3
"""Largest rounding error tolerated in one dimension's scaled squared distance while learning."""


@dataclass
class _Bounded:
    module: gpytorch.Module
    original: gpytorch.constraints.Interval
    floor: Tensor


class LengthscaleFloors:
    """Put ``GreaterThan(floor)`` on every lengthscale of ``kernel`` while it is learned.

    Parameters
    ----------
    kernel:
        GPyTorch kernel (composites included); modules with a ``raw_lengthscale`` under a
        lower-bounded constraint without upper bound (GPyTorch's default ``Positive``) are bounded.
    feature_scale:
        ``max_i |x_ij|`` per input column over all rows (all ranks' rows when distributed).
    min_lengthscale:
        None: the numerical floor of the module docstring; a number >= 0: that floor for every
        dimension (0: no floor).
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, feature_scale: Tensor, min_lengthscale: float | None):
        self._bounded: list[_Bounded] = []
        for module in kernel.modules():
            if "raw_lengthscale" not in getattr(module, "_parameters", {}):
                continue
            original = getattr(module, "raw_lengthscale_constraint", None)
            if not isinstance(original, gpytorch.constraints.Interval) or bool(
                torch.isfinite(original.upper_bound).any()
            ):
                continue  # a user's own interval: theirs to choose
            floor = self._floor(module, feature_scale, min_lengthscale)
            if floor is None or bool((floor <= original.lower_bound.to(floor)).all()):
                continue
            self._bounded.append(_Bounded(module, original, floor))

    @staticmethod
    def _floor(module: gpytorch.Module, feature_scale: Tensor, min_lengthscale: float | None) -> Tensor | None:
        raw = module.raw_lengthscale
        if min_lengthscale is not None:
            return None if min_lengthscale == 0 else torch.full_like(raw.detach(), float(min_lengthscale))
        scale = feature_scale.to(raw)
        dims = getattr(module, "active_dims", None)
        if dims is not None:
            scale = scale[dims]
        factor = math.sqrt(torch.finfo(raw.dtype).eps / DISTANCE_TOLERANCE)
        width = raw.shape[-1]
        if width == scale.numel():
            per_dim = scale
        else:  # one lengthscale for all dimensions: bound by the largest scaled row norm
            per_dim = scale.square().sum().sqrt().expand(width)
        return (factor * per_dim).expand_as(raw.detach()).clone()

    def __enter__(self) -> LengthscaleFloors:
        for b in self._bounded:
            value = b.module.lengthscale.detach().clone()
            low = value <= b.floor
            if bool(low.any()):
                warnings.warn(
                    f"learn: initial lengthscale {_fmt(value[low])} of {type(b.module).__name__} is at or below the "
                    f"numerical floor {_fmt(b.floor[low])} (learn_options['min_lengthscale']); starting from twice "
                    "the floor instead",
                    ConvergenceWarning,
                    stacklevel=3,
                )
                value = torch.where(low, 2 * b.floor, value)
            bound = gpytorch.constraints.GreaterThan(b.floor).to(device=b.floor.device, dtype=b.floor.dtype)
            b.module.register_constraint("raw_lengthscale", bound)
            b.module.lengthscale = value
        return self

    def __exit__(self, *exc) -> None:
        for b in self._bounded:
            value = b.module.lengthscale.detach().clone()
            b.module.register_constraint("raw_lengthscale", b.original)
            b.module.lengthscale = value
            if exc[0] is None:
                at_floor = value <= b.floor * 1.01
                if bool(at_floor.any()):
                    warnings.warn(
                        f"learn: lengthscale {_fmt(value[at_floor])} of {type(b.module).__name__} ended on its "
                        f"numerical floor {_fmt(b.floor[at_floor])}: the objective prefers a smaller value, which "
                        "the kernel's distance computation cannot resolve (the feature acts as an exact-match "
                        "indicator). Remedy: check that feature (a categorical or rounded column), standardize X, "
                        "or set learn_options['min_lengthscale']",
                        ConvergenceWarning,
                        stacklevel=3,
                    )


def _fmt(t: Tensor) -> str:
    values = t.reshape(-1).tolist()
    return ", ".join(f"{v:.3g}" for v in values[:5]) + (", ..." if len(values) > 5 else "")
