"""The three stages of a fit -- select centers, learn hyperparameters, solve -- and the Posterior they end in.

Each stage is a function of the plan (:mod:`.plan`), the training rows (:mod:`.rows`) and the previous
stage's result; :func:`run` chains them. Plugin calls run under ``torch.no_grad()`` unless the plugin
declares ``needs_grad`` (:func:`plugin_call`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .. import io
from ..diagnostics import ConvergenceWarning, ill_conditioned
from ..learning import learn_hyperparameters
from ..linalg import NotPSDError
from ..monitor import IterationInfo, Monitor
from ..plugin import Centers, Problem, SelectionRequest, Solution
from ..posterior import Posterior, Scaling, TargetScaling
from ..validation import to_tensor
from ..variance import FitInputs, for_fit, for_target
from ..variance.calibration import calibration_subset
from .plan import FitPlan, PluginChoice, RandomStreams
from .rows import TrainingRows

__all__ = [
    "FitResult",
    "calibrate_variance",
    "FitHyperparameters",
    "finish",
    "learn",
    "plugin_call",
    "run",
    "select_and_learn",
    "select_centers",
    "solve",
]


@contextlib.contextmanager
def plugin_call(choice: PluginChoice) -> Iterator[None]:
    """Run a plugin's work under ``torch.no_grad()`` unless it declares ``needs_grad``.

    A solver that multiplies with the kernel operator while the kernel's hyperparameters require
    gradients would otherwise build an autograd graph across all its iterations. A raw
    ``torch.linalg.LinAlgError`` escaping the plugin (LAPACK gave up) becomes kgp's
    :class:`~kgp.diagnostics.IllConditionedError`, which says what it means and what helps.
    """
    grad = contextlib.nullcontext() if choice.capabilities.needs_grad else torch.no_grad()
    try:
        with grad:
            yield
    except torch.linalg.LinAlgError as exc:
        raise ill_conditioned(type(choice.plugin).__name__, io.one_line(exc)) from exc


# ---------------------------------------------------------------------- stage 1: centers
def select_centers(
    plan: FitPlan,
    rows: TrainingRows,
    kernel: gpytorch.kernels.Kernel,
    streams: RandomStreams,
    input_scaling: Scaling | None = None,
    noise: float | None = None,
) -> Centers | None:
    """The selector's centers, the user's explicit centers, or None when no plugin uses centers.

    Explicit centers are given in the user's units: with ``normalize_X`` they are standardised like X.
    ``kernel`` and ``noise`` (default: the plan's) are the hyperparameters the selector sees.
    """
    if not plan.needs_centers:
        return None
    X = rows.X
    if plan.selector is not None:
        request = SelectionRequest(
            X=X,
            n_centers=plan.n_centers,
            kernel=kernel,
            noise=plan.noise if noise is None else noise,
            generator=streams.generator("select"),
            options=plan.selector.options,
            shard=rows.shard,
        )
        with plugin_call(plan.selector):
            return plan.selector.plugin.select(request)
    points = to_tensor(plan.explicit_centers, "centers", ndim=(2,), dtype=X.dtype, device=X.device)
    if points.shape[1] != X.shape[1]:
        raise ValueError(f"centers: expected {X.shape[1]} columns like X, got shape {tuple(points.shape)}")
    if input_scaling is not None:
        points = input_scaling.apply(points)
    if plan.n_centers is not None and plan.n_centers != points.shape[0]:
        raise ValueError(f"n_centers={plan.n_centers} does not match the {points.shape[0]} centers given")
    if not rows.comm.identical([points]):
        raise ValueError("centers: a distributed fit needs the same explicit centers on every rank")
    return Centers(points=points)


# ---------------------------------------------------------------------- stage 2: hyperparameters
@dataclass
class FitHyperparameters:
    """The hyperparameters the solve uses (learned, or the fixed ones when ``learn=None``).

    ``kernel`` holds the kernel hyperparameters; ``noise`` is sigma^2 and ``mean`` the constant mean per
    output, both in the scaled target units; ``history`` the minimised value per objective evaluation;
    ``refit`` what ``refit_subset`` changed (or None); ``summary`` how learning ended (the objective, the
    evaluations, the best value and where it was reached, why it stopped; None without learning).
    """

    kernel: gpytorch.kernels.Kernel
    noise: float
    mean: Tensor
    history: list[float] = field(default_factory=list)
    refit: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None


def learn(
    plan: FitPlan,
    rows: TrainingRows,
    kernel: gpytorch.kernels.Kernel,
    centers: Centers | None,
    streams: RandomStreams,
    monitor: Monitor,
) -> FitHyperparameters:
    """Minimise the objective over the kernel's hyperparameters, the noise and the mean (or keep them)."""
    Y = rows.Y
    if plan.objective is None:
        return FitHyperparameters(kernel, plan.noise, torch.zeros(Y.shape[1], dtype=Y.dtype, device=Y.device))
    result = learn_hyperparameters(
        plan.objective.name,
        rows.X,
        Y,
        kernel,
        noise=plan.noise,
        mean=rows.column_mean(),
        centers=centers,
        options=plan.learn_options,
        generator=streams.generator("learn"),
        monitor=monitor,
        shard=rows.shard,
        plugin=plan.objective.plugin,
    )
    # the same steps on every rank; the checksum confirms it
    rows.comm.replicate_([p.data for p in kernel.parameters()] + [result.mean])
    for p in kernel.parameters():  # detached from the optimiser's graph (parameters keep requires_grad)
        p.grad = None
    summary = {
        "objective": plan.objective.name,
        "evaluations": len(result.history),
        "best_value": result.best_value,
        "best_evaluation": result.best_step,
        "stopped": result.stopped,
        # sklearn's log_marginal_likelihood_value_: of the rows the objective used, at the returned point;
        # None where the value is no likelihood (holdout) or the refit moved the point after it
        "log_marginal_likelihood": (
            -result.best_value * result.terms
            if result.terms is not None and result.refit is None and math.isfinite(result.best_value)
            else None
        ),
        "likelihood_terms": result.terms,
        "refine": result.refine,
    }
    return FitHyperparameters(kernel, result.noise, result.mean, result.history, result.refit, summary)


# ---------------------------------------------------------------------- stage 3: solve
@dataclass
class FitResult:
    """What a fit produced: the Posterior, the centers, the learned hyperparameters, the solver's reports."""

    posterior: Posterior
    centers: Centers | None
    learned: FitHyperparameters
    history: list[IterationInfo]


def solve(
    plan: FitPlan,
    rows: TrainingRows,
    centers: Centers | None,
    learned: FitHyperparameters,
    scaling: TargetScaling,
    streams: RandomStreams,
    monitor: Monitor,
    *,
    chunk: int | None = None,
    previous: Any = None,
    input_scaling: Scaling | None = None,
) -> Posterior:
    """Run the solver on ``y - mean`` with the learned hyperparameters; wrap its predictor in a Posterior.

    ``chunk``: ``partial_fit`` of chunk number ``chunk`` (0 for the first), continuing ``previous``
    (None on the first chunk) and drawing from the solve stream of the chunk.
    """
    caps = plan.solver.capabilities
    problem = Problem(
        X=rows.X,
        y=rows.Y - learned.mean,
        kernel=learned.kernel,
        noise=learned.noise,
        centers=centers if caps.uses_centers else None,
        options=plan.solver.options,
        generator=streams.generator("solve", chunk or 0),
        monitor=monitor,
        shard=rows.shard,
        want_variance=for_target(caps.target).has_variance,
    )
    with plugin_call(plan.solver):
        if chunk is not None:
            predictor = plan.solver.plugin.partial_fit(problem, previous)
        else:
            predictor = plan.solver.plugin.fit(problem)
    factors = None
    if isinstance(predictor, Solution):
        predictor, factors = predictor.predictor, predictor.variance
    predictor = rows.comm.replicate_predictor(predictor, learned.kernel)
    posterior = posterior_of(plan, predictor, learned, scaling, centers, rows, input_scaling)
    if factors is not None:
        posterior.variance.adopt(factors)
    return posterior


def posterior_of(
    plan: FitPlan,
    predictor: Any,
    learned: FitHyperparameters,
    scaling: TargetScaling,
    centers: Centers | None,
    rows: TrainingRows | None,
    input_scaling: Scaling | None = None,
) -> Posterior:
    """The Posterior of a fitted predictor; its variance strategy follows the solver's declared target."""
    fit = FitInputs(
        solver=plan.solver.name,
        kernel=learned.kernel,
        noise=learned.noise,
        predictor=predictor,
        centers=None if centers is None else centers.points,
        train_X=None if rows is None else rows.X,
        shard=None if rows is None else rows.shard,
        learns=plan.objective is not None,
    )
    return Posterior(
        kernel=learned.kernel,
        predictor=predictor,
        noise=learned.noise,
        offset=learned.mean,
        scaling=scaling,
        variance=for_fit(plan.solver.capabilities.target, fit),
        input_scaling=input_scaling,
    )


# ---------------------------------------------------------------------- the chain
def scale_inputs(rows: TrainingRows, normalize: bool) -> tuple[TrainingRows, Scaling | None]:
    """``normalize_X``: standardise each feature with the training rows' mean and standard deviation.

    A constant feature keeps the scale 1. Without it the kernel sees the inputs as given, and a feature
    on a 1e-8 or 1e8 scale next to one of scale 1 makes every lengthscale start wrong.
    Distributed: the statistics of all ranks' rows.
    """
    if not normalize:
        return rows, None
    X = rows.X
    # the squared deviations over- or underflow for features beyond ~1e154 or below ~1e-154 (float64): a
    # column first divided by a power of two near its largest magnitude has them in range, and the power
    # of two makes the division and the products below exact (ordinary columns are not divided at all)
    unit = _column_units(X, rows.comm)
    Xu = X if unit is None else X / unit
    mean = rows.column_mean(Xu)
    std = rows.column_std(Xu, mean)
    if unit is not None:
        mean, std = mean * unit, std * unit
    std = torch.where(std > 0, std, torch.ones_like(std))
    scaling = Scaling(mean, std)
    return TrainingRows(scaling.apply(X), rows.Y, rows.comm), scaling


def _column_units(X: Tensor, comm) -> Tensor | None:
    """A power of two near each column's largest magnitude where squares of that magnitude would over- or
    underflow ``X.dtype`` (1 for the other columns); None when no column needs one.

    Distributed: from the mean over ranks of each rank's largest magnitude (one all-reduce of d numbers, on
    every rank), within a factor ``world_size`` of the largest, so every rank divides by the same power.
    """
    info = torch.finfo(X.dtype)
    local = X.abs().amax(0) if X.shape[0] > 0 else X.new_zeros(X.shape[1])
    biggest = comm.all_reduce_(local / comm.world_size)
    unit = torch.ones_like(biggest)
    extreme = (biggest > info.max**0.25) | ((biggest < info.tiny**0.25) & (biggest > 0))
    if not bool(extreme.any()):
        return None
    _, exponent = torch.frexp(biggest)
    unit = torch.where(extreme, torch.ldexp(unit, exponent.to(X.dtype)), unit)
    return unit


def scale_targets(rows: TrainingRows, normalize: bool) -> tuple[TrainingRows, TargetScaling]:
    """scikit-learn's ``GaussianProcessRegressor(normalize_y=True)``: centre and scale each column.

    A constant column keeps the scale 1 (as scikit-learn does), so nothing is divided by zero.
    Distributed: the mean and the standard deviation of all ranks' rows (two all-reduces of k numbers).
    """
    Y = rows.Y
    if not normalize:
        return rows, TargetScaling.identity(Y)
    mean = rows.column_mean(Y)
    std = rows.column_std(Y, mean)
    if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(std).all())):
        # the squared deviations overflow (|y| above ~1e154 in float64): std inf, every prediction NaN
        # the caller can rescale, kgp cannot pick the constant for them
        raise ValueError(
            f"y: normalize_y=True cannot standardize targets of magnitude {float(Y.abs().max()):.3g}: their "
            f"{'mean' if not bool(torch.isfinite(mean).all()) else 'standard deviation'} overflows "
            f"{str(Y.dtype).replace('torch.', '')}; divide y by a constant (e.g. its largest magnitude) first"
        )
    std = torch.where(std > 0, std, torch.ones_like(std))
    return TrainingRows(rows.X, (Y - mean) / std, rows.comm), TargetScaling(mean, std)


