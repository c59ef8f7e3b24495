r"""The Nystrom preconditioner of EigenPro 2.0 / 3.0 and the step-size rule it implies.

Shared by both solvers (the data preconditioner of ``eigenpro`` and ``eigenpro2``, the model
preconditioner of the inner EigenPro 2.0 projection):

- :func:`draw_subsamples`: the Nystrom subsample S and a held-out sample H disjoint from it;
- :func:`nystrom_preconditioner`: the eigensystem of ``K(X_s, X_s)``, giving
  ``P_s{K(., A) a} = K(., A) a - K(., X_s) Q_s K(X_s, A) a`` with ``Q_s = E diag(d) E^T``
  (EigenPro 3 eq. 29-30, Lemma 5), with the curvature of each direction measured on H;
- :func:`heldout_curvature`: the per-sample curvature ``beta`` and the top eigenvalue of a
  preconditioned map from its restriction to H;
- :func:`critical_batch_and_step`: the critical batch ``m* = beta / lambda`` and step
  ``eta_m = m / (beta + (m - 1) lambda)`` of EigenPro 2.0 (Ma & Belkin 2019; EigenPro 3 Sec. 4.5).

Everything is in "sum units": the curvature of ``sum_i (f(x_i) - y_i)^2 + sigma^2 ||f||^2`` (the
eigenvalues of ``K(X, X) + sigma^2 I``), so that EigenPro 2.0 (``K + sigma^2 I``) and 3.0
(``K_op + sigma^2 I`` projected on span Z) share one rule. Measurements: docs/solvers/eigenpro.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kgp.linalg import largest_eigenvalue

from .budget import block_rows

__all__ = [
    "KernelOpFactory",
    "NystromPreconditioner",
    "BATCH_FLOOR_PER_CENTER",
    "batch_floor",
    "critical_batch",
    "critical_batch_and_step",
    "draw_subsamples",
    "heldout_curvature",
    "nystrom_preconditioner",
]

#: ``kop(A, B)`` -> lazy ``K(A, B)`` (``problem.kernel_operator``).
KernelOpFactory = Callable[[Tensor, Tensor], Any]

#: Up to this many points the held-out sample is the whole point set: the curvature estimates are
#: then exact. 2,000 = the default subsample cap, so by default the estimate is exact where the
#: subsample is every point. At 3,000 (before) UCI skillcraft (n = 2,670, p = 2,670) spent 5.9 s of
#: its 14.6 s setup in the exact O(n^2 p) curvature and 2.3 s in the n x n residual's top eigenvalue;
#: with a held-out sample of 670 points the setup took 6.5 s at the same test RMSE (1.001x FALKON's).
EXACT_CURVATURE_POINTS = 2000


def draw_subsamples(
    n: int, s: int, h: int, generator: torch.Generator, device, exact_cols: int | None = None
) -> tuple[Tensor, Tensor, bool]:
    """Indices of the Nystrom subsample S (size s) and of a held-out sample H; ``exact`` when H is every point.

    With ``n <= EXACT_CURVATURE_POINTS`` H is every point (curvature estimates are exact), provided
    the ``n x exact_cols`` block of the exact estimate (default ``n x n``) fits
    ``kgp.settings.memory_budget``; otherwise H is drawn from the points outside S
    (``min(h, n - s)`` of them), so that it sees the directions the subsample did not.
    """
    perm = torch.randperm(n, generator=generator)
    idx_s = perm[:s].to(device)
    fits = block_rows(exact_cols if exact_cols is not None else n, device) >= n
    if (n <= EXACT_CURVATURE_POINTS and fits) or n - s < 2:
        return idx_s, torch.arange(n, device=device), True
    return idx_s, perm[s : s + max(min(h, n - s), 2)].to(device), False


@dataclass
class NystromPreconditioner:
    r"""Damping of the Nystrom eigendirections of ``K(X_s, X_s)``, in the factored form ``Q_s = E diag(d) E^T``.

    ``P_s psi_j = (tau / mu_j) psi_j`` for the kept eigenfunctions ``psi_j = K(., X_s) e_j / sqrt(lambda_j)``
    whose curvature ``mu_j`` exceeds the level ``tau`` (EigenPro 3 eq. 29 with ``tau = lambda_{q+1}``,
    ``mu_j = lambda_j`` in the paper), so ``d_j = (1 - tau / mu_j) / lambda_j``.

    Attributes
    ----------
    idx:
        Indices of the subsample in the points (length s).
    points:
        The subsample.
    E:
        ``s x q`` eigenvectors of the damped directions.
    d:
        Length-q diagonal above.
    eigenvalues:
        Eigenvalues ``lambda_j`` of ``K(X_s, X_s)`` (plus the white-noise shift for EigenPro 2.0),
        decreasing, all s of them.
    curvature:
        ``mu_j`` of the damped directions (sum units, ridge included).
    level:
        ``tau`` (sum units).
    """

    idx: Tensor
    points: Tensor
    E: Tensor
    d: Tensor
    eigenvalues: Tensor
    curvature: Tensor
    level: float

    @property
    def q(self) -> int:
        return self.E.shape[1]

    def apply(self, v: Tensor) -> Tensor:
        """``Q_s v`` for ``v`` of shape ``s x k``."""
        if self.q == 0:
            return torch.zeros_like(v)
        return self.E @ (self.d.unsqueeze(-1) * (self.E.T @ v))


def _check_finite(K: Tensor, what: str) -> None:
    if not bool(torch.isfinite(K).all()):
        raise ValueError(
            f"eigenpro: the kernel matrix {what} has non-finite entries ({K.dtype}); the inputs' scale "
            "overflows the kernel evaluation (e.g. squared distances beyond the dtype's range): standardise "
            "the inputs (or scale the lengthscale with them), or use float64"
        )


def _eigh(K: Tensor) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition, decreasing; retried in float64 if the dtype's LAPACK driver fails."""
    try:
        evals, evecs = torch.linalg.eigh(K)
    except torch.linalg.LinAlgError:
        evals, evecs = torch.linalg.eigh(K.double())
        evals, evecs = evals.to(K.dtype), evecs.to(K.dtype)
    return evals.flip(0), evecs.flip(1)


