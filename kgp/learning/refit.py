"""Re-estimate the outputscale and the noise on a subset after learning (``learn_options['refit_subset']``).

Why: an inducing-point bound explains the part of the data its M centers cannot represent as noise
(the trace term of Titsias 2009, eq. 9; Bauer, van der Wilk & Rasmussen 2016), so ``sgpr`` with few
centers learns a noise variance many times too large, and a solver with many more centers then
over-smooths (docs/benchmarks/gp-hyperparameters.md). With the lengthscales held at the learned values, the
exact log marginal likelihood (Rasmussen & Williams 2006, eq. 2.30) of ``s`` random rows, as a
function of the outputscale ``c`` and the noise ``sigma^2`` only, is cheap after one eigendecomposition
``K0 = U diag(lam) U^T`` of the unscaled ``s x s`` kernel matrix::

    -log p(y) = 1/2 sum_i [ log(c lam_i + sigma^2) + r_i^2 / (c lam_i + sigma^2) ] + s/2 log(2 pi),

with ``r = U^T (y - mean)``. Writing ``sigma^2 = c tau``, the optimal ``c`` for a given ``tau`` is
``sum_i r_i^2 / (lam_i + tau) / s`` (zero derivative in c), so a one-dimensional search over
``log tau`` finds the joint optimum. O(s^3) once, O(s) per trial value.

The one-dimensional search (:func:`_minimise`) is the best of a coarse grid of 25 values, refined by
``scipy.optimize.minimize_scalar(method="bounded")`` (Brent's method) between the grid's neighbours of
that point. Measured (2,000 rows of pol and elevators, 6,000-row z-scored samples, after ``sgpr`` with
M = 100 and 30 Adam steps; each of the three searches: outputscale and noise, outputscale at a fixed
noise, noise alone), against the earlier grid of 241 values refined by 80 golden-section steps and a
reference of a 20,001-value grid so refined: the same minimum value on every search (both within
3.3e-16 of the reference, per point: rounding), the outputscale and noise within 6.2e-8 of the
reference's (3.2e-8 before), where the objective moves by less than its rounding (Brent stops at
sqrt(eps) |x|, as any search of a smooth minimum must); 35-40 evaluations instead of 323. The grid is
insurance against a second local minimum: the profiled objective had one on pol, elevators, bike,
kin40k and protein (M = 20 and 100; 4,001-value scans), where Brent alone found it in 11-20 evaluations.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import gpytorch
import torch
from scipy.optimize import minimize_scalar
from torch import Tensor

from ..operators import kernel_operator
from ..variance import check_dense_size

__all__ = ["RefitResult", "refit_scale_and_noise"]

_GRID = 25  # trial values of the searched log variable, then Brent's method between a point's neighbours


@dataclass
class RefitResult:
    """What the refit changed (before / after), kept as the model's ``learn_refit_``."""

    rows: int
    outputscale: tuple[float, float] | None
    noise: tuple[float, float]
    nll_per_point: tuple[float, float]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _scale_kernel(kernel: gpytorch.kernels.Kernel) -> gpytorch.kernels.ScaleKernel | None:
    if isinstance(kernel, gpytorch.kernels.ScaleKernel) and kernel.raw_outputscale.requires_grad:
        return kernel
    return None


def refit_scale_and_noise(
    X: Tensor,
    Y: Tensor,
    kernel: gpytorch.kernels.Kernel,
    *,
    noise: float,
    mean: Tensor,
    rows: int,
    min_noise: float,
    learn_noise: bool,
    generator: torch.Generator,
) -> tuple[float, RefitResult]:
    """Maximise the exact marginal likelihood of ``rows`` random rows over outputscale and noise.

    Parameters
    ----------
    X, Y:
        ``n x d`` inputs and ``n x k`` targets (the k columns share the hyperparameters).
    kernel:
        The learned kernel; its outputscale (a trainable ``ScaleKernel`` at the top) is set in place.
        Every other hyperparameter is held fixed.
    noise, mean:
        The learned noise variance and constant mean (the mean is kept).
    rows:
        Size of the random subset (all rows if ``rows >= n``).
    min_noise:
        Lower bound of the noise (the loop's ``min_noise``); an optimum below it is moved onto it
        with a warning.
    learn_noise:
        False keeps ``noise`` and re-estimates the outputscale alone.
    generator:
        Draws the subset.

    Returns
    -------
    (noise, RefitResult)

    Raises
    ------
    ValueError
        Nothing to re-estimate: no trainable ``ScaleKernel`` at the top and ``learn_noise=False``.
    """
    scaled = _scale_kernel(kernel)
    if scaled is None and not learn_noise:
        raise ValueError(
            "learn_options['refit_subset'] re-estimates the outputscale and the noise, but the kernel has no "
            "trainable ScaleKernel at the top and learn_noise=False: nothing to re-estimate; drop refit_subset"
        )
    n = X.shape[0]
    size = min(rows, n)
    check_dense_size(size, X.element_size(), f"learn_options['refit_subset']={rows}", X.device)
    idx = torch.randperm(n, generator=generator)[:size].to(X.device)
    spectrum = _Spectrum.of(scaled.base_kernel if scaled is not None else kernel, X[idx], Y[idx] - mean)
    c0 = float(scaled.outputscale.detach()) if scaled is not None else 1.0
    before = spectrum.nll(c0, noise)
    c1, s1 = spectrum.optimum(c0, noise, min_noise, has_scale=scaled is not None, learn_noise=learn_noise)
    after = spectrum.nll(c1, s1)
    if not after <= before:  # never worse than the learned values on the same rows
        c1, s1, after = c0, noise, before
    if scaled is not None:
        raw = scaled.raw_outputscale
        # a Python float would pass through float32 in GPyTorch's setter (7 digits lost)
        scaled.outputscale = torch.tensor(c1, dtype=raw.dtype, device=raw.device)
    result = RefitResult(
        rows=size,
        outputscale=(c0, c1) if scaled is not None else None,
        noise=(float(noise), float(s1)),
        nll_per_point=(before, after),
    )
    return float(s1), result


