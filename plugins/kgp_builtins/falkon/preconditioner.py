r"""FALKON's preconditioner (Rudi, Carratino, Rosasco 2017, Appendix A, Def. 3) and its constructions.

With ``G = D K_MM D = Q T^T T Q^T`` (Q: M x q with Q^T Q = I, T: q x q triangular) and
``A^T A = T T^T / M + lambda I``, Def. 3 sets ``B = D Q T^{-1} A^{-1} / sqrt(n)``. As in the paper's
Algorithm 1 the ``1/sqrt(n)`` is left to the CG operator (:mod:`.cg`), so :class:`Preconditioner`
holds ``B' = D Q T^{-1} A^{-1}``. Constructions (:func:`build_preconditioner`):

- Example 1.1, Cholesky: ``Q = I``, ``T = chol(G + jitter)``, ``A = chol(T T^T / M + lambda I)``.
- Example 2, eigendecomposition: ``Q`` = kept eigenvectors, ``T = diag(sqrt(s))``,
  ``A = diag(sqrt(s / M + lambda))``; any rank.
- Pivoted Cholesky (kgp's variant of Def. 3): ``Q`` = the columns of I at the kept centers.

Numerics (see docs/solvers/falkon.md for the measurements behind these choices):

- The ``M x M`` factorizations run in ``precond_dtype``: float64 for float64 inputs; for float32 inputs
  ``"mixed"`` (:func:`mixed_cholesky`): factored and kept in float32, applied in float64. They cost
  ``O(M^3 + t M^2 k)``, which at M = 5,000 is still half of a fit on a 2-core CPU.
- ``factorization="auto"`` (default, both input dtypes): ``G + jitter * mean(diag G) * I`` is
  factored by Cholesky (Example 1.1) with the jitter the solver chose (:data:`DEFAULT_JITTER`, for
  float32 inputs at least 100x the measured float32 kernel error, :mod:`.precision`); the exact
  regulariser (:meth:`Preconditioner.regulariser`) takes the jitter out of the problem again, so it
  changes the conditioning of ``W`` only. If the Cholesky still fails (a user-set tiny jitter on a
  rank-deficient ``K_MM``, e.g. duplicate centers) the eigendecomposition of Example 2 takes over.
  float32 inputs do not need a truncated ``eigh`` whenever ``K_MM`` has eigenvalues below float32
  resolution (3-4x the fit time at M = 5,000): the float32 failures it would work around come from
  float32 sums in the kernel passes (:mod:`.precision`).
- ``factorization="pivoted"``: a pivoted Cholesky (LAPACK ``?pstrf``) that stops at pivots below
  ``rcond`` times the top eigenvalue; the dropped centers get ``alpha = 0`` and ``Q`` of Def. 3 is
  the column selection of the kept ones. ``O(M q^2)``: for large M with a low numerical rank.
- ``T`` and ``A = chol(T T^T / M + lambda I)`` are Cholesky factorisations written in place (LAPACK's
  ``potrf`` on the matrix's memory under flush-to-zero on a CPU), with ``T T^T = L^T L`` formed in ``M^3 / 3``
  flops (:mod:`kgp.linalg`): two ``M x M`` arrays at the peak, any M that memory holds (scipy's ``?lauum``
  crashed at M = 16,000).
- Every not-positive-definite failure (``factorization="cholesky"`` on a rank-deficient ``K_MM``, a
  kernel with a non-positive diagonal, ``A`` in too low a precision) raises
  :class:`kgp.linalg.NotPSDError` naming the matrix and a remedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kgp.linalg import (
    LowerFactor,
    NotPSDError,
    cholesky_in_place,
    gram_of_lower,
    largest_eigenvalue,
    tiny_fraction,
    zero_small_entries,
)
from kgp.options import InvalidOptionError
from kgp.plugin import Problem

from .lapack import pivoted_cholesky, upper_cholesky_of_scaled_product

__all__ = ["DEFAULT_JITTER", "Preconditioner", "build_preconditioner", "gram"]

DEFAULT_JITTER = 1e-3
"""Jitter of the Cholesky of ``D K_MM D``, relative to its mean diagonal (``T^T T = D K_MM D + jitter I``).