NOISE_RAISES = 3
"""How many times :func:`solve_with_a_usable_noise` raises a learned noise tenfold before it gives up."""


def solve_with_a_usable_noise(
    plan: FitPlan,
    rows: TrainingRows,
    centers: Centers | None,
    learned: FitHyperparameters,
    scaling: TargetScaling,
    streams: RandomStreams,
    monitor: Monitor,
    *,
    input_scaling: Scaling | None = None,
) -> tuple[Posterior, FitHyperparameters]:
    """:func:`solve`; where a *learned* noise leaves the solver's system not positive definite on all rows,
    the noise is raised tenfold, at most :data:`NOISE_RAISES` times, with a warning naming both values.

    Learning evaluates its objective on a subset (3,000 rows by default): at the floor ``min_noise`` with
    collapsed lengthscales, ``K + noise I`` can factor there and not on all rows. On UCI parkinsons the
    default GP learns noise 1e-6 with two lengthscales near 1e-6 and 1e-3; whether the 4,700-row solve
    then factors was a matter of rounding (a change of the kernel's summation order turned it into a
    ``NotPSDError`` after a minute of learning). A noise the user fixed (no learning, or
    ``learn_noise=False``) is never changed, and a distributed fit raises as before.
    """
    noise = learned.noise
    changeable = (
        plan.objective is not None
        and plan.learn_options is not None
        and plan.learn_options.loop.get("learn_noise", True)
        and rows.shard is None
    )
    attempt = 0
    while True:
        used = learned if noise == learned.noise else replace(learned, noise=noise)
        try:
            posterior = solve(plan, rows, centers, used, scaling, streams, monitor, input_scaling=input_scaling)
            break
        except NotPSDError:
            if not changeable or attempt == NOISE_RAISES or not math.isfinite(noise) or noise <= 0:
                raise
            noise *= 10.0
            attempt += 1
    if used is not learned:
        warnings.warn(
            f"the learned noise {learned.noise:.3g} left the solver's system not positive definite on all "
            f"{rows.X.shape[0]} rows; the fit uses noise {noise:.3g} instead (noise_). Learning ended at "
            "a degenerate point (noise at its floor, or lengthscales collapsed onto single features); "
            "raise learn_options['min_noise'] or learn_options['min_lengthscale'] to choose",
            ConvergenceWarning,
            stacklevel=4,
        )
    return posterior, used