@torch.no_grad()
def nystrom_preconditioner(
    kop: KernelOpFactory,
    points: Tensor,
    idx_s: Tensor,
    idx_h: Tensor,
    exact: bool,
    q: int,
    noise: float,
    white_noise: bool,
    n: int | None = None,
) -> tuple[NystromPreconditioner, Tensor, Tensor]:
    r"""Build the data preconditioner of EigenPro 2.0 / 3.0 (eq. 29-30) on the subsample ``points[idx_s]``.

    Parameters
    ----------
    kop:
        Kernel factory.
    points:
        All n points (training inputs, or the centers for the model preconditioner).
    idx_s, idx_h, exact:
        From :func:`draw_subsamples`.
    q:
        Most directions to damp (< s).
    noise:
        sigma^2 of the curvature ``K_op + sigma^2 I`` (0 for interpolation).
    white_noise:
        EigenPro 2.0's kernel ``k + sigma^2 delta``: the Nystrom matrix is ``K(X_s, X_s) + sigma^2 I``.
    n:
        Number of points the samples stand for; default ``points.shape[0]``. A distributed fit passes
        only the gathered rows of S and H as ``points`` (:class:`.rows.Rows`) and the global n here.

    Returns
    -------
    (NystromPreconditioner, K'(H, X_s), K'(H, H))
        The held-out blocks (``K' = K + shift delta``, the white-noise shift of EigenPro 2.0 included)
        are returned for the curvature estimate of :func:`heldout_curvature`.
    """
    n = points.shape[0] if n is None else n
    s = idx_s.shape[0]
    sub = points[idx_s]
    K = kop(sub, sub).to_dense()
    _check_finite(K, "of the Nystrom subsample")
    Khs = kop(points[idx_h], sub).to_dense()
    _check_finite(Khs, "between the held-out sample and the Nystrom subsample")
    if exact:
        # H = every point, so H holds S: its entries k(x, x) come from the exact diagonal, not from
        # the cross-block evaluation, which loses them at extreme input scales (|x| / lengthscale ~ 1e30).
        Khs[idx_s, torch.arange(s, device=Khs.device)] = K.diagonal()
    shift = noise if white_noise else 0.0
    if shift:
        K.diagonal().add_(shift)
    evals, evecs = _eigh(K)
    lam = evals.clamp_min(0.0)
    # Directions below the float32 rounding level of K(X_s, X_s) (s eps32 lambda_1, the pseudo-inverse
    # convention) are left alone, in both dtypes: inverting them amplified rounding errors without bound
    # (smooth kernels: test R^2 0.006 where exact reached 0.999), and with the float64 level instead
    # (s eps64 lambda_1) directions down to 1e-10 lambda_1 were damped by 1/lambda_j, which the
    # projection's L^{-1} (jitter 10 eps) turned into noise: test RMSE 0.71 in float64 against 0.049 in
    # float32 on the ill-conditioned ARD test problem (lengthscales 0.3 / 3 / 30, noise 1e-3).
    floor = s * torch.finfo(torch.float32).eps * float(lam[0]) if s else 0.0
    valid = int((lam > max(floor, 1e-300)).sum())
    q = min(q, max(valid - 1, 0))
    lam64 = lam.double()
    # Rayleigh quotient of each Nystrom eigenfunction on the whole operator K_op = sum_i K(., x_i) K(., x_i):
    # <psi_j, K_op psi_j> = sum_i (K(x_i, X_s) e_j)^2 / lambda_j, the subsample's own rows giving lambda_j^2
    # and the held-out rows estimating the rest. (n/s) lambda_j overstates it where K(X_s, X_s) is
    # dominated by its diagonal (short ARD lengthscales, duplicates), see docs.
    rows = Khs.double() @ evecs[:, :valid].double()
    kept = lam64[:valid]
    if exact:
        if shift:  # K'(X, X_s) = K(X, X_s) + sigma^2 at the subsample's own rows (H = X here)
            rows[idx_s] += shift * evecs[:, :valid].double()
        mu_v = rows.pow(2).sum(0) / kept
    else:
        mu_v = kept + (n - s) / idx_h.shape[0] * rows.pow(2).sum(0) / kept
    if not white_noise:  # the ridge term sigma^2 ||f||^2 (EigenPro 2.0's k + sigma^2 delta has it inside)
        mu_v = mu_v + noise
    mu = torch.zeros_like(lam64)
    mu[:valid] = mu_v
    # Level tau: damping a direction below the curvature rho left outside the subsample's span buys
    # nothing (the step is set by rho) and slows that direction down by rho / tau (measured on sml:
    # q = s - 1 with tau = lambda_s gave 31x FALKON's RMSE after 10 epochs). rho: top eigenvalue of the
    # Nystrom residual K(H, H) - K(H, S) K(S, S)^+ K(S, H), held out.
    Khh = kop(points[idx_h], points[idx_h]).to_dense()
    if shift:
        Khh.diagonal().add_(shift)
    Kp = Khs
    if shift and exact:
        Kp = Khs.clone()
        Kp[idx_s, torch.arange(s, device=Khs.device)] += shift
    if exact and s == n:
        # S is every point: the residual is K' - K' K'^+ K' = the truncated part of its own eigensystem,
        # whose top eigenvalue is the first one left out (an n x n eigenvalue problem saved)
        rho = float(lam[valid]) if valid < s else 0.0
        rho += 0.0 if white_noise else noise
    elif valid > 0:
        V = rows  # K'(H, X_s) E from above, its white-noise shift included (Kp E)
        R = Khh.double() - (V / lam64[:valid]) @ V.T
        _, rho = heldout_curvature(R, n, exact)
        rho += 0.0 if white_noise else noise
    else:
        rho = 0.0
    tau = max(float(mu[q]) if q < valid else float(noise), rho)
    keep = torch.zeros_like(lam64, dtype=torch.bool)
    keep[:q] = mu[:q] > tau
    E = evecs[:, keep]
    d = ((1.0 - tau / mu[keep]) / lam64[keep]).to(K.dtype)
    pre = NystromPreconditioner(
        idx=idx_s, points=sub, E=E, d=d, eigenvalues=lam, curvature=mu[keep].to(K.dtype), level=tau
    )
    return pre, Kp, Khh


