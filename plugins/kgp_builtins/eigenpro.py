"""Solvers ``eigenpro`` (EigenPro 3.0) and ``eigenpro2`` (EigenPro 2.0, centers = training set).

EigenPro 3.0 (Abedsoltan, Belkin & Pandit, "Toward large kernel models", ICML 2023, Algorithm 2)
fits ``f(x) = sum_j alpha_j k(x, z_j)`` on centers Z that need not be training points, by
projected, preconditioned minibatch SGD in the RKHS (eq. 27)::

    f <- f - (n/m) eta proj_Z( P_s{ grad_m L(f) } )

- stochastic gradient on a batch X_m (eq. 28): ``K(., X_m) (K(X_m, Z) alpha - y_m)``;
- data preconditioner P_s (eq. 29-30, Lemma 5) from the top-q eigensystem of K(X_s, X_s) on a
  Nystrom subsample of size s: ``P_s{K(., A) a} = K(., A) a - K(., X_s) Q_s K(X_s, A) a``,
  ``Q_s = E (I - lambda_{q+1} Lambda^-1) Lambda^-1 E^T``;
- inexact projection (eq. 32): ``K(Z, Z) theta = h`` solved by EigenPro 2.0 iterations on Z with
  its own ("model") Nystrom preconditioner, or exactly by Cholesky when K(Z, Z) fits in memory.

Conventions (kgp): ``problem.noise`` = GP noise variance sigma^2 = EigenPro's bare lambda.
``regularization="ridge"`` minimises ``||K_XZ a - y||^2 + sigma^2 a^T K_ZZ a`` (the Nystrom GP
posterior mean, ``(K_ZX K_XZ + sigma^2 K_ZZ) a = K_ZX y``); ``"none"`` minimises
``||K_XZ a - y||^2`` (the paper's problem 15, interpolation when Z = X). See
docs/solvers/eigenpro.md for the derivations, the measurements behind the defaults and the
fixed point of the paper's ordering of preconditioner and projection (``correction="paper"``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import kgp
from kgp import settings
from kgp.plugin import KernelExpansion, Problem, merge_options

__all__ = [
    "EigenPro2Solver",
    "EigenPro3Solver",
]

KernelOpFactory = Callable[[Tensor, Tensor], Any]


# ---------------------------------------------------------------------------------------- options
_COMMON_DEFAULTS: dict[str, Any] = {
    # Passes over the training data. The paper's Fig. 2 trains 50 epochs; with q > 0 the training
    # loss flattens within ~10 on the data sets measured in docs/solvers/eigenpro.md.
    "epochs": 10,
    # None: the critical batch size m* = beta / lambda_top (EigenPro 2.0, Ma & Belkin 2019;
    # EigenPro 3 Sec. 4.5 / reference code), beyond which larger batches stop paying off.
    "batch_size": None,
    # Nystrom subsample size s of the data preconditioner. None: min(n, 2000). The reference code
    # uses 5000 on a GPU; 2000 keeps the s x s eigendecomposition below ~1 s on 2 CPU cores.
    "subsample_size": None,
    # Preconditioner level q. None: s // 10 (the reference code's q = 500 for s = 5000). 0 turns
    # the data preconditioner off (plain projected SGD).
    "q": None,
    # "ridge": minimise ||K_XZ a - y||^2 + sigma^2 a^T K_ZZ a (GP posterior mean on span Z);
    # "none": lambda = 0, the paper's unregularised least squares / interpolation.
    "regularization": "ridge",
    # Stop when the epoch's running training MSE <= tol * mean(y^2) (0 disables).
    "tol": 0.0,
    # Multiplies the step size derived from the eigenvalues (1 = the EigenPro 2.0 rule).
    "lr_scale": 1.0,
    # Return the average of the iterates of the last `average_epochs` epochs (tail Polyak-Ruppert
    # averaging; not in the paper). None: epochs // 2. 0: the last iterate, as in the paper.
    # Constant-step SGD hovers around a non-interpolating optimum (ridge, p << n); averaging removes
    # that noise floor (airline test MSE 0.835 -> 0.734, letter accuracy +0.5-0.8 points; docs).
    "average_epochs": None,
}

EIGENPRO3_DEFAULTS: dict[str, Any] = {
    **_COMMON_DEFAULTS,
    # "projected": theta = proj_Z P_s proj_Z(grad): converges to the minimiser of the chosen
    # objective on span Z. "paper": Algorithm 2 as printed, theta = proj_Z P_s(grad), whose fixed
    # point is an (I - Q)-weighted least-squares solution (Lemma 6) when Z is not the data.
    "correction": "projected",
    # "auto": "cholesky" if the p x p matrix fits kgp.settings.memory_budget, else "eigenpro2".
    "projection": "auto",
    # Inner EigenPro 2.0 epochs per projection (the paper runs 1 epoch in its large experiments).
    "projection_epochs": 1,
    # Model-preconditioner subsample size / level for the inner solver (None: min(p, 2000), s // 10).
    "projection_subsample_size": None,
    "projection_q": None,
}

EIGENPRO2_DEFAULTS: dict[str, Any] = dict(_COMMON_DEFAULTS)

_REGULARIZATIONS = ("ridge", "none")
_CORRECTIONS = ("projected", "paper")
_PROJECTIONS = ("auto", "cholesky", "eigenpro2")


def _check_int(options: dict, name: str, *, minimum: int, allow_none: bool = False) -> None:
    value = options[name]
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"option {name!r}: expected {expected}, got {value!r}")


def _check_choice(options: dict, name: str, choices: tuple[str, ...]) -> None:
    if options[name] not in choices:
        raise ValueError(f"option {name!r}: expected one of {choices}, got {options[name]!r}")


def _check_common(options: dict) -> None:
    _check_int(options, "epochs", minimum=1)
    _check_int(options, "batch_size", minimum=1, allow_none=True)
    _check_int(options, "subsample_size", minimum=1, allow_none=True)
    _check_int(options, "q", minimum=0, allow_none=True)
    _check_choice(options, "regularization", _REGULARIZATIONS)
    _check_int(options, "average_epochs", minimum=0, allow_none=True)
    if options["average_epochs"] is None:
        options["average_epochs"] = options["epochs"] // 2
    if options["average_epochs"] > options["epochs"]:
        raise ValueError(
            f"option 'average_epochs': expected <= epochs={options['epochs']}, got {options['average_epochs']}"
        )
    for name in ("tol", "lr_scale"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"option {name!r}: expected a finite number, got {value!r}")
    if options["tol"] < 0:
        raise ValueError(f"option 'tol': expected >= 0, got {options['tol']!r}")
    if options["lr_scale"] <= 0:
        raise ValueError(f"option 'lr_scale': expected > 0, got {options['lr_scale']!r}")


def _resolve_sq(n_points: int, s: int | None, q: int | None, s_name: str, q_name: str) -> tuple[int, int]:
    s = min(n_points, 2000) if s is None else s
    if s > n_points:
        raise ValueError(f"option {s_name!r}: expected <= {n_points} (number of points), got {s}")
    q = s // 10 if q is None else q
    if q >= s:
        raise ValueError(f"option {q_name!r}: expected < {s_name}={s}, got {q}")
    return s, q


# ---------------------------------------------------------------------------------- preconditioner
@dataclass
class NystromPreconditioner:
    r"""Top-q eigensystem of ``K(P_s, P_s) + shift I`` on a subsample ``P_s`` of the points P.

    Represents :math:`Q_s = E (I - \lambda_{q+1}\Lambda^{-1})\Lambda^{-1} E^\top` (EigenPro 3 eq. 30)
    in factored form, ``E diag(d) E^T`` with ``d_i = (1 - lambda_{q+1}/lambda_i) / lambda_i``,
    eigenvalues in sum units (of the s x s matrix, not divided by s).

    Attributes
    ----------
    idx:
        Indices of the subsample in P (length s).
    points:
        ``P[idx]``.
    E:
        ``s x q`` top eigenvectors.
    d:
        Length-q diagonal above.
    eigenvalues:
        Top q + 1 eigenvalues, decreasing.
    beta:
        ``max_i k(p_i, p_i) + shift`` over the subsample (per-sample curvature bound of SGD).
    """

    idx: Tensor
    points: Tensor
    E: Tensor
    d: Tensor
    eigenvalues: Tensor
    beta: float

    @property
    def q(self) -> int:
        return self.E.shape[1]

    def apply(self, v: Tensor) -> Tensor:
        """``Q_s v`` for ``v`` of shape ``s x k``."""
        if self.q == 0:
            return torch.zeros_like(v)
        return self.E @ (self.d.unsqueeze(-1) * (self.E.T @ v))


@torch.no_grad()
def nystrom_preconditioner(
    kop: KernelOpFactory, points: Tensor, s: int, q: int, generator: torch.Generator, shift: float = 0.0
) -> NystromPreconditioner:
    """Build the Nystrom preconditioner of EigenPro 2.0 / 3.0 (eq. 29-30) on ``s`` uniform points.

    The s x s eigendecomposition (O(s^3), once) runs in ``points``' dtype.
    """
    n = points.shape[0]
    idx = torch.randperm(n, generator=generator)[:s].to(points.device)
    sub = points[idx]
    K = kop(sub, sub).to_dense()
    if shift:
        K.diagonal().add_(shift)
    beta = float(K.diagonal().max())
    # Only lambda_1..lambda_{q+1} matter and their relative accuracy in float32 (~eps lambda_1) is
    # ample for a step size; float32 eigh is about 2x faster than float64 here.
    evals, evecs = torch.linalg.eigh(K)
    evals, evecs = evals.flip(0), evecs.flip(1)
    top = evals[: q + 1].clamp_min(0.0)
    E = evecs[:, :q]
    lam = top[:q]
    lam_next = top[q] if q < s else top.new_zeros(())
    # Numerically zero eigenvalues (rank-deficient K) cannot be inverted: drop those directions.
    keep = lam > max(float(top[0]), 1e-300) * 1e-12
    lam, E = lam[keep], E[:, keep]
    d = (1.0 - lam_next / lam) / lam
    return NystromPreconditioner(idx=idx, points=sub, E=E, d=d, eigenvalues=top, beta=beta)


def _overlap(idx_a: Tensor, idx_b: Tensor) -> tuple[Tensor, Tensor]:
    """Positions (i, j) with ``idx_a[i] == idx_b[j]`` (both index sets have unique entries)."""
    eq = idx_a.unsqueeze(1) == idx_b.unsqueeze(0)
    return eq.nonzero(as_tuple=True)


@torch.no_grad()
def heldout_top_eigenvalue(
    kop: KernelOpFactory,
    points: Tensor,
    pre: NystromPreconditioner,
    size: int,
    generator: torch.Generator,
    shift: float = 0.0,
) -> float:
    r"""Estimate the top eigenvalue of the preconditioned operator :math:`P_s \mathcal{K}` (sum units).

    The Nystrom value ``(n/s) lambda^s_{q+1}`` underestimates it (by 1.5-2.6x in the measurements
    of docs/solvers/eigenpro.md, because P_s only flattens the directions the subsample saw). We
    evaluate ``K(H, H) - K(H, S) Q_s K(S, H)`` (the operator restricted to span K(., H)) on an
    independent uniform subsample H and rescale by n / |H|. With ``shift`` (the ridge diagonal of
    EigenPro 2.0, P built from K + shift I) the bound ``lambda_max(P K_shift) <= lambda_max(P K) +
    shift`` is returned (the white-noise part does not rescale with n / |H|).
    """
    n = points.shape[0]
    h_idx = torch.randperm(n, generator=generator)[:size].to(points.device)
    H = points[h_idx]
    Khh = kop(H, H).to_dense().double()
    if pre.q > 0:
        Khs = kop(H, pre.points).to_dense()
        Khh = Khh - Khs.double() @ pre.apply(Khs.T).double()
    return _sym_top(Khh) * n / size + shift


def _sym_top(M: Tensor) -> float:
    """Largest eigenvalue of a symmetric PSD matrix (LOBPCG: only the top one is needed)."""
    M = 0.5 * (M + M.T)
    if M.shape[0] < 12:
        return float(torch.linalg.eigvalsh(M)[-1])
    x0 = torch.ones(M.shape[0], 1, dtype=M.dtype, device=M.device) + 0.1 * torch.linspace(
        -1, 1, M.shape[0], dtype=M.dtype, device=M.device
    ).unsqueeze(-1)
    evals, _ = torch.lobpcg(M, k=1, X=x0, largest=True, niter=200, tol=1e-6)
    return float(evals[0])


def critical_batch_and_step(beta: float, lam_top: float, n: int, batch_size: int | None) -> tuple[int, Callable]:
    r"""Batch size and step rule of EigenPro 2.0 (Ma & Belkin 2019; EigenPro 3 Sec. 4.5).

    With per-sample curvature bound ``beta`` and top preconditioned eigenvalue per sample
    ``lam = lam_top / n``, the critical batch is ``m* = beta / lam`` and the step for a batch of
    m samples is ``eta_m = m / (beta + (m - 1) lam)`` in per-sample units (the update subtracts
    ``eta_m / m`` times the summed batch gradient: the paper's ``(n/m) eta`` with ``eta = eta_m / n``).
    """
    lam = max(lam_top / n, 1e-300)
    m = batch_size if batch_size is not None else int(min(n, max(1, round(beta / lam))))
    m = min(m, n)

    def step(mb: int) -> float:
        return mb / (beta + (mb - 1) * lam)

    return m, step


# --------------------------------------------------------------------------- EigenPro 2.0 epochs
@dataclass
class _EP2State:
    points: Tensor
    pre: NystromPreconditioner
    batch: int
    step: Callable[[int], float]
    shift: float
    lr_scale: float


def _ep2_epoch(
    kop: KernelOpFactory,
    st: _EP2State,
    theta: Tensor,
    targets: Tensor,
    generator: torch.Generator,
    after_step: Callable[[], None] | None = None,
) -> float:
    r"""One epoch of EigenPro 2.0 on ``(K(P, P) + shift I) theta = targets``; updates ``theta`` in place.

    Per batch b: ``g = K_shift(P_b, P) theta - t_b``; ``theta_b -= (eta_m/m) g``;
    ``theta_S += (eta_m/m) Q_s K_shift(P_S, P_b) g`` (Lemma 5 with X_m = P_b: the preconditioned
    gradient ``K(., P_b) g - K(., P_S) Q_s K(P_S, P_b) g`` lies in span K(., P), so no projection).
    Returns the running mean of ``g^2`` (training MSE seen during the epoch).
    """
    N = st.points.shape[0]
    perm = torch.randperm(N, generator=generator).to(st.points.device)
    total = 0.0
    for start in range(0, N, st.batch):
        b = perm[start : start + st.batch]
        mb = b.shape[0]
        g = kop(st.points[b], st.points) @ theta - targets[b]
        if st.shift:
            g += st.shift * theta[b]
        total += float(g.pow(2).sum())
        lr = st.lr_scale * st.step(mb) / mb
        if st.pre.q > 0:
            ks = kop(st.points[b], st.pre.points).to_dense().T @ g
            if st.shift:
                i, j = _overlap(st.pre.idx, b)
                ks[i] += st.shift * g[j]
            theta.index_add_(0, st.pre.idx, st.pre.apply(ks), alpha=lr)
        theta[b] -= lr * g
        if after_step is not None:
            after_step()
    return total / (N * targets.shape[1])


def _ep2_setup(
    kop: KernelOpFactory,
    points: Tensor,
    s: int,
    q: int,
    shift: float,
    batch_size: int | None,
    lr_scale: float,
    generator: torch.Generator,
) -> _EP2State:
    pre = nystrom_preconditioner(kop, points, s, q, generator, shift)
    lam_top = heldout_top_eigenvalue(kop, points, pre, s, generator, shift)
    batch, step = critical_batch_and_step(pre.beta, lam_top, points.shape[0], batch_size)
    return _EP2State(points=points, pre=pre, batch=batch, step=step, shift=shift, lr_scale=lr_scale)


# ------------------------------------------------------------------------------------ projection
class _CholeskyProjection:
    """Exact ``K(Z, Z)^{-1} h`` (Cholesky with the smallest jitter that factorises)."""

    kind = "cholesky"

    def __init__(self, kop: KernelOpFactory, Z: Tensor):
        K = kop(Z, Z).to_dense()
        scale = float(K.diagonal().max())
        eps = torch.finfo(Z.dtype).eps
        jitter = 10 * eps * scale
        while True:
            A = K.clone()
            A.diagonal().add_(jitter)
            L, info = torch.linalg.cholesky_ex(A)
            if int(info) == 0:
                break
            jitter *= 10
            if jitter > 1e-2 * scale:
                raise ValueError("eigenpro: K(Z, Z) is not positive definite even with jitter; are centers duplicated?")
        self.L = L
        self.jitter = jitter

    def solve(self, h: Tensor) -> Tensor:
        return torch.cholesky_solve(h, self.L)

    def solve_ridge(self, h: Tensor, alpha: Tensor, sigma2: float) -> Tensor:
        """``K_ZZ^{-1}(h + sigma2 K_ZZ alpha)`` with ``K_ZZ = L L^T - jitter I`` exactly, in one solve."""
        if not sigma2:
            return self.solve(h)
        return self.solve(h - (sigma2 * self.jitter) * alpha).add_(alpha, alpha=sigma2)


class _Average:
    """Running mean of the iterates (tail averaging), switched on for the last epochs."""

    def __init__(self, alpha: Tensor):
        self.alpha = alpha
        self.mean = torch.zeros_like(alpha)
        self.count = 0

    def __call__(self) -> None:
        self.count += 1
        self.mean.add_(self.alpha - self.mean, alpha=1.0 / self.count)

    def current(self) -> Tensor:
        return self.mean if self.count else self.alpha


class _EigenPro2Projection:
    """Inexact ``K(Z, Z)^{-1} h`` by ``epochs`` EigenPro 2.0 epochs from 0 (EigenPro 3 eq. 32)."""

    kind = "eigenpro2"

    def __init__(self, kop: KernelOpFactory, Z: Tensor, s: int, q: int, epochs: int, generator: torch.Generator):
        self.kop = kop
        self.Z = Z
        self.epochs = epochs
        self.generator = generator
        self.state = _ep2_setup(kop, Z, s, q, 0.0, None, 1.0, generator)

    def solve(self, h: Tensor) -> Tensor:
        theta = torch.zeros_like(h)
        for _ in range(self.epochs):
            _ep2_epoch(self.kop, self.state, theta, h, self.generator)
        return theta

    def solve_ridge(self, h: Tensor, alpha: Tensor, sigma2: float) -> Tensor:
        # The ridge part goes through the same inexact solve, so that the fixed point stays exact.
        return self.solve(h + sigma2 * (self.kop(self.Z, self.Z) @ alpha) if sigma2 else h)


# --------------------------------------------------------------------------------- helpers
def _targets(problem: Problem) -> Tensor:
    y = problem.y
    if y.dim() != 2 or y.shape[0] != problem.n:
        raise ValueError(f"eigenpro: expected y of shape (n, k) with n={problem.n}, got {tuple(y.shape)}")
    return y


def _batch_residual_gradient(kop: KernelOpFactory, Xb: Tensor, Z: Tensor, alpha: Tensor, yb: Tensor):
    """``g = K(X_b, Z) alpha - y_b`` and ``K(Z, X_b) g`` with one kernel evaluation when the block fits."""
    op = kop(Xb, Z)
    m, p = Xb.shape[0], Z.shape[0]
    if m * p * Xb.element_size() <= settings.memory_budget.value():
        Kb = op.to_dense()
        g = Kb @ alpha - yb
        return g, Kb.T @ g
    g = op @ alpha - yb
    return g, op.mT @ g


def _check_finite(alpha: Tensor, epoch: int, name: str) -> None:
    if not bool(torch.isfinite(alpha).all()):
        raise RuntimeError(
            f"{name}: the iteration diverged at epoch {epoch}; lower solver_options['lr_scale'] "
            "or increase 'subsample_size' (better eigenvalue estimates)"
        )


# --------------------------------------------------------------------------------- EigenPro 3.0
class EigenPro3Solver:
    """EigenPro 3.0 (Algorithm 2): projected preconditioned SGD with centers decoupled from the data.

    Options (``option_defaults``; see docs/solvers/eigenpro.md for their sources):

    epochs, batch_size, subsample_size (s), q, regularization, tol, lr_scale, correction,
    projection, projection_epochs, projection_subsample_size, projection_q.
    """

    option_defaults: dict = EIGENPRO3_DEFAULTS
    uses_centers = True
    name = "eigenpro"

    def check_options(self, options: dict) -> None:
        _check_common(options)
        _check_choice(options, "correction", _CORRECTIONS)
        _check_choice(options, "projection", _PROJECTIONS)
        _check_int(options, "projection_epochs", minimum=1)
        _check_int(options, "projection_subsample_size", minimum=1, allow_none=True)
        _check_int(options, "projection_q", minimum=0, allow_none=True)

    def fit(self, problem: Problem) -> KernelExpansion:
        opts = merge_options(f"solver {self.name!r}", self.option_defaults, problem.options)
        self.check_options(opts)
        if problem.centers is None:
            raise ValueError("solver 'eigenpro' needs centers (problem.centers is None)")
        Z = problem.centers.points
        if Z.dim() != 2 or Z.shape[1] != problem.X.shape[1]:
            raise ValueError(f"eigenpro: centers must be (p, {problem.X.shape[1]}), got {tuple(Z.shape)}")
        Z = Z.to(device=problem.device, dtype=problem.dtype)
        X, y = problem.X, _targets(problem)
        n, p = X.shape[0], Z.shape[0]
        s, q = _resolve_sq(n, opts["subsample_size"], opts["q"], "subsample_size", "q")
        projection = opts["projection"]
        if projection == "auto":
            fits = p * p * Z.element_size() <= settings.memory_budget.value()
            projection = "cholesky" if fits else "eigenpro2"
        s2, q2 = (None, None)
        if projection == "eigenpro2":
            s2, q2 = _resolve_sq(
                p, opts["projection_subsample_size"], opts["projection_q"], "projection_subsample_size", "projection_q"
            )
        sigma2 = float(problem.noise) if opts["regularization"] == "ridge" else 0.0
        gen = problem.generator
        kop = problem.kernel_operator

        monitor = problem.monitor
        # Started before the setup so that the reported elapsed times include it (as wall time).
        monitor.start(total=opts["epochs"], desc=self.name)
        with torch.no_grad():
            setup_start = time.perf_counter()
            pre = nystrom_preconditioner(kop, X, s, q, gen)
            # ZE = K(Z, X_s) E (p x q): the paper's C = K(Z, X_s) Q_s kept in factored form, O(p q).
            ZE = kop(Z, pre.points) @ pre.E if pre.q > 0 else Z.new_zeros(p, 0)
            proj = (
                _CholeskyProjection(kop, Z)
                if projection == "cholesky"
                else _EigenPro2Projection(kop, Z, s2, q2, opts["projection_epochs"], gen)
            )
            lam_top = self._top_eigenvalue(kop, X, Z, pre, ZE, proj, opts["correction"], s, gen) + sigma2
            beta = pre.beta + sigma2 / n
            batch, step = critical_batch_and_step(beta, lam_top, n, opts["batch_size"])
            setup_time = time.perf_counter() - setup_start

            alpha = torch.zeros(p, y.shape[1], dtype=X.dtype, device=X.device)
            y_scale = float(y.pow(2).mean()) or 1.0
            average = _Average(alpha)
            first_avg = opts["epochs"] - opts["average_epochs"] + 1
            for epoch in range(1, opts["epochs"] + 1):
                times = {"gradient": 0.0, "correction": 0.0, "projection": 0.0}
                perm = torch.randperm(n, generator=gen).to(X.device)
                sq_sum = 0.0
                for start in range(0, n, batch):
                    b = perm[start : start + batch]
                    mb = b.shape[0]
                    t0 = time.perf_counter()
                    Xb = X[b]
                    g, grad = _batch_residual_gradient(kop, Xb, Z, alpha, y[b])
                    sq_sum += float(g.pow(2).sum())
                    t1 = time.perf_counter()
                    theta = self._direction(
                        kop, opts["correction"], Xb, g, grad, alpha, pre, ZE, proj, sigma2, n / mb, times, t1
                    )
                    times["gradient"] += t1 - t0
                    alpha.sub_(theta, alpha=opts["lr_scale"] * step(mb) / n)
                    if epoch >= first_avg:
                        average()
                _check_finite(alpha, epoch, "eigenpro")
                train_mse = sq_sum / (n * y.shape[1])
                stop = monitor.step(
                    epoch,
                    lambda: KernelExpansion(problem.kernel, Z, average.current().clone()),
                    train_mse=train_mse,
                    batch_size=batch,
                    step_size=opts["lr_scale"] * step(batch),
                    top_eigenvalue=lam_top,
                    q=pre.q,
                    s=s,
                    projection=proj.kind,
                    setup_time=setup_time,
                    time_gradient=times["gradient"],
                    time_correction=times["correction"],
                    time_projection=times["projection"],
                )
                if stop or (opts["tol"] > 0 and train_mse <= opts["tol"] * y_scale):
                    break
        return KernelExpansion(problem.kernel, Z, average.current())

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _direction(kop, correction, Xb, g, grad, alpha, pre, ZE, proj, sigma2, scale, times, t_start) -> Tensor:
        r"""Search direction theta (coefficients on Z) for one batch; the caller subtracts ``eta theta``.

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
            ks = kop(Xb, pre.points).to_dense().T @ g  # K(X_s, X_m) g
            h = h - scale * (ZE @ (pre.d.unsqueeze(-1) * (pre.E.T @ ks)))
        if sigma2 and pre.q > 0:
            h = h - sigma2 * (ZE @ (pre.d.unsqueeze(-1) * (ZE.T @ alpha)))
        t1 = time.perf_counter()
        theta = proj.solve_ridge(h, alpha, sigma2)
        times["correction"] += t1 - t_start
        times["projection"] += time.perf_counter() - t1
        return theta

    @staticmethod
    def _top_eigenvalue(kop, X, Z, pre, ZE, proj, correction, size, gen) -> float:
        r"""Top eigenvalue (sum units) of the full-batch iteration map, estimated on a held-out subsample H.

        With the Cholesky projection (``K_ZZ = L L^T``, ``W = L^{-1} K(Z, H)``, ``U = L^{-1} ZE``) the map
        ``alpha -> theta`` restricted to the data term has the eigenvalues of
        ``(n/|H|) W^T (I - U D U^T) W`` (``"projected"``, symmetric) or
        ``(n/|H|) (W^T W - W^T U D E^T K(X_s, H))`` (``"paper"``). With the inexact projection
        (large p) the map itself, inner EigenPro 2.0 solves included, is power-iterated on H.
        """
        n = X.shape[0]
        h_idx = torch.randperm(n, generator=gen)[:size].to(X.device)
        H = X[h_idx]
        if not isinstance(proj, _CholeskyProjection):
            return EigenPro3Solver._power_top(kop, H, Z, pre, ZE, proj, correction, n / size, gen)
        L = proj.L
        W = torch.linalg.solve_triangular(L, kop(Z, H).to_dense(), upper=False).double()
        if pre.q == 0:
            M = W.T @ W
        else:
            U = torch.linalg.solve_triangular(L, ZE, upper=False).double()
            d = pre.d.double()
            WU = W.T @ U
            if correction == "projected":
                M = W.T @ W - (WU * d) @ WU.T
            else:
                Ksh = kop(pre.points, H).to_dense().double()
                M = W.T @ W - (WU * d) @ (pre.E.double().T @ Ksh)
        if correction == "projected" or pre.q == 0:
            top = _sym_top(M)
        else:
            top = float(torch.linalg.eigvals(M).abs().max())
        return top * n / size

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
            w = EigenPro3Solver._direction(
                kop, correction, H, g, KHZ.T @ g, v, pre, ZE, proj, 0.0, scale, times, time.perf_counter()
            )
            ratios.append(float(w.norm()))
            v = w
        return max(ratios[-5:])


# --------------------------------------------------------------------------------- EigenPro 2.0
class EigenPro2Solver:
    """EigenPro 2.0 (Ma & Belkin 2019): preconditioned SGD with centers = the training set.

    This is EigenPro 3.0 with Z = X, where the projection is the identity (EigenPro 3 Sec. 4.2).
    ``regularization="ridge"`` solves ``(K + sigma^2 I) alpha = y`` (the GP posterior mean) by the
    diagonal shift (kernel ``K + sigma^2 delta``); ``"none"`` solves ``K alpha = y``.
    """

    option_defaults: dict = EIGENPRO2_DEFAULTS
    uses_centers = False
    name = "eigenpro2"

    def fit(self, problem: Problem) -> KernelExpansion:
        opts = merge_options(f"solver {self.name!r}", self.option_defaults, problem.options)
        _check_common(opts)
        X, y = problem.X, _targets(problem)
        n = X.shape[0]
        s, q = _resolve_sq(n, opts["subsample_size"], opts["q"], "subsample_size", "q")
        shift = float(problem.noise) if opts["regularization"] == "ridge" else 0.0
        gen = problem.generator
        kop = problem.kernel_operator
        monitor = problem.monitor
        monitor.start(total=opts["epochs"], desc=self.name)
        with torch.no_grad():
            t0 = time.perf_counter()
            state = _ep2_setup(kop, X, s, q, shift, opts["batch_size"], opts["lr_scale"], gen)
            setup_time = time.perf_counter() - t0
            alpha = torch.zeros(n, y.shape[1], dtype=X.dtype, device=X.device)
            y_scale = float(y.pow(2).mean()) or 1.0
            average = _Average(alpha)
            first_avg = opts["epochs"] - opts["average_epochs"] + 1
            for epoch in range(1, opts["epochs"] + 1):
                t1 = time.perf_counter()
                train_mse = _ep2_epoch(kop, state, alpha, y, gen, average if epoch >= first_avg else None)
                _check_finite(alpha, epoch, "eigenpro2")
                stop = monitor.step(
                    epoch,
                    lambda: KernelExpansion(problem.kernel, X, average.current().clone()),
                    train_mse=train_mse,
                    batch_size=state.batch,
                    step_size=opts["lr_scale"] * state.step(state.batch),
                    q=state.pre.q,
                    s=s,
                    setup_time=setup_time,
                    time_epoch=time.perf_counter() - t1,
                )
                if stop or (opts["tol"] > 0 and train_mse <= opts["tol"] * y_scale):
                    break
        return KernelExpansion(problem.kernel, X, average.current())


@kgp.hookimpl
def register_solvers(register):
    register("eigenpro", EigenPro3Solver())
    register("eigenpro2", EigenPro2Solver())
