"""The whole fit: from the estimator's parameters, its converted rows and a communicator to a :class:`ModelFit`.

The estimator converts its inputs (tensors, encoded targets, feature names), calls one function of this
module and writes the fitted attributes from what it returns:

* :func:`fit_model` -- ``fit``: the parameters are checked once before the data are looked at
  (:func:`kgp.fitting.plan.prepare_plan`, which resolves the plan unless a recipe needs the data); the
  data's shape is known next (all ranks' rows in a distributed fit), a plan waiting for it is resolved, then
  the kernel, the checks that precede any heavy work (the ranks' agreement, the plugins' distributed
  capability, the number of centers, the memory estimate), the seed, the scalings, and the three stages;
* :func:`fit_chunk` -- ``partial_fit``: one chunk of a streaming fit, continuing a :class:`ChunkState`;
* :func:`learn_only` -- ``fit_hyperparameters``: the stages up to the solve.

What the fit resolved travels in the result: the solver plugin object (:attr:`ModelFit.solver`), the
recipe's report with its memory estimate, the learned constant mean (inside :attr:`ModelFit.result`).
Nothing the caller passed in is changed.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .. import distributed as dist
from .. import settings
from ..distributed_monitor import ShardedMonitor
from ..kernels import make_kernel
from ..monitor import IterationInfo, Monitor
from ..posterior import TargetScaling
from ..safeguards import check_memory
from ..validation import check_n_centers
from ..variance import for_target
from .memory_estimate import FitMemory, check_fit_memory, estimate_fit_memory
from .plan import AUTO, DataShape, FitPlan, PendingPlan, PluginChoice, RandomStreams, prepare_plan
from .rows import LocalComm, TrainingRows, broadcast_seed, comm_for, describe_fit
from .stages import (
    FitHyperparameters,
    FitResult,
    finish,
    learn,
    scale_inputs,
    scale_targets,
    select_and_learn,
    select_centers,
    solve,
)

__all__ = [
    "ChunkState",
    "ModelFit",
    "build_kernel",
    "check_distributed_plugins",
    "draw_seed",
    "fit_chunk",
    "fit_model",
    "fit_memory",
    "learn_only",
]


@dataclass(frozen=True)
class ModelFit:
    """What a fit hands back to the estimator: everything its fitted attributes are written from.

    Attributes
    ----------
    result:
        The Posterior, the centers, the learned hyperparameters (the constant mean among them) and the
        iterations reported.
    solver:
        The solver plugin the plan resolved (its name and object).
    recipe:
        What ``solver="auto"`` / ``learn="auto"`` chose and why, as plain values; with ``solver="auto"``
        also ``"memory"``, the fit's estimated peak memory by part (bytes,
        :meth:`kgp.fitting.memory_estimate.FitMemory.as_dict`). None when nothing was left to the recipe.
    seed, n_features, fit_time, chunks_seen:
        The seed of the random streams, the number of features, the seconds the fit took (all chunks for a
        streaming fit), and how many chunks the solve streams have served.
    shard:
        This rank's place in a distributed fit (None in one process).
    """

    result: FitResult
    solver: PluginChoice
    recipe: dict[str, Any] | None
    seed: int
    n_features: int
    fit_time: float
    chunks_seen: int
    shard: dist.Shard | None = None


@dataclass(frozen=True)
class ChunkState:
    """A streaming fit so far, as :func:`fit_chunk` continues it (from the estimator's fitted attributes)."""

    seed: int
    kernel: gpytorch.kernels.Kernel
    chunks_seen: int
    history: list[IterationInfo]
    predictor: Any
    fit_time: float
    n_features: int
    n_outputs: int


def draw_seed(random_state: int | None) -> int:
    """``random_state``, or a fresh seed from torch's global generator when it is None."""
    if random_state is not None:
        return int(random_state)
    return int(torch.randint(0, 2**62, (1,)).item())


def build_kernel(
    params: Mapping[str, Any], ard: bool, dtype: torch.dtype, device: Any, n_features: int | None = None
) -> gpytorch.kernels.Kernel:
    """The fit's kernel from the ``kernel`` and ``lengthscale`` parameters, on ``device`` in ``dtype``.

    A shortcut name becomes its GPyTorch kernel (one lengthscale per feature with ``ard``; wrapped in a
    ``ScaleKernel`` when hyperparameters are learned, the amplitude being one of them); a kernel object is
    copied, never changed.
    """
    kernel_param, lengthscale = params["kernel"], params["lengthscale"]
    if not isinstance(kernel_param, str):
        return copy.deepcopy(kernel_param).to(device=device, dtype=dtype)
    kernel = make_kernel(kernel_param, lengthscale)
    if ard and n_features is not None:
        # one lengthscale per input dimension, all starting at the given value
        nu = {"nu": kernel.nu} if isinstance(kernel, gpytorch.kernels.MaternKernel) else {}
        ard_kernel = type(kernel)(ard_num_dims=n_features, **nu)
        ard_kernel.lengthscale = kernel.lengthscale.detach().expand(1, n_features)
        kernel = ard_kernel
    if params["learn"] is not None and kernel_param.lower() != "linear":
        # a GP's amplitude is a hyperparameter too: learned with the lengthscales (starts at 1)
        kernel = gpytorch.kernels.ScaleKernel(kernel)
    kernel = kernel.to(device=device, dtype=dtype)
    if lengthscale is not None:
        # GPyTorch builds the parameter in float32 (0.8 becomes 0.800000012): set it again in the fit's dtype
        for module in kernel.modules():
            if getattr(module, "has_lengthscale", False):
                module.lengthscale = torch.full_like(module.lengthscale, float(lengthscale))
    return kernel


def check_distributed_plugins(plan: FitPlan) -> None:
    """Refuse, before any work, plugins that do not declare the ``distributed`` capability."""
    caps = plan.solver.capabilities
    if not caps.distributed:
        # a solver may say why it is not distributed and what to use instead (eigenpro2)
        reason = caps.distributed_refusal
        raise ValueError(
            f"solver {plan.solver.name!r} does not support distributed fitting (distributed=True): "
            + (
                f"{reason}."
                if reason
                else "it does not declare Capabilities(distributed=True). Use solver='falkon', or fit on one process "
                "holding all rows."
            )
        )
    if plan.selector is not None and not plan.selector.capabilities.distributed:
        raise ValueError(
            f"centers={plan.selector.name!r} does not support distributed fitting (distributed=True): the "
            "selector does not declare Capabilities(distributed=True). Use centers='uniform' or explicit centers."
        )


def fit_memory(plan: FitPlan, X: Tensor, k: int, n_total: int) -> FitMemory | None:
    """The estimated peak memory of this process's part of the fit (:mod:`.memory_estimate`), or None.

    The exact solver factors the ``n x n`` kernel matrix in place and hands that factor to the variance
    (one ``n x n`` array and one row block, no stored kernel rows); a solver on centers counts its ``M x M`` arrays, the
    stored ``K_nM`` under its ``kernel_cache`` option, and the variance's factors when the fit builds them
    (a fit that learns). None where M is left to the selector, or where this rank holds no rows. The
    converted ``X`` already exists when this runs: only the fit's further copies are counted.
    """
    n, d = X.shape
    if n == 0:
        return None
    caps = plan.solver.capabilities
    if caps.uses_centers:
        if plan.n_centers is not None:
            m = plan.n_centers
        elif plan.explicit_centers is not None:
            m = len(plan.explicit_centers)
        else:
            return None
        sizes: dict[str, Any] = {
            "kernel_cache": "never" if plan.solver.options.get("kernel_cache") == "never" else "auto",
            "variance": plan.objective is not None and for_target(caps.target).has_variance,
        }
    else:
        m = n_total
        sizes = {"kernel_cache": "never", "solver_arrays": 1, "variance": False, "block_buffers": 1}
    learn_rows = 0
    if plan.objective is not None and "subset" in plan.objective.options:
        subset = plan.objective.options["subset"]
        learn_rows = n_total if subset is None else subset
        refine = plan.learn_options.loop.get("refine_subset") if plan.learn_options is not None else None
        learn_rows = max(learn_rows, refine or 0)
    return estimate_fit_memory(
        n,
        d,
        n_centers=m,
        k=k,
        dtype=X.dtype,
        normalize_X=plan.normalize_X,
        normalize_y=plan.normalize_y,
        budget=int(settings.memory_budget.value(X.device)),
        learn_rows=min(learn_rows, n),
        **sizes,
    )


def _recipe_report(params: Mapping[str, Any], plan: FitPlan, X: Tensor, k: int, n_total: int) -> dict[str, Any] | None:
    """``recipe_``: the recipe's choices and reasons; with ``solver="auto"`` also its ``"memory"`` estimate,
    checked first (:func:`_check_memory`). None when nothing was left to the recipe."""
    recipe = None if plan.recipe is None else plan.recipe.as_dict()
    if params["solver"] == AUTO:
        # the recipe chose the solver and M: the fit's peak memory is told, and checked, before it is spent
        memory = fit_memory(plan, X, k, n_total)
        if memory is not None:
            _check_memory(plan, memory, n_total, X.device)
            recipe["memory"] = memory.as_dict()
    return recipe


def _check_memory(plan: FitPlan, memory: FitMemory, n_total: int, device: torch.device) -> None:
    """Refuse a fit whose estimated peak exceeds the available memory, naming the option to change."""
    if plan.solver.capabilities.uses_centers:
        m = plan.n_centers if plan.n_centers is not None else len(plan.explicit_centers)
        check_fit_memory(memory, n_centers=m, device=device)
        return
    check_memory(
        memory.peak,
        what=f"solver {plan.solver.name!r} on n={n_total:,} rows ({memory.describe()})",
        remedy=(
            "lower kgp.settings.max_exact_size or kgp.settings.memory_budget below n (solver='auto' then fits "
            "FALKON on centers), or fit in float32 (dtype='float32')"
        ),
        device=device,
    )


def fit_model(
    params: Mapping[str, Any],
    X: Tensor,
    Y: Tensor,
    channel: Any = None,
    *,
    plan: FitPlan | PendingPlan | None = None,
    validation: tuple[Tensor, Tensor] | None = None,
    validation_metric: Callable[[Tensor, Tensor], float] | None = None,
) -> ModelFit:
    """Fit the estimator's parameters ``params`` (``get_params()``) on the rows ``X`` (n x d), ``Y`` (n x k):
    the :class:`ModelFit` the estimator's fitted attributes are written from.

    Parameters
    ----------
    params:
        The estimator's constructor parameters; ``callback`` and ``progress`` report the iterations.
    X, Y:
        The converted inputs and encoded targets (this rank's rows in a distributed fit, possibly none).
    channel:
        None for a fit in one process, else the distributed fit's channel (:func:`kgp.distributed.guarded`).
    plan:
        What :func:`kgp.fitting.plan.prepare_plan` made of ``params`` before the caller converted the data
        (so that a bad parameter is reported before bad data); None: prepared here.
    validation, validation_metric:
        ``(X_val, Y_val)`` in the user's units, and the metric iterative solvers report on it (None: the
        mean squared error).

    Raises
    ------
    ValueError, TypeError
        A parameter or its combination with the data (naming it), ranks that disagree, a plugin that is
        not distributed in a distributed fit.
    kgp.InsufficientMemoryError
        With ``solver="auto"``: the estimated peak exceeds the available memory (before any allocation).
    """
    shard = None
    if channel is not None:
        # the dtype is compared with the parameters (describe_fit below), by name
        counts = {"number of features": X.shape[1], "number of outputs": Y.shape[1]}
        shard = dist.shard_rows(channel, X.shape[0], **counts)
    comm = comm_for(shard, X.shape[0])
    shape = DataShape(comm.n_total, X.shape[1], Y.shape[1], X.dtype, X.device, shard is not None)
    plan = _complete(params, plan, shape)
    kernel = build_kernel(params, plan.ard, X.dtype, X.device, X.shape[1])
    if shard is not None:
        # every rank fits the same model, or every rank raises the same ValueError naming the parameter,
        # before any collective whose size or meaning depends on the parameters
        comm.agree(describe_fit(params, plan, kernel, X, Y))
        check_distributed_plugins(plan)
    check_n_centers(plan.n_centers, comm.n_total)
    streams = RandomStreams(broadcast_seed(comm, draw_seed(params["random_state"])))
    recipe = _recipe_report(params, plan, X, Y.shape[1], comm.n_total)
    rows, input_scaling = scale_inputs(TrainingRows(X, Y, comm), plan.normalize_X)
    if validation is not None and input_scaling is not None:  # the predictor works in standardised inputs
        validation = (input_scaling.apply(validation[0]), validation[1])
    rows, scaling = scale_targets(rows, plan.normalize_y)
    start = time.perf_counter()
    monitor = _monitor(params, plan, rows, scaling, validation, validation_metric)
    try:
        centers, learned = select_and_learn(plan, rows, kernel, streams, monitor, input_scaling)
        if plan.objective is not None:
            monitor.close()  # the solver's stage starts its own bar
            # the learning reports no predictions; the solver's are offset by the learned mean
            monitor.metric = _in_target_units(validation_metric, learned.mean, scaling, plan.normalize_y)
        result = finish(plan, rows, centers, learned, scaling, streams, monitor, input_scaling)
    finally:
        monitor.close()
    return ModelFit(
        result=result,
        solver=plan.solver,
        recipe=recipe,
        seed=streams.seed,
        n_features=X.shape[1],
        fit_time=time.perf_counter() - start,
        chunks_seen=1,  # a partial_fit continuing this fit draws from the next solve streams
        shard=shard,
    )


def fit_chunk(
    params: Mapping[str, Any],
    X: Tensor,
    Y: Tensor,
    previous: ChunkState | None = None,
    plan: FitPlan | PendingPlan | None = None,
) -> ModelFit:
    """One chunk of a streaming fit (``partial_fit``): the solver's ``partial_fit`` on ``X``, ``Y``.

    ``previous``: the fit so far (None: the first chunk, which draws the seed and builds the kernel);
    ``plan``: as for :func:`fit_model`.
    Chunk ``c`` draws from the solve stream of chunk ``c`` (:class:`kgp.fitting.RandomStreams`).

    Raises
    ------
    ValueError
        ``solver="auto"``, a solver without ``partial_fit``, ``learn``, ``normalize_y`` or ``normalize_X``
        (they need the whole training set), chunks whose widths differ from the first's.
    """
    if params["solver"] == AUTO:
        raise ValueError(
            "partial_fit: solver='auto' chooses a solver from the whole training set; name a streaming "
            "solver (e.g. solver='dsg')"
        )
    plan = _complete(params, plan, DataShape(X.shape[0], X.shape[1], Y.shape[1], X.dtype, X.device))
    if not plan.solver.capabilities.partial_fit:
        raise ValueError(f"solver {params['solver']!r} does not support partial_fit")
    if plan.objective is not None or plan.normalize_y or plan.normalize_X:
        raise ValueError("partial_fit: learn, normalize_y and normalize_X need the whole training set; use fit")
    if previous is None:
        seed, kernel = draw_seed(params["random_state"]), build_kernel(params, plan.ard, X.dtype, X.device, X.shape[1])
        chunks, history, predictor, spent = 0, [], None, 0.0
    else:
        if X.shape[1] != previous.n_features or Y.shape[1] != previous.n_outputs:
            raise ValueError(
                f"partial_fit: expected chunks of {previous.n_features} features and {previous.n_outputs} "
                f"output(s) like the first chunk, got {X.shape[1]} and {Y.shape[1]}"
            )
        seed, kernel, chunks = previous.seed, previous.kernel, previous.chunks_seen
        history, predictor, spent = list(previous.history), previous.predictor, previous.fit_time
    start = time.perf_counter()
    monitor = Monitor(params["callback"], bool(params["progress"]))
    rows = TrainingRows(X, Y, LocalComm(X.shape[0]))
    learned = FitHyperparameters(
        kernel, float(params["noise"]), torch.zeros(Y.shape[1], dtype=Y.dtype, device=Y.device)
    )
    try:
        posterior = solve(
            plan,
            rows,
            None,
            learned,
            TargetScaling.identity(Y),
            RandomStreams(seed),
            monitor,
            chunk=chunks,
            previous=predictor,
        )
    finally:
        monitor.close()
    return ModelFit(
        result=FitResult(posterior, None, learned, history + list(monitor.history)),
        solver=plan.solver,
        recipe=None,
        seed=seed,
        n_features=X.shape[1],
        fit_time=time.perf_counter() - start + spent,
        chunks_seen=chunks + 1,
    )


@dataclass(frozen=True)
class LearnedOnly:
    """What :func:`learn_only` returns: the learned hyperparameters and the scalings they apply to."""

    learned: FitHyperparameters
    x_mean: Tensor | None = None
    x_std: Tensor | None = None
    y_mean: Tensor | None = None
    y_std: Tensor | None = None

    def as_dict(self) -> dict[str, Any]:
        """``kernel``, ``noise``, ``mean``, ``history`` and the scalings (None when off)."""
        learned = self.learned
        return {
            "kernel": learned.kernel,
            "noise": learned.noise,
            "mean": learned.mean,
            "history": learned.history,
            "x_mean": self.x_mean,
            "x_std": self.x_std,
            "y_mean": self.y_mean,
            "y_std": self.y_std,
        }


def learn_only(
    params: Mapping[str, Any], X: Tensor, Y: Tensor, plan: FitPlan | PendingPlan | None = None
) -> LearnedOnly:
    """Select the centers and learn the hyperparameters of ``params`` on ``X``, ``Y``, without solving.

    ``plan``: as for :func:`fit_model`.

    Raises
    ------
    ValueError
        ``learn`` is None, or a parameter is invalid (naming it).
    """
    if params["learn"] is None:
        raise ValueError("fit_hyperparameters: set learn (e.g. learn='auto') to learn hyperparameters")
    plan = _complete(params, plan, DataShape(X.shape[0], X.shape[1], Y.shape[1], X.dtype, X.device))
    streams = RandomStreams(draw_seed(params["random_state"]))
    kernel = build_kernel(params, plan.ard, X.dtype, X.device, X.shape[1])
    rows, input_scaling = scale_inputs(TrainingRows(X, Y, LocalComm(X.shape[0])), plan.normalize_X)
    rows, scaling = scale_targets(rows, plan.normalize_y)
    monitor = Monitor(params["callback"], bool(params["progress"]))
    try:
        centers = select_centers(plan, rows, kernel, streams, input_scaling)
        learned = learn(plan, rows, kernel, centers, streams, monitor)
    finally:
        monitor.close()
    return LearnedOnly(
        learned,
        x_mean=None if input_scaling is None else input_scaling.mean,
        x_std=None if input_scaling is None else input_scaling.std,
        y_mean=scaling.mean if plan.normalize_y else None,
        y_std=scaling.std if plan.normalize_y else None,
    )


def _monitor(
    params: Mapping[str, Any],
    plan: FitPlan,
    rows: TrainingRows,
    scaling: TargetScaling,
    validation: tuple[Tensor, Tensor] | None,
    validation_metric: Callable[[Tensor, Tensor], float] | None,
) -> Monitor:
    """The fit's monitor: the callback, one progress bar (rank 0), the validation metric in target units."""
    # the solver fits (y - shift) / scale - mean: validation predictions are mapped back before scoring
    metric = validation_metric
    if plan.normalize_y or plan.objective is not None:
        Y = rows.Y
        zero = torch.zeros(Y.shape[1], dtype=Y.dtype, device=Y.device)
        metric = _in_target_units(validation_metric, zero, scaling, plan.normalize_y)
    # one rank's stop request stops all; one progress bar
    progress = bool(params["progress"]) and rows.comm.rank == 0
    if rows.shard is None:
        return Monitor(params["callback"], progress, validation, metric)
    return ShardedMonitor(rows.shard, params["callback"], progress, validation, metric)


def _complete(params: Mapping[str, Any], plan: FitPlan | PendingPlan | None, shape: DataShape) -> FitPlan:
    """The fit's plan: ``plan`` as prepared (or prepared now), resolved for the data's ``shape`` if it waited."""
    prepared = prepare_plan(params) if plan is None else plan
    return prepared.resolve(shape) if isinstance(prepared, PendingPlan) else prepared


def _in_target_units(
    metric: Callable[[Tensor, Tensor], float] | None, mean: Tensor, scaling: TargetScaling, scaled: bool
) -> Callable[[Tensor, Tensor], float]:
    """``metric`` applied to the solver's predictions mapped back to the targets' units: plus the constant
    ``mean``, then (``scaled``: ``normalize_y``) times the targets' std plus their mean."""

    def scored(pred: Tensor, target: Tensor) -> float:
        out = pred.unsqueeze(-1) if pred.dim() == 1 else pred
        out = out + mean
        if scaled:
            out = out * scaling.std + scaling.mean
        if metric is not None:
            return metric(out, target)
        return float(((out.reshape(target.shape) - target) ** 2).mean())

    return scored
