"""Solver ``dsg``: doubly stochastic functional gradients with random features (Dai et al., NIPS 2014).

Implements Algorithm 1 (train) of B. Dai, B. Xie, N. He, Y. Liang, A. Raj, M.-F. Balcan, L. Song,
"Scalable Kernel Methods via Doubly Stochastic Gradients", NIPS 2014, for the square loss, with a
minibatch of data points and a block of random features per step; Algorithm 2 (predict) is
:class:`.features.RandomFeatureExpansion`.

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
come from a ``torch.Generator`` seeded with ``seed_t = mix(seed, t)``); the fitted model stores only
the ``t x r x k`` coefficients and one integer seed: memory O(t r k), independent of d.

Step size ``gamma_t = theta / (t + t0)`` (Thm. 4 uses ``theta / t`` with ``theta nu`` in (1, 2) or a
positive integer). Default ``theta = 1 / nu`` (``theta nu = 1``). With ``nu = sigma^2 / n`` tiny,
``theta / 1`` is far above any stable step, so by default the clock starts at ``t0 + 1`` with
``t0 = theta / gamma_max - 1``: the first step is ``gamma_max`` and the schedule is the paper's
after a shift of the clock, which leaves the recursion of the paper's proof, and so its O(1/t)
rate in the shifted clock, unchanged. ``t0 = 0`` gives the paper's schedule exactly.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from kgp.plugin import Problem

from .features import RandomFeatureExpansion, RandomFeatureMap
from .spectra import SpectralSampler, spectral_sampler

__all__ = ["DSGSolver"]


def _check_int(options: Mapping[str, Any], name: str, *, allow_none: bool = False, minimum: int = 1) -> int | None:
    value = options[name]
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"solver 'dsg' option {name}: expected {expected}, got {value!r}")
    return int(value)


def _check_float(options: Mapping[str, Any], name: str, *, auto: str | None = None, zero_ok: bool = False):
    value = options[name]
    if value is None or (auto is not None and value == auto):
        return None
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        none = f", None or {auto!r}" if auto else ", or None"
        raise ValueError(
            f"solver 'dsg' option {name}: expected a {'non-negative' if zero_ok else 'positive'} "
            f"number{none}, got {value!r}"
        )
    return float(value)


class DSGSolver:
    r"""Doubly stochastic functional gradient descent (Dai et al. 2014, Algorithms 1-2), square loss.

    Options (defaults in :attr:`option_defaults`; see docs/solvers/dsg.md):

    ``features_per_step`` (64)
        r, random features drawn per step (one seed per step).
    ``batch_size`` (256)
        m, data points per step (sampled without replacement within each pass).
    ``passes`` (10)
        Passes over the data in ``fit``; ``partial_fit_passes`` (1) passes over each chunk.
    ``max_steps`` (None)
        Cap on the steps of one call.
    ``nu`` (None)
        The paper's regulariser; None uses ``noise / n_seen`` (= ``problem.lam`` in ``fit``).
    ``theta`` (None)
        Step-size constant; None gives ``theta = 1 / nu`` (``theta nu = 1``, admissible in Thm. 4).
    ``t0`` ("auto")
        Clock offset in ``gamma_t = theta / (t + t0)``; "auto" gives ``max(0, theta / gamma_max - 1)``.
    ``gamma_max`` ("auto")
        First step for "auto" t0: ``min(1 / (lambda_1 + s / m), r m / (n s))`` with ``lambda_1`` the
        top eigenvalue of ``K(X_q, X_q) / q`` on q <= 512 random points and s = k(x, x) (not in the
        paper; see :meth:`_gamma_max` and docs/solvers/dsg.md).
    ``seed`` (None)
        Model seed for the random features; None draws one from ``problem.generator``.
    ``train_predictions`` ("auto")
        How f_t(x_j) is evaluated: "recompute" (Algorithm 1 as printed: regenerate all earlier
        features for the batch, O(t r d m) per step), "cache" (keep f_t on the training points up to
        date, O(n r d) per step; identical values), "auto" (the cheaper of the two for this call).
    ``report_every`` (None)
        Steps between ``monitor.step`` reports; None reports once per pass.
    """

    option_defaults: dict[str, Any] = {
        "features_per_step": 64,
        "batch_size": 256,
        "passes": 10,
        "partial_fit_passes": 1,
        "max_steps": None,
        "nu": None,
        "theta": None,
        "t0": "auto",
        "gamma_max": "auto",
        "seed": None,
        "train_predictions": "auto",
        "report_every": None,
    }
    uses_centers = False

    def fit(self, problem: Problem) -> RandomFeatureExpansion:
        """Run Algorithm 1 for ``passes`` passes (or ``max_steps`` steps) over ``problem.X``."""
        return self._run(problem, None, self._options(problem)["passes"])

    def partial_fit(self, problem: Problem, previous: RandomFeatureExpansion | None) -> RandomFeatureExpansion:
        """Continue from ``previous`` on a new chunk: the step counter, the seed and the schedule carry over.

        ``nu`` defaults to ``noise / n_seen`` with n_seen the points seen so far (this chunk included),
        so that after the last chunk the objective is that of ``fit`` on all chunks together.
        """
        if previous is not None and not isinstance(previous, RandomFeatureExpansion):
            raise TypeError(f"previous: expected a RandomFeatureExpansion or None, got {type(previous).__name__}")
        return self._run(problem, previous, self._options(problem)["partial_fit_passes"])

    # ------------------------------------------------------------------------------------------ internals
    def _options(self, problem: Problem) -> dict[str, Any]:
        o = problem.options
        opts = {
            "features_per_step": _check_int(o, "features_per_step"),
            "batch_size": _check_int(o, "batch_size"),
            "passes": _check_int(o, "passes"),
            "partial_fit_passes": _check_int(o, "partial_fit_passes"),
            "max_steps": _check_int(o, "max_steps", allow_none=True),
            "nu": _check_float(o, "nu"),
            "theta": _check_float(o, "theta"),
            "t0": _check_float(o, "t0", auto="auto", zero_ok=True),
            "gamma_max": _check_float(o, "gamma_max", auto="auto"),
            "seed": _check_int(o, "seed", allow_none=True, minimum=0),
            "report_every": _check_int(o, "report_every", allow_none=True),
        }
        mode = o["train_predictions"]
        if mode not in ("auto", "cache", "recompute"):
            raise ValueError(
                f"solver 'dsg' option train_predictions: expected 'auto', 'cache' or 'recompute', got {mode!r}"
            )
        opts["train_predictions"] = mode
        if not problem.X.is_floating_point():
            raise TypeError(f"X: expected a floating-point tensor, got {problem.X.dtype}")
        return opts

    def _gamma_max(self, problem: Problem, sampler: SpectralSampler, m: int, r: int) -> float:
        """``min(1 / (lambda_1 + s / m), r m / (n s))``: a stable constant step for m points and r features.

        The first term keeps one step stable on the smooth part of the error: ``lambda_1`` (top
        eigenvalue of the covariance operator, estimated by ``K(X_q, X_q) / q`` on q <= 512 random
        points) plus the ``s / m`` of an m-point average (s = k(x, x)). The second keeps the random-
        feature noise in check: a step adds ``gamma^2 s^2 / (r m)`` times the mean squared residual to
        the squared error at every point, while each point's own residual is only pulled back, by
        ``gamma s / m``, when it is in the batch, once per pass of ``n / m`` steps. See
        docs/solvers/dsg.md for the measurements behind this choice (it is not in the paper).
        """
        n = problem.n
        q = min(n, 512)
        idx = torch.randperm(n, generator=problem.generator)[:q].to(problem.device)
        with torch.no_grad():
            K = problem.kernel_operator(problem.X[idx]).to_dense().to(torch.float64)
            lam1 = float(torch.linalg.eigvalsh(K)[-1]) / q
        s = sampler.outputscale
        return min(1.0 / (lam1 + s / m), r * m / (n * s))

    def _run(self, problem: Problem, previous: RandomFeatureExpansion | None, passes: int) -> RandomFeatureExpansion:
        opts = self._options(problem)
        X, Y = problem.X, problem.y
        n, k = problem.n, problem.n_outputs
        sampler = spectral_sampler(problem.kernel)
        r = opts["features_per_step"]
        m = min(opts["batch_size"], n)
        if previous is not None:
            if previous.features_per_step != r:
                raise ValueError(
                    f"solver 'dsg' option features_per_step={r} differs from the {previous.features_per_step} "
                    "features per step of the model being continued"
                )
            if previous.coef.shape[2] != k:
                raise ValueError(f"y: expected {previous.coef.shape[2]} outputs like the previous chunks, got {k}")
            seed = previous.seed
            t_prev = previous.n_steps
            sched = dict(previous.schedule)
            n_seen = int(sched.get("n_seen", 0)) + n
            gamma_max = opts["gamma_max"] or sched.get("gamma_max")
        else:
            seed = opts["seed"]
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=problem.generator))
            t_prev = 0
            n_seen = n
            gamma_max = opts["gamma_max"]
        if gamma_max is None:
            gamma_max = self._gamma_max(problem, sampler, m, r)
        nu = opts["nu"] if opts["nu"] is not None else problem.noise / n_seen
        theta = opts["theta"] if opts["theta"] is not None else 1.0 / nu
        t0 = opts["t0"] if opts["t0"] is not None else max(0.0, theta / gamma_max - 1.0)
        schedule = {"nu": nu, "theta": theta, "t0": t0, "gamma_max": gamma_max, "n_seen": n_seen}

        steps_per_pass = math.ceil(n / m)
        n_new = passes * steps_per_pass
        if opts["max_steps"] is not None:
            n_new = min(n_new, opts["max_steps"])
        report_every = opts["report_every"] or steps_per_pass
        fmap = RandomFeatureMap(problem.kernel, seed, r, t_prev + n_new)

        # Coefficients a_i = S * C[i - 1]; S is the global product of the (1 - gamma_t nu) shrinks.
        C = torch.zeros(t_prev + n_new, r, k, dtype=X.dtype, device=X.device)
        if previous is not None:
            C[:t_prev] = previous.coef.to(C)
        S = 1.0

        mode = opts["train_predictions"]
        if mode == "auto":
            cache_cost = n * (t_prev + n_new)
            recompute_cost = m * n_new * (t_prev + n_new / 2)
            mode = "cache" if cache_cost <= recompute_cost else "recompute"
        F = None  # with the cache, f_t(X) = S * F
        if mode == "cache":
            F = fmap.apply(X, C[:t_prev]) if t_prev else torch.zeros(n, k, dtype=X.dtype, device=X.device)

        amp = math.sqrt(2.0 * sampler.outputscale / r)
        d = X.shape[1]
        U = sampler.scale_inputs(X)
        monitor = problem.monitor
        monitor.start(total=math.ceil(n_new / report_every), desc="dsg")

        def snapshot(t_done: int) -> RandomFeatureExpansion:
            return RandomFeatureExpansion(problem.kernel, C[:t_done] * S, seed, schedule)

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
                    gamma = theta / (t + t0)
                    z, b = fmap.frequencies(sampler, range(t, t + 1), d, X)
                    if F is not None:
                        Phi_all = torch.addmm(b, U, z).cos_().mul_(amp)  # phi_t on every training point
                        Phi_b = Phi_all[idx]
                        f_b = F[idx] * S
                    else:
                        Phi_all = None
                        Phi_b = torch.addmm(b, U[idx], z).cos_().mul_(amp)
                        f_b = fmap.apply(X[idx], C[: t - 1]) * S if t > 1 else torch.zeros_like(Y[idx])
                    resid = f_b - Y[idx]  # l'(f(x), y) = f(x) - y for l = (f - y)^2 / 2
                    sq_sum += float(resid.square().sum())
                    count += resid.numel()
                    grad = Phi_b.T @ resid / idx.numel()  # r x k: the batch mean of l' phi_t(x_j)
                    shrink = 1.0 - gamma * nu
                    S *= shrink
                    if S == 0.0 or abs(S) < 1e-8:  # fold the scale in (rare: S decays like (t0 / t)^(theta nu))
                        C[: t - 1].mul_(S)
                        if F is not None:
                            F.mul_(S)
                        S = 1.0
                    C[t - 1] = grad * (-gamma / S)
                    if F is not None:
                        F.addmm_(Phi_all, C[t - 1])
                    if done % report_every == 0 or done == n_new:
                        stopped = monitor.step(
                            math.ceil(done / report_every),
                            (lambda t_done=t: snapshot(t_done)) if monitor.wants_predictor else None,
                            step=t,
                            n_features=t * r,
                            gamma=gamma,
                            train_mse=sq_sum / max(count, 1),
                        )
                        sq_sum, count = 0.0, 0
                        if stopped:
                            break
        if t and not bool(torch.isfinite(C[:t]).all()):
            warnings.warn(
                "solver 'dsg': the coefficients overflowed (the step size is too large for this kernel and data); "
                "lower the option gamma_max or theta",
                RuntimeWarning,
                stacklevel=2,
            )
        return RandomFeatureExpansion(problem.kernel, C[:t] * S, seed, schedule)
