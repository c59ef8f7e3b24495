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
from collections.abc import Mapping
from typing import Any

import torch

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
        X, Y = problem.X, problem.y
        if not X.is_floating_point():
            raise TypeError(f"X: expected a floating-point tensor, got {X.dtype}")
        # n: rows of the global problem; the step loop draws global batches and each rank works on the
        # rows it holds (n_here), summing the normal-equation sums, gradients and losses (_Sums)
        n, k, n_here = problem.n, problem.n_outputs, problem.n_local
        sums = Sums(problem.shard)
        if problem.shard is not None and previous is not None:
            raise ValueError(f"{_OWNER}: partial_fit is not distributed; continue the model on one process")
        sampler = spectral_sampler(problem.kernel)
        update = opts["update"]
        if previous is not None:
            update = previous.schedule.get("update", "gradient")
            if opts["update"] != update and problem.options.get("update") is not None:
                raise InvalidOptionError(
                    f"{_OWNER} option 'update': expected {update!r} (the update of the model being continued), "
                    f"got {opts['update']!r}"
                )
        least_squares = update == "least_squares"
        r = opts["features_per_step"] or (LS_FEATURES if least_squares else GRADIENT_FEATURES)
        m = min(opts["batch_size"] or (n if least_squares else GRADIENT_BATCH), n)
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
            seed = previous.seed
            t_prev = previous.n_steps
            sched = dict(previous.schedule)
            n_seen = int(sched.get("n_seen", 0)) + n
            gamma_max = sched.get("gamma_max") if opts["gamma_max"] is None else opts["gamma_max"]
            shift = previous.shift
        else:
            seed = opts["seed"]
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=problem.generator))
            t_prev = 0
            n_seen = n
            gamma_max = opts["gamma_max"]
            # Centre the inputs: phases omega^T (x - mean) stay small (rounding, float32; checks.py).
            shift = sums.tensor(X.detach().to(torch.float64).sum(0)).div_(n) if n else None
        steps_per_pass = math.ceil(n / m)
        n_new = passes * steps_per_pass
        if opts["max_steps"] is not None:
            n_new = min(n_new, opts["max_steps"])
        nu = opts["nu"] if opts["nu"] is not None else problem.noise / n_seen
        fmap = RandomFeatureMap(problem.kernel, seed, r, t_prev + n_new, shift)
        U = scaled_inputs_checked(fmap, sampler, X)
        if least_squares:
            rho = opts["ridge"] if opts["ridge"] is not None else nu * (t_prev + n_new)
            schedule = {"update": update, "nu": nu, "ridge": rho, "n_seen": n_seen}
            theta = t0 = 0.0
        else:
            if gamma_max is None:
                gamma_max = self._gamma_max(problem, sampler, m, r)
            theta = opts["theta"] if opts["theta"] is not None else 1.0 / nu
            t0 = max(0.0, theta / gamma_max - 1.0) if opts["t0"] is None else opts["t0"]
            schedule = {"update": update, "nu": nu, "theta": theta, "t0": t0, "gamma_max": gamma_max, "n_seen": n_seen}
        report_every = opts["report_every"] or steps_per_pass

        # Coefficients a_i = S * C[i - 1]; S is the global product of the (1 - gamma_t nu) shrinks.
        C = torch.zeros(t_prev + n_new, r, k, dtype=X.dtype, device=X.device)
        if previous is not None:
            C[:t_prev] = previous.coef.to(C)
        S = 1.0

        mode = opts["train_predictions"]
        if least_squares:
            mode = "cache"  # the residual on the batch is needed at every step; f_t on X costs O(n k)
        elif mode == "auto":
            cache_cost = n * (t_prev + n_new)
            recompute_cost = m * n_new * (t_prev + n_new / 2)
            mode = "cache" if cache_cost <= recompute_cost else "recompute"
        F = None  # with the cache, f_t(X) = S * F
        if mode == "cache":
            F = fmap.apply(X, C[:t_prev]) if t_prev else torch.zeros(n_here, k, dtype=X.dtype, device=X.device)

        amp = math.sqrt(2.0 * sampler.outputscale / r)
        d = X.shape[1]
        monitor = problem.monitor
        monitor.start(total=math.ceil(n_new / report_every), desc="dsg")
        y_sq = sums.floats(float(Y.double().square().sum()))[0] / (n * k) if n * k else 0.0
        if least_squares:
            remedy = "pass float64 inputs or a larger 'ridge' option"
        else:
            remedy = "lower the option gamma_max or theta, or use update='least_squares' (the default)"
        trace = LossTrace(y_sq, monotone=least_squares and m == n, remedy=remedy)
        if F is not None and t_prev:
            trace.initial = max(trace.initial, float((F.double() - Y.double()).square().mean()))

        def snapshot(t_done: int) -> RandomFeatureExpansion:
            return RandomFeatureExpansion(problem.kernel, C[:t_done] * S, seed, schedule, shift)

        n_reports = math.ceil(n_new / report_every)
        mid_report = max(1, n_reports // 2)  # f on X is copied here for the convergence check
        F_mid = None
        t = t_prev
        done = 0
        sq_sum, count = 0.0, 0
        stopped = False
        with torch.no_grad():
            while done < n_new and not stopped:
                perm = torch.randperm(n, generator=problem.generator).to(X.device)
                for start in range(0, n, m):
                    if done >= n_new:
                        break
                    t += 1
                    done += 1
                    idx = perm[start : start + m]
                    batch = idx.numel()
                    full = batch == n
                    # the batch positions of this rank's rows, and their rows in X (all of X when full)
                    positions, idx = sums.batch(idx, full)
                    z, b = fmap.frequencies(sampler, range(t, t + 1), d, X)
                    if least_squares:
                        Phi_all = torch.addmm(b, U, z).cos_().mul_(amp)  # phi_t on every training point
                        Phi_b = Phi_all if full else Phi_all[idx]
                        resid = Y - F if full else Y[idx] - F[idx]
                        a, _ = solve_block(
                            Phi_b,
                            resid,
                            rho,
                            opts["gram_rows"],
                            problem.generator,
                            t,
                            batch_size=batch,
                            positions=positions,
                            reduce=sums.tensor,
                        )
                        if opts["shrink"] != 1.0:
                            a.mul_(opts["shrink"])
                        C[t - 1] = a.to(C.dtype)
                        trace.check_coefficients(C[t - 1], t)
                        F.addmm_(Phi_all, C[t - 1])
                        gamma = 1.0
                        if not full:
                            sq_sum += float(resid.double().square().sum())
                            count += resid.numel()
                    else:
                        gamma = theta / (t + t0)
                        if F is not None:
                            Phi_all = torch.addmm(b, U, z).cos_().mul_(amp)  # phi_t on every training point
                            Phi_b = Phi_all[idx]
                            f_b = F[idx] * S
                        else:
                            Phi_all = None
                            Phi_b = torch.addmm(b, U[idx], z).cos_().mul_(amp)
                            f_b = fmap.apply(X[idx], C[: t - 1]) * S if t > 1 else torch.zeros_like(Y[idx])
                        resid = f_b - Y[idx]  # l'(f(x), y) = f(x) - y for l = (f - y)^2 / 2
                        sq_sum += float(resid.double().square().sum())
                        count += resid.numel()
                        grad = sums.tensor(Phi_b.T @ resid) / batch  # r x k: the batch mean of l' phi_t(x_j)
                        shrink = 1.0 - gamma * nu
                        S *= shrink
                        if S == 0.0 or abs(S) < 1e-8:  # fold the scale in (rare: S decays like (t0 / t)^(theta nu))
                            C[: t - 1].mul_(S)
                            if F is not None:
                                F.mul_(S)
                            S = 1.0
                        C[t - 1] = grad * (-gamma / S)
                        trace.check_coefficients(C[t - 1], t)
                        if F is not None:
                            F.addmm_(Phi_all, C[t - 1])
                    if done % report_every == 0 or done == n_new:
                        if least_squares and m == n:
                            # exact training loss
                            loss = sums.floats(float((F.double() - Y.double()).square().sum()))[0] / (n * k)
                        else:
                            sq_sum, count = sums.floats(sq_sum, count)
                            loss = sq_sum / max(count, 1)  # running minibatch loss since the last report
                        trace.add(loss, t)
                        if F is not None and math.ceil(done / report_every) == mid_report:
                            F_mid = F.double() * S
                        stopped = monitor.step(
                            math.ceil(done / report_every),
                            (lambda t_done=t: snapshot(t_done)) if monitor.wants_predictor else None,
                            step=t,
                            n_features=t * r,
                            gamma=gamma,
                            train_mse=loss,
                        )
                        sq_sum, count = 0.0, 0
                        if stopped:
                            break
        if not stopped:
            moved = None
            if least_squares and F_mid is not None:
                # The movement of f on X; gradient runs keep the loss criterion, since their minibatch
                # noise moves f by O(gamma) at every step even at the optimum.
                F_end = F.double() * S
                diff_sq, end_sq = sums.floats(float((F_end - F_mid).square().sum()), float(F_end.square().sum()))
                moved = math.sqrt(diff_sq) / max(math.sqrt(end_sq), 1e-300)
            more = " or features_per_step" if least_squares else " or use the default update"
            schedule["moved"] = trace.finish(
                what=f"the run of {done} steps ({t * r} features)", remedy="raise the option passes" + more, moved=moved
            )
            if n and y_sq > 0:
                isolated = self._isolated(problem, sampler, sums)
                noise, score = off_data_noise(C[:t] * S, sampler.outputscale, y_sq, isolated)
                schedule.update(off_data_noise=noise, isolated=isolated, off_data_score=score)
                warn_if_noisy_off_data(noise, score, isolated, y_sq, least_squares=least_squares)
        return RandomFeatureExpansion(problem.kernel, C[:t] * S, seed, schedule, shift)
