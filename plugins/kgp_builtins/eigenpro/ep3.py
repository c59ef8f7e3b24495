r"""EigenPro 3.0 (Abedsoltan, Belkin & Pandit, "Toward large kernel models", ICML 2023, Algorithm 2): ``eigenpro``.

Fits ``f(x) = sum_j alpha_j k(x, z_j)`` on centers Z that need not be training points, by projected,
preconditioned minibatch SGD in the RKHS (eq. 27)::

    f <- f - (n/m) eta proj_Z( P_s{ grad_m L(f) } )

- stochastic gradient on a batch X_m (eq. 28): ``K(., X_m) (K(X_m, Z) alpha - y_m)``;
- data preconditioner P_s (eq. 29-30, Lemma 5; :mod:`.nystrom`);
- projection (eq. 32; :mod:`.projection`): exact by Cholesky or inexact by EigenPro 2.0 epochs on Z.

Conventions (kgp): ``problem.noise`` = GP noise variance sigma^2 = EigenPro's bare lambda.
``regularization="ridge"`` minimises ``||K_XZ a - y||^2 + sigma^2 a^T K_ZZ a`` (the Nystrom GP
posterior mean, ``(K_ZX K_XZ + sigma^2 K_ZZ) a = K_ZX y``); ``"none"`` minimises
``||K_XZ a - y||^2`` (the paper's problem 15, interpolation when Z = X). See
docs/solvers/eigenpro.md for the derivations, the measurements behind the defaults and the
fixed point of the paper's ordering of preconditioner and projection (``correction="paper"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import kgp
from kgp import settings
from kgp.linalg import solve_lower_wide
from kgp.options import Option
from kgp.plugin import KernelExpansion, Problem

from ..resolution import warn_if_under_resolved
from .budget import ITEMSIZE, block_rows, check_center_sizes, kernel_diagonal
from .features import features_fit, features_pay, whitened_features
from .iterates import EpochLog, TailAverage, checked_targets
from .nystrom import (
    KernelOpFactory,
    batch_floor,
    critical_batch,
    critical_batch_and_step,
    draw_subsamples,
    heldout_curvature,
    nystrom_preconditioner,
)
from .options import EIGENPRO3_DEFAULTS, check_options, resolve_subsample
from .projection import CholeskyProjection, EigenPro2Projection
from .rows import Rows

__all__ = ["EigenPro3Solver"]


def _batch_residual_gradient(kop: KernelOpFactory, Xb: Tensor, Z: Tensor, alpha: Tensor, yb: Tensor):
    """``g = K(X_b, Z) alpha - y_b`` and ``K(Z, X_b) g`` with one kernel evaluation when the block fits."""
    m, p = Xb.shape[0], Z.shape[0]
    if m == 0:  # a rank holding none of the batch's rows (distributed fit): its part of the sum is 0
        return yb.new_zeros(0, alpha.shape[1]), alpha.new_zeros(p, alpha.shape[1])
    op = kop(Xb, Z)
    if m * p * Xb.element_size() <= settings.memory_budget.value(Xb.device):
        Kb = op.to_dense()
        g = Kb @ alpha - yb
        return g, Kb.T @ g
    g = op @ alpha - yb
    return g, op.mT @ g


def _paper_correction_sum(kop: KernelOpFactory, Xb: Tensor, g: Tensor, pre) -> Tensor:
    """``E^T K(X_s, X_b) g`` (q x k): the batch's part of the ``correction="paper"`` term (a sum over its rows)."""
    if Xb.shape[0] == 0:
        return g.new_zeros(pre.q, g.shape[1])
    ks = kop(Xb, pre.points).to_dense().T @ g  # K(X_s, X_m) g
    return pre.E.T @ ks


@dataclass(frozen=True)
class _Sizes:
    """The preconditioner's subsample and rank, the projection and (``eigenpro2`` only) its own sizes."""

    s: int
    q: int
    projection: str
    s2: int | None
    q2: int | None


