"""A factor on the Nystrom variance's conditional term, measured on the fit's own residuals.

The DTC variance (:mod:`.nystrom`) is the sum of two terms,

    var f(x) = d(x) + t(x),    d(x) = k(x, x) - Q(x, x),    t(x) = sigma^2 k_Mx^T (sigma^2 K_MM + K_Mn K_nM)^{-1} k_Mx.

``d`` is the prior variance of f given its values at the centers: the error of the *conditional* mean
``E[f(x) | f(Z)]``. With many rows per center the fitted mean is instead close to the least-squares
projection of f onto the centers' span over the data, whose error is smaller; ``t`` (the weights'
uncertainty) then vanishes as sigma^2 / n. So at ``n >> M`` the variance overstates the error: a learned
GP at 1e7 rows with 11,241 centers covered 0.963 of test rows with its 95 % interval, standardised
residuals of mean square 0.86 (docs/benchmarks/large-data.md). Far from the data ``Q -> 0`` and
``d -> k(x, x)`` is exact (the mean falls back to the prior's), so one factor on ``d`` everywhere would make
the std there too small. The scaled term is therefore

    d_c(x) = g(x) d(x),    g(x) = c + (1 - c) rho(x),    rho(x) = d(x) / k(x, x) in [0, 1]:

``c`` where the centers represent f well (``rho`` near 0, the rows the factor is measured on), 1 where they
represent nothing (``rho = 1``). The covariance scales as ``G^{1/2} D G^{1/2}`` (``G = diag(g)``), positive
semi-definite with the same diagonal.

``c`` is chosen so that the standardised residuals of ``CALIBRATION_ROWS`` training rows, drawn uniformly by
a fixed seed, have mean square one:

    mean_i r_i^2 / (sigma^2 + c a_i + b_i)  =  1 - 2 M / n - Z_SE * se,    a = d - rho d,  b = rho d + t,

solved for c in ``[0, 1]`` (the left side falls as c grows; bisection). Matching the mean square of the
residuals themselves instead (``mean r^2 = mean variance``) weighs the few rows with the largest errors and
variances most: on a d = 3 prior draw (40,000 rows, M = 300) it asked for c = 0.41 where the test rows'
standardised residuals already had mean square 1.01 at c = 1, and the 95 % coverage fell from 0.946 to
0.937. The in-sample residuals are optimistic: for a linear smoother with ``df`` degrees of freedom the
noise's share of the mean square is low by ``2 df / n`` (Mallows' C_p), and the Nystrom smoother's ``df``,
the trace of a hat matrix of rank at most M, is at most M; ``se`` is the standard error of the mean square
of the standardised residuals. Both lower the target and so raise c: the factor never claims less error than
the residuals show. The factor only shrinks (``c <= 1``): where the residuals exceed the variance, the DTC's
own value stands, and with few rows per center the bound alone keeps ``c = 1``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "CALIBRATION_ROWS",
    "CALIBRATION_SEED",
    "Z_SE",
    "calibration_subset",
    "can_shrink",
    "conditional_scale",
    "estimate_calibration",
    "split_terms",
]

CALIBRATION_ROWS = 5_000
"""Training rows the factor is measured on: O(CALIBRATION_ROWS M^2) flops, the std's cost for as many rows
(about 12 s at M = 11,241 on a 2-core CPU, a twentieth of the fit it belongs to). Its standard error is
about 0.02 on a mean square of one."""
CALIBRATION_SEED = 1
"""Seed of the row draw (the Gram subset of :mod:`.nystrom` uses 0): a function of n only."""
Z_SE = 2.0
"""Standard errors of the standardised residuals' mean square taken off the target (module docstring)."""


def calibration_subset(n: int) -> Tensor:
    """The global row numbers the factor is measured on, ascending: all n up to ``CALIBRATION_ROWS``, else that
    many drawn uniformly without replacement by a generator of fixed seed. A function of n only: every rank of
    a distributed fit draws the same numbers and takes those it holds."""
    if n <= CALIBRATION_ROWS:
        return torch.arange(n)
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randperm(n, generator=generator)[:CALIBRATION_ROWS].sort().values


def can_shrink(n: int, n_centers: int) -> bool:
    """Whether residuals could ask for ``c < 1`` at all: not where the optimism bound ``2 M / n`` alone puts the
    target at or below 0 (``n <= 2 M``), so that such fits skip the measurement."""
    return n > 2 * n_centers


def conditional_scale(prior: Tensor, conditional: Tensor, calibration: float) -> Tensor:
    """``g = c + (1 - c) rho`` per row, ``rho = d / k(x, x)`` clamped to ``[0, 1]`` (module docstring).

    ``prior``: ``k(x, x)``; ``conditional``: ``d(x) = k(x, x) - Q(x, x)`` as computed (rounding may leave it
    slightly negative). Rows whose prior is not positive keep ``g = 1``.
    """
    rho = torch.where(prior > 0, conditional.clamp_min(0) / prior.clamp_min(torch.finfo(prior.dtype).tiny), 1.0)
    return calibration + (1.0 - calibration) * rho.clamp(0.0, 1.0)


def split_terms(prior: Tensor, conditional: Tensor, rest: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: ``a = d - rho d``, the part of the latent variance c multiplies, and ``b = rho d + t``, the rest."""
    d = conditional.clamp_min(0)
    rho_d = d * conditional_scale(prior, conditional, 0.0)
    return d - rho_d, rho_d + rest.clamp_min(0)


def _mean_square_z(residual_square: Tensor, noise: float, a: Tensor, b: Tensor, c: float) -> float:
    return float((residual_square / (noise + c * a + b)).mean())


def estimate_calibration(residual_square: Tensor, a: Tensor, b: Tensor, noise: float, n: int, n_centers: int) -> float:
    """The factor c (module docstring) in ``[0, 1]``.

    Parameters
    ----------
    residual_square:
        Per measured row, the residuals' mean square over the outputs (float64, the units of ``noise``).
    a, b:
        Per row, the latent variance's part c multiplies and the rest (:func:`split_terms`).
    noise:
        sigma^2.
    n, n_centers:
        The fit's training rows and centers M.
    """
    m = residual_square.numel()
    if m < 2 or not can_shrink(n, n_centers):
        return 1.0
    z2 = residual_square / (noise + a + b)
    standard_error = float(z2.std()) / math.sqrt(m)
    target = 1.0 - 2.0 * n_centers / n - Z_SE * standard_error
    if not float(z2.mean()) < target:
        return 1.0  # the variance as it is does not overstate the errors
    low, high = 0.0, 1.0
    if _mean_square_z(residual_square, noise, a, b, low) <= target:
        return 0.0
    for _ in range(_BISECTIONS):
        middle = 0.5 * (low + high)
        if _mean_square_z(residual_square, noise, a, b, middle) > target:
            low = middle
        else:
            high = middle
    return high


_BISECTIONS = 30
"""Bisection steps of :func:`estimate_calibration`: c to 1e-9, far below its standard error."""
