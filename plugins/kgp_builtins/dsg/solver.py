"""Solver ``dsg``: doubly stochastic functional gradients with random features (Dai et al., NIPS 2014).

The two update rules share one step loop, its stopping and divergence checks and the partial_fit
continuation; the numerics live in ``least_squares``, ``features``, ``spectra`` and ``checks``, the
option table in ``options``, the sums over ranks in ``reductions``.

Implements Algorithm 1 (train) of B. Dai, B. Xie, N. He, Y. Liang, A. Raj, M.-F. Balcan, L. Song,
"Scalable Kernel Methods via Doubly Stochastic Gradients", NIPS 2014, for the square loss, with a
minibatch of data points and a block of random features per step; Algorithm 2 (predict) is
:class:`.features.RandomFeatureExpansion`.

Two update rules (option ``update``; docs/solvers/dsg.md):

- ``"least_squares"`` (default): the preconditioned step of the paper's Sec. 4
  remark ("estimate an empirical covariance for preconditioning"): step t's block is the ridge
  least-squares fit ``a_t = (Phi_t^T Phi_t / m + rho I)^-1 Phi_t^T (y_B - f_t(X_B)) / m`` of the
  residual by its r features (:func:`.least_squares.solve_block`), ``rho = nu T``: one sweep of
  block coordinate descent on the random-feature ridge problem with all T r features. It cannot
  overshoot, so it has no step size; the defaults (r = 512, all n points per step,
  ``20 min(n, 5000)`` features in all) come from the UCI measurements in the docs.
- ``"gradient"``: the plain step of eq. 6 below, with the step-size rule of :meth:`_gamma_max`.

Both raise :class:`kgp.DivergenceError` on non-finite coefficients or a growing training loss and
warn (:class:`kgp.ConvergenceWarning`) when a run ends far from converged, or when the model's
random-feature noise would dominate its predictions at new points because the training points are
isolated at the kernel's lengthscale (:mod:`.checks`; the ``least_squares`` remedy is the option
``shrink``, which takes only a fraction of each block fit). Inputs
are centred on the training mean before the features (the phases stay small; the kernel is
shift-invariant), and inputs whose phases would carry no precision are refused.

Objective and regularisation (kgp convention, docs/solvers/dsg.md)
------------------------------------------------------------------
The paper minimises ``R(f) = E[l(f(x), y)] + (nu / 2) ||f||_H^2`` (Sec. 3). With the loss
``l(u, y) = (u - y)^2 / 2`` (so ``l'(u, y) = u - y``) and the empirical distribution of n points::

    R(f) = 1/2 [ (1/n) sum_i (f(x_i) - y_i)^2 + nu ||f||_H^2 ]

which is FALKON's objective with ``lambda = nu``. Its minimiser is the GP posterior mean with noise
variance ``sigma^2 = n nu``, i.e. ``nu = sigma^2 / n = problem.lam`` (``noise / n``).

Update (eq. 6 and Algorithm 1) at step t with minibatch B_t (m points) and r features
``phi_t(x) = sqrt(2 s / r) cos(omega_t^T x + b_t)`` (Bochner, Thm. 2; s = outputscale)::

    f_{t+1} = (1 - gamma_t nu) f_t - gamma_t (1/m) sum_{j in B_t} (f_t(x_j) - y_j) phi_t(x_j)^T phi_t(.)

so step t appends the coefficient block ``a_t = -gamma_t (1/m) Phi_t(X_B)^T (f_t(X_B) - y_B)``
(``r x k``) and shrinks every earlier block by ``(1 - gamma_t nu)``. The shrink is kept as one global
scale (``a_i = S c_i``), so a step costs O(1) for it instead of O(t) (digest section 3.3).

Random features are regenerated from per-step seeds at train and predict time (``omega_t, b_t``
come from a ``torch.Generator`` seeded with ``step_seed(seed, t)``, :mod:`.spectra`); the fitted
model stores only the ``t x r x k`` coefficients and one integer seed: memory O(t r k), independent
of d.

Step size ``gamma_t = theta / (t + t0)`` (Thm. 4 uses ``theta / t`` with ``theta nu`` in (1, 2) or a
positive integer). Default ``theta = 1 / nu`` (``theta nu = 1``). With ``nu = sigma^2 / n`` tiny,
``theta / 1`` is far above any stable step, so by default the clock starts at ``t0 + 1`` with
``t0 = theta / gamma_max - 1``: the first step is ``gamma_max`` and the schedule is the paper's
after a shift of the clock, which leaves the recursion of the paper's proof, and so its O(1/t)
rate in the shifted clock, unchanged. ``t0 = 0`` gives the paper's schedule exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

import kgp
from kgp.linalg import largest_eigenvalue
from kgp.options import InvalidOptionError, Option
from kgp.plugin import Problem

from .checks import LossTrace, isolated_fraction, off_data_noise, scaled_inputs_checked, warn_if_noisy_off_data
from .features import RandomFeatureExpansion, RandomFeatureMap
from .least_squares import solve_block
from .options import (
    DSG_OPTIONS,
    GRADIENT_BATCH,
    GRADIENT_FEATURES,
    LS_FEATURES,
    LS_FEATURES_PER_POINT,
    LS_POINTS_CAP,
)
from .reductions import Sums
from .spectra import SpectralSampler, spectral_sampler

__all__ = ["DSGSolver"]


_OWNER = "solver 'dsg'"

# Training points sampled for the isolation estimate of the off-data noise check, and rows per kernel block.
_ISOLATION_SAMPLE = 512
_ISOLATION_BLOCK = 8192


class DSGSolver:
    r"""Doubly stochastic functional gradient descent (Dai et al. 2014, Algorithms 1-2), square loss.

    Options: :data:`.options.DSG_OPTIONS` (its module docstring has notes on the less obvious ones),
    validated once by :func:`kgp.resolve_options`.
    """

    option_defaults: dict[str, Option] = DSG_OPTIONS
    # approximates the exact posterior mean by random features (no variance); fit is data-parallel,
    # partial_fit is local (docs/scaling-out.md)
    capabilities = kgp.Capabilities(target="mean_only", distributed=True, partial_fit=True)

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """One spelling for "computed from the data": the alias ``"auto"`` of t0 and gamma_max becomes None."""
        for name in ("t0", "gamma_max"):
            if options[name] == "auto":
                options[name] = None
        return options

    def fit(self, problem: Problem) -> RandomFeatureExpansion:
        """Run Algorithm 1 for ``passes`` passes (or ``max_steps`` steps) over ``problem.X``."""
        opts = problem.options  # resolved by the core (kgp.resolve_options)
        return self._run(problem, None, opts, opts["passes"])

    def partial_fit(self, problem: Problem, previous: RandomFeatureExpansion | None) -> RandomFeatureExpansion:
        """Continue from ``previous`` on a new chunk: the step counter, the seed and the schedule carry over.

        ``nu`` defaults to ``noise / n_seen`` with n_seen the points seen so far (this chunk included),
        so that after the last chunk the objective is that of ``fit`` on all chunks together.
        """
        if previous is not None and not isinstance(previous, RandomFeatureExpansion):
            raise TypeError(f"previous: expected a RandomFeatureExpansion or None, got {type(previous).__name__}")
        opts = problem.options  # resolved by the core (kgp.resolve_options)
        passes = opts["partial_fit_passes"]
        if passes is None:
            update = previous.schedule.get("update", "gradient") if previous is not None else opts["update"]
            gradient = update == "gradient"
            passes = 1 if gradient else opts["passes"]  # gradient: one pass per chunk (Algorithm 1 streams)
        return self._run(problem, previous, opts, passes)

    # ------------------------------------------------------------------------------------------ internals
    def _gamma_max(self, problem: Problem, sampler: SpectralSampler, m: int, r: int) -> float:
        """``min(1 / (lambda_1 + s / m), r m / (n s))``: a stable constant step for m points and r features.

        The first term keeps one step stable on the smooth part of the error: ``lambda_1`` (top
        eigenvalue of the covariance operator, estimated by ``K(X_q, X_q) / q`` on q <= 512 random
        points with :func:`kgp.linalg.largest_eigenvalue`) plus the ``s / m`` of an m-point average
        (s = k(x, x)). The second keeps the random-feature noise in check: a step adds
        ``gamma^2 s^2 / (r m)`` times the mean squared residual to the squared error at every point,
        while each point's own residual is only pulled back, by ``gamma s / m``, when it is in the
        batch, once per pass of ``n / m`` steps. See docs/solvers/dsg.md for the measurements behind
        this choice (it is not in the paper).
        """
        n = problem.n
        q = min(n, 512)
        idx = torch.randperm(n, generator=problem.generator)[:q].to(problem.device)
        # distributed: the same q global rows on every rank (gathered by one exact all-reduce)
        Xq = problem.X[idx] if problem.shard is None else problem.shard.take_rows(problem.X, idx)
        with torch.no_grad():
            K = problem.kernel_operator(Xq).to_dense().to(torch.float64)
            lam1 = largest_eigenvalue(K) / q
        s = sampler.outputscale
        return min(1.0 / (lam1 + s / m), r * m / (n * s))

    def _isolated(self, problem: Problem, sampler: SpectralSampler, sums: Sums) -> float:
        """Estimated fraction of new points with no training point near them (:func:`.checks.isolated_fraction`).

        The neighbour mass of q <= 512 random training points against all n, in row blocks of X
        (``q x 8192`` kernel entries at a time); distributed, every rank adds its rows' part.
        """
        n = problem.n
        q = min(n, _ISOLATION_SAMPLE)
        idx = torch.randperm(n, generator=problem.generator)[:q].to(problem.device)
        X = problem.X
        Xq = X[idx] if problem.shard is None else problem.shard.take_rows(X, idx)
        rows = torch.zeros(q, dtype=torch.float64, device=X.device)
        with torch.no_grad():
            for start in range(0, X.shape[0], _ISOLATION_BLOCK):
                block = problem.kernel_operator(X[start : start + _ISOLATION_BLOCK], Xq).to_dense()
                rows += block.sum(0).to(torch.float64)
        rows = sums.tensor(rows)
        return float(isolated_fraction(rows, sampler.outputscale).mean())

    def _run(
        self, problem: Problem, previous: RandomFeatureExpansion | None, opts: Mapping[str, Any], passes: int | None
    ) -> RandomFeatureExpansion:
        """Algorithm 1 in labelled phases (:class:`_Run`): settings, schedule, state, steps, final checks."""
        if not problem.X.is_floating_point():
            raise TypeError(f"X: expected a floating-point tensor, got {problem.X.dtype}")
        if problem.shard is not None and previous is not None:
            raise ValueError(f"{_OWNER}: partial_fit is not distributed; continue the model on one process")
        run = _Run(problem, opts, spectral_sampler(problem.kernel))
        run.settle(previous, passes)
        run.schedule(lambda: self._gamma_max(problem, run.sampler, run.m, run.r))
        run.start(previous)
        run.steps()
        if not run.stopped:
            run.finish(lambda: self._isolated(problem, run.sampler, run.sums))
        return run.expansion()


class _Run:
    """One run of Algorithm 1 over explicit state, in the order its phases run.

    :meth:`settle` (the update rule, features per step, batch, passes, the continuation of a previous
    model), :meth:`schedule` (the random-feature map, ``nu`` and the step-size schedule), :meth:`start`
    (coefficients, the cached predictions, the loss trace), :meth:`steps` (the step loop: one block of
    features per step, by :meth:`_least_squares_step` or :meth:`_gradient_step`), :meth:`finish` (the
    convergence and off-data noise checks).

    Coefficients are ``a_i = S * C[i - 1]``, ``S`` the global product of the ``(1 - gamma_t nu)`` shrinks;
    with the cache, ``f_t(X) = S * F``. In a distributed fit ``n`` counts the rows of the global problem;
    the step loop draws global batches and each rank works on the rows it holds (``n_here``), summing the
    normal-equation sums, gradients and losses (:class:`.reductions.Sums`).
    """

    def __init__(self, problem: Problem, opts: Mapping[str, Any], sampler: SpectralSampler) -> None:
        self.problem, self.opts, self.sampler = problem, opts, sampler
        self.X, self.Y = problem.X, problem.y
        self.n, self.k, self.n_here = problem.n, problem.n_outputs, problem.n_local
        self.sums = Sums(problem.shard)
        self.stopped = False

    # ------------------------------------------------------------------ phases
    def settle(self, previous: RandomFeatureExpansion | None, passes: int | None) -> None:
        """The update rule, ``r`` features per step, ``m`` points per batch, the passes and the continuation."""
        opts, n, k = self.opts, self.n, self.k
        update = opts["update"]
        if previous is not None:
            update = previous.schedule.get("update", "gradient")
            if opts["update"] != update and self.problem.options.get("update") is not None:
                raise InvalidOptionError(
                    f"{_OWNER} option 'update': expected {update!r} (the update of the model being continued), "
                    f"got {opts['update']!r}"
                )
        self.update = update
        self.least_squares = least_squares = update == "least_squares"
        self.r = r = opts["features_per_step"] or (LS_FEATURES if least_squares else GRADIENT_FEATURES)
        self.m = m = min(opts["batch_size"] or (n if least_squares else GRADIENT_BATCH), n)
        if passes is None:
            # least_squares: D = 20 min(n, 5000) features in all, one step per pass with m = n
            # (docs/solvers/dsg.md, "Defaults"); gradient: a fixed 10 passes.
            passes = max(1, math.ceil(LS_FEATURES_PER_POINT * min(n, LS_POINTS_CAP) / r)) if least_squares else 10
        if previous is not None:
            if previous.features_per_step != r:
                raise InvalidOptionError(
                    f"{_OWNER} option 'features_per_step': expected {previous.features_per_step} (the features per "
                    f"step of the model being continued), got {r!r}"
                )
            if previous.coef.shape[2] != k:
                raise ValueError(f"y: expected {previous.coef.shape[2]} outputs like the previous chunks, got {k}")
            self.seed = previous.seed
            self.t_prev = previous.n_steps
            self.n_seen = int(previous.schedule.get("n_seen", 0)) + n
            self.gamma_max = previous.schedule.get("gamma_max") if opts["gamma_max"] is None else opts["gamma_max"]
            self.shift = previous.shift
        else:
            seed = opts["seed"]
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self.problem.generator))
            self.seed = seed
            self.t_prev = 0
            self.n_seen = n
            self.gamma_max = opts["gamma_max"]
            # Centre the inputs: phases omega^T (x - mean) stay small (rounding, float32; checks.py).
            self.shift = self.sums.tensor(self.X.detach().to(torch.float64).sum(0)).div_(n) if n else None
        self.steps_per_pass = math.ceil(n / m)
        n_new = passes * self.steps_per_pass
        if opts["max_steps"] is not None:
            n_new = min(n_new, opts["max_steps"])
        self.n_new = n_new

    def schedule(self, gamma_max: Callable[[], float]) -> None:
        """The random-feature map and scaled inputs, ``nu``, and the step-size schedule (``gamma_max()`` on demand)."""
        opts = self.opts
        self.nu = nu = opts["nu"] if opts["nu"] is not None else self.problem.noise / self.n_seen
        total = self.t_prev + self.n_new
        self.fmap = RandomFeatureMap(self.problem.kernel, self.seed, self.r, total, self.shift)
        self.U = scaled_inputs_checked(self.fmap, self.sampler, self.X)
        if self.least_squares:
            self.rho = opts["ridge"] if opts["ridge"] is not None else nu * total
            self.schedule_record = {"update": self.update, "nu": nu, "ridge": self.rho, "n_seen": self.n_seen}
            self.theta = self.t0 = 0.0
        else:
            if self.gamma_max is None:
                self.gamma_max = gamma_max()
            self.theta = opts["theta"] if opts["theta"] is not None else 1.0 / nu
            self.t0 = max(0.0, self.theta / self.gamma_max - 1.0) if opts["t0"] is None else opts["t0"]
            self.schedule_record = {
                "update": self.update,
                "nu": nu,
                "theta": self.theta,
                "t0": self.t0,
                "gamma_max": self.gamma_max,
                "n_seen": self.n_seen,
            }
        self.report_every = opts["report_every"] or self.steps_per_pass

    def start(self, previous: RandomFeatureExpansion | None) -> None:
        """Coefficients (the previous model's first), the training predictions' cache, the monitor, the loss trace."""
        X, Y, n, k, t_prev, n_new = self.X, self.Y, self.n, self.k, self.t_prev, self.n_new
        self.C = torch.zeros(t_prev + n_new, self.r, k, dtype=X.dtype, device=X.device)
        if previous is not None:
            self.C[:t_prev] = previous.coef.to(self.C)
        self.S = 1.0
        mode = self.opts["train_predictions"]
        if self.least_squares:
            mode = "cache"  # the residual on the batch is needed at every step; f_t on X costs O(n k)
        elif mode == "auto":
            cache_cost = n * (t_prev + n_new)
            recompute_cost = self.m * n_new * (t_prev + n_new / 2)
            mode = "cache" if cache_cost <= recompute_cost else "recompute"
        self.F = None
        if mode == "cache":
            zeros = torch.zeros(self.n_here, k, dtype=X.dtype, device=X.device)
            self.F = self.fmap.apply(X, self.C[:t_prev]) if t_prev else zeros
        self.amp = math.sqrt(2.0 * self.sampler.outputscale / self.r)
        self.monitor = self.problem.monitor
        self.monitor.start(total=math.ceil(n_new / self.report_every), desc="dsg")
        self.y_sq = self.sums.floats(float(Y.double().square().sum()))[0] / (n * k) if n * k else 0.0
        if self.least_squares:
            remedy = "pass float64 inputs or a larger 'ridge' option"
        else:
            remedy = "lower the option gamma_max or theta, or use update='least_squares' (the default)"
        self.trace = LossTrace(self.y_sq, monotone=self.least_squares and self.m == n, remedy=remedy)
        if self.F is not None and t_prev:
            self.trace.initial = max(self.trace.initial, float((self.F.double() - Y.double()).square().mean()))
        self.mid_report = max(1, math.ceil(n_new / self.report_every) // 2)  # f on X is copied there
        self.F_mid = None
        self.t, self.done = t_prev, 0
        self.sq_sum, self.count = 0.0, 0

    def steps(self) -> None:
        """The step loop: a fresh permutation per pass, one batch and one block of features per step."""
        n, m, d = self.n, self.m, self.X.shape[1]
        with torch.no_grad():
            while self.done < self.n_new and not self.stopped:
                perm = torch.randperm(n, generator=self.problem.generator).to(self.X.device)
                for start in range(0, n, m):
                    if self.done >= self.n_new:
                        break
                    self.t += 1
                    self.done += 1
                    idx = perm[start : start + m]
                    batch = idx.numel()
                    full = batch == n
                    # the batch positions of this rank's rows, and their rows in X (all of X when full)
                    positions, idx = self.sums.batch(idx, full)
                    z, b = self.fmap.frequencies(self.sampler, range(self.t, self.t + 1), d, self.X)
                    if self.least_squares:
                        gamma = self._least_squares_step(idx, batch, full, positions, z, b)
                    else:
                        gamma = self._gradient_step(idx, batch, z, b)
                    if self.done % self.report_every == 0 or self.done == self.n_new:
                        self.stopped = self._report(gamma)
                        if self.stopped:
                            break

    def finish(self, isolated: Callable[[], float]) -> None:
        """After a run not stopped by the caller: the convergence check and the off-data noise check."""
        moved = None
        if self.least_squares and self.F_mid is not None:
            # The movement of f on X; gradient runs keep the loss criterion, since their minibatch
            # noise moves f by O(gamma) at every step even at the optimum.
            F_end = self.F.double() * self.S
            diff_sq, end_sq = self.sums.floats(float((F_end - self.F_mid).square().sum()), float(F_end.square().sum()))
            moved = math.sqrt(diff_sq) / max(math.sqrt(end_sq), 1e-300)
        more = " or features_per_step" if self.least_squares else " or use the default update"
        self.schedule_record["moved"] = self.trace.finish(
            what=f"the run of {self.done} steps ({self.t * self.r} features)",
            remedy="raise the option passes" + more,
            moved=moved,
        )
        if self.n and self.y_sq > 0:
            fraction = isolated()
            noise, score = off_data_noise(self.C[: self.t] * self.S, self.sampler.outputscale, self.y_sq, fraction)
            self.schedule_record.update(off_data_noise=noise, isolated=fraction, off_data_score=score)
            warn_if_noisy_off_data(noise, score, fraction, self.y_sq, least_squares=self.least_squares)

    def expansion(self, t_done: int | None = None) -> RandomFeatureExpansion:
        """The model after ``t_done`` steps (default: all steps run)."""
        t_done = self.t if t_done is None else t_done
        return RandomFeatureExpansion(
            self.problem.kernel, self.C[:t_done] * self.S, self.seed, self.schedule_record, self.shift
        )

    # ------------------------------------------------------------------ one step
    def _least_squares_step(self, idx: Tensor, batch: int, full: bool, positions: Any, z: Tensor, b: Tensor) -> float:
        """Block t's ridge fit of the residual on the batch (:func:`.least_squares.solve_block`)."""
        t, C, F, Y = self.t, self.C, self.F, self.Y
        Phi_all = torch.addmm(b, self.U, z).cos_().mul_(self.amp)  # phi_t on every training point
        Phi_b = Phi_all if full else Phi_all[idx]
        resid = Y - F if full else Y[idx] - F[idx]
        a, _ = solve_block(
            Phi_b,
            resid,
            self.rho,
            self.opts["gram_rows"],
            self.problem.generator,
            t,
            batch_size=batch,
            positions=positions,
            reduce=self.sums.tensor,
        )
        if self.opts["shrink"] != 1.0:
            a.mul_(self.opts["shrink"])
        C[t - 1] = a.to(C.dtype)
        self.trace.check_coefficients(C[t - 1], t)
        F.addmm_(Phi_all, C[t - 1])
        if not full:
            self.sq_sum += float(resid.double().square().sum())
            self.count += resid.numel()
        return 1.0

    def _gradient_step(self, idx: Tensor, batch: int, z: Tensor, b: Tensor) -> float:
        """Eq. 6: shrink every earlier block by ``1 - gamma_t nu`` (in ``S``) and append the gradient block."""
        t, C, F, X, Y = self.t, self.C, self.F, self.X, self.Y
        gamma = self.theta / (t + self.t0)
        if F is not None:
            Phi_all = torch.addmm(b, self.U, z).cos_().mul_(self.amp)  # phi_t on every training point
            Phi_b = Phi_all[idx]
            f_b = F[idx] * self.S
        else:
            Phi_all = None
            Phi_b = torch.addmm(b, self.U[idx], z).cos_().mul_(self.amp)
            f_b = self.fmap.apply(X[idx], C[: t - 1]) * self.S if t > 1 else torch.zeros_like(Y[idx])
        resid = f_b - Y[idx]  # l'(f(x), y) = f(x) - y for l = (f - y)^2 / 2
        self.sq_sum += float(resid.double().square().sum())
        self.count += resid.numel()
        grad = self.sums.tensor(Phi_b.T @ resid) / batch  # r x k: the batch mean of l' phi_t(x_j)
        shrink = 1.0 - gamma * self.nu
        self.S *= shrink
        if self.S == 0.0 or abs(self.S) < 1e-8:  # fold the scale in (rare: S decays like (t0 / t)^(theta nu))
            C[: t - 1].mul_(self.S)
            if F is not None:
                F.mul_(self.S)
            self.S = 1.0
        C[t - 1] = grad * (-gamma / self.S)
        self.trace.check_coefficients(C[t - 1], t)
        if F is not None:
            F.addmm_(Phi_all, C[t - 1])
        return gamma

    def _report(self, gamma: float) -> bool:
        """The training loss since the last report, to the loss trace and the monitor; whether to stop."""
        n, k, Y, F = self.n, self.k, self.Y, self.F
        if self.least_squares and self.m == n:
            # exact training loss
            loss = self.sums.floats(float((F.double() - Y.double()).square().sum()))[0] / (n * k)
        else:
            self.sq_sum, self.count = self.sums.floats(self.sq_sum, self.count)
            loss = self.sq_sum / max(self.count, 1)  # running minibatch loss since the last report
        self.trace.add(loss, self.t)
        report = math.ceil(self.done / self.report_every)
        if F is not None and report == self.mid_report:
            self.F_mid = F.double() * self.S
        stop = self.monitor.step(
            report,
            (lambda t_done=self.t: self.expansion(t_done)) if self.monitor.wants_predictor else None,
            step=self.t,
            n_features=self.t * self.r,
            gamma=gamma,
            train_mse=loss,
        )
        self.sq_sum, self.count = 0.0, 0
        return stop
