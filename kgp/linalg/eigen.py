"""Extreme eigenvalues of a symmetric positive semi-definite matrix without a full eigendecomposition.

:func:`largest_eigenvalue` by block subspace iteration (``O(M^2 b)`` per step instead of ``O(M^3)``);
:func:`smallest_eigenvalue_from_cholesky` by inverse iteration through the matrix's lower Cholesky factor.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["largest_eigenvalue", "smallest_eigenvalue_from_cholesky"]

# Below this size a full eigvalsh is cheaper than iterating.
_DENSE_EIGEN_SIZE = 64


def _start_block(A: Tensor, block: int) -> Tensor:
    g = torch.Generator(device=A.device).manual_seed(0)
    return torch.randn(A.shape[0], min(block, A.shape[0]), generator=g, dtype=A.dtype, device=A.device)


def largest_eigenvalue(A: Tensor, *, rtol: float = 1e-6, max_iters: int = 100, block: int = 8) -> float:
    """Largest eigenvalue of a symmetric PSD matrix (a Ritz value: a lower bound, converging from below).

    Block subspace iteration from a fixed seed, stopped when the Ritz value changes by less than
    ``rtol`` (relative) or after ``max_iters`` steps; ``O(M^2 block)`` per step. Matrices of at
    most 64 rows use ``eigvalsh``. The product is formed as ``(V^T A)^T`` (A is symmetric), which
    ran 1.5-9x faster than ``A V`` for 8 columns at M = 10,000 on the development machine.

    Parameters
    ----------
    A:
        ``M x M`` symmetric positive semi-definite matrix.
    rtol:
        Relative change of the Ritz value below which iteration stops (0: run ``max_iters``).
    max_iters:
        Most subspace steps.
    block:
        Subspace size; convergence goes like ``(lambda_{block+1} / lambda_1)^iters``.
    """
    if A.shape[0] <= _DENSE_EIGEN_SIZE:
        return float(torch.linalg.eigvalsh(A)[-1])
    V = torch.linalg.qr(_start_block(A, block)).Q
    previous = None
    value = 0.0
    for _ in range(max_iters):
        W = (V.mT @ A).mT
        value = float(torch.linalg.eigvalsh(V.mT @ W)[-1])
        if previous is not None and abs(value - previous) <= rtol * abs(value):
            break
        previous = value
        V = torch.linalg.qr(W).Q
    return value


def smallest_eigenvalue_from_cholesky(L: Tensor, *, iters: int = 15, block: int = 8) -> float:
    """Ritz estimate (an upper bound) of the smallest eigenvalue of ``L L^T`` from its lower factor ``L``.

    Inverse subspace iteration, two triangular solves per step: ``O(iters M^2 block)`` against
    ``O(M^3)`` with a large constant for ``eigvalsh``. Capped by ``min L_ii^2``, also an upper bound.
    """
    V = _start_block(L, block)
    for _ in range(iters):
        V = torch.linalg.solve_triangular(L, V, upper=False)
        V = torch.linalg.qr(torch.linalg.solve_triangular(L.mT, V, upper=True)).Q
    R = L.mT @ V
    return min(float(torch.linalg.eigvalsh(R.mT @ R)[0]), float(L.diagonal().square().min()))
