"""Dense linear-algebra helpers that several solvers need, with one failure behaviour.

Public API for plugin authors (the built-ins use nothing else):

- :func:`psd_cholesky`: Cholesky of a symmetric positive (semi-)definite matrix with growing
  diagonal jitter, through linear_operator's ``psd_safe_cholesky``; every not-positive-definite
  failure raises linear_operator's :class:`NotPSDError` naming the matrix and a remedy.
- :func:`largest_eigenvalue`: Ritz estimate of the top eigenvalue of a symmetric PSD matrix by
  block subspace iteration (``O(M^2 b)`` per step instead of ``O(M^3)``).
- :func:`smallest_eigenvalue_from_cholesky`: the same for the bottom eigenvalue of ``L L^T``, by
  inverse iteration through the factor.
- :func:`inverse_from_cholesky`: ``A^{-1}`` from the lower factor of ``A`` in ``2 n^3 / 3`` flops.
- :func:`cholesky_in_place`, :func:`solve_lower_in_place`, :func:`gram_of_lower`: Cholesky,
  triangular solves and ``L^T L`` written over their input, so that a large factorisation holds one
  ``M x M`` array instead of two or three (``torch.linalg.cholesky`` copies its input, even with
  ``out=``). On a CPU the Cholesky is MKL's ``potrf`` on the matrix's own memory (:mod:`kgp.torch_lapack`),
  under flush-to-zero where subnormal numbers must be kept out (:mod:`kgp.denormals`); elsewhere torch's
  routines and blocked loops do the work on any device. scipy's bundled OpenBLAS ``?lauum`` and ``?potrf``
  crash the process at M = 16,000 and n = 32,000 on a 2-core development host, so they are not used.
"""

from __future__ import annotations

import math
import warnings

import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning
from torch import Tensor

from .denormals import flush_denormals
from .torch_lapack import potrf_applies, potrf_lower

__all__ = [
    "NotPSDError",
    "cholesky_in_place",
    "flush_below_scale",
    "flush_for_cholesky",
    "gram_of_lower",
    "inverse_from_cholesky",
    "inverse_of_lower",
    "largest_eigenvalue",
    "mirror_lower",
    "psd_cholesky",
    "smallest_eigenvalue_from_cholesky",
    "solve_lower_in_place",
    "solve_lower_wide",
    "tiny_fraction",
    "zero_small_entries",
]

