"""Blocked algebra with a lower triangular factor computed once: solves, ``L^T L``, inverses, written in place.

:func:`solve_lower_in_place`, :func:`gram_of_lower`, :func:`inverse_of_lower` and :func:`inverse_from_cholesky`
write their result over their input where asked, so that a large factorization holds one ``M x M`` array
instead of two or three, and run their flops as GEMMs on views of the factor (no copy into LAPACK's order).
scipy's bundled OpenBLAS ``?lauum`` crashes the process at n = 32,000 on a 2-core development host, so it is
not used. :func:`solve_lower_wide` solves a float32 factor in float64 with flushes, to keep chains of small
values out of the subnormal range. Repeated solves with a few right-hand sides: :mod:`kgp.linalg.lower_factor`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .subnormal import flush_below_scale

__all__ = [
    "BLOCK",
    "GRAM_BLOCK",
    "gram_of_lower",
    "inverse_from_cholesky",
    "inverse_of_lower",
    "mirror_lower",
    "mirror_upper",
    "solve_lower_in_place",
    "solve_lower_wide",
]

# Block of the blocked triangular solves: GEMMs of (n x 512) panels still run at the machine's GEMM rate,
# and the diagonal blocks, multiplied whole (zeros included), waste less than at 1024 (one thread,
# float64; benchmarks/bench_roofline.py). The block temporaries (n x 512) are a small
# fraction of n x n.
BLOCK = 512
# L^T L's blocks (two threads, 2-core host, n = 2,000 / 4,000 / 8,000, float64), whose diagonal blocks are
# multiplied whole: 0.041 / 0.263 / 1.96 s with 256 against 0.052 / 0.306 / 2.07 s with 512.
GRAM_BLOCK = 256


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


def mirror_upper(A: Tensor, *, block: int = GRAM_BLOCK) -> Tensor:
    """Copy the strict upper triangle of square ``A`` onto its strict lower triangle, in place.

    The diagonal is left as it is. Tile by tile, as :func:`mirror_lower`; the temporaries are one
    ``block x block`` tile.
    """
    n = A.shape[-1]
    for i in range(0, n, block):
        e = min(i + block, n)
        A[e:, i:e] = A[i:e, e:].mT
        tile = A[i:e, i:e]
        tile.copy_(tile.triu() + tile.triu(1).mT)
    return A


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
