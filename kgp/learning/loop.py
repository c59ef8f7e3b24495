"""kgp's hyperparameter optimisation loop (the objective plugins only supply the loss).

The loop trains, with ``torch.optim``:

- every trainable GPyTorch parameter of the kernel, in GPyTorch's *raw* parametrisation, so the
  kernel's own constraints (positive lengthscales, outputscale, ...) hold at every step;
- the noise variance of a GPyTorch ``GaussianLikelihood`` under ``GreaterThan(min_noise)`` (its
  softplus raw parameter);
- a constant mean per output: a GPyTorch ``ConstantMean`` with one constant per output
  (``batch_shape=(k,)``).

The minimised value is the objective per data point minus the GPyTorch prior log-densities of the
kernel, the likelihood (``learn_options['noise_prior']``) and the mean, divided by n, which is GPyTorch's
``ExactMarginalLogLikelihood`` convention (its value is ``(log p(y) + log priors) / n``) with the sign
flipped. The priors are read through ``named_priors()`` of one module holding the three parts.

:func:`learn_hyperparameters` checks its inputs and runs the stages of a :class:`LearningRun`: the
first stage (Adam, extended while the objective still falls and polished by L-BFGS, or L-BFGS alone),
then the optional refine stage on more rows, each a method over the run's explicit state (the trained
tensors, the history of values, the best point, the optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .. import settings
from ..diagnostics import DivergenceError
from ..linalg import NotPSDError
from ..monitor import Monitor
from ..options import ResolvedOptions, resolve_options
from ..problem_data import Centers
from ..registry import get_objective
from .bounds import LengthscaleFloors
from .loop_options import LEARN_OPTIONS, ResolvedLearnOptions, split_learn_options
from .outcome import BestPoint, report_learning, still_falling, white_noise_nll
from .parts import LearnedParts
from .problem import LearningProblem, ObjectiveLoss
from .refit import refit_scale_and_noise

__all__ = ["LEARN_OPTIONS", "LearnResult", "LearningRun", "learn_hyperparameters"]

_DEFAULT_LR = {"adam": 0.1, "lbfgs": 1.0}


@dataclass
class LearnResult:
    """What :func:`learn_hyperparameters` found.

    Attributes
    ----------
    kernel:
        The kernel object given, with the learned hyperparameters (trained in place).
    noise:
        Learned noise variance sigma^2.
    mean:
        Learned constant mean, one value per output (shape ``(k,)``).
    history:
        Minimised value (objective per point minus priors / n) at each evaluation: before each Adam
        update; at each function evaluation of L-BFGS (its line search included).
    options:
        The merged options (loop's and objective's).
    refine:
        With ``refine_subset``: ``{"subset": rows, "first_evaluation": i, "evaluations": m, "start": v0,
        "first_stage_best": v1}`` (the refine stage's evaluations are ``history[i - 1:]``, ``v0`` its value at
        the first stage's best point, ``v1`` the first stage's best value on its own rows); ``best_value``
        and ``terms`` are then the refine stage's. None without it, or when it did not run: the first stage
        stopped early or had not converged (its objective still falling,
        :func:`kgp.learning.outcome.still_falling`), or ``refine_subset`` rows are no more than ``subset``'s
        after capping both at n.
    refit:
        With ``refit_subset``: what the refit changed (:class:`kgp.learning.refit.RefitResult` as a
        dict), else None.
    best_value, best_step:
        The minimised value of the returned hyperparameters and the evaluation (1-based index into
        ``history``) where it was reached; ``best_step`` is ``len(history) + 1`` when the point after the
        last update was the best (it is evaluated once more, without a gradient, to know).
    stopped:
        Why the loop ended: ``"budget"`` (all iterations ran), ``"callback"`` (the monitor's callback
        asked), ``"interrupted"`` (Ctrl-C), or ``"failed: ..."`` (a later step failed; the best earlier
        point is returned and a :class:`kgp.ConvergenceWarning` says so).
    terms:
        For an objective whose value is a negative log likelihood per point (``Capabilities(likelihood=True)``): the
        number of (row, output) terms it averages, so ``-best_value * terms`` is the log marginal
        likelihood of the rows it used (a lower bound for ``sgpr``); None for other objectives.
    """

    kernel: gpytorch.kernels.Kernel
    noise: float
    mean: Tensor
    history: list[float] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    refit: dict[str, Any] | None = None
    refine: dict[str, Any] | None = None
    best_value: float = math.nan
    best_step: int = 0
    stopped: str = "budget"
    terms: int | None = None


def learn_hyperparameters(
    objective: str,
    X: Tensor,
    y: Tensor,
    kernel: gpytorch.kernels.Kernel,
    *,
    noise: float,
    mean: Tensor | float = 0.0,
    centers: Centers | None = None,
    options: dict[str, Any] | ResolvedLearnOptions | None = None,
    generator: torch.Generator | None = None,
    monitor: Monitor | None = None,
    shard: Any = None,
    plugin: Any = None,
) -> LearnResult:
    """Minimise the objective plugin ``objective`` over the kernel's hyperparameters, noise and mean.

    Parameters
    ----------
    objective:
        Name of a registered objective (``kgp plugins`` lists them), e.g. ``"sgpr"`` or ``"exact"``.
    X, y:
        ``n x d`` inputs and ``n`` or ``n x k`` targets (same dtype and device).
    kernel:
        GPyTorch kernel on X's device and dtype; **trained in place** (pass a copy to keep yours).
    noise:
        Initial noise variance sigma^2 (> ``min_noise``).
    mean:
        Initial constant mean (a number or one value per output).
    centers:
        Inducing points for objectives with ``uses_centers`` (held fixed).
    options:
        ``learn_options``: the loop's (:data:`LEARN_OPTIONS`) and the objective's options, as a dict (validated
        here) or as the fit plan's :class:`~kgp.learning.loop_options.ResolvedLearnOptions` (validated there).
    generator:
        Seeded CPU generator for the objective's random draws (default: seed 0).
    monitor:
        Receives one report per step (``extras``: ``stage="learn"``, ``objective``, ``noise``); the
        caller owns and closes it.
    shard:
        None, or a :class:`kgp.distributed.Shard`: X and y are this rank's rows; the objective must
        declare ``Capabilities(distributed=True)`` and returns the same loss and gradient on every rank,
        so every rank takes the same optimizer steps.
    plugin:
        The objective plugin itself, when the caller has resolved it already (a fit plan has); otherwise
        ``objective`` is looked up in the registry.

    Returns
    -------
    LearnResult

    Raises
    ------
    ValueError
        Unknown objective (the message lists the available ones), unknown or invalid option, a kernel
        without trainable parameters, an initial noise not above ``min_noise``, missing centers.
    kgp.DivergenceError
        The objective became NaN or infinite; the message names the step and the hyperparameters.

    Notes
    -----
    The stages run in :class:`LearningRun`; this function checks the inputs, builds the problem, runs
    the stages and collects the result (over 80 lines only by its signature and this docstring).
    """
    obj = plugin if plugin is not None else get_objective(objective)
    loop, obj_options = _checked_options(objective, obj, options, shard)
    Y = y.unsqueeze(-1) if y.dim() == 1 else y
    if obj.capabilities.uses_centers and centers is None:
        raise ValueError(f"objective {objective!r} needs centers (inducing points); pass centers or n_centers")
    params = _trainable(kernel, objective)
    parts = LearnedParts(kernel, _initial_noise(noise, Y, loop, shard), mean, Y.shape[1], loop, X.dtype, X.device)
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    problem = LearningProblem(
        X=X, y=Y, kernel=kernel, centers=centers, options=obj_options, generator=generator, shard=shard
    )
    run = LearningRun(objective, obj, problem, parts, params, loop, monitor if monitor is not None else Monitor())
    with torch.enable_grad(), LengthscaleFloors(kernel, _feature_scale(X, shard), loop["min_lengthscale"]):
        run.first_stage()
        refine = run.refine()
    run.check_finite()
    for p in params:
        p.grad = None
    learned_noise, learned_mean = float(parts.noise().detach()), parts.mean_module.constant.detach().clone()
    refit = None
    if loop["refit_subset"] is not None:
        learned_noise, refit = _refit(problem, loop, learned_noise, learned_mean)
    return LearnResult(
        kernel=kernel,
        noise=learned_noise,
        mean=learned_mean,
        history=run.history,
        options={**loop, **obj_options},
        refit=refit,
        refine=refine,
        best_value=run.best.value,
        best_step=run.best.step,
        stopped=run.stopped,
        terms=run.terms,
    )


def _trainable(kernel: gpytorch.kernels.Kernel, objective: str) -> list[Tensor]:
    """The kernel's parameters with ``requires_grad``; a ValueError naming ``kernel`` when there are none."""
    params = [p for p in kernel.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"kernel: learn={objective!r} needs a kernel with trainable parameters, but {type(kernel).__name__} "
            "has none (or all have requires_grad=False)"
        )
    return params