Not the paper's ``M eps``: with the jitter removed from the problem again (``Preconditioner.regulariser``)
it only bounds how much the preconditioner amplifies directions where ``K_MM`` is nearly singular,
i.e. where ``(n/M) K_MM^2`` estimates ``K_nM^T K_nM`` worst. Measured at M = 2,000 on nine UCI sets
with learned ARD hyperparameters, 20 iterations, float64 (docs/solvers/falkon.md, "Jitter"): test RMSE
0.2158 -> 0.1645 on kin40k, 0.1514 -> 0.1099 on keggdirected, 0.1140 -> 0.0992 on pol, and within
0.1% elsewhere; 1e-4 is in between, and 1e-2 or more slows convergence again (kin40k 0.1799)."""


@dataclass
class Preconditioner:
    r"""The map ``B' = D Q T^{-1} A^{-1}`` of Def. 3 (without the ``1/sqrt(n)``) and its pieces.

    Either triangular factors (``T`` and ``A`` upper triangular, ``Q = I``; Example 1.1) or the
    diagonal eigen-form (``Q`` = kept eigenvectors, ``T = diag(sqrt(s))``,
    ``A = diag(sqrt(s / M + lambda))``; Example 2), in which case ``t_diag``/``a_diag`` are set.
    """

    lam: float
    d: Tensor | None  # diagonal of D (length M), None for D = I
    T: Tensor | None = None  # upper triangular, T^T T = D K_MM D + jitter
    A: Tensor | None = None  # upper triangular, A^T A = T T^T / M + lam I
    Q: Tensor | None = None  # M x q eigenvectors (eig path)
    keep: Tensor | None = None  # pivoted path: indices of the q kept centers (Q = columns of I)
    m: int = 0  # number of centers M (pivoted path)
    t_diag: Tensor | None = None
    a_diag: Tensor | None = None
    method: str = "cholesky"
    shift: float = 0.0  # Cholesky path: T^T T = D K_MM D + shift I (absolute jitter)
    jitter: float = 0.0  # the same, relative to the mean diagonal of D K_MM D
    precision: str = ""  # "mixed": float32 T and A, applied in float64 (mixed_cholesky)
    # T^T and A^T prepared for the CG's repeated solves (kgp.linalg.lower_factor), built at the first solve: after
    # a distributed fit has replicated T and A in place
    _factors: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def rank(self) -> int:
        """q: the number of directions the preconditioner keeps (M unless some were dropped)."""
        if self.Q is not None:
            return self.Q.shape[1]
        return self.T.shape[0]

    def _solve(self, name: str, v: Tensor, *, upper: bool) -> Tensor:
        """``T^{-1} v`` / ``A^{-1} v`` (``upper``) or ``T^{-T} v`` / ``A^{-T} v``, for ``name`` "T" or "A"."""
        factor = self._factors.get(name)
        if factor is None:
            factor = self._factors[name] = LowerFactor(getattr(self, name).mT)
        return factor.solve(v, transpose=upper)

    @property
    def dtype(self) -> torch.dtype:
        """The working precision of the CG vectors and of every solve: the factors' dtype, except float64 for
        ``precision="mixed"``, whose float32 factors are read in float64 arithmetic."""
        if self.precision == "mixed":
            return torch.float64
        return self.T.dtype if self.T is not None else self.Q.dtype

    def apply(self, u: Tensor) -> Tensor:
        """``B' u = D Q T^{-1} A^{-1} u`` (q x k -> M x k)."""
        if self.T is not None:
            v = self._solve("A", u, upper=True)
            v = self._solve("T", v, upper=True)
            if self.keep is not None:
                full = v.new_zeros(self.m, v.shape[1])
                full[self.keep] = v
                v = full
        else:
            v = self.Q @ (u / (self.t_diag * self.a_diag).unsqueeze(-1))
        return v if self.d is None else v * self.d.unsqueeze(-1)

    def apply_t(self, v: Tensor) -> Tensor:
        """``B'^T v = A^{-T} T^{-T} Q^T D v`` (M x k -> q x k)."""
        if self.d is not None:
            v = v * self.d.unsqueeze(-1)
        if self.T is not None:
            if self.keep is not None:
                v = v[self.keep]
            u = self._solve("T", v, upper=False)
            return self._solve("A", u, upper=False)
        return (self.Q.mT @ v) / (self.t_diag * self.a_diag).unsqueeze(-1)

    def regulariser(self, u: Tensor) -> Tensor:
        """The ``lambda n K_MM`` part of ``W'``: ``lambda A^{-T} (I - shift (T T^T)^{-1}) A^{-1} u``.

        ``T^T T = D K_MM D + shift I``, so ``T^{-T} D K_MM D T^{-1} = I - shift T^{-T} T^{-1}``: the
        jitter changes the preconditioner only, never the problem solved (without the second term it
        would add ``lambda n shift ||alpha||^2`` to the objective). Two more triangular solves,
        ``O(M^2 k)``, when ``shift > 0``.
        """
        if self.T is not None:
            w = self._solve("A", u, upper=True)
            if self.shift:
                x = self._solve("T", w, upper=True)
                w = w - self.shift * self._solve("T", x, upper=False)
            return self.lam * self._solve("A", w, upper=False)
        return self.lam * u / self.a_diag.square().unsqueeze(-1)

    def forward(self, u: Tensor) -> tuple[Tensor, Solves]:
        """``B' u`` (as :meth:`apply`) and the intermediate solves that :meth:`normal` reuses.

        CG needs both ``B' p`` (for the kernel pass) and ``lambda A^{-T} A^{-1} p`` minus the jitter term
        (:meth:`regulariser`); the latter's ``A^{-1} p`` and ``T^{-1} A^{-1} p`` are the steps of the
        former, so they are kept instead of solved again.
        """
        if self.T is None:
            return self.apply(u), Solves(u=u)
        a_inv_u = self._solve("A", u, upper=True)
        t_inv = self._solve("T", a_inv_u, upper=True)
        v = t_inv
        if self.keep is not None:
            v = t_inv.new_zeros(self.m, t_inv.shape[1])
            v[self.keep] = t_inv
        v = v if self.d is None else v * self.d.unsqueeze(-1)
        return v, Solves(u=u, a_inv_u=a_inv_u, t_inv=t_inv)

    def normal(self, kv: Tensor, solves: Solves) -> Tensor:
        r"""``W' u = B'^T kv + regulariser(u)`` with ``kv = K_nM^T K_nM B' u / n`` and ``solves = forward(u)[1]``.

        Equal to ``apply_t(kv) + regulariser(u)``, regrouped (Cholesky path) as
        ``A^{-T} (T^{-T} (Q^T D kv - lambda shift T^{-1} A^{-1} u) + lambda A^{-1} u)``: two triangular
        solves instead of six. Each solve reads an ``M x M`` triangle at about memory speed, and eight of
        them per CG iteration cost as much as the stored kernel pass at M = 10,000 (float64, 2-core host,
        docs/benchmarks/falkon-float32-and-setup.md, "Where the time goes").
        """
        if self.T is None:
            return self.apply_t(kv) + self.regulariser(solves.u)
        if self.d is not None:
            kv = kv * self.d.unsqueeze(-1)
        if self.keep is not None:
            kv = kv[self.keep]
        if self.shift:
            kv = kv - (self.lam * self.shift) * solves.t_inv
        x = self._solve("T", kv, upper=False)
        return self._solve("A", x + self.lam * solves.a_inv_u, upper=False)


