"""Solver ``nystrom-direct``: the Nystrom estimator by one dense M x M solve.

The Nystrom KRR estimator (Rudi, Carratino, Rosasco 2017, eq. 8, with kgp's ``lambda n = sigma^2``)
is ``f(x) = sum_j alpha_j k(x, z_j)`` with

    (K_nM^T K_nM + sigma^2 K_MM) alpha = K_nM^T y.                                   (*)

FALKON approximates it iteratively; this solver computes it directly, which makes it a reference
for center-based solvers at moderate M (O(n M^2) time, O(M^2) memory; nothing n x M is stored).

Robust M x M solve. ``H`` in (*) inherits the conditioning of ``K_MM`` (nearby or duplicate
centers make it singular), so instead of factorising ``H`` we change variables to the
eigenbasis of ``K_MM`` (FALKON Appendix A, Def. 3, eigendecomposition variant): with
``K_MM = U S U^T`` and ``T = U_q S_q^{-1/2}`` over the ``q`` eigenvalues above
``rcond * max(S)``, ``alpha = T beta`` turns (*) into

    (T^T K_nM^T K_nM T + sigma^2 I_q) beta = T^T K_nM^T y,

whose matrix is the sum of a PSD part and ``sigma^2 I``. Rounding can make the computed PSD part
slightly indefinite in float32, so it is diagonalised and its eigenvalues clamped at 0 before
adding ``sigma^2``: the solve never fails and the result is the minimum-norm Nystrom solution on
the numerically non-degenerate part of ``span{k(., z_j)}``.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kgp
from kgp.plugin import KernelExpansion, Problem

__all__ = ["NystromDirect", "solve_nystrom_system"]


def solve_nystrom_system(gram: Tensor, kmm: Tensor, rhs: Tensor, noise: float, rcond: float | None = None) -> Tensor:
    """Solve ``(gram + noise * kmm) alpha = rhs`` in the eigenbasis of ``kmm`` (see the module docstring).

    Parameters
    ----------
    gram:
        ``K_nM^T K_nM`` (M x M, symmetric positive semi-definite).
    kmm:
        ``K_MM`` (M x M).
    rhs:
        ``K_nM^T y`` (M x k).
    noise:
        sigma^2 > 0.
    rcond:
        Eigenvalues of ``K_MM`` below ``rcond * max eigenvalue`` are dropped; None uses
        ``M * eps(dtype)``, the usual pseudo-inverse threshold.

    Returns
    -------
    Tensor
        ``alpha`` (M x k), in the dtype and device of ``gram``.
    """
    m = kmm.shape[0]
    if rcond is None:
        rcond = m * torch.finfo(kmm.dtype).eps
    evals, evecs = torch.linalg.eigh(0.5 * (kmm + kmm.T))
    keep = evals > rcond * evals.max().clamp_min(0)
    if not bool(keep.any()):
        raise ValueError("solver 'nystrom-direct': K(centers, centers) is numerically zero; check kernel and centers")
    T = evecs[:, keep] / evals[keep].sqrt()
    whitened = T.T @ gram @ T
    w_evals, w_evecs = torch.linalg.eigh(0.5 * (whitened + whitened.T))
    denom = w_evals.clamp_min(0) + noise
    beta = w_evecs @ ((w_evecs.T @ (T.T @ rhs)) / denom.unsqueeze(-1))
    return T @ beta


class NystromDirect:
    """Dense Nystrom solve of ``(K_nM^T K_nM + sigma^2 K_MM) alpha = K_nM^T y`` (all outputs at once).

    Options (declared with :class:`kgp.Option`, resolved by kgp once before ``fit``)
    -------
    rcond : float in [0, 1) or None, default None
        Relative eigenvalue threshold on ``K_MM`` (None: ``M * eps`` of the dtype).

    Center weights (FALKON's D) are accepted and ignored: the Nystrom estimator does not depend on
    D (Rudi et al. 2017, Appendix A, Def. 4), only an iterative solver's conditioning does.
    """

    # the Nystrom estimator on the centers (the predictive variance is then the DTC one on them)
    capabilities = kgp.Capabilities(uses_centers=True, target="nystrom")
    option_defaults = {
        "rcond": kgp.Option.number(
            None,
            minimum=0.0,
            maximum=1.0,
            exclusive_maximum=True,
            allow_none=True,
            help="relative eigenvalue threshold on K_MM (None: M * eps of the dtype)",
        )
    }

    def fit(self, problem: Problem) -> KernelExpansion:
        rcond = problem.options["rcond"]  # resolved by kgp: validated, default filled in
        if problem.centers is None:
            raise ValueError("solver 'nystrom-direct' needs centers (problem.centers is None)")
        Z = problem.centers.points
        if Z.dim() != 2 or Z.shape[1] != problem.X.shape[1]:
            raise ValueError(f"centers: expected an M x {problem.X.shape[1]} tensor, got shape {tuple(Z.shape)}")
        Z = Z.to(device=problem.device, dtype=problem.dtype)
        m = Z.shape[0]
        problem.monitor.start(total=1, desc="nystrom-direct")
        with torch.no_grad():
            knm = problem.kernel_operator(problem.X, Z)
            # fused_matmul(I) = K_nM^T (K_nM I): K_nM^T K_nM accumulated over row blocks of X in one pass.
            gram = knm.fused_matmul(torch.eye(m, dtype=problem.dtype, device=problem.device))
            rhs = knm.T @ problem.y
            kmm = problem.kernel_operator(Z).to_dense()
            alpha = solve_nystrom_system(gram, kmm, rhs, problem.noise, rcond)
        predictor = KernelExpansion(problem.kernel, Z, alpha)
        problem.monitor.step(1, predictor, centers=m)
        return predictor


@kgp.hookimpl
def register_solvers(register) -> None:
    register("nystrom-direct", NystromDirect())