def _refit(problem: LearningProblem, loop: dict[str, Any], noise: float, mean: Tensor) -> tuple[float, dict]:
    """``refit_subset``: the outputscale and noise re-estimated by the exact likelihood (:mod:`.refit`)."""
    noise, result = refit_scale_and_noise(
        problem.X,
        problem.y,
        problem.kernel,
        noise=noise,
        mean=mean,
        rows=loop["refit_subset"],
        min_noise=loop["min_noise"],
        learn_noise=loop["learn_noise"],
        generator=problem.generator,
    )
    return noise, result.as_dict()


def _checked_options(
    objective: str, obj: Any, options: dict[str, Any] | ResolvedLearnOptions | None, shard: Any
) -> tuple[dict[str, Any], ResolvedOptions]:
    """The loop's and the objective's options (resolved here unless the fit plan did), checked for a shard."""
    if shard is not None and not obj.capabilities.distributed:
        raise ValueError(
            f"learn={objective!r} does not support distributed fitting (distributed=True): the objective does not "
            "declare Capabilities(distributed=True). Use learn='sgpr', or learn='exact' with "
            "learn_options={'subset': S}"
        )
    if isinstance(options, ResolvedLearnOptions):  # validated by the fit plan: not again
        loop, obj_options = options.loop, options.objective
    else:
        loop, obj_options = split_learn_options(objective, obj, options)
    if shard is not None and loop["refit_subset"] is not None:
        raise ValueError(
            "learn_options['refit_subset'] is not supported in a distributed fit (its subset is not gathered "
            "across ranks); drop it"
        )
    return loop, obj_options