@dataclass
class Solves:
    """What :meth:`Preconditioner.forward` solved on the way to ``B' u``, for :meth:`Preconditioner.normal`."""

    u: Tensor
    a_inv_u: Tensor | None = None  # A^{-1} u (Cholesky path)
    t_inv: Tensor | None = None  # T^{-1} A^{-1} u, before Q and D (Cholesky path)


def gram(problem: Problem, work: torch.dtype, d: Tensor | None, *, symmetric: bool = True) -> Tensor:
    """``G = D K_MM D`` in the working precision; with ``symmetric``, exactly symmetric.

    The Cholesky and ``eigh`` read only the lower triangle, so they skip the symmetrisation, which cost
    more than building ``K_MM`` (0.15 against 0.08 s at M = 5,000, 0.69 against 0.47 s at M = 10,000,
    float64, two threads): the pivoted path's LAPACK call and the subspace iteration read both triangles.
    """
    Zw = problem.centers.points.to(work)
    G = problem.kernel_operator(Zw, Zw).to_dense()
    if d is not None:
        G.mul_(d.unsqueeze(0)).mul_(d.unsqueeze(1))
    if symmetric:
        G.add_(G.mT.clone()).mul_(0.5)  # symmetric to the last bit
    scale = float(G.diagonal().abs().mean())
    if scale > 0 and math.isfinite(scale):  # both triangles: the pivoted path and eigh read them
        zero_small_entries(G, tiny_fraction(work) * scale)
    return G


