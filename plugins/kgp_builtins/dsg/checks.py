"""Checks that keep ``dsg`` from returning a wrong answer silently.

- :func:`scaled_inputs_checked`: the phases ``omega^T (x - c)`` of the random features must carry
  some precision, else every feature is rounding noise (inputs scaled by 1e30 with a unit
  lengthscale would give predictions of 1e5 for targets of size 3).
- :class:`LossTrace`: the training loss after every report, a :class:`kgp.DivergenceError` when it
  becomes non-finite or grows, and a :class:`kgp.ConvergenceWarning` when the run ends while the
  loss is still falling fast (criterion and its measurements in docs/solvers/dsg.md).
- :func:`isolated_fraction` and :func:`warn_if_noisy_off_data`: a :class:`kgp.ConvergenceWarning`
  when the random-feature noise the model carries would dominate its predictions at new points,
  which happens when the training points are isolated at the kernel's lengthscale (rounded or
  discrete features, small lengthscales). The training fit is converged there, so the
  loss checks cannot see it.

Messages go through :func:`kgp.diagnostics.diverged` / :func:`kgp.diagnostics.warn_not_converged`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kgp.diagnostics import diverged, warn_not_converged

from .features import RandomFeatureMap
from .spectra import SpectralSampler

__all__ = [
    "CONVERGENCE_TOL",
    "MOVE_TOL",
    "OFF_DATA_TOL",
    "PHASE_TOL",
    "LossTrace",
    "isolated_fraction",
    "off_data_noise",
    "scaled_inputs_checked",
    "warn_if_noisy_off_data",
]

_SOLVER = "dsg"

# Largest accepted rounding error of a typical phase omega^T u, in radians. Beyond ~0.1 rad the
# cosines of train and predict time (different blockings, so different roundings) disagree and
# the kernel estimate is noise. float64: inputs spanning up to ~5e13 lengthscales; float32: ~8e4.
PHASE_TOL = 0.1

# Gradient runs (no movement check): "far from converged" when the running training loss fell by
# more than this fraction of its final value over the second half of the run, i.e. at least halved.
# The conformance runs (100 passes, 3.8% from exact KRR) fall by 41-63%; a diverging rounded-input run
# (50 passes, R^2 -6.5) by 103% (docs/solvers/dsg.md, "Checks").
CONVERGENCE_TOL = 1.0

# least_squares: "far from converged" when the fitted function on the training points still moved
# by more than this fraction of its norm over the second half of the run. Measured
# (docs/solvers/dsg.md): 0.006-0.13 with the defaults on the UCI sets measured (protein 0.128,
# skillcraft 0.076, the noisiest); 0.25-0.47 for truncated runs (energy, 4-8 passes of 16-32 features).
MOVE_TOL = 0.15

# Largest accepted estimate of the random-feature noise at new points, relative to the RMS target
# (:func:`off_data_noise`). Measured (docs/solvers/dsg.md, "Isolated points"): 0.01-0.21 on the runs
# whose test R^2 is within 0.03 of exact KRR (UCI sets with learned hyperparameters, smooth
# synthetic data, rounded inputs at lengthscale >= 1 in 3 dimensions); 0.33-0.93 on rounded inputs
# with points isolated at the lengthscale, whose test R^2 falls 0.1-1.0 below exact KRR. 0.3 is
# about 9% of the mean squared target added to the test error.
OFF_DATA_TOL = 0.3


def scaled_inputs_checked(fmap: RandomFeatureMap, sampler: SpectralSampler, X: Tensor, what: str = "X") -> Tensor:
    """``(X - shift) / lengthscale`` after checking that the phases of the features keep their precision.

    The phase of a feature is ``z^T u`` with ``z ~ N(0, I)`` (RBF; heavier tails for Matern), so its
    size is about ``||u||`` and its rounding error about ``||u|| eps``. The check uses the largest
    ``||u||`` (after the shift) times 4 (a 4-sigma phase) times the dtype's epsilon.

    Raises
    ------
    ValueError
        If ``X / lengthscale`` overflows, or its phases would carry a rounding error above
        :data:`PHASE_TOL` radians; the message names the spread in lengthscales and the remedy.
    """
    U = fmap.scaled_inputs(X, sampler)
    if not bool(torch.isfinite(U).all()):
        raise ValueError(
            f"solver 'dsg': {what} / lengthscale overflows {X.dtype} (inputs up to "
            f"{float(X.abs().max().double()):.3g}); rescale {what} (e.g. standardise it) or use a larger lengthscale"
        )
    spread = float(U.double().norm(dim=1).max()) if U.numel() else 0.0
    error = 4.0 * spread * torch.finfo(U.dtype).eps
    if error > PHASE_TOL:
        raise ValueError(
            f"solver 'dsg': {what} spans {spread:.3g} kernel lengthscales from its mean; the random-feature "
            f"phases omega^T x would carry rounding errors of ~{error:.3g} rad in {X.dtype}, so every feature "
            f"would be noise (the kernel itself is ~0 between points this far apart). Rescale {what} (e.g. "
            "standardise it) or set a lengthscale on the scale of the inputs"
            + ("; or pass float64 inputs" if U.dtype != torch.float64 else "")
        )
    return U


class LossTrace:
    """Training loss after every report: divergence errors and the end-of-run convergence warning.

    Parameters
    ----------
    initial:
        Mean squared target (the loss of f = 0 on the data the run sees), > 0.
    monotone:
        True for the ``least_squares`` update on all points, whose exact loss can only fall
        (each step is a ridge least-squares fit of the residual): any growth beyond rounding is a
        numerical failure. False for minibatch losses, which fluctuate.
    remedy:
        What to change when the run diverges (depends on the update rule).
    """

    def __init__(self, initial: float, *, monotone: bool, remedy: str):
        self.initial = float(initial)
        self.monotone = monotone
        self.remedy = remedy
        self.losses: list[float] = []
        self.best = math.inf

    def check_coefficients(self, block: Tensor, step: int) -> None:
        """Raise :class:`kgp.DivergenceError` if step ``step``'s coefficients are not finite."""
        if not bool(torch.isfinite(block).all()):
            raise diverged(
                _SOLVER,
                f"the coefficients of step {step} are not finite",
                cause="overflow in the update (a step too large for this kernel and data, or inputs/targets "
                "far outside float range)",
                remedy=self.remedy,
            )

    def add(self, loss: float, step: int) -> None:
        """Record the loss at step ``step``; raise :class:`kgp.DivergenceError` if it is not finite or grows.

        Growth means: above 1.5 x the best loss so far for the monotone least-squares update (it
        cannot grow in exact arithmetic; rounding moves it by ~1e-6 relative in float32); above
        both 10 x the best and the loss of f = 0 for minibatch losses (a working run stays below
        the loss of predicting zero; a diverging one grows geometrically past any such bound).
        """
        if not math.isfinite(loss):
            raise diverged(
                _SOLVER,
                f"the training loss is {loss} at step {step}",
                cause="overflow in the update",
                remedy=self.remedy,
            )
        grown = loss > 1.5 * self.best if self.monotone else loss > 10.0 * self.best and loss > self.initial
        if grown:
            raise diverged(
                _SOLVER,
                f"the training loss grew from {self.best:.4g} to {loss:.4g} by step {step} (loss of f = 0: "
                f"{self.initial:.4g})",
                cause="the iteration is unstable for this kernel and data",
                remedy=self.remedy,
            )
        self.losses.append(loss)
        self.best = min(self.best, loss)

    def finish(self, *, what: str, remedy: str, moved: float | None = None) -> float | None:
        """Warn (:class:`kgp.ConvergenceWarning`) if the run ends far from converged; return the measure.

        With ``moved`` (the solver's ``||f_end - f_mid|| / ||f_end||`` on the training points over
        the second half of the run) the measure is that relative movement of the fitted function:
        a run that still moves its predictions by more than :data:`MOVE_TOL` of their size is far
        from its limit. Without it (no cache of f on X), the measure is the fall of the training loss
        over the second half of the reports, ``(L_mid - L_end) / L_end``, against
        :data:`CONVERGENCE_TOL`. The training loss alone is a poor guide when the noise is small (it
        keeps falling towards interpolation long after the test error has settled), hence the
        function movement first. None when fewer than 4 reports exist.
        """
        if len(self.losses) < 4:
            return None
        if moved is not None:
            measure, tol = float(moved), MOVE_TOL
            observed = (
                f"{what} ended while the fitted function was still moving: it changed by {100 * measure:.1f}% "
                f"(relative, on the training points) over the second half of the run (converged runs: < "
                f"{100 * tol:.0f}%)"
            )
        else:
            end = self.losses[-1]
            mid = self.losses[(len(self.losses) - 1) // 2]
            measure, tol = (mid - end) / max(end, 1e-300 * max(mid, 1.0)), CONVERGENCE_TOL
            observed = (
                f"{what} ended while the training loss was still falling fast: it fell by {100 * measure:.0f}% of "
                f"its final value ({end:.4g}) over the second half of the run (converged runs: < {100 * tol:.0f}%)"
            )
        if not math.isfinite(measure) or measure > tol:
            warn_not_converged(
                _SOLVER,
                observed,
                cause="too few passes / features for this kernel and data",
                remedy=remedy,
                stacklevel=4,
            )
        return measure


def isolated_fraction(kernel_rows: Tensor, outputscale: float) -> Tensor:
    """Per sample point, ``1 / (1 + m_i)`` with ``m_i = sum_{j != i} k(x_i, x_j) / s`` its neighbour mass.

    ``kernel_rows`` holds, for each sampled training point, its kernel values summed over all training
    points (itself included once, so ``s`` is subtracted). A point with no neighbour within a few
    lengthscales gives ~1, a point with a duplicate or many close neighbours ~0: the mean is an
    estimate of the fraction of new points that fall where the training data say nothing.
    """
    mass = (kernel_rows.double() / outputscale - 1.0).clamp_min(0.0)
    return 1.0 / (1.0 + mass)


def off_data_noise(coef: Tensor, outputscale: float, y_sq: float, isolated: float) -> tuple[float, float]:
    """``(noise, score)``: the RMS random-feature noise of the model at new isolated points, and its share.

    A feature vector ``phi(x)`` at a point x with no training point near it is a vector of r cosines
    per block with uniformly random phases, uncorrelated with the coefficients, each of variance
    ``s / r`` (amplitude ``sqrt(2 s / r)``); so ``f(x) = sum_t phi_t(x)^T a_t`` has mean 0 and variance
    ``s sum_t ||a_t||^2 / r`` (per output). The exact GP predicts ~0 (the prior mean) there; the
    model predicts noise of that size. ``score = noise * sqrt(isolated / y_sq)``: the noise weighted
    by the estimated fraction of isolated points, relative to the RMS target.
    """
    T, r, k = coef.shape
    noise = math.sqrt(outputscale * float(coef.double().square().sum()) / (r * max(k, 1)))
    score = noise * math.sqrt(max(isolated, 0.0) / y_sq) if y_sq > 0 else 0.0
    return noise, score


def warn_if_noisy_off_data(noise: float, score: float, isolated: float, y_sq: float, *, least_squares: bool) -> None:
    """Warn (:class:`kgp.ConvergenceWarning`) when :func:`off_data_noise`'s score exceeds :data:`OFF_DATA_TOL`."""
    if not score > OFF_DATA_TOL:
        return
    remedy = (
        "pass solver_options={'shrink': 0.2} (each block fit moves a fifth of the way, which spreads the fit "
        "over many more features; docs/solvers/dsg.md, 'Isolated points')"
        if least_squares
        else "use the default update='least_squares' with solver_options={'shrink': 0.2}"
    )
    warn_not_converged(
        _SOLVER,
        f"at points away from the training data the model predicts random-feature noise of RMS {noise:.3g} "
        f"({100 * noise / math.sqrt(y_sq):.0f}% of the RMS target) where the exact solution predicts ~0, and "
        f"~{100 * isolated:.0f}% of the training points have no neighbour within a few lengthscales (sampled): "
        f"expect a test error well above the exact solution's (estimated extra squared error: "
        f"{100 * score**2:.0f}% of the mean squared target)",
        cause="points isolated at the kernel's lengthscale (rounded or discrete features, a small lengthscale): "
        "the training fit interpolates them with a few blocks of features, whose noise does not average out",
        remedy=remedy + ", more features (passes), a larger lengthscale, or an exact or Nystrom solver "
        "('exact', 'falkon')",
        stacklevel=4,
    )
