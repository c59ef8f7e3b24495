"""Cholesky factorizations with one failure behaviour: jittered (:func:`psd_cholesky`), in place
(:func:`cholesky_in_place`), and both (:func:`psd_cholesky_in_place`).

Every not-positive-definite failure raises linear_operator's :class:`NotPSDError` naming the matrix and a remedy.
:func:`cholesky_in_place` writes the factor over its input, so that a large factorization holds one ``M x M`` array
instead of two (``torch.linalg.cholesky`` copies its input, even with ``out=``). On a CPU it is MKL's ``potrf`` on
the matrix's own memory (:mod:`kgp.linalg.lapack`), under flush-to-zero where subnormal numbers must be kept out
(:mod:`kgp.linalg.subnormal`); elsewhere torch's routine and a blocked loop do the work on any device. scipy's
bundled OpenBLAS ``?potrf`` crashes the process at M = 16,000 on a 2-core development host, so it is not used.
"""

from __future__ import annotations

import warnings

import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning
from torch import Tensor

from .lapack import potrf_applies, potrf_lower
from .subnormal import flush_denormals, zero_small_entries
from .triangular import mirror_upper

__all__ = ["CHOLESKY_BLOCK", "POTRF_MAX", "NotPSDError", "cholesky_in_place", "psd_cholesky", "psd_cholesky_in_place"]

# The blocked Cholesky's blocks, measured with two threads on a 2-core host (
# n = 2,000 / 4,000 / 8,000, float64): the Cholesky took 0.050 / 0.297 / 2.11 s with 384-wide blocks
# against 0.060 / 0.360 / 2.36 s with 512 and 0.055 / 0.348 / 2.51 s with 256 (float32: 0.030 / 0.161 /
# 1.10 s against 0.034 / 0.167 / 1.12 s).
CHOLESKY_BLOCK = 384
# Where LAPACK cannot be called directly (kgp.linalg.lapack), torch's potrf (on A's own memory: 0.62x the
# blocked loop at n = 2,000 in both dtypes) is used up to this size and the blocked loop above it:
# torch's routine then also zeroes the other triangle against the memory order (docs/backend.md, "LAPACK in
# place" and "The setup without copies" in docs/benchmarks/roofline.md).
POTRF_MAX = 2048


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


def psd_cholesky_in_place(
    A: Tensor,
    *,
    max_tries: int = 6,
    what: str = "the matrix",
    remedy: str = "",
) -> Tensor:
    """Lower Cholesky factor of a symmetric PSD matrix written over ``A``, with :func:`psd_cholesky`'s jitter rule.

    The matrix is ``A``'s upper triangle (diagonal included), mirrored onto the lower one first, so that every
    try factors the same, exactly symmetric matrix. A try that fails leaves the strict upper triangle as it was
    (LAPACK's ``potrf`` writes only the lower one, :func:`kgp.linalg.lapack.potrf_lower`): the next try
    restores the lower triangle from it and the diagonal from a saved copy, adds the jitter, and factors
    again, so that no second ``M x M`` array is held. Jitter as :func:`psd_cholesky` adds it: none first,
    then ``eps(dtype) * mean(diag(A))`` growing tenfold, ``max_tries`` times. On success the strict upper
    triangle is set to 0. Where LAPACK cannot be called on ``A``'s memory (:func:`~kgp.linalg.lapack.potrf_applies`
    is False: another device, autograd), :func:`psd_cholesky` factors a copy and the factor is copied back.

    Raises
    ------
    NotPSDError
        If no tried jitter makes ``A`` positive definite (or ``A`` holds NaN); ``A`` is then overwritten.
    """
    if not potrf_applies(A):
        return A.copy_(psd_cholesky(A.triu() + A.triu(1).mT, max_tries=max_tries, what=what, remedy=remedy))
    mirror_upper(A)
    diagonal = A.diagonal().clone()
    scale = float(diagonal.abs().mean()) if A.numel() else 1.0
    jitter = torch.finfo(A.dtype).eps * (scale if scale > 0 else 1.0)
    for attempt in range(max_tries + 1):
        if attempt:
            mirror_upper(A)
            A.diagonal().copy_(diagonal).add_(jitter * 10 ** (attempt - 1))
        if potrf_lower(A, zero_upper=False) == 0 and bool(torch.isfinite(A.diagonal()).all()):
            return A.tril_()
    if not (bool(torch.isfinite(diagonal).all()) and bool(torch.isfinite(A.triu(1)).all())):
        raise NotPSDError(f"{what} contains NaN or infinite entries; {remedy}".rstrip("; "))
    raise NotPSDError(_message(A, what, remedy, jitter * 10 ** (max_tries - 1) if max_tries else None))


def _message(A: Tensor, what: str, remedy: str, jitter: float | None) -> str:
    text = f"{what} ({A.shape[-1]} x {A.shape[-1]}, {A.dtype}) is not positive definite"
    if jitter is not None:
        text += f" even with a diagonal jitter of {jitter:.1e}"
    return text + (f"; {remedy}" if remedy else "")