def _selects_with_learned_kernel(plan: FitPlan) -> bool:
    """Whether the fit learns hyperparameters and its selector's centers depend on the kernel."""
    return (
        plan.objective is not None
        and plan.needs_centers
        and plan.selector is not None
        and plan.selector.capabilities.uses_kernel
    )


def select_and_learn(
    plan: FitPlan,
    rows: TrainingRows,
    kernel: gpytorch.kernels.Kernel,
    streams: RandomStreams,
    monitor: Monitor,
    input_scaling: Scaling | None = None,
) -> tuple[Centers | None, FitHyperparameters]:
    """Stages 1 and 2: the centers and the hyperparameters the solve uses.

    A selector whose centers depend on the kernel selects (again) with the learned hyperparameters; it
    selects before learning too when the objective works on centers.
    """
    reselect = _selects_with_learned_kernel(plan)
    objective_uses_centers = plan.objective is not None and plan.objective.capabilities.uses_centers
    centers = None
    if not reselect or objective_uses_centers:
        centers = select_centers(plan, rows, kernel, streams, input_scaling)
    learned = learn(plan, rows, kernel, centers, streams, monitor)
    if reselect:
        centers = select_centers(plan, rows, learned.kernel, streams, input_scaling, noise=learned.noise)
        centers.info = {**centers.info, "kernel": "learned"}
    return centers, learned


