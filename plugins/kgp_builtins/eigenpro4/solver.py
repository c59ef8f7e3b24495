r"""EigenPro 4 (Abedsoltan, Ma, Pandit & Belkin, "Fast training of large kernel models with delayed projections",
NeurIPS 2025): solver ``eigenpro4``.

Fits ``f(x) = sum_j a_j k(x, z_j)`` on centers Z by preconditioned minibatch SGD in the RKHS, like
EigenPro 3.0, but projects onto span K(., Z) only every T steps instead of after every step:

1. a step on the batch X_b is EigenPro 2.0's preconditioned step in the whole RKHS (the data
   preconditioner P_s of EigenPro 3 eq. 29-30 on a Nystrom subsample X_s of the data): the batch's rows
   become temporary centers and X_s gets the preconditioner's correction (:mod:`.state`); predictions
   on later batches include them, so no information waits for the projection;
2. every T steps (and at the end of each epoch) the temporary part is projected onto the centers by a
   solve of ``K(Z, Z) v = h`` (:mod:`.projection`: the paper's inexact inner EigenPro 2.0 epochs, or the
   exact Cholesky solve where its factor fits the memory budget) and dropped.

An inexact projection costs about as much as M / m steps, and is made once per T = M / m steps by default
(about M temporary centers), so the cost per step stays O(m (M + s + T m)) = O(m M), where EigenPro 3.0
pays a projection after every step; an exact one costs ``2 M^2`` flops per output after an ``M^3 / 3`` setup.

Conventions (kgp): ``problem.noise`` = sigma^2. ``regularization="ridge"`` minimises
``||K_XZ a - y||^2 + sigma^2 a^T K_ZZ a`` over span Z (the Nystrom GP posterior mean); ``"none"``
the plain least squares. The step and batch follow EigenPro 2.0's rule (Ma & Belkin 2019) with the
curvature of the preconditioned map measured on held-out rows (kgp's :mod:`kgp_builtins.eigenpro.nystrom`).
"""

from __future__ import annotations

import logging
import time

import torch

import kgp
from kgp.options import Option
from kgp.plugin import KernelExpansion, Problem
from kgp_builtins.eigenpro.budget import block_rows
from kgp_builtins.eigenpro.iterates import EpochLog, TailAverage, checked_targets
from kgp_builtins.eigenpro.nystrom import (
    critical_batch,
    critical_batch_and_step,
    draw_subsamples,
    heldout_curvature,
    nystrom_preconditioner,
)
from kgp_builtins.eigenpro.options import resolve_subsample

from .memory import plan_memory
from .options import DEFAULT_MAX_BATCH, EIGENPRO4_DEFAULTS, OWNER, check_data_options, check_options
from .projection import DelayedProjection, resolve_projection
from .state import DelayedState

__all__ = ["EigenPro4Solver"]

logger = logging.getLogger(__name__)

_DISTRIBUTED_REFUSAL = (
    "its temporary centers are the batches' rows, which every rank would need for every later step of the "
    "period (an all-gather of the batch's inputs per step); use solver='eigenpro' (EigenPro 3.0), which fits "
    "the same model data-parallel over rows"
)