def build_preconditioner(
    problem: Problem,
    weights: Tensor | None,
    *,
    factorization: str,
    precond_dtype: str,
    jitter: float | None,
    rcond: float | None,
) -> Preconditioner:
    """Build ``Q, T, A`` of Def. 3 (Example 1.1, a pivoted variant, or Example 2) from ``G = D K_MM D``.

    Parameters are the solver options of the same names (see :class:`~.solver.FalkonSolver`);
    ``weights`` is the diagonal of D or None.
    """
    if precond_dtype == "mixed":
        if factorization in ("auto", "cholesky"):
            prec = mixed_cholesky(problem, weights, jitter=DEFAULT_JITTER if jitter is None else jitter)
            if prec is not None:
                return prec
        # eigh / pivoted, or a float32 Cholesky that failed: the float64 path
        precond_dtype = "float64"
    work = torch.float64 if precond_dtype == "float64" else problem.dtype
    M = problem.centers.points.shape[0]
    lam = problem.lam
    d = None if weights is None else weights.to(work)
    # K_MM is evaluated in the working precision (not cast from the input dtype), so the
    # factors describe the exact kernel.
    G = gram(problem, work, d, symmetric=factorization == "pivoted")
    diag = G.diagonal()
    mean_diag, max_diag = float(diag.mean()), float(diag.max())
    if not math.isfinite(mean_diag) or not math.isfinite(max_diag) or float(diag.min()) <= 0:
        raise NotPSDError(
            f"solver 'falkon': K_MM has a non-positive or non-finite diagonal (mean {mean_diag!r}); "
            "check the kernel and the centers"
        )
    eps = torch.finfo(problem.dtype).eps
    if rcond is None:
        # float64: the pseudo-inverse convention M eps. float32: eps32 alone, the precision of
        # the kernel pass; M eps32 also dropped directions that carried 3% of the prediction.
        rcond = M * eps if problem.dtype == torch.float64 else eps
    method = factorization
    if method == "auto":
        # Cholesky with the jitter the solver chose (DEFAULT_JITTER, or the float32 rule); eigh only if
        # that fails, which a jitter of that size rules out for a positive semi-definite K_MM.
        method = "cholesky_or_eigh"
    if method in ("cholesky", "cholesky_or_eigh"):
        if jitter is None:
            jitter = DEFAULT_JITTER
        shift = jitter * mean_diag
        G.diagonal().add_(shift)
        try:
            # the jitter is fixed, never grown (max_tries=0): eigh takes over instead
            # written over G: one M x M array at the peak instead of two
            L = cholesky_in_place(
                G,
                what="solver 'falkon': D K_MM D + jitter * mean(diag) * I",
                remedy="K_MM is rank deficient (e.g. duplicate centers); use solver option "
                "factorization='auto', 'pivoted' or 'eigh', or a larger 'jitter'",
                flush_below=tiny_fraction(work) * math.sqrt(mean_diag + shift),
            )
        except NotPSDError:
            if method == "cholesky":
                raise
            L = None
        del G
        prec = None
        if L is not None:
            try:
                prec = from_cholesky(L, lam=lam, d=d, n_centers=M, shift=shift)
                prec.jitter = jitter
            except NotPSDError:
                if method == "cholesky":
                    raise
        del L
        if prec is not None:
            return prec
        G = gram(problem, work, d, symmetric=False)  # rare fallback: recompute instead of keeping a copy
        method = "eigh"
    if method == "pivoted":
        # the threshold of Example 2 (rcond times the top eigenvalue), applied to the pivots
        tol = rcond * largest_eigenvalue(G)
        if max_diag <= tol:  # ?pstrf would stop before its first pivot, the largest diagonal entry
            raise InvalidOptionError(
                f"solver 'falkon' option 'rcond': expected a number below max(diag) / max eigenvalue of D K_MM D "
                f"= {max_diag * rcond / tol:.3g} with factorization='pivoted' (no center kept), got {rcond!r}"
            )
        L, keep = pivoted_cholesky(G, tol)
        del G
        return from_cholesky(L, lam=lam, d=d, n_centers=keep.numel(), keep=keep, m=M)
    s, U = torch.linalg.eigh(G)
    del G
    # eigh sorts ascending: the kept eigenpairs are a trailing block (a view, no copy of U)
    first = int((s <= rcond * s[-1]).sum())
    s, U = s[first:], U[:, first:]
    if s.numel() == 0:  # only if no eigenvalue is positive (the diagonal check makes this unreachable)
        raise NotPSDError("solver 'falkon': D K_MM D has no positive eigenvalue; check the kernel and the centers")
    return Preconditioner(lam=lam, d=d, Q=U, t_diag=s.sqrt(), a_diag=(s / M + lam).sqrt(), method="eigh")