#: Up to this size the top eigenvalue of a held-out map is taken from the full ``eigvalsh``: a strong
#: preconditioner flattens the top of the spectrum to the level tau, where block subspace iteration
#: converges slowly (UCI yacht, n = 246, q = s - 1: 100 iterations, 5.5 s of a 5.7 s fit under load,
#: 0.07 s by ``eigvalsh``). Above it ``eigvalsh`` costs more than the iteration (1,202^2: 0.7 s).
DENSE_EIGVALS = 600


def _top_eigenvalue(A: Tensor) -> float:
    if A.shape[0] <= DENSE_EIGVALS:
        return float(torch.linalg.eigvalsh(A)[-1])
    return largest_eigenvalue(A, rtol=1e-9, block=32)


def heldout_curvature(M: Tensor, n: int, exact: bool) -> tuple[float, float]:
    r"""Per-sample curvature ``beta`` and top eigenvalue (sum units) of a map from its held-out restriction.

    ``M`` (h x h) is the map restricted to the held-out sample H: its diagonal holds each point's own
    curvature ``beta_i`` (the per-sample bound of SGD is their maximum) and its off-diagonal part
    the interaction between points. For the n x n map the off-diagonal part scales with the number
    of points, the diagonal does not, so the top eigenvalue is estimated as
    ``(n - 1)/(h - 1) lambda_max(M - D) + max D`` (an upper bound of ``lambda_max`` when the scaled
    off-diagonal estimate holds). The plain ``(n/h) lambda_max(M)`` overstated it by up to n/h where
    the map is dominated by its diagonal (short ARD lengthscales), so steps were that much too small.
    With ``exact`` (H = every point) ``lambda_max(M)`` itself.
    """
    M = 0.5 * (M + M.T)
    D = M.diagonal()
    beta = float(D.max())
    if exact:
        return beta, _top_eigenvalue(M.double())
    h = M.shape[0]
    shifted = M.double() - torch.diag(D.double()) + beta * torch.eye(h, dtype=torch.float64, device=M.device)
    off = _top_eigenvalue(shifted) - beta
    return beta, (n - 1) / (h - 1) * max(off, 0.0) + beta