def cholesky_in_place(
    A: Tensor,
    *,
    what: str = "the matrix",
    remedy: str = "",
    block: int | None = None,
    flush_below: float | None = None,
) -> Tensor:
    """Lower Cholesky factor of a symmetric positive definite ``A``, written over ``A``.

    Only the lower triangle of ``A`` is read, the strict upper triangle is set to zero. With ``block=None``
    a contiguous float32/float64 CPU matrix goes to LAPACK's ``potrf`` on its own memory
    (:mod:`kgp.linalg.lapack`, where torch's build exports it); other matrices (another device, autograd, or
    no such symbol) go to ``torch.linalg.cholesky_ex`` up to :data:`POTRF_MAX` rows and to a right-looking
    blocked loop above it, whose temporaries are one ``n x block`` panel (``n^3 / 3`` flops in GEMMs of
    block width, :data:`CHOLESKY_BLOCK` unless ``block`` is given).

    ``flush_below``: keep subnormal numbers, which some CPUs process 10-100x slower, out of the
    factorization (FALKON's setup, the exact solver): LAPACK then runs with the CPU's flush-to-zero mode in
    every thread (:func:`kgp.linalg.subnormal.flush_denormals`), and where that mode cannot be set the blocked
    loop (above :data:`POTRF_MAX` rows) sets the entries of each diagonal block and panel below
    ``flush_below`` in magnitude to 0 before and after their factorization or triangular solve. Either
    way the factor's entries below ``flush_below`` are set to 0 at the end (flush the input too:
    :func:`tiny_fraction`). None: nothing is changed.

    Raises
    ------
    NotPSDError
        If a pivot block is not positive definite or not finite (``A`` is then partly overwritten).
    """
    n = A.shape[-1]
    if block is None and potrf_applies(A):
        # LAPACK called on A's memory is faster than the blocked loop at any size (0.52-0.83x); with flush_below the
        # CPU's flush-to-zero mode keeps its GEMMs free of subnormal numbers, as the loop's flushes do (docs/backend.md,
        # "The setup without copies"), and where that mode cannot be set the loop takes the large matrices
        if not flush_below:
            return _potrf_in_place(A, what, remedy)
        with flush_denormals() as flushing:
            if flushing or n <= POTRF_MAX:
                return zero_small_entries(_potrf_in_place(A, what, remedy), flush_below)
    elif block is None and n <= POTRF_MAX:
        L = _potrf_in_place(A, what, remedy)
        return L if not flush_below else zero_small_entries(L, flush_below)
    block = CHOLESKY_BLOCK if block is None else block
    for k in range(0, n, block):
        e = min(k + block, n)
        diag = A[k:e, k:e].tril()
        diag = diag + diag.tril(-1).mT  # the lower triangle is the matrix; the upper may be stale
        if flush_below:
            zero_small_entries(diag, flush_below)
        L_kk, info = torch.linalg.cholesky_ex(diag)
        if int(info) != 0 or not bool(torch.isfinite(L_kk).all()):
            raise NotPSDError(_message(A, what, remedy, None))
        if flush_below:
            zero_small_entries(L_kk, flush_below)
        A[k:e, k:e] = L_kk
        A[:k, k:e] = 0
        if e == n:
            break
        panel = A[e:, k:e]
        if flush_below:
            zero_small_entries(panel, flush_below)
        if torch.is_grad_enabled() and A.requires_grad:
            A[e:, k:e] = torch.linalg.solve_triangular(L_kk.mT, panel, upper=True, left=False)
        else:
            # L_kk X^T = A^T on the transposed view, written where the panel lies: LAPACK reads the strided
            # panel in place, where X L_kk^T = A (left=False) copied it first and back (84 against 14 ms a
            # 19,616 x 384 float32 panel; docs/benchmarks/roofline.md, "The setup without copies")
            torch.linalg.solve_triangular(L_kk, panel.mT, upper=False, left=True, out=panel.mT)
        if flush_below:
            zero_small_entries(panel, flush_below)
        for j in range(e, n, block):  # the trailing lower triangle, one block column at a time
            f = min(j + block, n)
            A[j:, j:f].addmm_(panel[j - e :], panel[j - e : f - e].mT, alpha=-1.0)
    return A


def _potrf_in_place(A: Tensor, what: str, remedy: str) -> Tensor:
    """LAPACK's ``potrf`` on ``A``'s own memory: the lower Cholesky factor written over ``A``.

    Called directly where :func:`kgp.linalg.lapack.potrf_applies` (no copy, no strided ``triu_``), else through
    ``torch.linalg.cholesky_ex`` as follows.

    A row-major ``A`` is, read column-major, ``A^T``: its upper triangle there is ``A``'s lower one, so the
    upper factor of ``A.mT`` (written into ``A.mT``, with the other triangle zeroed) is ``L`` in ``A``.
    Factoring a copy and copying ``L`` back (column-major, so a transposing copy) took 1.6-1.9x as long at
    n = 2,000 (float32 26.6 against 16.5 ms, float64 40.5 against 25.3 ms; 2-core Intel Xeon host), as did
    the finiteness check of every entry: a NaN or infinity anywhere in the lower triangle reaches a later
    pivot, so the diagonal is checked.
    """
    if potrf_applies(A):
        info = potrf_lower(A)
    elif torch.is_grad_enabled() and A.requires_grad:
        # out= takes no part in autograd: factor a copy, so that the copy back stays differentiable
        L, info = torch.linalg.cholesky_ex(A)
        A.copy_(L)
    else:
        info = torch.empty((), dtype=torch.int32, device=A.device)
        _, info = torch.linalg.cholesky_ex(A.mT, upper=True, out=(A.mT, info))
    if int(info) != 0 or not bool(torch.isfinite(A.diagonal()).all()):
        raise NotPSDError(_message(A, what, remedy, None))
    return A