@dataclass
class _Run:
    """What the setup decided, read by the epochs: the centers and targets, the preconditioner ``pre``
    (with ``ZE = K(Z, X_s) E``), the projection, the curvature (``beta``, ``lam_top``, the whitened
    correction ``U``), the batch size and step rule, the kept whitened features (or None)."""

    Z: Tensor
    y: Tensor
    rows: Rows
    n: int
    s: int
    sigma2: float
    pre: Any
    ZE: Tensor
    proj: CholeskyProjection | EigenPro2Projection
    whitened: bool
    U: Tensor | None
    beta: float
    lam_top: float
    batch: int
    step: Callable[[int], float]
    features: Tensor | None
    setup_time: float

    def coefficients(self, iterate: Tensor) -> Tensor:
        """alpha from the averaged iterate (``alpha = L^{-T} b`` when the features are kept)."""
        return self.proj.factor.solve(iterate, transpose=True) if self.features is not None else iterate


class EigenPro3Solver:
    """EigenPro 3.0 (Algorithm 2): projected preconditioned SGD with centers decoupled from the data.

    Options: :data:`~kgp_builtins.eigenpro.options.EIGENPRO3_DEFAULTS` (``kgp plugins --options eigenpro``;
    their sources in docs/solvers/eigenpro.md).

    Data-parallel (``problem.shard``, docs/scaling-out.md): every rank draws the same subsamples and
    batches over global row numbers (:mod:`.rows`), computes its rows' part of each batch's
    ``K(Z, X_m) g`` and sums it over the ranks (one ``(p + q) x k`` all-reduce per batch); the rest
    (preconditioner, projection, update, averaging) is replicated.
    """

    option_defaults: dict[str, Option] = EIGENPRO3_DEFAULTS
    # the Nystrom estimator on the centers (regularization="ridge"); data-parallel over rows
    capabilities = kgp.Capabilities(uses_centers=True, target="nystrom", distributed=True)
    name = "eigenpro"

    def check_options(self, options: dict) -> dict:
        """The rules between options (:func:`.options.check_options`), run once by :func:`kgp.resolve_options`."""
        return check_options(f"solver {self.name!r}", options, projection=True)

    def fit(self, problem: Problem) -> KernelExpansion:
        """Algorithm 2 in labelled phases: sizes (:meth:`_sizes`), setup (:meth:`_setup`), epochs (:meth:`_epochs`)."""
        owner = f"solver {self.name!r}"
        if problem.centers is None:
            raise ValueError("solver 'eigenpro' needs centers (problem.centers is None)")
        Z = problem.centers.points
        if Z.dim() != 2 or Z.shape[1] != problem.X.shape[1]:
            raise ValueError(f"eigenpro: centers must be (p, {problem.X.shape[1]}), got {tuple(Z.shape)}")
        Z = Z.to(device=problem.device, dtype=problem.dtype)
        y = checked_targets(problem)
        rows = Rows(problem)
        sizes = self._sizes(owner, problem, rows, Z, y)
        # Started before the setup so that the reported elapsed times include it (as wall time).
        problem.monitor.start(total=problem.options["epochs"], desc=self.name)
        with torch.no_grad():
            run = self._setup(owner, problem, rows, Z, y, sizes)
            average = self._epochs(problem, run)
        return KernelExpansion(problem.kernel, Z, run.coefficients(average.current()))

    # ------------------------------------------------------------------ phases
    @staticmethod
    def _sizes(owner: str, problem: Problem, rows: Rows, Z: Tensor, y: Tensor) -> _Sizes:
        """The preconditioner's subsample ``s`` and rank ``q``, the projection and its own sizes; sizes checked."""
        opts = problem.options  # resolved by the core: validated, cross-checked, defaults filled in
        n, p = rows.n, Z.shape[0]
        s, q = resolve_subsample(
            owner, n, opts["subsample_size"], opts["q"], model_spans_points=p >= n, device=problem.device
        )
        projection = opts["projection"]
        if projection == "auto":
            # K(Z, Z) is evaluated and factored in float64 whatever the input dtype
            fits = p * p * ITEMSIZE <= settings.memory_budget.value(problem.device)
            projection = "cholesky" if fits else "eigenpro2"
        s2, q2 = (None, None)
        if projection == "eigenpro2":
            s2, q2 = resolve_subsample(
                owner,
                p,
                opts["projection_subsample_size"],
                opts["projection_q"],
                s_name="projection_subsample_size",
                q_name="projection_q",
                points="centers",
                device=problem.device,
            )
        check_center_sizes(owner, problem, p, q, projection, opts["epochs"], y.shape[1])
        return _Sizes(s, q, projection, s2, q2)

    def _setup(self, owner: str, problem: Problem, rows: Rows, Z: Tensor, y: Tensor, sizes: _Sizes) -> _Run:
        """The preconditioner, the projection, the curvature, the batch size and step, the kept features."""
        opts, X, gen, kop = problem.options, problem.X, problem.generator, problem.kernel_operator
        n, p, s, q, projection = rows.n, Z.shape[0], sizes.s, sizes.q, sizes.projection
        sigma2 = float(problem.noise) if opts["regularization"] == "ridge" else 0.0
        setup_start = time.perf_counter()
        # held-out blocks K(Z, H) (p x h) and K(H, X_s) within the memory budget
        h = min(s, block_rows(max(p, s), X.device))
        idx_s, idx_h, exact = draw_subsamples(n, s, h, gen, X.device, exact_cols=max(n, p))
        points, idx_s, idx_h = rows.sample(idx_s, idx_h, exact)
        pre, _, _ = nystrom_preconditioner(kop, points, idx_s, idx_h, exact, q, sigma2, white_noise=False, n=n)
        H = points[idx_h]
        # ZE = K(Z, X_s) E (p x q): the paper's C = K(Z, X_s) Q_s kept in factored form, O(p q).
        ZE = kop(Z, pre.points) @ pre.E if pre.q > 0 else Z.new_zeros(p, 0)
        proj = (
            CholeskyProjection(kop, Z)
            if projection == "cholesky"
            else EigenPro2Projection(kop, Z, sizes.s2, sizes.q2, opts["projection_epochs"], gen)
        )
        if isinstance(proj, CholeskyProjection):  # the factor of K_ZZ is at hand: r p^2 flops for the check
            L64 = proj.L.to(torch.float64)
            warn_if_under_resolved(
                owner, problem, Z, lambda k_zr: torch.linalg.solve_triangular(L64, k_zr, upper=False)
            )
            del L64
        whitened = projection == "cholesky" and opts["correction"] == "projected"
        # Phi = K(X, Z) L^{-T} is kept when it fits the budget and pays for itself (features.py), decided
        # once the batch is known; its rows of H are then the curvature's L^{-1} K(Z, H). A distributed
        # fit (where Phi would be replicated) forms blocks per step.
        with settings.kernel_cache(opts["kernel_cache"]):
            may_keep = whitened and not rows.distributed and features_fit(X, p)
            held_out = whitened_features(kop, H, Z, proj.L) if may_keep else None
        if isinstance(proj, CholeskyProjection):
            W = None if held_out is None else held_out.mT
            beta, lam_data, U = self._curvature(kop, H, n, Z, exact, pre, ZE, proj, opts["correction"], W)
        else:
            U = None
            beta = float(kernel_diagonal(kop, pre.points).max())
            lam_data = self._power_top(kop, H, Z, pre, ZE, proj, opts["correction"], n / len(idx_h), gen)
        lam_top = lam_data + sigma2
        beta = beta + sigma2 / n
        if rows.distributed:
            # the batch size, the step and q decide how many all-reduces an epoch issues: rank 0's
            # values everywhere (replicated from the same gathered rows, they differ in the last bits at most)
            curv = torch.tensor([beta, lam_top], dtype=torch.float64, device=X.device)  # NCCL: on the GPU
            setup = [pre.E, pre.d, ZE, curv] + ([proj.L] if isinstance(proj, CholeskyProjection) else [])
            rows.replicate_(setup + ([U] if U is not None else []), q=pre.q)
            beta, lam_top = (float(v) for v in curv)
        # a floor on the default batch: each batch pays two M x M triangular solves (batch_floor)
        floor = batch_floor(p) if isinstance(proj, CholeskyProjection) else 1
        batch, step = critical_batch_and_step(beta, lam_top, n, opts["batch_size"], floor)
        features = None
        kept = held_out is not None
        del held_out  # h x p: not needed past the curvature
        if kept and features_pay(opts["epochs"], batch, y.shape[1]):
            with settings.kernel_cache(opts["kernel_cache"]):
                features = whitened_features(kop, X, Z, proj.L)
        setup_time = time.perf_counter() - setup_start
        return _Run(
            Z, y, rows, n, s, sigma2, pre, ZE, proj, whitened, U, beta, lam_top, batch, step, features, setup_time
        )

    def _epochs(self, problem: Problem, run: _Run) -> TailAverage:
        """Epochs of minibatch steps (eq. 27) until ``epochs``, ``tol`` or the monitor stops; the tail average."""
        opts, X, y, n, p, kop = problem.options, problem.X, run.y, run.n, run.Z.shape[0], problem.kernel_operator
        pre, proj, whitened = run.pre, run.proj, run.whitened
        alpha = torch.zeros(p, y.shape[1], dtype=X.dtype, device=X.device)
        # whitened coordinates b = L^T alpha (K_ZZ + jitter = L L^T): the projected preconditioned
        # step is then L^{-T} (I - U d U^T) L^{-1} h, two triangular solves per batch (docs)
        b_white = torch.zeros_like(alpha) if whitened else None
        y_scale = run.rows.mean_square() or 1.0
        # with the features the iterate is b alone (alpha = L^{-T} b where a model is wanted)
        average = TailAverage(b_white if run.features is not None else alpha)
        log = EpochLog(self.name, y_scale)
        converged = stop = False
        first_avg = opts["epochs"] - opts["average_epochs"] + 1
        for epoch in range(1, opts["epochs"] + 1):
            times = {"gradient": 0.0, "correction": 0.0, "projection": 0.0}
            perm = torch.randperm(n, generator=problem.generator).to(X.device)
            sq_sum = 0.0
            for start in range(0, n, run.batch):
                b = perm[start : start + run.batch]
                mb = b.shape[0]  # the global batch: its rows may sit on several ranks
                t0 = time.perf_counter()
                eta = opts["lr_scale"] * run.step(mb) / n
                if run.features is not None:
                    sq_sum += self._feature_step(run, b, mb, eta, b_white, times, t0)
                else:
                    sq_sum += self._kernel_step(opts, kop, run, b, mb, eta, alpha, b_white, times, t0)
                if epoch >= first_avg:
                    average()
            if whitened and run.features is None:
                # re-synchronise b = L^T alpha (rounding drift between the two updates)
                torch.matmul(proj.L.mT, alpha, out=b_white)
            train_mse = run.rows.sum_float(sq_sum) / (n * y.shape[1])
            log.record(epoch, train_mse, alpha if run.features is None else b_white)
            stop = problem.monitor.step(
                epoch,
                lambda: KernelExpansion(problem.kernel, run.Z, run.coefficients(average.current()).clone()),
                train_mse=train_mse,
                batch_size=run.batch,
                critical_batch=critical_batch(run.beta, run.lam_top, n),
                step_size=opts["lr_scale"] * run.step(run.batch),
                top_eigenvalue=run.lam_top,
                beta=run.beta,
                q=pre.q,
                s=run.s,
                projection=proj.kind,
                setup_time=run.setup_time,
                time_gradient=times["gradient"],
                time_correction=times["correction"],
                time_projection=times["projection"],
                remaining=log.remaining(),
            )
            converged = opts["tol"] > 0 and train_mse <= opts["tol"] * y_scale
            if stop or converged:
                break
        # a caller's stop (monitor) is the caller's choice: no warning then
        log.finish(converged or bool(stop))
        return average

    @staticmethod
    def _feature_step(run: _Run, b: Tensor, mb: int, eta: float, b_white: Tensor, times: dict, t0: float) -> float:
        """One step on the kept whitened features ``Phi = K(X, Z) L^{-T}``; the batch's squared residual."""
        pre = run.pre
        rows_b = run.features[b]
        g = torch.addmm(run.y[b], rows_b, b_white, beta=-1.0)  # K(X_m, Z) alpha - y_m
        sq = float(g.pow(2).sum())
        w = (rows_b.T @ g).mul_(run.n / mb)  # L^{-1} K(Z, X_m) g (n / m)
        if run.sigma2:
            w.add_(b_white, alpha=run.sigma2)
        t1 = time.perf_counter()
        if pre.q > 0:
            w.sub_(run.U @ (pre.d.unsqueeze(-1) * (run.U.T @ w)))
        b_white.sub_(w, alpha=eta)
        times["gradient"] += t1 - t0
        times["correction"] += time.perf_counter() - t1
        return sq

    def _kernel_step(
        self, opts, kop, run: _Run, b: Tensor, mb: int, eta: float, alpha: Tensor, b_white, times: dict, t0: float
    ) -> float:
        """One step from kernel blocks of the batch (whitened, or by :meth:`_direction`); its squared residual."""
        pre, proj, p, n = run.pre, run.proj, run.Z.shape[0], run.n
        Xb, yb = run.rows.batch(b)
        g, grad = _batch_residual_gradient(kop, Xb, run.Z, alpha, yb)
        sq = float(g.pow(2).sum())
        t_grad = time.perf_counter()
        paper = opts["correction"] == "paper" and not run.whitened and pre.q > 0
        eks = _paper_correction_sum(kop, Xb, g, pre) if paper else None
        t_corr = time.perf_counter()
        if run.rows.distributed:  # one all-reduce per batch: [K(Z, X_m) g; E^T K(X_s, X_m) g]
            summed = run.rows.sum_(torch.cat([grad, eks]) if paper else grad)
            grad, eks = (summed[:p], summed[p:]) if paper else (summed, None)
        t1 = time.perf_counter()
        times["gradient"] += (t_grad - t0) + (t1 - t_corr)  # the batch sum's all-reduce included
        times["correction"] += t_corr - t_grad
        if run.whitened:
            w = proj.factor.solve(grad).mul_(n / mb)
            if run.sigma2:
                w.add_(b_white, alpha=run.sigma2)
            t2 = time.perf_counter()
            if pre.q > 0:
                w.sub_(run.U @ (pre.d.unsqueeze(-1) * (run.U.T @ w)))
            t3 = time.perf_counter()
            b_white.sub_(w, alpha=eta)
            alpha.sub_(proj.factor.solve(w, transpose=True), alpha=eta)
            times["projection"] += (t2 - t1) + (time.perf_counter() - t3)
            times["correction"] += t3 - t2
        else:
            theta = self._direction(
                opts["correction"], eks, grad, alpha, pre, run.ZE, proj, run.sigma2, n / mb, times, t1
            )
            alpha.sub_(theta, alpha=eta)
        return sq

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _direction(correction, eks, grad, alpha, pre, ZE, proj, sigma2, scale, times, t_start) -> Tensor:
        r"""Search direction theta (coefficients on Z) for one batch; the caller subtracts ``eta theta``.

        ``grad = K(Z, X_m) g`` and, for ``"paper"`` with ``q > 0``, ``eks = E^T K(X_s, X_m) g``
        (:func:`_paper_correction_sum`): the batch sums, over all ranks in a distributed fit.

        ``correction="projected"``: ``u = proj_Z(F)``, ``theta = u - proj_Z(K(., X_s) Q_s K(X_s, Z) u)``
        = coefficients of ``proj_Z P_s proj_Z F`` with ``F = (n/m) K(., X_m) g + sigma^2 f``.
        ``"paper"`` (Algorithm 2): ``theta = proj_Z(P_s F)``, ``h = (n/m)[K(Z, X_m) g - C K(X_s, X_m) g]``
        ``+ sigma^2 [K(Z, Z) alpha - C K(X_s, Z) alpha]``, ``C = K(Z, X_s) Q_s``.
        """
        h = grad * scale
        if correction == "projected":
            t1 = time.perf_counter()
            u = proj.solve_ridge(h, alpha, sigma2)
            t2 = time.perf_counter()
            c = ZE @ (pre.d.unsqueeze(-1) * (ZE.T @ u)) if pre.q > 0 else None
            t3 = time.perf_counter()
            theta = u - proj.solve(c) if c is not None else u
            t4 = time.perf_counter()
            times["correction"] += (t1 - t_start) + (t3 - t2)
            times["projection"] += (t2 - t1) + (t4 - t3)
            return theta
        if pre.q > 0:
            h = h - scale * (ZE @ (pre.d.unsqueeze(-1) * eks))
        if sigma2 and pre.q > 0:
            h = h - sigma2 * (ZE @ (pre.d.unsqueeze(-1) * (ZE.T @ alpha)))
        t1 = time.perf_counter()
        theta = proj.solve_ridge(h, alpha, sigma2)
        times["correction"] += t1 - t_start
        times["projection"] += time.perf_counter() - t1
        return theta

    @staticmethod
    def _curvature(kop, H, n, Z, exact, pre, ZE, proj, correction, held_out=None):
        r"""Per-sample curvature and top eigenvalue (sum units) of the data term of the iteration map, on H.

        With ``K_ZZ = L L^T``, ``W = L^{-1} K(Z, H)`` and ``U = L^{-1} ZE`` the map ``alpha -> theta``
        restricted to the data term acts on span K(., H) as ``W^T (I - U D U^T) W`` (``"projected"``,
        symmetric) or ``W^T W - W^T U D E^T K(X_s, H)`` (``"paper"``); :func:`heldout_curvature` turns
        its restriction to H into ``beta`` and ``lambda_top``. ``H``: the held-out rows; ``n``: the
        number of points they stand for; ``held_out``: ``W`` already formed (the rows of H of the whitened
        features, :mod:`.features`), else None. Returns ``(beta, lambda_top, U)``.
        """
        L = proj.L
        # in float64 (kgp.linalg.solve_lower_wide): a float32 solve's chains of small values went subnormal
        # (UCI pumadyn32nm: 26 s a solve against 0.38 s); the features were solved under flush-to-zero
        W = solve_lower_wide(L, kop(Z, H).to_dense()) if held_out is None else held_out.to(L.dtype)
        U = solve_lower_wide(L, ZE) if pre.q > 0 else None
        M = W.T @ W
        if pre.q > 0:
            WU = W.T @ U
            if correction == "projected":
                M = M - (WU * pre.d) @ WU.T
            else:
                Ksh = kop(pre.points, H).to_dense()
                M = M - (WU * pre.d) @ (pre.E.T @ Ksh)
        if correction == "projected" or pre.q == 0:
            beta, top = heldout_curvature(M, n, exact)
        else:
            beta = float(M.diagonal().max())
            top = float(torch.linalg.eigvals(M.double()).abs().max()) * (n / M.shape[0] if not exact else 1.0)
        return beta, top, U

    @staticmethod
    def _power_top(kop, H, Z, pre, ZE, proj, correction, scale, gen, iterations: int = 20) -> float:
        """Spectral radius of the batch-H iteration map ``v -> theta(v)`` by power iteration.

        The inner EigenPro 2.0 projection is itself an approximate, randomised inverse, so the map is
        estimated as applied; the largest of the last five Rayleigh-type ratios is returned.
        """
        KHZ = kop(H, Z).to_dense()  # |H| x p, within the O(p s) memory budget
        v = torch.randn(Z.shape[0], 1, generator=gen, dtype=Z.dtype).to(Z.device)
        ratios = []
        for _ in range(iterations):
            v = v / v.norm()
            g = KHZ @ v
            times = {"correction": 0.0, "projection": 0.0}
            eks = _paper_correction_sum(kop, H, g, pre) if correction == "paper" and pre.q > 0 else None
            w = EigenPro3Solver._direction(
                correction, eks, KHZ.T @ g, v, pre, ZE, proj, 0.0, scale, times, time.perf_counter()
            )
            ratios.append(float(w.norm()))
            v = w
        return max(ratios[-5:])
