"""Dense linear-algebra helpers that several solvers need, with one failure behaviour.

Public API for plugin authors (the built-ins use nothing else):

- :func:`psd_cholesky`: Cholesky of a symmetric positive (semi-)definite matrix with growing
  diagonal jitter, through linear_operator's ``psd_safe_cholesky``; every not-positive-definite
  failure raises linear_operator's :class:`NotPSDError` naming the matrix and a remedy.
- :func:`largest_eigenvalue`: Ritz estimate of the top eigenvalue of a symmetric PSD matrix by
  block subspace iteration (``O(M^2 b)`` per step instead of ``O(M^3)``).
- :func:`smallest_eigenvalue_from_cholesky`: the same for the bottom eigenvalue of ``L L^T``, by
  inverse iteration through the factor.
"""

from __future__ import annotations

import warnings

import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning
from torch import Tensor

__all__ = ["NotPSDError", "largest_eigenvalue", "psd_cholesky", "smallest_eigenvalue_from_cholesky"]

# Below this size a full eigvalsh is cheaper than iterating.
_DENSE_EIGEN_SIZE = 64


def psd_cholesky(
    A: Tensor,
    *,
    jitter: float | None = None,
    max_tries: int = 6,
    what: str = "the matrix",
    remedy: str = "",
) -> Tensor:
    """Lower Cholesky factor of a symmetric PSD matrix, adding diagonal jitter only if needed.

    Parameters
    ----------
    A:
        ``M x M`` symmetric matrix (not modified).
    jitter:
        First jitter tried when the plain factorisation fails (absolute); it grows tenfold per
        try. None: ``eps(dtype) * mean(diag(A))``, the rounding level of the matrix.
    max_tries:
        Number of jitters tried; 0 means no jitter at all (fail at once).
    what, remedy:
        Name of the matrix and advice, for the error message.

    Raises
    ------
    NotPSDError
        If no tried jitter makes ``A`` positive definite (or ``A`` holds NaN).
    """
    if max_tries == 0:
        L, info = torch.linalg.cholesky_ex(A)
        if int(info.max()) != 0:
            raise NotPSDError(_message(A, what, remedy, None))
        return L
    if jitter is None:
        scale = float(A.detach().diagonal().abs().mean()) if A.numel() else 1.0
        jitter = torch.finfo(A.dtype).eps * (scale if scale > 0 else 1.0)
    with warnings.catch_warnings():
        # the caller decides whether jitter is worth a warning; linear_operator warns once per try
        warnings.simplefilter("ignore", NumericalWarning)
        try:
            return psd_safe_cholesky(A, jitter=jitter, max_tries=max_tries)
        except NotPSDError as exc:
            raise NotPSDError(_message(A, what, remedy, jitter * 10 ** (max_tries - 1))) from exc
        except RuntimeError as exc:  # linear_operator's NanError
            if bool(torch.isnan(A).any()):
                raise NotPSDError(f"{what} contains NaN; {remedy}".rstrip("; ")) from exc
            raise


def _message(A: Tensor, what: str, remedy: str, jitter: float | None) -> str:
    text = f"{what} ({A.shape[-1]} x {A.shape[-1]}, {A.dtype}) is not positive definite"
    if jitter is not None:
        text += f" even with a diagonal jitter of {jitter:.1e}"
    return text + (f"; {remedy}" if remedy else "")


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
