r"""EigenPro 2.0 (Ma & Belkin 2019): preconditioned SGD with centers = the points, and solver ``eigenpro2``.

:func:`ep2_epoch` is one epoch on ``(K(P, P) + shift I) theta = targets``; it serves the solver
``eigenpro2`` (P = X, EigenPro 3 Sec. 4.2: Z = X makes the projection the identity) and the inexact
projection of ``eigenpro`` (P = Z, EigenPro 3 eq. 32, with the "model" preconditioner).
``regularization="ridge"`` solves ``(K + sigma^2 I) alpha = y`` (the GP posterior mean) by the
diagonal shift (kernel ``K + sigma^2 delta``); ``"none"`` solves ``K alpha = y``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

import kgp
from kgp.options import Option
from kgp.plugin import KernelExpansion, Problem

from .budget import block_rows, check_center_sizes
from .iterates import EpochLog, TailAverage, checked_targets
from .nystrom import (
    KernelOpFactory,
    NystromPreconditioner,
    critical_batch_and_step,
    draw_subsamples,
    heldout_curvature,
    nystrom_preconditioner,
)
from .options import EIGENPRO2_DEFAULTS, check_options, resolve_subsample

__all__ = ["EP2State", "EigenPro2Solver", "ep2_epoch", "ep2_setup"]


@dataclass
class EP2State:
    """What the epochs of EigenPro 2.0 on the points P need: preconditioner, batch size and step rule."""

    points: Tensor
    pre: NystromPreconditioner
    batch: int
    step: Callable[[int], float]
    shift: float
    lr_scale: float
    beta: float
    top_eigenvalue: float
    pos_in_s: Tensor  # position of each point in the Nystrom subsample, -1 outside it


def ep2_epoch(
    kop: KernelOpFactory,
    st: EP2State,
    theta: Tensor,
    targets: Tensor,
    generator: torch.Generator,
    after_step: Callable[[], None] | None = None,
) -> float:
    r"""One epoch of EigenPro 2.0 on ``(K(P, P) + shift I) theta = targets``; updates ``theta`` in place.

    Per batch b: ``g = K'(P_b, P) theta - t_b``; ``theta_b -= (eta_m/m) g``;
    ``theta_S += (eta_m/m) Q_s K'(P_S, P_b) g`` with ``K' = K + shift delta`` (Lemma 5 with X_m = P_b: the
    preconditioned gradient ``K(., P_b) g - K(., P_S) Q_s K(P_S, P_b) g`` lies in span K(., P), so no
    projection). Returns the running mean of ``g^2`` (training MSE seen during the epoch).

    Both products come from one formation of ``K(P_b, P)``
    (:meth:`kgp.operators.KernelOperator.residual_matmul`: natively on a CPU, with no block in memory;
    otherwise in row blocks within ``kgp.settings.memory_budget``): ``K(P_S, P_b) g`` is the subsample's rows
    of ``K(P_b, P)^T g``, so each kernel entry is evaluated once per epoch. Where a row meets its own
    column the exact ``k(p, p)`` is used: the cross-block evaluation (||x||^2 + ||z||^2 - 2 x.z) loses it at
    extreme input scales (|x| / lengthscale ~ 1e30 gave 0 instead of 1, and predictions ~1e5 for |y| <= 3).
    """
    N = st.points.shape[0]
    perm = torch.randperm(N, generator=generator).to(st.points.device)
    correct = st.pre.q > 0
    total = 0.0
    for start in range(0, N, st.batch):
        b = perm[start : start + st.batch]
        offset = -targets[b]
        if st.shift:  # the shift sits on the row's own entry: K'(P_b, P) theta = K(P_b, P) theta + shift theta_b
            offset.add_(theta[b], alpha=st.shift)
        g, kt = kop(st.points[b], st.points).residual_matmul(theta, offset, own_columns=b, transpose=correct)
        total += float(g.pow(2).sum())
        lr = st.lr_scale * st.step(b.shape[0]) / b.shape[0]
        if correct:
            ks = kt[st.pre.idx]
            if st.shift:  # ... and on K'(P_S, P_b)'s entries where a batch row is a subsample point
                pos = st.pos_in_s[b]
                inside = (pos >= 0).nonzero(as_tuple=True)[0]
                ks.index_add_(0, pos[inside], g[inside], alpha=st.shift)
            theta.index_add_(0, st.pre.idx, st.pre.apply(ks), alpha=lr)
        theta[b] -= lr * g
        if after_step is not None:
            after_step()
    return total / (N * targets.shape[1])


def ep2_setup(
    kop: KernelOpFactory,
    points: Tensor,
    s: int,
    q: int,
    shift: float,
    batch_size: int | None,
    lr_scale: float,
    generator: torch.Generator,
) -> EP2State:
    """Preconditioner (eq. 29-30 on ``K + shift I``), held-out curvature, critical batch and step."""
    N = points.shape[0]
    # held-out blocks K(H, P_S) and K(H, H) within the memory budget; the exact estimate is N x N
    idx_s, idx_h, exact = draw_subsamples(N, s, min(s, block_rows(s, points.device)), generator, points.device)
    pre, Khs, Khh = nystrom_preconditioner(kop, points, idx_s, idx_h, exact, q, shift, white_noise=True)
    pos_in_s = torch.full((N,), -1, dtype=torch.long, device=points.device)
    pos_in_s[idx_s] = torch.arange(idx_s.shape[0], device=points.device)
    # The map restricted to H: K'(H, H) - K'(H, S) Q_s K'(S, H) with K' = K + shift delta (both from
    # nystrom_preconditioner, shift included).
    M = Khh - Khs @ pre.apply(Khs.T) if pre.q > 0 else Khh
    beta, lam_top = heldout_curvature(M, N, exact)
    batch, step = critical_batch_and_step(beta, lam_top, N, batch_size)
    return EP2State(
        points=points,
        pre=pre,
        batch=batch,
        step=step,
        shift=shift,
        lr_scale=lr_scale,
        beta=beta,
        top_eigenvalue=lam_top,
        pos_in_s=pos_in_s,
    )


_DISTRIBUTED_REFUSAL = (
    "its n coefficients are one per training row, so every batch would need all ranks' coefficients; "
    "use solver='eigenpro' with centers (e.g. centers='uniform'), which fits the same kind of model data-parallel"
)


class EigenPro2Solver:
    """EigenPro 2.0 (Ma & Belkin 2019): preconditioned SGD with centers = the training set.

    This is EigenPro 3.0 with Z = X, where the projection is the identity (EigenPro 3 Sec. 4.2).
    ``regularization="ridge"`` solves ``(K + sigma^2 I) alpha = y`` (the GP posterior mean) by the
    diagonal shift (kernel ``K + sigma^2 delta``); ``"none"`` solves ``K alpha = y``. Options:
    :data:`~kgp_builtins.eigenpro.options.EIGENPRO2_DEFAULTS` (``kgp plugins --options eigenpro2``).
    """

    option_defaults: dict[str, Option] = EIGENPRO2_DEFAULTS
    # the exact posterior mean (an expansion over every training point); why a distributed fit refuses it
    # is quoted in the model's error (docs/scaling-out.md)
    capabilities = kgp.Capabilities(target="exact", distributed_refusal=_DISTRIBUTED_REFUSAL)
    name = "eigenpro2"

    def check_options(self, options: dict) -> dict:
        """The rules between options (:func:`.options.check_options`), run once by :func:`kgp.resolve_options`."""
        return check_options(f"solver {self.name!r}", options, projection=False)

    def fit(self, problem: Problem) -> KernelExpansion:
        owner = f"solver {self.name!r}"
        opts = problem.options  # resolved by the core: validated, cross-checked, defaults filled in
        average_epochs = opts["average_epochs"]
        X, y = problem.X, checked_targets(problem)
        n = X.shape[0]
        s, q = resolve_subsample(owner, n, opts["subsample_size"], opts["q"], device=X.device)
        check_center_sizes(owner, problem, n, q, "none", opts["epochs"], y.shape[1], training_centers=True)
        shift = float(problem.noise) if opts["regularization"] == "ridge" else 0.0
        gen = problem.generator
        kop = problem.kernel_operator
        monitor = problem.monitor
        monitor.start(total=opts["epochs"], desc=self.name)
        with torch.no_grad():
            t0 = time.perf_counter()
            state = ep2_setup(kop, X, s, q, shift, opts["batch_size"], opts["lr_scale"], gen)
            setup_time = time.perf_counter() - t0
            alpha = torch.zeros(n, y.shape[1], dtype=X.dtype, device=X.device)
            y_scale = float(y.pow(2).mean()) or 1.0
            average = TailAverage(alpha)
            log = EpochLog(self.name, y_scale)
            converged = stop = False
            first_avg = opts["epochs"] - average_epochs + 1
            for epoch in range(1, opts["epochs"] + 1):
                t1 = time.perf_counter()
                train_mse = ep2_epoch(kop, state, alpha, y, gen, average if epoch >= first_avg else None)
                log.record(epoch, train_mse, alpha)
                stop = monitor.step(
                    epoch,
                    lambda: KernelExpansion(problem.kernel, X, average.current().clone()),
                    train_mse=train_mse,
                    batch_size=state.batch,
                    step_size=opts["lr_scale"] * state.step(state.batch),
                    top_eigenvalue=state.top_eigenvalue,
                    beta=state.beta,
                    q=state.pre.q,
                    s=s,
                    setup_time=setup_time,
                    time_epoch=time.perf_counter() - t1,
                    remaining=log.remaining(),
                )
                converged = opts["tol"] > 0 and train_mse <= opts["tol"] * y_scale
                if stop or converged:
                    break
            # a caller's stop (monitor) is the caller's choice: no warning then
            log.finish(converged or bool(stop), zero_fixed_point=True)
        return KernelExpansion(problem.kernel, X, average.current())