def from_cholesky(
    L: Tensor,
    *,
    lam: float,
    d: Tensor | None,
    n_centers: int,
    keep: Tensor | None = None,
    m: int = 0,
    shift: float = 0.0,
) -> Preconditioner:
    """Def. 3 from a lower Cholesky factor ``L`` of the (kept block of) ``D K_MM D``.

    ``T = L^T`` and ``A = chol(T T^T / n_centers + lambda I)``. With ``keep`` (the pivoted path)
    ``Q`` is the column selection of the kept centers and ``n_centers`` their number q: when the
    dropped centers duplicate kept ones this is FALKON on the deduplicated centers.

    Raises
    ------
    NotPSDError
        If ``T T^T / n_centers + lambda I`` is not numerically positive definite.
    """
    T = L.mT  # upper triangular, T^T T = L L^T
    A = upper_cholesky_of_scaled_product(
        L,
        1.0 / n_centers,
        lam,
        what="solver 'falkon': T T^T / M + lambda I (A of Def. 3)",
        remedy="use solver option precond_dtype='float64', or a larger noise",
        flush=True,
    )
    method = "cholesky" if keep is None else "pivoted"
    return Preconditioner(lam=lam, d=d, T=T, A=A, keep=keep, m=m, method=method, shift=shift)


MIXED_A_SHIFT = 0.1
"""``precond_dtype="mixed"``: ``A`` factors ``T T^T / M + (lambda + extra) I`` with ``extra = MIXED_A_SHIFT *
eps32 * mean(diag(T^T T))``, above the float32 rounding of the product (at most ``eps32 * ||T T^T|| / M``
and ``||T T^T|| <= trace``), so that the float32 Cholesky of ``A`` cannot fail on rounding; raised tenfold
(at most twice) if it does anyway."""

MIXED_ROWS = 1024
"""Rows per block when ``K_MM`` is evaluated in float64 (and of the lower-triangle passes)."""

TINY_FRACTION = 2.0**-63
"""Entries of the float32 matrices below this fraction of their scale are set to 0 (``_flush_tiny``).

2^-63 (``tiny_fraction(torch.float32)``) is the square root of float32's smallest normal number, so no
product of two kept entries is subnormal. Subnormal operands and results make the float32 GEMMs inside the
factorizations slow on some CPUs: on bike (M = 5,000, short lengthscales, so K_MM holds values down to
e^-700 that float32 rounds into the subnormal range) the mixed-precision setup took 15.3 s on a 2-core Intel
Xeon against 1.4 s for the float64 one, unflushed. The change to a matrix is below 1e-19 of its scale,
under float32's own rounding (6e-8) by eleven orders of magnitude."""


def factor_flush(M: int) -> float:
    """Relative threshold below which the float32 factorizations of ``mixed_cholesky`` zero entries.

    ``max(TINY_FRACTION, eps32 / M)`` of the factor's scale (the square root of the mean diagonal). No
    product of two kept entries is subnormal (:data:`TINY_FRACTION`), and the entries flushed change any
    inner product of ``M`` terms by at most ``eps32`` of the scale, the factorization's own rounding. The
    larger threshold also cuts the chains of ever smaller values inside the panels' triangular solves,
    whose subnormal intermediates :data:`TINY_FRACTION` alone left: on UCI bike (M = 5,000, short
    lengthscales) the float32 setup took 1.7-2.3 s against 1.3-1.5 s with ``eps32 / M``, and 1.0-1.2 s
    with flush-to-zero in every thread (2-core Intel Xeon host; docs/solvers/falkon.md).
    """
    return max(TINY_FRACTION, torch.finfo(torch.float32).eps / M)


def _lower_blocks(M: int):
    """``(r, e)`` per block of ``MIXED_ROWS`` rows: ``X[r:e, :e]`` covers the lower triangle (and no more)."""
    for r in range(0, M, MIXED_ROWS):
        yield r, min(r + MIXED_ROWS, M)


def _flush_tiny(X: Tensor, scale: float) -> None:
    """Set the lower triangle's entries of ``X`` below ``tiny_fraction(X.dtype) * scale`` in magnitude to 0.

    Only the lower triangle: the factorizations read nothing else, and the upper one of a fresh buffer is
    still unwritten memory. Read first, each of its pages is mapped twice (the zero page, then a copy on the
    write), which cost 0.4 s for the 200 MB upper triangle of a 10,000 x 10,000 float32 matrix on the 2-core
    Intel host; written first (the Cholesky zeroes it), it costs a fraction of that.
    """
    if scale > 0 and math.isfinite(scale):
        for r, e in _lower_blocks(X.shape[0]):
            zero_small_entries(X[r:e, :e], tiny_fraction(X.dtype) * scale)