def finish(
    plan: FitPlan,
    rows: TrainingRows,
    centers: Centers | None,
    learned: FitHyperparameters,
    scaling: TargetScaling,
    streams: RandomStreams,
    monitor: Monitor,
    input_scaling: Scaling | None = None,
) -> FitResult:
    """Stage 3: the solve (:func:`solve_with_a_usable_noise`), and a learned GP's variance built now."""
    posterior, learned = solve_with_a_usable_noise(
        plan, rows, centers, learned, scaling, streams, monitor, input_scaling=input_scaling
    )
    if plan.objective is not None and posterior.has_variance:
        with monitor.stage(f"variance ({posterior.variance_kind})"):
            try:
                # a GP fit builds what its std needs now (counted in the fit's time; in a distributed fit the
                # pass over all ranks' rows)
                posterior.variance.build()
            except NotPSDError as exc:
                # the mean is fitted and good: a failed variance must not throw the fit away (keggdirected)
                warnings.warn(
                    f"the predictive variance could not be built ({exc}); the fitted mean is kept and "
                    "predict(..., return_std=True) will raise this error",
                    ConvergenceWarning,
                    stacklevel=4,
                )
        if posterior.variance.built and posterior.variance.can_calibrate(rows.n):
            with monitor.stage("variance calibration"):
                calibrate_variance(posterior, rows)
    return FitResult(posterior, centers, learned, list(monitor.history))