def critical_batch(beta: float, lam_top: float, n: int) -> int:
    """The critical batch ``m* = beta / lambda`` (``lambda = lam_top / n``), in ``[1, n]``."""
    lam = max(lam_top / n, 1e-300)
    return int(min(n, max(1, round(beta / lam))))


def critical_batch_and_step(
    beta: float, lam_top: float, n: int, batch_size: int | None, floor: int = 1
) -> tuple[int, Callable]:
    r"""Batch size and step rule of EigenPro 2.0 (Ma & Belkin 2019; EigenPro 3 Sec. 4.5).

    With per-sample curvature bound ``beta`` and top preconditioned eigenvalue per sample
    ``lam = lam_top / n``, the critical batch is ``m* = beta / lam`` and the step for a batch of
    m samples is ``eta_m = m / (beta + (m - 1) lam)`` in per-sample units (the update subtracts
    ``eta_m / m`` times the summed batch gradient: the paper's ``(n/m) eta`` with ``eta = eta_m / n``).
    That step is the optimal one for every m (Ma, Bassily & Belkin 2018, Thm. 4): linear in m
    (``m / beta``) well below m*, and saturating at ``1 / lam`` (the full-gradient step, stable
    below ``2 / lam``) above it, so a batch above m* keeps a stable step.

    ``floor``: the default batch is ``max(m*, floor)`` (capped at n): the solver's per-batch overhead
    (EigenPro 3: two triangular solves with the M x M Cholesky factor) makes batches far below it
    cost more per row than they gain per step (:func:`batch_floor`). An explicit ``batch_size`` is
    taken as given.
    """
    lam = max(lam_top / n, 1e-300)
    m = batch_size if batch_size is not None else max(critical_batch(beta, lam_top, n), int(floor))
    m = min(m, n)

    def step(mb: int) -> float:
        return mb / (beta + (mb - 1) * lam)

    return m, step


#: Default batch floor per model center (EigenPro 3, Cholesky projection): M / 16. Measured on
#: tamielectric (M = 5,000, d = 3, float32, docs/solvers/eigenpro.md "Batch floor"): a batch costs
#: ~16 ms of fixed work (the two triangular solves, 13-15 ms) plus ~53 us per row (the K(X_b, Z)
#: passes), so the two balance at m ~ 300 = M / 16; both terms scale with M (M^2 vs M per row).
BATCH_FLOOR_PER_CENTER = 1.0 / 16.0


def batch_floor(n_centers: int) -> int:
    """Smallest default batch for a model on ``n_centers`` centers: ``ceil(n_centers / 16)``."""
    return max(1, -(-int(n_centers) // int(round(1.0 / BATCH_FLOOR_PER_CENTER))))


def symmetric_top_eigenvalue(M: Tensor) -> float:
    """Largest eigenvalue of a symmetric PSD matrix (see :func:`kgp.linalg.largest_eigenvalue`)."""
    return largest_eigenvalue(0.5 * (M + M.T), rtol=1e-9, block=32)
