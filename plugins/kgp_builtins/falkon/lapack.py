"""Dense factorisations for FALKON's preconditioner (Rudi et al. 2017, Def. 3).

- :func:`upper_cholesky_of_scaled_product` builds ``A`` of Def. 3, ``A^T A = T T^T / M + lambda I``,
  from the Cholesky factor of ``K_MM``: ``L^T L`` in ``M^3 / 3`` flops and its Cholesky, both blocked and in
  place (:mod:`kgp.linalg`), so one ``M x M`` array is allocated besides ``L``.
- :func:`pivoted_cholesky` is the truncated pivoted Cholesky behind ``factorization="pivoted"`` (scipy's
  LAPACK ``?pstrf`` on the CPU; torch has none).

scipy's ``?lauum`` + ``?potrf`` are not used: the bundled OpenBLAS ``?lauum`` crashes the process
(SIGSEGV) at M = 16,000 and took 5.8-46 s at M = 12,000-16,000 on a 2-core host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp.linalg import cholesky_in_place, flush_for_cholesky, gram_of_lower

__all__ = ["pivoted_cholesky", "upper_cholesky_of_scaled_product"]


def upper_cholesky_of_scaled_product(
    L: Tensor,
    scale: float,
    shift: float,
    *,
    what: str = "scale * L^T L + shift * I",
    remedy: str = "",
    flush: bool = False,
) -> Tensor:
    """Upper triangular ``A`` with ``A^T A = scale * L^T L + shift * I`` (``L`` lower, strict upper zero).

    Returns the transpose view of a lower factor: one new ``M x M`` array at the peak, on L's device.
    ``flush``: entries of the product and of its factor below ``kgp.linalg.tiny_fraction`` of their scale are
    set to 0 (:func:`kgp.linalg.flush_for_cholesky`), to keep subnormal numbers out of the GEMMs.

    Raises
    ------
    NotPSDError
        If the product is not numerically positive definite (``what`` names it, ``remedy`` ends the message).
    """
    P = gram_of_lower(L, scale=scale)
    P.diagonal().add_(shift)
    flush_below = flush_for_cholesky(P) if flush else None
    return cholesky_in_place(P, what=what, remedy=remedy, flush_below=flush_below).mT


def pivoted_cholesky(G: Tensor, tol: float) -> tuple[Tensor, Tensor]:
    """Truncated pivoted Cholesky ``G[p, p] ~ L L^T`` (LAPACK ``?pstrf``, run on the CPU).

    Pivots greedily on the largest remaining Schur-complement diagonal and stops once it is at or
    below ``tol``: every dropped center is then within ``sqrt(tol)`` of the span of the kept ones
    in the RKHS norm. Returns the lower factor ``L`` (q x q, on G's device) and the kept indices
    ``p`` (q, int64) in pivot order. ``G`` is overwritten.
    """
    import numpy as np
    from scipy.linalg import lapack

    a = G.detach().cpu().numpy()
    routine = lapack.dpstrf if a.dtype == np.float64 else lapack.spstrf
    # G is symmetric, so its transpose (Fortran order, no copy) is G itself
    c, piv, rank, info = routine(a.T, tol=tol, lower=1, overwrite_a=1)
    if info < 0:
        raise RuntimeError(f"LAPACK ?pstrf: illegal argument {-info}")
    q = int(rank)
    if q == 0:
        raise ValueError("solver 'falkon': D K_MM D has no pivot above rcond * max diagonal; check the kernel")
    keep = torch.from_numpy(piv[:q].astype(np.int64) - 1).to(G.device)
    L = torch.from_numpy(c[:q, :q]).tril().to(G.device)
    return L, keep
