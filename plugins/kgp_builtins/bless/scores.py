"""The leverage-score estimator of BLESS eq. 3 (Rudi, Calandriello, Carratino and Rosasco, NeurIPS 2018).

    l~_J(i, lambda) = (lambda n)^{-1} (K_ii - K_{J,i}^T (K_{J,J} + lambda n A)^{-1} K_{J,i})

for a column set J (a dictionary of centers) with weights A; with J = [n] and A = I it is the exact
ridge leverage score (eq. 4). Every kernel block goes through :func:`kgp.kernel_operator`; nothing
n x n (the O(n^3) oracle of the tests is :func:`kgp_builtins.oracles.exact_leverage_scores`).
"""

from __future__ import annotations

from typing import Any

import gpytorch
import torch
from torch import Tensor

from kgp.linalg import flush_below_scale, flush_for_cholesky, psd_cholesky, zero_small_entries
from kgp.operators import kernel_operator, plan_block_rows, row_slices

from .checks import check_inputs, work_dtype
from .options import parse_option

__all__ = ["ScoreEstimator", "estimate_leverage_scores"]


class ScoreEstimator:
    """The estimator ``l~_J(., lam)`` of BLESS eq. 3 for a fixed column set J and weights A.

    ``K_{J,J} + lam n A`` is factorised through ``W = A^{-1/2} K_{J,J} A^{-1/2} + lam n I`` (its
    eigenvalues are >= lam n, so the Cholesky is safe even when K_{J,J} is singular), and
    ``K_{J,i}^T (K_{J,J} + lam n A)^{-1} K_{J,i} = ||L^{-1} A^{-1/2} K_{J,i}||^2``.
    """

    def __init__(
        self, X: Tensor, kernel, idx: Tensor, a: Tensor, lam: float, work_dtype: torch.dtype, shard: Any = None
    ):
        self.X, self.kernel, self.work_dtype, self.shard = X, kernel, work_dtype, shard
        # distributed (shard, kgp.distributed): X holds this rank's rows; idx and the rows to score
        # are global row numbers; n is the global n
        self.lam_n = lam * (X.shape[0] if shard is None else shard.n_total)
        self.XJ = X[idx] if shard is None else shard.take_rows(X, idx)
        self.chol = None
        if idx.numel() > 0:
            kjj = kernel_operator(kernel, self.XJ).to_dense().to(work_dtype)
            self.s = a.to(device=X.device, dtype=work_dtype).rsqrt()
            w = self.s[:, None] * kjj * self.s[None, :]
            w.diagonal().add_(self.lam_n)
            # entries whose products are subnormal set to 0, in W and in its factor (kgp.linalg.tiny_fraction):
            # with short lengthscales the factorization and the solves against it were 30-50x slower
            # (UCI parkinsons with the exact GP's hyperparameters: 75 s for BLESS's levels)
            flush_below = flush_for_cholesky(w)
            # only rounding can make W indefinite: growing jitter from eps * max W_ii; NaN (or a jitter
            # that does not help) raises NotPSDError instead
            self.chol = psd_cholesky(
                w,
                jitter=float(torch.finfo(work_dtype).eps * w.diagonal().max()),
                what="BLESS's W = A^-1/2 K_JJ A^-1/2 + lambda n I",
                remedy="use linalg_dtype='float64', a larger lambda, or check X and the kernel for NaN",
            )
            if flush_below is not None:
                zero_small_entries(self.chol, flush_below)

    def __call__(self, rows: Tensor) -> Tensor:
        """Scores of ``X[rows]`` (in ``work_dtype``, on X's device).

        Distributed: ``rows`` are global row numbers; each rank scores the ones it holds and one
        all-reduce of the ``len(rows)`` scores (zeros elsewhere, so the sum is exact) gives every
        rank all of them: 8 bytes per candidate, the only communication of a level.
        """
        if self.shard is None:
            return self._scores(self.X[rows])
        positions, local = self.shard.local_rows(rows)
        out = torch.zeros(rows.numel(), dtype=self.work_dtype, device=self.X.device)
        out[positions] = self._scores(self.X[local])
        return self.shard.all_reduce_(out)

    def _scores(self, xr: Tensor) -> Tensor:
        diag = kernel_operator(self.kernel, xr).diagonal().to(self.work_dtype)
        if self.chol is None:
            return diag / self.lam_n
        m = self.XJ.shape[0]
        # kernel block, its working-dtype copy and the triangular-solve result: 3 buffers per row
        block = plan_block_rows(xr.shape[0], m, torch.finfo(self.work_dtype).bits // 8, buffers=3, device=xr.device)
        quad = torch.empty_like(diag)
        for sl in row_slices(0, xr.shape[0], block):
            kb = kernel_operator(self.kernel, xr[sl], self.XJ).to_dense().to(self.work_dtype)
            kb.mul_(self.s[None, :])
            # as W: the kernel's values far below its scale are 0 to the scores, and subnormal in the solve
            flush_below_scale(kb, max(float(kb.abs().max()), float(diag.abs().max()) * float(self.s.max())))
            v = torch.linalg.solve_triangular(self.chol, kb.T, upper=False)
            quad[sl] = v.pow(2).sum(0)
        floor = torch.finfo(self.work_dtype).eps * diag  # Schur complement >= 0; keep p > 0 under rounding
        # True scores are <= 1; a point far from every column of J gets K_ii / (lam n) >> 1 from eq. 3,
        # which would inflate d_h (and M_h) by orders of magnitude at small lambda. Clipping at 1 only
        # moves such an estimate towards the truth.
        return (torch.maximum(diag - quad, floor) / self.lam_n).clamp_max_(1.0)


def estimate_leverage_scores(
    X: Tensor,
    kernel: gpytorch.kernels.Kernel,
    lam: float,
    indices: Tensor,
    a: Tensor,
    rows: Tensor | None = None,
    *,
    linalg_dtype: str = "float64",
) -> Tensor:
    """Approximate ridge leverage scores ``l~_J(i, lam)`` of BLESS eq. 3.

    Parameters
    ----------
    X:
        ``n x d`` inputs.
    kernel:
        GPyTorch kernel.
    lam:
        Per-sample lambda (sigma^2 / n).
    indices:
        Column set J (indices into X, distinct).
    a:
        Diagonal of the weight matrix A (length |J|), e.g. :attr:`BlessResult.a`.
    rows:
        Points i to score (indices into X); None scores all n points (O(n |J|^2) time).
    linalg_dtype:
        ``"float64"`` (default) or ``"input"``: dtype of the |J| x |J| factorisation and solves.

    Returns
    -------
    Tensor
        Scores in X's dtype and device.
    """
    lam = check_inputs(X, kernel, lam)
    linalg_dtype = parse_option("estimate_leverage_scores()", "linalg_dtype", linalg_dtype)
    if indices.dim() != 1 or a.shape != indices.shape:
        raise ValueError(
            f"indices, a: expected two 1-D tensors of equal length, got {tuple(indices.shape)}, {tuple(a.shape)}"
        )
    rows = torch.arange(X.shape[0], device=X.device) if rows is None else rows.to(X.device)
    with torch.no_grad():
        est = ScoreEstimator(X, kernel, indices.to(X.device), a, lam, work_dtype(X, linalg_dtype))
        return est(rows).to(X.dtype)