def mixed_cholesky(problem: Problem, weights: Tensor | None, *, jitter: float) -> Preconditioner | None:
    r"""Example 1.1 factored in float32 and applied in float64 (``precond_dtype="mixed"``); None if it fails.

    Def. 3 asks two things of ``B = T^{-1} A^{-1}``: that it is one fixed invertible map, and that the
    ``lambda K_MM`` part of ``W = B^T H B`` is the true one; CG on ``W`` then converges to the same
    ``alpha = B beta`` for any such ``B`` (Rudi et al. 2017, Def. 3; ``B`` only sets the conditioning).
    So the ``M^3`` work (Cholesky of ``D K_MM D + shift I``, ``T T^T``, Cholesky of ``T T^T / M + (lambda
    + extra) I``) runs in float32 at twice the float64 GEMM rate, and every solve of the CG reads the
    float32 factors exactly widened to float64 and sums in float64 (:class:`kgp.linalg.LowerFactor`), so
    ``B`` is a fixed map to float64 rounding (float32 solves are not), at half the memory traffic of a
    float64 factor.
    ``A`` sets the conditioning only, so ``extra`` (:data:`MIXED_A_SHIFT`) may exceed ``lambda``. The
    regulariser uses ``T^T T = D K_MM D + shift I``, which the float32 factor satisfies to its backward
    error, about ``eps32 sqrt(M) mean(diag)`` against the ``shift`` it corrects (1e-3 of the mean diagonal):
    a relative change of ``W`` of order 1e-4, measured harmless (docs/solvers/falkon.md, "float32").

    ``K_MM`` is evaluated in float64 (the float32 distance GEMM errs by up to 3.5e-3 on some UCI sets,
    more than the jitter) and rounded to float32. Memory: the two float32 factors share one buffer the
    size of one ``M x M`` float64 array, half the float64 path's peak. Where the native solve cannot be
    built (no C compiler) each factor is widened into a float64 copy at its first solve instead.
    """
    f32, f64 = torch.float32, torch.float64
    Z = problem.centers.points.to(f64)
    M = Z.shape[0]
    lam = problem.lam
    d = None if weights is None else weights.to(f64)
    buf = torch.empty(2 * M * M, dtype=f32, device=Z.device)  # the bytes of one M x M float64 array
    G, P = buf[: M * M].view(M, M), buf[M * M :].view(M, M)
    for r, e in _lower_blocks(M):  # the lower triangle of D K_MM D, block row by block row
        block = problem.kernel_operator(Z[r:e], Z[:e]).to_dense()
        if d is not None:
            block.mul_(d[r:e, None]).mul_(d[None, :e])
        G[r:e, :e] = block
    diag = G.diagonal()
    mean_diag = float(diag.double().mean())
    if not math.isfinite(mean_diag) or not bool(torch.isfinite(diag).all()) or float(diag.min()) <= 0:
        return None  # the float64 path raises the error
    _flush_tiny(G, mean_diag)
    shift = jitter * mean_diag
    diag.add_(shift)
    try:
        cholesky_in_place(
            G,
            what="solver 'falkon': D K_MM D + jitter * mean(diag) * I (float32)",
            flush_below=factor_flush(M) * math.sqrt(mean_diag + shift),
        )
    except NotPSDError:
        return None
    extra = MIXED_A_SHIFT * torch.finfo(f32).eps * (mean_diag + shift)
    for _ in range(3):
        gram_of_lower(G, out=P, scale=1.0 / M)
        P.diagonal().add_(lam + extra)
        _flush_tiny(P, float(P.diagonal().double().mean()))
        try:
            cholesky_in_place(
                P,
                what="solver 'falkon': T T^T / M + lambda I (float32)",
                flush_below=factor_flush(M) * math.sqrt(float(P.diagonal().double().mean())),
            )
            break
        except NotPSDError:
            extra *= 10.0
    else:
        return None
    # G and P hold the lower factors: T of Def. 3 and A are their transposes, solved in float64 on the
    # float32 entries (kgp.linalg.LowerFactor)
    return Preconditioner(
        lam=lam, d=d, T=G.mT, A=P.mT, method="cholesky", shift=shift, jitter=jitter, precision="mixed"
    )