class EigenPro4Solver:
    """EigenPro 4: preconditioned SGD with temporary centers and a delayed projection onto the centers.

    Options: :data:`~kgp_builtins.eigenpro4.options.EIGENPRO4_DEFAULTS` (``kgp plugins --options eigenpro4``;
    docs/solvers/eigenpro4.md). The memory estimate (:mod:`.memory`) is logged (logger
    ``kgp_builtins.eigenpro4.solver``, level INFO) before the first kernel evaluation and reported in every
    iteration's extras as ``memory_estimate`` (bytes).
    """

    option_defaults: dict[str, Option] = EIGENPRO4_DEFAULTS
    # the Nystrom estimator on the centers (regularization="ridge"): its DTC variance on return_std
    capabilities = kgp.Capabilities(uses_centers=True, target="nystrom", distributed_refusal=_DISTRIBUTED_REFUSAL)
    name = "eigenpro4"

    def check_options(self, options: dict) -> dict:
        """The rules between options (:func:`.options.check_options`), run once by :func:`kgp.resolve_options`."""
        return check_options(options)

    def fit(self, problem: Problem) -> KernelExpansion:
        opts = problem.options
        if problem.centers is None:
            raise ValueError(f"{OWNER} needs centers (problem.centers is None)")
        if problem.shard is not None:
            raise ValueError(f"{OWNER} is not data-parallel: {_DISTRIBUTED_REFUSAL}")
        X, y = problem.X, checked_targets(problem)
        Z = problem.centers.points
        if Z.dim() != 2 or Z.shape[1] != X.shape[1]:
            raise ValueError(f"{OWNER}: centers must be (M, {X.shape[1]}), got {tuple(Z.shape)}")
        Z = Z.to(device=X.device, dtype=X.dtype)
        n, M, k = X.shape[0], Z.shape[0], y.shape[1]
        check_data_options(opts, n, M)
        on_centers = opts["preconditioner"] == "centers"
        s, q = resolve_subsample(
            OWNER,
            M if on_centers else n,
            opts["subsample_size"],
            opts["q"],
            points="centers" if on_centers else "training points",
            model_spans_points=False,
            device=X.device,
        )
        sigma2 = float(problem.noise) if opts["regularization"] == "ridge" else 0.0
        gen, kop, monitor = problem.generator, problem.kernel_operator, problem.monitor
        # refused before any kernel evaluation when the centers alone (or, with both given, the centers and
        # the temporary centers) exceed the budget; the batch and period follow from the curvature otherwise,
        # and the check is repeated with them
        known = opts["batch_size"] is not None and opts["projection_period"] is not None
        capacity0 = min(opts["projection_period"], -(-n // opts["batch_size"])) * opts["batch_size"] if known else 0
        projection = resolve_projection(opts["projection"], M, X.device)
        layout = {
            "n_centers": M,
            "d": X.shape[1],
            "k": k,
            "itemsize": X.element_size(),
            "device": X.device,
            "projection": projection,
        }
        plan_memory(
            s=s, q=q, stored_subsample=not on_centers, capacity=capacity0, batch=opts["batch_size"] or 1, **layout
        )
        monitor.start(total=opts["epochs"], desc=self.name)
        with torch.no_grad():
            t_setup = time.perf_counter()
            pre, center_index, beta, lam = self._preconditioner(kop, X, Z, s, q, sigma2, on_centers, gen)
            lam_top, beta = lam + sigma2, beta + sigma2 / n
            batch, step = critical_batch_and_step(beta, lam_top, n, opts["batch_size"])
            if opts["batch_size"] is None:
                batch = min(batch, DEFAULT_MAX_BATCH)
            period = opts["projection_period"] or max(1, M // batch)
            capacity = min(period, -(-n // batch)) * batch  # temporaries between projections (epoch ends project)
            plan = plan_memory(s=s, q=pre.q, stored_subsample=not on_centers, capacity=capacity, batch=batch, **layout)
            logger.info(plan.describe())
            state = DelayedState(kop, Z, pre, center_index, capacity, k)
            proj = DelayedProjection(
                kop,
                Z,
                projection,
                opts["projection_subsample_size"],
                opts["projection_q"],
                opts["projection_epochs"],
                gen,
            )
            setup_time = time.perf_counter() - t_setup

            carry = opts["projection_residual"] == "carry"
            average = TailAverage(state.alpha)
            y_scale = float(y.pow(2).mean()) or 1.0
            log = EpochLog(self.name, y_scale)
            first_avg = opts["epochs"] - opts["average_epochs"] + 1
            converged = stop = False
            for epoch in range(1, opts["epochs"] + 1):
                t_step = t_proj = 0.0
                perm = torch.randperm(n, generator=gen).to(X.device)
                sq_sum, steps = 0.0, 0
                for start in range(0, n, batch):
                    b = perm[start : start + batch]
                    t0 = time.perf_counter()
                    eta = opts["lr_scale"] * step(b.shape[0])
                    sq_sum += state.step(X[b], y[b], eta, sigma2 / n)
                    steps += 1
                    t1 = time.perf_counter()
                    t_step += t1 - t0
                    last = start + batch >= n
                    if steps % period == 0 or last or not state.room(batch):
                        v = proj.solve(state.h)
                        state.absorb(v, proj.residual(v, state.h) if carry else None)
                        t_proj += time.perf_counter() - t1
                        if epoch >= first_avg:
                            average()
                train_mse = sq_sum / (n * k)
                log.record(epoch, train_mse, state.alpha)
                stop = monitor.step(
                    epoch,
                    lambda: KernelExpansion(problem.kernel, Z, average.current().clone()),
                    train_mse=train_mse,
                    batch_size=batch,
                    critical_batch=critical_batch(beta, lam_top, n),
                    step_size=opts["lr_scale"] * step(batch),
                    top_eigenvalue=lam_top,
                    beta=beta,
                    q=pre.q,
                    s=s,
                    preconditioner=opts["preconditioner"],
                    projection=proj.kind,
                    projection_period=period,
                    projections=proj.count,
                    memory_estimate=plan.total,
                    setup_time=setup_time,
                    time_steps=t_step,
                    time_projection=t_proj,
                    remaining=log.remaining(),
                )
                converged = opts["tol"] > 0 and train_mse <= opts["tol"] * y_scale
                if stop or converged:
                    break
            log.finish(converged or bool(stop))
        return KernelExpansion(problem.kernel, Z, average.current().clone())

    @staticmethod
    def _preconditioner(kop, X, Z, s, q, sigma2, on_centers, gen):
        r"""The Nystrom preconditioner (EigenPro 3 eq. 29-30) and the curvature of the step ``P_s (K_op + sigma^2)``.

        The subsample X_s is drawn from the centers (``on_centers``; their positions are returned) or from
        the training rows. Either way
        the curvature of each Nystrom direction, the level, and the step's per-sample curvature ``beta`` and
        top eigenvalue (sum units, ridge excluded) are measured on held-out training rows H
        (:func:`heldout_curvature` on ``K(H, H) - K(H, X_s) Q_s K(X_s, H)``).
        Returns ``(pre, center_index or None, beta, lambda_top)``.
        """
        n = X.shape[0]
        if on_centers:
            center_index = torch.randperm(Z.shape[0], generator=gen)[:s].to(X.device)
            h = max(2, min(n, s, block_rows(s, X.device)))
            idx_h = torch.randperm(n, generator=gen)[:h].to(X.device)
            points = torch.cat([Z[center_index], X[idx_h]])
            sub, held = torch.arange(s, device=X.device), torch.arange(s, s + h, device=X.device)
            # the held-out rows are data and the subsample is not: never the "H = every point" shortcut
            pre, Khs, Khh = nystrom_preconditioner(kop, points, sub, held, False, q, sigma2, white_noise=False, n=n)
            exact = False
        else:
            center_index = None
            idx_s, idx_h, exact = draw_subsamples(n, s, min(s, block_rows(s, X.device)), gen, X.device)
            pre, Khs, Khh = nystrom_preconditioner(kop, X, idx_s, idx_h, exact, q, sigma2, white_noise=False, n=n)
        Mh = Khh - Khs @ pre.apply(Khs.mT) if pre.q > 0 else Khh
        beta, lam = heldout_curvature(Mh, n, exact)
        return pre, center_index, beta, lam
