"""How a learning run ended: the best point kept, and the warnings that say when it is not the natural end.

A learning run never returns a point worse than the best it evaluated (with ``lr=50`` the last point can
go from -0.81 to 413,292 and R^2 from 0.996 to -0.10), and says when it failed part-way, went astray, was
interrupted, or had not converged at its budget (y on a 1e6 scale without ``normalize_y``: 0% coverage).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from ..diagnostics import ConvergenceWarning

__all__ = ["BestPoint", "report_learning", "still_falling", "white_noise_nll"]


class BestPoint:
    """The trained tensors at the lowest objective value evaluated so far (a run never returns worse)."""

    def __init__(self, trained: list[Tensor]):
        self.trained = trained
        self.value = math.inf
        self.step = 0
        self.saved: list[Tensor] | None = None
        self.final: float | None = None

    def offer(self, value: Tensor, step: int) -> None:
        v = float(value.detach())
        if v < self.value:  # NaN never compares lower
            self.value, self.step = v, step
            self.saved = [t.detach().clone() for t in self.trained]

    def offer_final(self, value: float, step: int) -> None:
        self.final = value
        if value <= self.value:
            self.value, self.step, self.saved = value, step, None  # the current tensors are the best

    def restore(self) -> None:
        if self.saved is not None:
            with torch.no_grad():
                for t, saved in zip(self.trained, self.saved):
                    t.copy_(saved)


# The objective is "still falling" when its last quarter of evaluations lowered it by more than
# _FALLING_NATS per point, or by more than _STILL_FALLING_FRACTION of the whole run's decrease and more than
# _STILL_FALLING_NATS (smaller changes do not move predictions). Measured on learn="auto"'s 100 Adam steps
# (docs/benchmarks/gp-default.md): pol 0.006 and elevators 0.007 nats per point (converged: test RMSE 0.95x
# and 1.01x the exact GP's), bike 0.091 (noise 0.0022 against the exact GP's 0.00038, RMSE 1.20x).
_FALLING_NATS = 0.03
_STILL_FALLING_FRACTION = 0.1
_STILL_FALLING_NATS = 1e-3
_ASTRAY_FRACTION = 0.1
_WHITE_NOISE_MARGIN = 0.5  # nats per point


def still_falling(history: list[float], best_value: float, white_noise: float | None = None) -> bool:
    """Whether the objective fell enough over its last quarter of evaluations to call the run unconverged."""
    if len(history) < 8:
        return False
    recent = history[-max(2, len(history) // 4)] - best_value
    whole = history[0] - best_value
    above_trivial = white_noise is not None and best_value > white_noise + _WHITE_NOISE_MARGIN
    return recent > _FALLING_NATS or (
        recent > _STILL_FALLING_NATS and (recent > _STILL_FALLING_FRACTION * whole or above_trivial)
    )


def white_noise_nll(obj: Any, Y: Tensor, shard: Any) -> float | None:
    """Per-point negative log likelihood of the constant-mean, white-noise model at the targets' variance.

    ``1/2 log(2 pi e var(y))`` averaged over outputs: every GP whose kernel can shrink to 0 does at least
    this well, so a likelihood objective (``Capabilities(likelihood=True)``) that ends above it has not
    converged.
    None for other objectives and in a distributed fit (the variance would need all ranks' rows).
    """
    if not obj.capabilities.likelihood or shard is not None or Y.shape[0] < 2:
        return None
    var = Y.detach().double().var(dim=0).clamp_min(1e-300)
    return float((0.5 * torch.log(2 * math.pi * math.e * var)).mean())


def report_learning(
    objective: str,
    stopped: str,
    best: BestPoint,
    history: list[float],
    iterations: int,
    lr: float,
    white_noise: float | None = None,
) -> None:
    """Warn (kgp.ConvergenceWarning) when the returned point is not the run's natural end."""
    name = f"learn {objective!r}"
    if stopped == "interrupted":
        warnings.warn(
            f"{name}: interrupted (Ctrl-C) after {len(history)} of {iterations} evaluations; the fit goes on with "
            f"the best point found (objective {best.value:.6g} at evaluation {best.step}); press Ctrl-C again to "
            "stop the fit",
            ConvergenceWarning,
            stacklevel=3,
        )
        return
    if stopped.startswith("failed: "):
        warnings.warn(
            f"{name}: evaluation {len(history) + 1} failed, so learning stopped there and the best earlier point is "
            f"kept (objective {best.value:.6g} at evaluation {best.step}). The failure: {stopped[8:]}",
            ConvergenceWarning,
            stacklevel=3,
        )
        return
    if not history:
        return
    start, final = history[0], best.final if best.final is not None else history[-1]
    # Adam ends a little above its best point routinely (the best point is then kept without a word); a
    # final value above the best by a tenth of the run's decrease is a run that went astray
    astray = final - best.value > max(_ASTRAY_FRACTION * (start - best.value), _STILL_FALLING_NATS)
    if best.saved is not None and (astray or not math.isfinite(final)):
        ended = f"ended at {final:.6g}" if math.isfinite(final) else "was not finite at the final point"
        warnings.warn(
            f"{name}: the objective {ended}, above its best value {best.value:.6g} (evaluation {best.step} of "
            f"{len(history)}): the best point is kept. Likely cause: a step size too large for this objective "
            f"(lr={lr:g}); remedy: a smaller learn_options['lr']",
            ConvergenceWarning,
            stacklevel=3,
        )
        return
    if stopped != "budget" or len(history) < 8:
        return
    tail = max(2, len(history) // 4)
    whole = start - best.value
    recent = history[-tail] - best.value
    # a likelihood still above the white-noise model's has not even reached the trivial fit
    above_trivial = white_noise is not None and best.value > white_noise + _WHITE_NOISE_MARGIN
    if still_falling(history, best.value, white_noise):
        trivial = (
            f"; its best value {best.value:.4g} is above the {white_noise:.4g} of a constant predictor with the "
            "targets' variance as noise"
            if above_trivial
            else ""
        )
        warnings.warn(
            f"{name}: the objective was still falling when the budget of {iterations} evaluations ran out (it "
            f"fell {recent:.3g} per point over the last {tail}, {recent / whole:.0%} of the run's decrease{trivial}):"
            " the hyperparameters may be far from the optimum. Likely cause: targets or inputs on a scale far from 1 "
            "(use normalize_y=True / normalize_X=True) or too few iterations; remedy: raise "
            "learn_options['iterations'] or the step size learn_options['lr']",
            ConvergenceWarning,
            stacklevel=3,
        )