def _initial_noise(noise: float, Y: Tensor, loop: dict[str, Any], shard: Any) -> float:
    """The starting noise variance: ``initial_noise_fraction`` of the targets' variance, else ``noise``."""
    if loop["initial_noise_fraction"] is not None:
        variance = _target_variance(Y, shard)
        if variance > 0:  # constant targets: the model's noise
            noise = loop["initial_noise_fraction"] * variance
    floor = loop["min_noise"]
    if not noise > floor:
        raise ValueError(
            f"noise: the initial noise variance {noise!r} must be above learn_options['min_noise']={floor!r}"
        )
    return noise


class LearningRun:
    """One run of the learning loop, its stages as methods over explicit state.

    The first stage (:meth:`first_stage`: Adam, extended while still falling up to ``max_iterations`` and
    polished by L-BFGS, or L-BFGS alone) and the optional refine stage (:meth:`refine`) each evaluate the
    objective through :meth:`_evaluate` (one evaluation = one monitor step) and keep the best point.

    Attributes
    ----------
    trained:
        The trained tensors in the order L-BFGS flattens them: the kernel's raw parameters, the raw noise,
        the mean's constant (those with ``requires_grad``).
    history:
        The minimised value at each evaluation (:attr:`LearnResult.history`).
    best:
        The best point of the current stage (:class:`kgp.learning.outcome.BestPoint`).
    stopped:
        How the last stage ended: ``"budget"``, ``"callback"``, ``"interrupted"`` or ``"failed: ..."``.
    loss, terms:
        The objective's prepared loss (:class:`ObjectiveLoss`) and its terms (None unless the objective
        declares ``likelihood``).
    """

    def __init__(
        self,
        name: str,
        objective: Any,
        problem: LearningProblem,
        parts: LearnedParts,
        params: list[Tensor],
        loop: dict[str, Any],
        monitor: Monitor,
    ) -> None:
        self.name, self.objective, self.problem, self.parts = name, objective, problem, parts
        self.loop, self.monitor = loop, monitor
        # L-BFGS flattens its parameters in this order: the kernel's, the noise, the mean
        extra = [p for p in (parts.likelihood.raw_noise, parts.mean_module.raw_constant) if p.requires_grad]
        self.trained = params + extra
        self.history: list[float] = []
        self.best = BestPoint(self.trained)
        self.stopped = "budget"
        self.loss: ObjectiveLoss | None = None
        self.terms: int | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.white_noise: float | None = None
        self.lr = loop["lr"] if loop["lr"] is not None else _DEFAULT_LR[loop["optimizer"]]
        self.draw_state = problem.generator.get_state()  # the refine stage draws the same permutation again

    # ------------------------------------------------------------------ stages
    def first_stage(self) -> None:
        """Prepare the loss, run the chosen optimizer, return to the best point and report how it went."""
        self._prepare(self.problem)
        iterations = self.loop["iterations"]
        self.monitor.start(total=iterations, desc=f"learn {self.name}")
        self.white_noise = white_noise_nll(self.objective, self.problem.y, self.problem.shard)
        body = self._lbfgs_stage if self.loop["optimizer"] == "lbfgs" else self._adam_stage
        self.stopped = self._run_stage(body, needs_a_point=True)
        if self.stopped in ("budget", "callback"):
            self._offer_final_point()
        self.best.restore()
        total = max(iterations, len(self.history))
        report_learning(self.name, self.stopped, self.best, self.history, total, self.lr, self.white_noise)

    def refine(self) -> dict[str, Any] | None:
        """With ``refine_subset``: L-BFGS from the first stage's best point on more rows (a superset of them).

        Runs only after a first stage that used its whole budget and converged, and when the refine rows
        outnumber the first stage's. Returns :attr:`LearnResult.refine` (None when it did not run).
        """
        rows, n = self.loop["refine_subset"], self.problem.n
        if (
            rows is None
            or self.stopped != "budget"
            or min(rows, n) <= min(self.problem.options["subset"], n)
            or self._still_falling()
        ):
            return None
        # the first stage's rows are a random subset, and which rows were drawn moves the learned GP more
        # than its optimizer does (docs/benchmarks/gp-default.md, "Refine"): a few L-BFGS evaluations on
        # a larger subset from its converged point correct the draw, at (rows / subset)^3 the cost of one
        # of its steps. Not after a first stage still falling: there they would continue its descent at
        # that cost (bike: test RMSE 0.010 -> 0.042, worse than SGPR's, while the NLPD improved)
        first, first_terms, start = self.best, self.terms, len(self.history) + 1
        self.problem.generator.set_state(self.draw_state)
        options = self.problem.options
        wider = resolve_options(options.owner, self.objective, {**options, "subset": rows})
        self._prepare(replace(self.problem, options=wider))
        self.best = BestPoint(self.trained)  # the values of another objective: not comparable with the first's
        budget = self.loop["refine_iterations"]
        self.optimizer = self._lbfgs(_DEFAULT_LR["lbfgs"], budget)
        # a failure here falls back on the first stage's point (below)
        self.stopped = self._run_stage(lambda: self.optimizer.step(self._closure), needs_a_point=False)
        if self.stopped in ("budget", "callback"):
            self._offer_final_point()
        if self.best.step == 0:  # no evaluation on the wider rows succeeded: the first stage's point stands
            self.best, self.terms = first, first_terms
        self.best.restore()
        if self.stopped != "budget":  # the refine stage's own few evaluations are not judged for convergence
            report_learning(self.name, self.stopped, self.best, self.history, start - 1 + budget, _DEFAULT_LR["lbfgs"])
        return {
            "subset": min(rows, n),
            "first_evaluation": start,
            "evaluations": len(self.history) - start + 1,
            "start": self.history[start - 1] if len(self.history) >= start else math.nan,
            "first_stage_best": first.value,
        }

    def check_finite(self) -> None:
        """Raise :class:`kgp.DivergenceError` if a trained tensor ended non-finite."""
        if not all(bool(torch.isfinite(t).all()) for t in self.trained):
            nan = torch.tensor(float("nan"))
            _check_finite(nan, self.name, len(self.history) + 1, *self._state())

    # ------------------------------------------------------------------ the first stage's optimizers
    def _adam_stage(self) -> None:
        iterations = self.loop["iterations"]
        self.optimizer = torch.optim.Adam(self.trained, lr=self.lr)
        for _ in range(iterations):
            self._adam_step()
        limit = self.loop["max_iterations"] or 0
        chunk = max(1, iterations // 4)
        while len(self.history) < limit and self._still_falling():
            for _ in range(min(chunk, limit - len(self.history))):
                self._adam_step()
        if self.loop["polish_iterations"] and self._still_falling():
            self._polish()

    def _adam_step(self) -> None:
        self.best.offer(self._evaluate(), len(self.history))
        self.optimizer.step()

    def _polish(self) -> None:
        # Adam's fixed step size crawls in the narrow valleys of short lengthscales and small
        # noise (bike: still falling after 300 steps); L-BFGS from Adam's best point converges there
        # in tens of evaluations. Only while still falling: where Adam has converged, converging a
        # 3,000-row subset's likelihood further helped two sets and hurt two (keggdirected's NLPD
        # fell below SGPR's) (docs/benchmarks/gp-default.md, "Polish")
        self.best.restore()
        self.optimizer = self._lbfgs(_DEFAULT_LR["lbfgs"], self.loop["polish_iterations"])
        self.optimizer.step(self._closure)

    def _lbfgs_stage(self) -> None:
        self.optimizer = self._lbfgs(self.lr, self.loop["iterations"])
        self.optimizer.step(self._closure)

    def _lbfgs(self, step: float, evaluations: int) -> torch.optim.LBFGS:
        # its own iteration and evaluation counts bound the work
        return torch.optim.LBFGS(
            self.trained, lr=step, max_iter=evaluations, max_eval=evaluations, line_search_fn="strong_wolfe"
        )

    # ------------------------------------------------------------------ evaluations
    def _prepare(self, problem: LearningProblem) -> None:
        self.loss = ObjectiveLoss.from_prepared(self.objective.prepare(problem), f"objective {self.name!r}")
        self.terms = self.loss.terms if self.objective.capabilities.likelihood else None

    def _total(self) -> Tensor:
        """The minimised value: the objective per point minus the priors' log-densities / n."""
        parts = self.parts
        value = self.loss(parts.noise(), parts.mean_module.constant)
        for _, module, prior, closure, _ in parts.named_priors():
            value = value - prior.log_prob(closure(module)).sum() / self.problem.n
        return value

    def _evaluate(self) -> Tensor:
        """One objective evaluation with its gradient = one reported step (Adam: one per update; L-BFGS:
        each evaluation of its line search)."""
        self.optimizer.zero_grad()
        step = len(self.history) + 1
        try:
            value = self._total()
        except NotPSDError as exc:
            # an optimizer trial point (L-BFGS line searches reach far) where a factorization failed:
            # name the step and the values, as for a non-finite objective
            kernel, noise, mean = self._state()
            raise NotPSDError(
                f"learn {self.name!r}: step {step} failed: {exc}. Hyperparameters at that step: "
                f"{_describe(kernel, float(noise.detach()), mean)}. Remedy: "
                "learn_options={'optimizer': 'adam'} (bounded steps), a smaller 'lr', or a larger 'min_noise'"
            ) from exc
        _check_finite(value, self.name, step, *self._state())
        value.backward()
        self.history.append(float(value.detach()))
        noise_now = float(self.parts.noise().detach())
        if self.monitor.step(step, None, stage="learn", objective=self.history[-1], noise=noise_now):
            raise _Stop
        return value

    def _closure(self) -> Tensor:
        value = self._evaluate()
        self.best.offer(value, len(self.history))
        return value

    def _offer_final_point(self) -> None:
        # the point after the last update has not been evaluated: compare it with the best one
        with torch.no_grad():
            try:
                final = float(self._total())
            except NotPSDError:
                final = math.nan
        self.best.offer_final(final, len(self.history) + 1)

    def _run_stage(self, body: Callable[[], None], *, needs_a_point: bool) -> str:
        """Run one stage; how it ended: "budget", "callback", "interrupted" or "failed: ..."."""
        try:
            body()
        except _Stop:
            return "callback"  # the user's callback asked to stop; keep the best values
        except KeyboardInterrupt:
            # Ctrl-C ends the learning, not the fit, once a point exists (settings.interrupted_learning): the
            # solve runs with the best point found; a second Ctrl-C stops the fit. Ranks of a distributed fit
            # would disagree on where they stopped, so there it always stops the fit.
            stop_fit = settings.interrupted_learning.value() == "stop_fit"
            if stop_fit or self.problem.shard is not None or (needs_a_point and self.best.step == 0):
                raise
            return "interrupted"
        except (DivergenceError, NotPSDError) as exc:
            if needs_a_point and self.best.step == 0:  # no point was evaluated: nothing to fall back to
                raise
            return f"failed: {exc}"
        return "budget"

    def _still_falling(self) -> bool:
        return still_falling(self.history, self.best.value, self.white_noise)

    def _state(self) -> tuple[gpytorch.kernels.Kernel, Tensor, Tensor]:
        return self.problem.kernel, self.parts.noise(), self.parts.mean_module.constant


def _target_variance(Y: Tensor, shard: Any) -> float:
    """The targets' variance (two passes, mean over outputs); in a distributed fit of all ranks' rows."""
    with torch.no_grad():
        Yd = Y.detach().double()
        count = torch.tensor([float(Y.shape[0])], dtype=torch.float64, device=Y.device)
        total = Yd.sum(dim=0)
        if shard is not None:
            count, total = shard.all_reduce_(count), shard.all_reduce_(total)
        squares = (Yd - total / count).square().sum(dim=0)
        if shard is not None:
            squares = shard.all_reduce_(squares)
        # the population variance, as normalize_y's std (scikit-learn's): standardised targets give 1
        return float((squares / count).mean())


def _feature_scale(X: Tensor, shard: Any) -> Tensor:
    """``max_i |x_ij|`` per column over every rank's rows (a rank may hold none)."""
    local = X.detach().abs().amax(0) if X.shape[0] else X.new_zeros(X.shape[1])
    if shard is None:
        return local
    return shard.gather_rows(local.double().tolist()).amax(0).to(X)


class _Stop(Exception):
    """The monitor's callback returned True."""


def hyperparameter_values(kernel: gpytorch.kernels.Kernel) -> dict[str, list[float] | float]:
    """The kernel's hyperparameters in their constrained (user-facing) form, e.g. ``{"lengthscale": [...]}``."""
    out: dict[str, list[float] | float] = {}
    for name, raw, constraint in kernel.named_parameters_and_constraints():
        value = constraint.transform(raw) if constraint is not None else raw
        flat = value.detach().reshape(-1).tolist()
        out[name.replace("raw_", "")] = flat[0] if len(flat) == 1 else flat
    return out


def _check_finite(value: Tensor, objective: str, step: int, kernel, noise: Tensor, mean: Tensor) -> None:
    if bool(torch.isfinite(value)):
        return
    raise DivergenceError(
        f"learn {objective!r}: the objective is {float(value.detach())} at step {step}; hyperparameters: "
        f"{_describe(kernel, float(noise.detach()), mean)}; "
        "likely cause: a step size too large for the data's scale, or a noise variance too small for the kernel "
        "matrix to be positive definite; remedy: lower learn_options['lr'], raise learn_options['min_noise'], "
        "or use normalize_y=True"
    )


def _describe(kernel, noise: float, mean: Tensor) -> str:
    hypers = ", ".join(f"{k}={_fmt(v)}" for k, v in hyperparameter_values(kernel).items())
    return f"{hypers}, noise={noise:.6g}, mean={_fmt(mean.detach().reshape(-1).tolist())}"


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:.6g}" for v in value) + "]"
    return f"{value:.6g}"