# Below this size a full eigvalsh is cheaper than iterating.
_DENSE_EIGEN_SIZE = 64
# Block of the blocked triangular solves: GEMMs of (n x 512) panels still run at the machine's GEMM rate,
# and the diagonal blocks, multiplied whole (zeros included), waste less than at 1024 (one thread,
# float64; benchmarks/bench_roofline.py). The block temporaries (n x 512) are a small
# fraction of n x n.
BLOCK = 512
# The factorisations' own blocks, measured with two threads on a 2-core host (
# n = 2,000 / 4,000 / 8,000, float64): the Cholesky took 0.050 / 0.297 / 2.11 s with 384-wide blocks
# against 0.060 / 0.360 / 2.36 s with 512 and 0.055 / 0.348 / 2.51 s with 256 (float32: 0.030 / 0.161 /
# 1.10 s against 0.034 / 0.167 / 1.12 s); L^T L, whose diagonal blocks are multiplied whole, 0.041 /
# 0.263 / 1.96 s with 256 against 0.052 / 0.306 / 2.07 s with 512.
CHOLESKY_BLOCK = 384
GRAM_BLOCK = 256
# Where LAPACK cannot be called directly (kgp.torch_lapack), torch's potrf (on A's own memory: 0.62x the
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
    (:mod:`kgp.torch_lapack`, where torch's build exports it); other matrices (another device, autograd, or
    no such symbol) go to ``torch.linalg.cholesky_ex`` up to :data:`POTRF_MAX` rows and to a right-looking
    blocked loop above it, whose temporaries are one ``n x block`` panel (``n^3 / 3`` flops in GEMMs of
    block width, :data:`CHOLESKY_BLOCK` unless ``block`` is given).

    ``flush_below``: keep subnormal numbers, which some CPUs process 10-100x slower, out of the
    factorization (FALKON's setup, the exact solver): LAPACK then runs with the CPU's flush-to-zero mode in
    every thread (:func:`kgp.denormals.flush_denormals`), and where that mode cannot be set the blocked
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

    Called directly where :func:`kgp.torch_lapack.potrf_applies` (no copy, no strided ``triu_``), else through
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


def tiny_fraction(dtype: torch.dtype) -> float:
    """The square root of ``dtype``'s smallest normal number (2^-63 in float32, 2^-511 in float64).

    Entries of a matrix below this fraction of its scale can be set to 0 before a factorization
    (:func:`zero_small_entries`, ``cholesky_in_place(flush_below=...)``) so that no product of two kept
    entries is subnormal: some CPUs process subnormal operands 10-100x slower. kgp's kernels floor ``exp``
    near the dtype's smallest normal number, but the GEMMs of a factorization multiply such entries. On the
    2-core Intel Xeon host (UCI parkinsons, short lengthscales) FALKON's float64
    setup at M = 4,700 took 78 s and the exact solver's float64 Cholesky at n = 4,700 took 22 s; flushed,
    2.3 s and 0.5 s. The change to the matrix is below 1e-150 of its scale in float64 (1e-19 in float32).
    """
    return math.sqrt(torch.finfo(dtype).tiny)


def flush_for_cholesky(A: Tensor) -> float | None:
    """Set the entries of a symmetric positive definite ``A`` below :func:`tiny_fraction` of its mean diagonal
    to 0, in place; return the ``flush_below`` for its factor (the same fraction of the factor's scale, the
    root of the mean diagonal) to pass to :func:`cholesky_in_place`, or None (nothing changed) if the mean
    diagonal is not positive and finite.
    """
    scale = float(A.diagonal().mean())
    if not flush_below_scale(A, scale):
        return None
    return tiny_fraction(A.dtype) * math.sqrt(scale)


def solve_lower_wide(L: Tensor, B: Tensor, *, block: int = 512) -> Tensor:
    """``L^{-1} B`` for a lower-triangular ``L``, computed in float64 and returned in ``B``'s dtype.

    For float32 factors whose solves build chains of ever smaller values: flushing the inputs keeps their
    products normal, but forward substitution multiplies small results by small entries again and again,
    and float32's subnormal range is reached within a few steps. EigenPro's curvature estimate on UCI
    pumadyn32nm (a 5,000 x 5,000 float32 factor, 2,000 right-hand sides) took 26 s in float32 against
    0.38 s in float64, where the same chains stay normal (2-core Intel Xeon host; scaling the
    right-hand side by 2^64 still took 18 s). Float64 input runs the same loop: its right-hand side, each
    solved block row and the result are flushed below ``sqrt(tiny)`` of their largest entry. Block row by
    block row, so that the float64 temporaries are one ``block x M`` row of ``L`` and ``X`` itself; only the
    lower triangle of ``L`` is read.
    """
    M = L.shape[0]
    if L.ndim != 2 or L.shape[1] != M or B.ndim != 2 or B.shape[0] != M:
        raise ValueError(f"solve_lower_wide: L must be M x M and B M x k, got {tuple(L.shape)} and {tuple(B.shape)}")
    wide = torch.float64
    X = B.to(wide, copy=True)
    # kernel columns floored near the smallest normal number (UCI parkinsons' short lengthscales) make
    # subnormal products in float64 too: this solve and the Gram matrices of its result took 22 s there,
    # against 0.9 s flushed (2-core Intel Xeon host)
    _flush_to_max(X)
    for s in range(0, M, block):
        e = min(s + block, M)
        r = X[s:e]
        if s:
            r.addmm_(L[s:e, :s].to(wide), X[:s], alpha=-1.0)
        X[s:e] = torch.linalg.solve_triangular(L[s:e, s:e].to(wide), r, upper=False)
        _flush_to_max(X[s:e])
    out = X if B.dtype == wide else X.to(B.dtype)
    if B.dtype != wide:  # results below float32's normal range would slow the products that read them
        _flush_to_max(out)
    return out


def _flush_to_max(X: Tensor) -> None:
    """Flush the entries of ``X`` below :func:`tiny_fraction` of its largest magnitude (in place)."""
    if X.numel():
        flush_below_scale(X, float(X.abs().max()))


def flush_below_scale(X: Tensor, scale: float) -> bool:
    """Set the entries of ``X`` below :func:`tiny_fraction` of ``scale`` in magnitude to 0, in place.

    Their products with anything of the size of ``scale`` are subnormal (slow on some CPUs) and far below
    what a sum of such products resolves. Returns False, changing nothing, where ``scale`` is not positive
    and finite.
    """
    if not (math.isfinite(scale) and scale > 0):
        return False
    zero_small_entries(X, tiny_fraction(X.dtype) * scale)
    return True


def zero_small_entries(X: Tensor, threshold: float, *, rows: int | None = None) -> Tensor:
    """Set the entries of ``X`` smaller than ``threshold`` in magnitude to 0, in place (NaN and inf are kept).

    Keeps subnormal numbers out of float32 factorizations (see ``cholesky_in_place``'s ``flush_below``).
    ``threshold`` is rounded to ``X``'s dtype, as a comparison of ``X`` with it would be. One pass of
    ``torch.hardshrink`` written over ``X``, which zeroes ``|x| <= lambd``: ``lambd`` is the largest value
    of the dtype below the threshold. One pass instead of a magnitude, a mask and a masked fill (three passes
    and two temporaries): 0.19 s against 2.04 s for a 20,000 x 20,000 float32 matrix (2-core Intel Xeon host,
    two passive threads). ``rows``: rows per call (None: all of ``X`` at once). No autograd:
    ``X`` must not require grad (a flush is a numerical device, not part of a model).
    """
    lambd = float(torch.nextafter(torch.tensor(threshold, dtype=X.dtype), torch.tensor(0.0, dtype=X.dtype)))
    rows = X.shape[0] if rows is None else rows
    for r in range(0, X.shape[0], max(1, rows)):
        part = X[r : r + rows]
        torch.hardshrink(part, lambd, out=part)
    return X


def solve_lower_in_place(L: Tensor, B: Tensor, *, transpose: bool = False, block: int = BLOCK) -> Tensor:
    """``L^{-1} B`` (or ``L^{-T} B`` with ``transpose``) written over ``B``, reading only L's lower triangle.

    Block substitution: ``L`` is never copied (``torch.linalg.solve_triangular`` may copy a C-ordered
    ``n x n`` factor into LAPACK's order).
    """
    n = L.shape[-1]
    starts = range(0, n, block)
    for k in reversed(starts) if transpose else starts:
        e = min(k + block, n)
        L_kk = L[k:e, k:e].tril()
        if transpose:
            if e < n:
                B[k:e].sub_(L[e:, k:e].mT @ B[e:])
            B[k:e] = torch.linalg.solve_triangular(L_kk.mT, B[k:e], upper=True)
        else:
            if k:
                B[k:e].sub_(L[k:e, :k] @ B[:k])
            B[k:e] = torch.linalg.solve_triangular(L_kk, B[k:e], upper=False)
    return B


def gram_of_lower(
    L: Tensor,
    *,
    out: Tensor | None = None,
    block: int = GRAM_BLOCK,
    overwrite: bool = False,
    scale: float = 1.0,
) -> Tensor:
    """The lower triangle of ``scale * L^T L`` for a lower triangular ``L`` with zeros above the diagonal of its blocks.

    Row block ``k`` of ``L^T L`` is ``L[k:, k]^T L[k:, :k+1]`` because ``L[i, k] = 0`` for ``i < k``: one
    GEMM per block row, ``n^3 / 3`` flops against ``2 n^3`` for the full product (the work of LAPACK
    ``?lauum``, without its crash). The strict upper triangle of ``out`` outside the diagonal blocks is
    not written, and that of ``L`` is not read. ``overwrite``: the result goes into ``L`` itself (row block
    ``k`` reads rows ``k`` on only, so it replaces row block ``k`` once formed), with no ``n x n`` array
    allocated. ``scale`` multiplies each block as it is formed (GEMM's ``alpha``): no second pass over the
    result, whose unwritten upper triangle a whole-matrix ``mul_`` would fault in.
    """
    n = L.shape[-1]
    if overwrite:
        out = L
    elif out is None:
        out = torch.empty_like(L)
    in_place = overwrite or (torch.is_grad_enabled() and (L.requires_grad or out.requires_grad))
    for k in range(0, n, block):
        e = min(k + block, n)
        if in_place:  # the block's inputs overlap its output, or autograd needs a plain product
            out[k:e, :e] = L[k:, k:e].mT @ L[k:, :e] if scale == 1.0 else (L[k:, k:e].mT @ L[k:, :e]) * scale
        else:  # straight into the output rows, no temporary (beta = 0: their old contents are not read)
            torch.addmm(out[k:e, :e], L[k:, k:e].mT, L[k:, :e], beta=0.0, alpha=scale, out=out[k:e, :e])
    return out


def inverse_from_cholesky(
    L: Tensor, *, block: int = GRAM_BLOCK, flush: bool = False, overwrite: bool = False
) -> Tensor:
    """``A^{-1}`` (full, exactly symmetric) from the lower Cholesky factor ``L`` of ``A = L L^T``.

    ``W = L^{-1}`` by :func:`inverse_of_lower` (``n^3 / 3`` flops), then ``A^{-1} = W^T W`` by
    :func:`gram_of_lower` (``n^3 / 3``). Measured on a 2-core host (two threads, float64): 0.12 / 0.40 /
    1.55 s at n = 2,000 / 3,000 / 5,000, against 0.23 / 0.65 / 2.98 s for
    ``cholesky_solve(I, L)`` and 0.24 / 0.45 / 2.05 s for ``cholesky_inverse`` (LAPACK ``?potri``); the three
    agree to 1e-14 relative. One ``n x n`` array besides the result's, none with ``overwrite`` (the inverse
    is formed in ``L``'s memory, which is returned: fresh ``n x n`` arrays cost their first touch, 15 ms a
    3,000 x 3,000 float64 array on the development host). ``flush``: entries of ``W`` below
    :func:`tiny_fraction` of its mean diagonal are set to 0 before ``W^T W``, so that the product's GEMMs
    meet no subnormal operands. Only the lower triangle of ``L`` is read.
    """
    W = inverse_of_lower(L, block=block, overwrite=overwrite)
    n = L.shape[-1]
    if flush and n:
        flush_below_scale(W, float(W.diagonal().abs().mean()))
    # the same blocks: W is zero above the diagonal inside them (and holds L's entries outside them)
    inverse = gram_of_lower(W, block=block, overwrite=overwrite)
    del W
    return mirror_lower(inverse, block=block)


def inverse_of_lower(L: Tensor, *, block: int = GRAM_BLOCK, overwrite: bool = False) -> Tensor:
    """``L^{-1}`` for a lower triangular ``L`` (only its lower triangle is read), lower triangular itself.

    By block rows, as LAPACK's ``?trtri``: with ``D_i`` the inverse of diagonal block ``i``,
    ``W[i, :i] = -D_i (L[i, :i] W[:i, :i])``, where the product runs over the nonzero rows of each column
    block of ``W`` only (``n^3 / 3`` flops, all in GEMMs on views of ``L``). ``solve_triangular`` on the
    trailing submatrices ``L[j:, j:]`` would do the same flops but copy each
    submatrix into LAPACK's order first, about ``n^3 / (3 block)`` entries (280 MB at n = 3,000): the
    largest fresh-memory cost of an ``exact`` learning step. ``overwrite``: ``W`` is formed in ``L``'s
    memory (block row ``i`` of ``W`` needs block row ``i`` of ``L`` and earlier rows of ``W`` only); its
    strict upper triangle is then zero in the diagonal blocks and ``L``'s outside them.
    """
    n = L.shape[-1]
    W = L if overwrite else torch.zeros_like(L)
    for i in range(0, n, block):
        e = min(i + block, n)
        eye = torch.eye(e - i, dtype=L.dtype, device=L.device)
        D = torch.linalg.solve_triangular(L[i:e, i:e], eye, upper=False)
        if i:
            T = torch.empty(e - i, i, dtype=L.dtype, device=L.device)
            for j in range(0, i, block):
                f = min(j + block, i)
                torch.mm(L[i:e, j:i], W[j:i, j:f], out=T[:, j:f])
            torch.mm(D, T, out=W[i:e, :i])
            W[i:e, :i].neg_()
        W[i:e, i:e] = D
    return W


def mirror_lower(A: Tensor, *, block: int = GRAM_BLOCK) -> Tensor:
    """Copy the lower triangle of square ``A`` onto its upper triangle, in place (``A`` exactly symmetric).

    Tile by tile, so that the transposed reads stay in cache: 0.013 s at n = 3,000 in float64 against
    0.033 s for ``A.tril_().add_(A.tril(-1).mT)`` (two threads, development host).
    """
    n = A.shape[-1]
    for i in range(0, n, block):
        e = min(i + block, n)
        A[:i, i:e] = A[i:e, :i].mT
        tile = A[i:e, i:e]
        tile.copy_(tile.tril() + tile.tril(-1).mT)
    return A
