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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .. import settings
from ..diagnostics import DivergenceError
from ..linalg import NotPSDError
from ..monitor import Monitor
from ..options import ResolvedOptions
from ..problem_data import Centers
from ..registry import get_objective
from .bounds import LengthscaleFloors
from .loop_options import LEARN_OPTIONS, ResolvedLearnOptions, split_learn_options
from .outcome import BestPoint, report_learning, still_falling, white_noise_nll
from .parts import LearnedParts
from .problem import LearningProblem
from .refit import refit_scale_and_noise

__all__ = ["LEARN_OPTIONS", "LearnResult", "learn_hyperparameters"]

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
    """
    obj = get_objective(objective)
    caps = obj.capabilities
    if shard is not None and not caps.distributed:
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
    Y = y.unsqueeze(-1) if y.dim() == 1 else y
    if caps.uses_centers and centers is None:
        raise ValueError(f"objective {objective!r} needs centers (inducing points); pass centers or n_centers")
    params = [p for p in kernel.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"kernel: learn={objective!r} needs a kernel with trainable parameters, but {type(kernel).__name__} "
            "has none (or all have requires_grad=False)"
        )
    min_noise = loop["min_noise"]
    if loop["initial_noise_fraction"] is not None:
        variance = _target_variance(Y, shard)
        if variance > 0:  # constant targets: the model's noise
            noise = loop["initial_noise_fraction"] * variance
    if not noise > min_noise:
        raise ValueError(
            f"noise: the initial noise variance {noise!r} must be above learn_options['min_noise']={min_noise!r}"
        )
    parts = LearnedParts(kernel, noise, mean, Y.shape[1], loop, X.dtype, X.device)
    likelihood, mean_module = parts.likelihood, parts.mean_module
    # L-BFGS flattens its parameters in this order: the kernel's, the noise, the mean
    trained = params + [p for p in (likelihood.raw_noise, mean_module.raw_constant) if p.requires_grad]

    problem = LearningProblem(
        X=X,
        y=Y,
        kernel=kernel,
        centers=centers,
        options=obj_options,
        generator=generator if generator is not None else torch.Generator().manual_seed(0),
        shard=shard,
    )
    monitor = monitor if monitor is not None else Monitor()
    history: list[float] = []
    n = problem.n

    floors = LengthscaleFloors(kernel, _feature_scale(X, shard), loop["min_lengthscale"])
    draw_state = problem.generator.get_state()  # the refine stage draws the same permutation again
    with torch.enable_grad(), floors:
        loss_fn = obj.prepare(problem)
        terms = getattr(loss_fn, "terms", None) if caps.likelihood else None

        def total() -> Tensor:
            value = loss_fn(parts.noise(), mean_module.constant)
            for _, module, prior, closure, _ in parts.named_priors():
                value = value - prior.log_prob(closure(module)).sum() / n
            return value

        optimizer = loop["optimizer"]
        lr = loop["lr"] if loop["lr"] is not None else _DEFAULT_LR[optimizer]
        iterations = loop["iterations"]
        monitor.start(total=iterations, desc=f"learn {objective}")

        def evaluate() -> Tensor:
            # one objective evaluation with its gradient = one reported step (Adam: one per update;
            # L-BFGS: each evaluation of its line search)
            opt.zero_grad()
            step = len(history) + 1
            try:
                value = total()
            except NotPSDError as exc:
                # an optimizer trial point (L-BFGS line searches reach far) where a factorization failed:
                # name the step and the values, as for a non-finite objective
                noise_now = float(parts.noise().detach())
                raise NotPSDError(
                    f"learn {objective!r}: step {step} failed: {exc}. Hyperparameters at that step: "
                    f"{_state(kernel, noise_now, mean_module.constant)}. Remedy: "
                    "learn_options={'optimizer': 'adam'} (bounded steps), a smaller 'lr', or a larger 'min_noise'"
                ) from exc
            _check_finite(value, objective, step, kernel, parts.noise(), mean_module.constant)
            value.backward()
            history.append(float(value.detach()))
            noise_now = float(parts.noise().detach())
            if monitor.step(step, None, stage="learn", objective=history[-1], noise=noise_now):
                raise _Stop
            return value

        def offer_final_point(best: BestPoint) -> None:
            # the point after the last update has not been evaluated: compare it with the best one
            with torch.no_grad():
                try:
                    final = float(total())
                except NotPSDError:
                    final = math.nan
            best.offer_final(final, len(history) + 1)

        def closure() -> Tensor:
            value = evaluate()
            best.offer(value, len(history))
            return value

        def lbfgs(step: float, evaluations: int) -> torch.optim.LBFGS:
            # its own iteration and evaluation counts bound the work
            return torch.optim.LBFGS(
                trained, lr=step, max_iter=evaluations, max_eval=evaluations, line_search_fn="strong_wolfe"
            )

        def run_stage(body, *, needs_a_point: bool) -> str:
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
                if stop_fit or shard is not None or (needs_a_point and best.step == 0):
                    raise
                return "interrupted"
            except (DivergenceError, NotPSDError) as exc:
                if needs_a_point and best.step == 0:  # no point was evaluated: nothing to fall back to
                    raise
                return f"failed: {exc}"
            return "budget"

        def first_stage() -> None:
            nonlocal opt
            if optimizer == "lbfgs":
                opt = lbfgs(lr, iterations)
                opt.step(closure)
                return
            opt = torch.optim.Adam(trained, lr=lr)
            for _ in range(iterations):
                best.offer(evaluate(), len(history))
                opt.step()
            limit = loop["max_iterations"] or 0
            chunk = max(1, iterations // 4)
            while len(history) < limit and still_falling(history, best.value, white_noise):
                for _ in range(min(chunk, limit - len(history))):
                    best.offer(evaluate(), len(history))
                    opt.step()
            if loop["polish_iterations"] and still_falling(history, best.value, white_noise):
                # Adam's fixed step size crawls in the narrow valleys of short lengthscales and small
                # noise (bike: still falling after 300 steps); L-BFGS from Adam's best point converges there
                # in tens of evaluations. Only while still falling: where Adam has converged, converging a
                # 3,000-row subset's likelihood further helped two sets and hurt two (keggdirected's NLPD
                # fell below SGPR's) (docs/benchmarks/gp-default.md, "Polish")
                best.restore()
                opt = lbfgs(_DEFAULT_LR["lbfgs"], loop["polish_iterations"])
                opt.step(closure)

        opt: torch.optim.Optimizer | None = None
        best = BestPoint(trained)
        white_noise = white_noise_nll(obj, Y, shard)
        stopped = run_stage(first_stage, needs_a_point=True)
        if stopped in ("budget", "callback"):
            offer_final_point(best)
        best.restore()
        report_learning(objective, stopped, best, history, max(iterations, len(history)), lr, white_noise)
        refine = None
        rows = loop["refine_subset"]
        if (
            rows is not None
            and stopped == "budget"
            and min(rows, n) > min(obj_options["subset"], n)
            and not still_falling(history, best.value, white_noise)
        ):
            # the first stage's rows are a random subset, and which rows were drawn moves the learned GP more
            # than its optimizer does (docs/benchmarks/gp-default.md, "Refine"): a few L-BFGS evaluations on
            # a larger subset from its converged point correct the draw, at (rows / subset)^3 the cost of one
            # of its steps. Not after a first stage still falling: there they would continue its descent at
            # that cost (bike: test RMSE 0.010 -> 0.042, worse than SGPR's, while the NLPD improved)
            first, first_terms, start = best, terms, len(history) + 1
            problem.generator.set_state(draw_state)
            wider = ResolvedOptions(obj_options.owner, {**obj_options, "subset": rows})
            loss_fn = obj.prepare(replace(problem, options=wider))
            terms = getattr(loss_fn, "terms", None) if caps.likelihood else None
            best = BestPoint(trained)  # the values of another objective: not comparable with the first stage's
            budget = loop["refine_iterations"]
            opt = lbfgs(_DEFAULT_LR["lbfgs"], budget)
            # a failure here falls back on the first stage's point (below)
            stopped = run_stage(lambda: opt.step(closure), needs_a_point=False)
            if stopped in ("budget", "callback"):
                offer_final_point(best)
            if best.step == 0:  # no evaluation on the wider rows succeeded: the first stage's point stands
                best, terms = first, first_terms
            best.restore()
            if stopped != "budget":  # the refine stage's own few evaluations are not judged for convergence
                report_learning(objective, stopped, best, history, start - 1 + budget, _DEFAULT_LR["lbfgs"])
            refine = {
                "subset": min(rows, n),
                "first_evaluation": start,
                "evaluations": len(history) - start + 1,
                "start": history[start - 1] if len(history) >= start else math.nan,
                "first_stage_best": first.value,
            }
    if not all(bool(torch.isfinite(t).all()) for t in trained):
        _check_finite(
            torch.tensor(float("nan")), objective, len(history) + 1, kernel, parts.noise(), mean_module.constant
        )
    for p in params:
        p.grad = None
    learned_noise = float(parts.noise().detach())
    learned_mean = mean_module.constant.detach().clone()
    refit = None
    if loop["refit_subset"] is not None:
        learned_noise, result = refit_scale_and_noise(
            X,
            Y,
            kernel,
            noise=learned_noise,
            mean=learned_mean,
            rows=loop["refit_subset"],
            min_noise=min_noise,
            learn_noise=loop["learn_noise"],
            generator=problem.generator,
        )
        refit = result.as_dict()
    return LearnResult(
        kernel=kernel,
        noise=learned_noise,
        mean=learned_mean,
        history=history,
        options={**loop, **obj_options},
        refit=refit,
        refine=refine,
        best_value=best.value,
        best_step=best.step,
        stopped=stopped,
        terms=terms,
    )


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
        f"{_state(kernel, float(noise.detach()), mean)}; "
        "likely cause: a step size too large for the data's scale, or a noise variance too small for the kernel "
        "matrix to be positive definite; remedy: lower learn_options['lr'], raise learn_options['min_noise'], "
        "or use normalize_y=True"
    )


def _state(kernel, noise: float, mean: Tensor) -> str:
    hypers = ", ".join(f"{k}={_fmt(v)}" for k, v in hyperparameter_values(kernel).items())
    return f"{hypers}, noise={noise:.6g}, mean={_fmt(mean.detach().reshape(-1).tolist())}"


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:.6g}" for v in value) + "]"
    return f"{value:.6g}"