def calibrate_variance(posterior: Posterior, rows: TrainingRows) -> float:
    """Measure the variance's factor on the conditional term on a fixed draw of training rows.

    The residuals of the fitted mean at ``kgp.variance.calibration.CALIBRATION_ROWS`` rows (all rows below),
    their mean square over the outputs, in the scaled units; in a distributed fit each rank takes the rows
    of the global draw it holds and the sums are all-reduced (:meth:`kgp.variance.VarianceStrategy.calibrate`).
    """
    chosen = calibration_subset(rows.n)
    gather = None
    if rows.shard is None:
        local = chosen
    else:
        positions, local = rows.shard.local_rows(chosen)

        def gather(values: Tensor) -> Tensor:
            table = values.new_zeros(chosen.numel(), values.shape[1])
            table[positions.to(values.device)] = values
            return rows.shard.all_reduce_(table)

    local = local.to(rows.X.device)
    X, Y = rows.X[local], rows.Y[local]
    with torch.no_grad():
        fitted = posterior.predictor.predict(X)
        if fitted.dim() == 1:
            fitted = fitted.unsqueeze(-1)
        residual_square = (Y - posterior.offset - fitted).square().mean(-1)
    return posterior.variance.calibrate(X, residual_square, rows.n, gather=gather)


def run(
    plan: FitPlan,
    rows: TrainingRows,
    scaling: TargetScaling,
    kernel: gpytorch.kernels.Kernel,
    streams: RandomStreams,
    monitor: Monitor,
    input_scaling: Scaling | None = None,
) -> FitResult:
    """Select, learn, solve: the stages of the (scaled) ``rows`` (the caller owns and closes ``monitor``)."""
    centers, learned = select_and_learn(plan, rows, kernel, streams, monitor, input_scaling)
    if plan.objective is not None:
        monitor.close()  # the solver's stage starts its own bar
    return finish(plan, rows, centers, learned, scaling, streams, monitor, input_scaling)