@dataclass
class _Spectrum:
    """The subset's likelihood as a function of the outputscale c and the noise s2 (module docstring).

    ``lam``: eigenvalues of the unscaled ``s x s`` kernel matrix; ``r2``: squared projections of the
    centred targets on its eigenvectors, summed over the k outputs.
    """

    lam: Tensor
    r2: Tensor
    k: int

    @classmethod
    def of(cls, base: gpytorch.kernels.Kernel, X: Tensor, R: Tensor) -> _Spectrum:
        with torch.no_grad():
            K0 = kernel_operator(base, X).to_dense()
            lam, U = torch.linalg.eigh(0.5 * (K0 + K0.mT))
            lam = lam.clamp_min(0.0).double()
            r2 = (U.mT @ R).double().square().sum(1)
        return cls(lam, r2, R.shape[1])

    @property
    def count(self) -> int:
        return self.lam.shape[0] * self.k

    def nll(self, c: float, s2: float) -> float:
        """Negative log likelihood per (row, output) term, without the constant."""
        d = c * self.lam + s2
        return float(0.5 * (self.k * torch.log(d).sum() + (self.r2 / d).sum())) / self.count

    def scale_for(self, s2: float, c0: float) -> float:
        """The best outputscale at a fixed noise (searched over ``c0 e^{+-30}``)."""
        return math.exp(_minimise(lambda lc: self.nll(math.exp(lc), s2), math.log(c0) - 30, math.log(c0) + 30))

    def optimum(self, c0: float, noise: float, min_noise: float, *, has_scale: bool, learn_noise: bool):
        """``(c, s2)`` minimising :meth:`nll`: both (profiled over ``tau = s2 / c``), c alone, or s2 alone."""
        lam, r2 = self.lam, self.r2
        c1, s1 = c0, noise
        if has_scale and learn_noise:
            top = float(lam.max()) if float(lam.max()) > 0 else 1.0

            def best_scale(tau: float) -> float:
                return float((r2 / (lam + tau)).sum()) / self.count

            def profiled(log_tau: float) -> float:
                tau = math.exp(log_tau)
                c = best_scale(tau)
                return self.nll(c, c * tau) if c > 0 else math.inf

            tau = math.exp(_minimise(profiled, math.log(top * 1e-12), math.log(top * 1e6)))
            c1 = best_scale(tau)
            s1 = c1 * tau
            if s1 < min_noise:
                s1 = min_noise
                c1 = self.scale_for(s1, c0)
                _warn_bound(min_noise)
        elif has_scale:  # the noise is fixed by the user
            c1 = self.scale_for(noise, c0)
        else:
            top = max(float(lam.max()), min_noise)
            s1 = math.exp(_minimise(lambda ls: self.nll(1.0, math.exp(ls)), math.log(min_noise), math.log(top * 1e6)))
            if s1 <= min_noise * (1 + 1e-6):
                _warn_bound(min_noise)
        return c1, s1


def _minimise(f: Callable[[float], float], lo: float, hi: float) -> float:
    """Minimum of ``f`` on ``[lo, hi]``: the best of a uniform grid, refined by Brent's method around it."""
    step = (hi - lo) / (_GRID - 1)
    grid = [lo + i * step for i in range(_GRID)]
    values = [f(x) for x in grid]
    i = min(range(_GRID), key=values.__getitem__)
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, _GRID - 1)]
    # xatol below the method's own relative floor (sqrt(eps) |x|): the minimum is located as well as the
    # rounding of f allows; the grid point is kept when the refinement is no better (an optimum on a bound)
    found = minimize_scalar(f, bounds=(a, b), method="bounded", options={"xatol": 1e-10, "maxiter": 500})
    return float(found.x) if found.fun <= values[i] else grid[i]


def _warn_bound(min_noise: float) -> None:
    warnings.warn(
        f"learn_options['refit_subset']: the subset's likelihood is largest at a noise variance below "
        f"min_noise={min_noise:g}; the noise was set to min_noise (lower learn_options['min_noise'] to allow less)",
        UserWarning,
        stacklevel=4,
    )
