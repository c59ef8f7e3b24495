"""One ``least_squares`` step: the ridge least-squares fit of the residual by the step's r features.

Dai et al. (NIPS 2014, end of Sec. 4, after eq. 6): "our algorithm can also take a mini-batch of
points and random functions at each step, and estimate an empirical covariance for preconditioning".
With the empirical covariance ``A = Phi_t^T Phi_t / m`` of step t's r features on the batch B_t, the
preconditioned functional gradient step (square loss, step size 1) is the ridge least-squares fit of
the current residual by the new features::

    a_t = argmin_a  (1/m) ||y_B - f_t(X_B) - Phi_t a||^2 + rho ||a||^2 = (A + rho I)^-1 Phi_t^T (y_B - f_t(X_B)) / m

It cannot overshoot (the batch loss falls at every step, whatever the spectrum of the kernel), and in
the directions the r features resolve it moves all the way instead of by ``gamma lambda_i``: the
plain step's speed is bounded by the largest eigenvalue (``gamma < 2 / lambda_1``), this one's is
not. docs/solvers/dsg.md has the measurements (10-100x fewer features than the plain step for the
same test error on the UCI sweep).

The system is solved in float64 whatever the input dtype (``r x r``; the features themselves stay in
the input dtype): directly (Cholesky of A) when the batch has at most ``gram_rows`` points, else by
conjugate gradients on the exact system with ``Phi_t`` products, preconditioned by the Cholesky
factor of the covariance of ``gram_rows`` random rows of the batch: the same answer for ``O(m r)``
per iteration instead of the ``O(m r^2)`` of the full covariance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kgp.linalg import psd_cholesky

__all__ = ["BlockSolve", "solve_block"]

# Relative residual at which the conjugate gradients stop, and their cap. The block fit is one step
# of an iteration, not an end in itself: 1e-3 gave the same test errors as an exact solve on the UCI
# sweep (docs/solvers/dsg.md) after 7-15 iterations.
CG_TOL = 1e-3
CG_MAXITER = 50


@dataclass(frozen=True)
class BlockSolve:
    """How one block was solved: ``direct`` or ``cg`` with its iteration count and relative residual."""

    method: str
    iterations: int = 0
    residual: float = 0.0


def _ridge_floor(A: Tensor, dtype: torch.dtype) -> float:
    """Smallest ridge: 10 eps of the feature dtype times the mean diagonal of the covariance.

    Features computed in float32 carry relative errors ~eps32 per entry, so covariance directions
    below ~eps32 * trace / r are rounding noise; a ridge below that would amplify them.
    """
    return 10.0 * torch.finfo(dtype).eps * float(A.diagonal().mean().clamp_min(0.0))


def _no_reduce(t: Tensor) -> Tensor:
    return t


def solve_block(
    Phi: Tensor,
    resid: Tensor,
    rho: float,
    gram_rows: int,
    generator: torch.Generator,
    step: int,
    *,
    batch_size: int | None = None,
    positions: Tensor | None = None,
    reduce: Callable[[Tensor], Tensor] = _no_reduce,
) -> tuple[Tensor, BlockSolve]:
    """Return ``a = (Phi^T Phi / m + rho I)^-1 Phi^T resid / m`` (``r x k``, float64) and how it was solved.

    Parameters
    ----------
    Phi:
        ``m x r`` features of the step on the batch (input dtype).
    resid:
        ``m x k`` residual ``y - f_t`` on the batch.
    rho:
        Ridge (>= 0; raised to the rounding floor of the feature dtype).
    gram_rows:
        Batches with at most this many points are solved directly; larger ones by preconditioned CG.
    generator:
        Draws the rows of the preconditioner.
    step:
        Step number, for error messages.
    batch_size, positions, reduce:
        Distributed fits (:mod:`kgp.distributed`): ``Phi`` and ``resid`` are this rank's rows of a
        batch of ``batch_size`` points, at ``positions`` in the batch; ``reduce`` sums a tensor over
        the ranks in place. The normal-equation sums ``Phi^T Phi`` and ``Phi^T resid`` (and CG's
        ``Phi^T Phi v``) are the only things summed; the ``r x r`` solve is replicated. Defaults: the
        whole batch is here.
    """
    m, r = Phi.shape
    if batch_size is not None:
        m = batch_size
    rhs = reduce((Phi.T @ resid).to(torch.float64)).div_(m)
    remedy = "pass a larger 'ridge' option, or float64 inputs"
    if m <= gram_rows:
        P = Phi.to(torch.float64)
        A = reduce(P.T @ P)
        A.div_(m)
        A.diagonal().add_(max(rho, _ridge_floor(A, Phi.dtype)))
        L = psd_cholesky(A, what=f"the covariance of step {step}'s features", remedy=remedy)
        return torch.cholesky_solve(rhs, L), BlockSolve("direct")
    rows = torch.randperm(m, generator=generator)[:gram_rows].to(Phi.device)
    if positions is not None:  # the sampled batch positions this rank holds
        rows = torch.isin(positions.to(Phi.device), rows).nonzero().reshape(-1)
    P = Phi[rows].to(torch.float64)
    A = reduce(P.T @ P)
    A.div_(gram_rows)
    rho = max(rho, _ridge_floor(A, Phi.dtype))
    A.diagonal().add_(rho)
    L = psd_cholesky(A, what=f"the covariance of step {step}'s features", remedy=remedy)

    def matvec(v: Tensor) -> Tensor:
        out = reduce((Phi.T @ (Phi @ v.to(Phi.dtype))).to(torch.float64)).div_(m)
        return out.add_(v, alpha=rho)

    # Preconditioned CG, one column per output (the scalars are per column).
    a = torch.zeros_like(rhs)
    res = rhs.clone()
    z = torch.cholesky_solve(res, L)
    p = z.clone()
    rz = (res * z).sum(0)
    norm0 = rhs.norm(dim=0).clamp_min(1e-300)
    rel = 1.0
    it = 0
    while it < CG_MAXITER:
        it += 1
        Ap = matvec(p)
        alpha = rz / (p * Ap).sum(0).clamp_min(1e-300)
        a.add_(p * alpha)
        res.sub_(Ap * alpha)
        rel = float((res.norm(dim=0) / norm0).max())
        if rel <= CG_TOL:
            break
        z = torch.cholesky_solve(res, L)
        rz_new = (res * z).sum(0)
        p = z + p * (rz_new / rz.clamp_min(1e-300))
        rz = rz_new
    return a, BlockSolve("cg", it, rel)
