"""Solver ``falkon``: Nystrom kernel ridge regression by preconditioned conjugate gradient.

Implements FALKON (Rudi, Carratino, Rosasco, NIPS 2017; arXiv 1705.10958 v3) in the general form
of its Appendix A (Def. 3 and Def. 4): weighted centers (the diagonal matrix D, e.g. from
leverage-score sampling) and a rank-deficient ``K_MM`` are handled by the same code.

Problem (eq. 7-8, kgp's convention ``lambda = noise / n = problem.lam``)::

    H alpha = z,   H = K_nM^T K_nM + lambda n K_MM,   z = K_nM^T y

Preconditioner (Def. 3): with ``G = D K_MM D = Q T^T T Q^T`` (Q: M x q with Q^T Q = I, T: q x q
triangular) and ``A^T A = T T^T / M + lambda I``::

    B = D Q T^{-1} A^{-1} / sqrt(n)

Conjugate gradient on ``W beta = b`` with ``W = B^T H B`` and ``b = B^T z``, then ``alpha = B beta``
(Def. 4). As in the paper's Algorithm 1 the ``1/sqrt(n)`` is folded into the operator: with
``B' = D Q T^{-1} A^{-1}`` the code runs CG on

    W' u = A^{-T} T^{-T} Q^T D K_nM^T K_nM D Q T^{-1} A^{-1} u / n + lambda A^{-T} A^{-1} u,
    b'   = A^{-T} T^{-T} Q^T D K_nM^T y / n,

whose solution ``beta' = beta / sqrt(n)`` gives ``alpha = B' beta'``. The second term of ``W'`` uses
``Q^T D K_MM D Q = T^T T``. Unlike the MATLAB code of the paper's Appendix G, D is applied in
``B'``, in ``B'^T`` and in ``alpha`` (the printed code omits it and solves a different problem; see
the digest, section 1.5).

Numerics (see docs/solvers/falkon.md for the measurements behind these choices):

- The ``M x M`` factorizations and the CG recurrences (vectors of length M) run in
  ``precond_dtype`` (default float64), whatever the input dtype; only the kernel passes
  ``K_nM^T (K_nM v + w)`` run in the input dtype. These ``M x M`` operations cost
  ``O(M^3 + t M^2 k)``, negligible next to the ``O(t n M)`` kernel passes.
- float64 inputs: ``G + jitter * mean(diag G) * I`` is factored by Cholesky (Example 1.1; jitter
  ``M * eps64``, the paper's ``eps * M``); if that fails (rank-deficient ``K_MM``, e.g. duplicate
  centers) the eigendecomposition of Example 2 takes over.
- float32 inputs: the eigendecomposition of Example 2, dropping eigenvalues of ``G`` at or below
  ``eps32 * max``, whenever there are such eigenvalues. Directions of ``K_MM`` that the float32
  kernel pass cannot resolve make ``W`` ill conditioned through any jitter (CG diverged at
  lambda = 1e-9 with jitters from ``M eps64`` to ``1e-3``); removing them (q < M) keeps it
  convergent. When there are none, that truncated eigendecomposition keeps every direction and
  builds the same ``B' B'^T`` as a Cholesky factor, so the Cholesky (jitter ``M eps64``) is used
  instead: about 15 s of setup against 190 s for the eigh at M = 10,000 on the development
  machine. Which case holds is decided from Ritz estimates of the extreme eigenvalues of ``G``
  (subspace iteration, ``O(M^2)`` per step, the inverse one with the Cholesky factor).
- ``factorization="pivoted"``: a pivoted Cholesky (LAPACK ``?pstrf``) that stops at pivots below
  ``rcond`` times the top eigenvalue; the dropped centers get ``alpha = 0`` and ``Q`` of Def. 3 is
  the column selection of the kept ones. ``O(M q^2)``: for large M with a low numerical rank.
- ``A = chol(T T^T / M + lambda I)`` with ``T T^T = L^T L`` formed by LAPACK ``?lauum`` on the CPU
  (a sixth of a GEMM's flops, 7.5 s instead of 25 s at M = 10,000) and factored in place.
- Every ``residual_every`` iterations the true residual ``b' - W' beta'`` replaces the recursive
  one. It costs no extra pass: the current ``alpha`` rides along as extra columns of the fused
  pass ``K_nM^T (K_nM [p, alpha] + [0, -y])``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor

import kgp
from kgp.plugin import KernelExpansion, Problem, merge_options

__all__ = ["FalkonSolver"]

_FACTORIZATIONS = ("auto", "cholesky", "pivoted", "eigh")
_PRECOND_DTYPES = ("float64", "input")


@dataclass
class _Preconditioner:
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

    @property
    def rank(self) -> int:
        """q: the number of directions the preconditioner keeps (M unless some were dropped)."""
        if self.Q is not None:
            return self.Q.shape[1]
        return self.T.shape[0]

    def apply(self, u: Tensor) -> Tensor:
        """``B' u = D Q T^{-1} A^{-1} u`` (q x k -> M x k)."""
        if self.T is not None:
            v = torch.linalg.solve_triangular(self.A, u, upper=True)
            v = torch.linalg.solve_triangular(self.T, v, upper=True)
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
            u = torch.linalg.solve_triangular(self.T.mT, v, upper=False)
            return torch.linalg.solve_triangular(self.A.mT, u, upper=False)
        return (self.Q.mT @ v) / (self.t_diag * self.a_diag).unsqueeze(-1)

    def regulariser(self, u: Tensor) -> Tensor:
        """``lambda A^{-T} A^{-1} u``: the ``lambda n K_MM`` part of ``W'`` (uses ``Q^T G Q = T^T T``)."""
        if self.T is not None:
            v = torch.linalg.solve_triangular(self.A, u, upper=True)
            return self.lam * torch.linalg.solve_triangular(self.A.mT, v, upper=False)
        return self.lam * u / self.a_diag.square().unsqueeze(-1)


class FalkonSolver:
    """FALKON: Nystrom KRR solved by conjugate gradient with the preconditioner of Def. 3.

    Options (``solver_options``)
    ----------------------------
    maxiter : int, default 20
        CG iterations t. Thm. 3 asks ``t >= log(n)/2 + 5 + 2 log(a + 3 kappa)`` (about 16 at
        n = 2e5 with standardised targets); Fig. 1 (HIGGS) plateaus within about 10 iterations.
    tol : float, default 1e-7
        Early stop when every output's relative residual ``||b' - W' beta'|| / ||b'||`` of the
        preconditioned system is at most ``tol`` (0 disables; the paper runs exactly t steps).
    residual_every : int, default 10
        Replace the recursive CG residual by the true one every this many iterations (0 never).
        Costs no extra kernel pass (extra columns of the fused pass).
    jitter : float or None, default None
        Cholesky path: added to the diagonal of ``D K_MM D``, relative to its mean diagonal
        (it regularises like ``lambda n jitter`` on the coefficients). None: ``M * eps`` of the
        input dtype (the paper's Algorithm 1 uses ``eps * M``); ``M * eps64`` on the float32
        ``"auto"`` path, which must see the spectrum of ``K_MM`` itself.
    factorization : {"auto", "cholesky", "pivoted", "eigh"}, default "auto"
        ``"cholesky"``: Def. 3, Example 1.1 (raises on rank-deficient ``K_MM``); ``"eigh"``:
        Example 2, any rank, eigenvalues at or below ``rcond * max`` dropped; ``"pivoted"``:
        pivoted Cholesky stopped at pivots at or below ``rcond * max eigenvalue``, centers it does
        not keep get ``alpha = 0`` (fast when the numerical rank q is far below M); ``"auto"``:
        float64 inputs Cholesky with ``"eigh"`` as fallback; float32 inputs Cholesky when no
        eigenvalue of ``D K_MM D`` is at or below ``rcond * max`` (then it equals ``"eigh"``),
        else ``"eigh"`` (robust down to lambda = 1e-9). The factorization used and the rank kept
        are reported in each iteration's ``extras`` (``model.history_``).
    precond_dtype : {"float64", "input"}, default "float64"
        Precision of ``K_MM``, its factors and the CG vectors. Kernel passes always use the
        input dtype. ``"input"`` halves the ``O(M^2)`` memory of float32 fits.
    rcond : float or None, default None
        Eigen and pivoted paths (and the float32 ``"auto"`` check): drop eigenvalues (pivots) of
        ``D K_MM D`` at or below ``rcond * max eigenvalue``.
        None: ``M * eps64`` for float64 inputs (the pseudo-inverse convention), ``eps32`` for
        float32 inputs.
    kernel_cache : {"auto", "never"}, default "auto"
        ``"auto"``: keep ``K_nM`` in memory from the second CG pass on when ``n M`` entries fit
        ``kgp.settings.memory_budget`` (a fifth of RAM by default); later passes then read it
        instead of recomputing kernel blocks (4-5x faster per pass at d = 10, docs/backend.md).
        ``"never"``: recompute every pass (memory O(M^2) + one block). Never above the budget.

    Returns a :class:`kgp.KernelExpansion` over ``problem.centers``. Every kernel product goes
    through ``problem.kernel_operator`` (the fused pass ``K_nM^T (K_nM v + w)``); memory is
    ``O(M^2)`` for the factors plus the backend's block budget.
    """

    option_defaults: dict[str, Any] = {
        "maxiter": 20,
        "tol": 1e-7,
        "residual_every": 10,
        "jitter": None,
        "factorization": "auto",
        "precond_dtype": "float64",
        "rcond": None,
        "kernel_cache": "auto",
    }
    uses_centers = True

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_options(options: dict[str, Any]) -> dict[str, Any]:
        # the model merges and checks names (kgp.merge_options); a direct fit(problem) call gets the same check
        opts = merge_options("solver 'falkon'", FalkonSolver.option_defaults, options)
        maxiter = opts["maxiter"]
        if isinstance(maxiter, bool) or not isinstance(maxiter, Integral) or maxiter < 1:
            raise ValueError(f"solver option 'maxiter': expected a positive integer, got {maxiter!r}")
        every = opts["residual_every"]
        if every is None:
            every = 0
        if isinstance(every, bool) or not isinstance(every, Integral) or every < 0:
            raise ValueError(f"solver option 'residual_every': expected an integer >= 0, got {every!r}")
        tol = _check_real(opts["tol"], "tol", allow_zero=True)
        jitter = opts["jitter"]
        if jitter is not None:
            jitter = _check_real(jitter, "jitter", allow_zero=True)
        rcond = opts["rcond"]
        if rcond is not None:
            rcond = _check_real(rcond, "rcond", allow_zero=True)
            if rcond >= 1:
                raise ValueError(f"solver option 'rcond': expected a number in [0, 1), got {rcond!r}")
        if opts["factorization"] not in _FACTORIZATIONS:
            raise ValueError(
                f"solver option 'factorization': expected one of {_FACTORIZATIONS}, got {opts['factorization']!r}"
            )
        if opts["precond_dtype"] not in _PRECOND_DTYPES:
            raise ValueError(
                f"solver option 'precond_dtype': expected one of {_PRECOND_DTYPES}, got {opts['precond_dtype']!r}"
            )
        if opts["kernel_cache"] not in ("auto", "never"):
            raise ValueError(f"solver option 'kernel_cache': expected 'auto' or 'never', got {opts['kernel_cache']!r}")
        return {
            "kernel_cache": opts["kernel_cache"],
            "maxiter": int(maxiter),
            "tol": tol,
            "residual_every": int(every),
            "jitter": jitter,
            "factorization": opts["factorization"],
            "precond_dtype": opts["precond_dtype"],
            "rcond": rcond,
        }

    @staticmethod
    def _check_problem(problem: Problem) -> Tensor | None:
        if problem.centers is None:
            raise ValueError("solver 'falkon' needs Nystrom centers: problem.centers is None")
        Z = problem.centers.points
        if Z.dim() != 2 or Z.shape[1] != problem.X.shape[1]:
            raise ValueError(f"centers: expected shape (M, {problem.X.shape[1]}), got {tuple(Z.shape)}")
        if Z.dtype != problem.X.dtype or Z.device != problem.X.device:
            raise TypeError("centers: expected the dtype and device of X")
        if not problem.X.dtype.is_floating_point:
            raise TypeError(f"X: expected a floating dtype, got {problem.X.dtype}")
        if problem.y.dim() != 2 or problem.y.shape[0] != problem.n:
            raise ValueError(f"y: expected shape ({problem.n}, k), got {tuple(problem.y.shape)}")
        if not (math.isfinite(problem.noise) and problem.noise > 0):
            raise ValueError(f"noise: expected a finite positive number, got {problem.noise!r}")
        w = problem.centers.weights
        if w is None:
            return None
        if w.dim() != 1 or w.shape[0] != Z.shape[0]:
            raise ValueError(f"center_weights: expected shape ({Z.shape[0]},), got {tuple(w.shape)}")
        if not bool(torch.isfinite(w).all()) or not bool((w > 0).all()):
            raise ValueError("center_weights: expected finite, strictly positive weights (the diagonal of D)")
        return w

    # ------------------------------------------------------------------ preconditioner
    @staticmethod
    def _gram(problem: Problem, work: torch.dtype, d: Tensor | None) -> Tensor:
        """``G = D K_MM D`` in the working precision, exactly symmetric."""
        Zw = problem.centers.points.to(work)
        G = problem.kernel_operator(Zw, Zw).to_dense()
        if d is not None:
            G.mul_(d.unsqueeze(0)).mul_(d.unsqueeze(1))
        G.add_(G.mT.clone()).mul_(0.5)  # symmetric to the last bit, for Cholesky and eigh alike
        return G

    def _preconditioner(self, problem: Problem, weights: Tensor | None, opts: dict[str, Any]) -> _Preconditioner:
        """Build ``Q, T, A`` of Def. 3 (Example 1.1, a pivoted variant, or Example 2) from ``G = D K_MM D``."""
        work = torch.float64 if opts["precond_dtype"] == "float64" else problem.dtype
        M = problem.centers.points.shape[0]
        lam = problem.lam
        d = None if weights is None else weights.to(work)
        # K_MM is evaluated in the working precision (not cast from the input dtype), so the
        # factors describe the exact kernel.
        G = self._gram(problem, work, d)
        diag = G.diagonal()
        mean_diag, max_diag = float(diag.mean()), float(diag.max())
        if not math.isfinite(mean_diag) or not math.isfinite(max_diag) or float(diag.min()) <= 0:
            raise ValueError(
                f"solver 'falkon': K_MM has a non-positive or non-finite diagonal (mean {mean_diag!r}); "
                "check the kernel and the centers"
            )
        eps = torch.finfo(problem.dtype).eps
        rcond = opts["rcond"]
        if rcond is None:
            # float64: the pseudo-inverse convention M eps. float32: eps32 alone, the precision of
            # the kernel pass; M eps32 also dropped directions that carried 3% of the prediction.
            rcond = M * eps if problem.dtype == torch.float64 else eps
        method = opts["factorization"]
        if method == "auto":
            # float64: Cholesky, eigh if it fails. float32: Cholesky too, but only if no eigenvalue of
            # G lies at or below rcond * max, i.e. if the truncated eigh of Example 2 would keep every
            # direction and so build the same preconditioner; otherwise that eigh. Directions below
            # eps32 of the top one are invisible to float32 kernel passes and made CG diverge at
            # lambda = 1e-9 through any jitter (docs/solvers/falkon.md, "Numerics").
            method = "cholesky_or_eigh" if problem.dtype == torch.float64 else "checked_cholesky_or_eigh"
        if method in ("cholesky", "cholesky_or_eigh", "checked_cholesky_or_eigh"):
            checked = method == "checked_cholesky_or_eigh"
            jitter = opts["jitter"]
            if jitter is None:
                # the paper's M eps. The checked float32 path judges the spectrum of G itself, so its
                # jitter stays far below eps32: M eps64.
                jitter = M * (torch.finfo(torch.float64).eps if checked else eps)
            G.diagonal().add_(jitter * mean_diag)
            lmax = _largest_eigenvalue(G) if checked else 0.0
            L, info = torch.linalg.cholesky_ex(G)
            del G
            ok = int(info) == 0
            if ok and checked:
                ok = _smallest_eigenvalue(L) > rcond * lmax
            if ok:
                prec = _from_cholesky(L, lam=lam, d=d, n_centers=M)
                if prec is not None:
                    return prec
            del L
            if method == "cholesky":
                raise ValueError(
                    f"solver 'falkon': Cholesky of D K_MM D + jitter failed in {work} (K_MM is rank deficient, "
                    "e.g. duplicate centers); use solver option factorization='auto', 'pivoted' or 'eigh', or a "
                    "larger 'jitter'"
                )
            G = self._gram(problem, work, d)  # rare fallback: recompute instead of keeping a copy
            method = "eigh"
        if method == "pivoted":
            # the threshold of Example 2 (rcond times the top eigenvalue), applied to the pivots
            L, keep = _pivoted_cholesky(G, rcond * _largest_eigenvalue(G))
            del G
            prec = _from_cholesky(L, lam=lam, d=d, n_centers=keep.numel(), keep=keep, m=M)
            if prec is None:
                raise ValueError(f"solver 'falkon': Cholesky of T T^T / M + lambda I failed in {work}")
            return prec
        s, U = torch.linalg.eigh(G)
        del G
        # eigh sorts ascending: the kept eigenpairs are a trailing block (a view, no copy of U)
        first = int((s <= rcond * s[-1]).sum())
        s, U = s[first:], U[:, first:]
        if s.numel() == 0:
            raise ValueError(
                "solver 'falkon': D K_MM D has no eigenvalue above rcond * max; check the kernel and centers"
            )
        return _Preconditioner(lam=lam, d=d, Q=U, t_diag=s.sqrt(), a_diag=(s / M + lam).sqrt(), method="eigh")

    # ------------------------------------------------------------------ solve
    def fit(self, problem: Problem) -> KernelExpansion:
        """Run FALKON (Def. 4) on ``problem``; return the kernel expansion over its centers.

        Raises
        ------
        ValueError
            On invalid options, missing centers, bad weights, or a failed factorization with
            ``factorization="cholesky"``.
        """
        opts = self._check_options(problem.options)
        weights = self._check_problem(problem)
        n, k = problem.n, problem.n_outputs
        dtype = problem.dtype
        maxiter, tol, every = opts["maxiter"], opts["tol"], opts["residual_every"]
        monitor = problem.monitor
        monitor.start(total=maxiter, desc="falkon")

        with torch.no_grad(), kgp.settings.kernel_cache(opts["kernel_cache"]):
            prec = self._preconditioner(problem, weights, opts)
            work = prec.T.dtype if prec.T is not None else prec.Q.dtype
            facts = {"factorization": prec.method, "rank": prec.rank}
            Z = problem.centers.points
            op = problem.kernel_operator(problem.X, Z)
            y = problem.y.to(dtype)

            def predictor(beta: Tensor) -> KernelExpansion:
                return KernelExpansion(problem.kernel, Z, prec.apply(beta).to(dtype))

            # b' = A^{-T} T^{-T} Q^T D K_nM^T y / n
            b = prec.apply_t((op.T @ y).to(work) / n)
            b_norm = b.norm(dim=0)
            scale = torch.where(b_norm > 0, b_norm, torch.ones_like(b_norm))
            beta = torch.zeros_like(b)
            r = b.clone()
            p = r.clone()
            rs = (r * r).sum(0)
            it = 0
            if bool((b_norm == 0).all()):
                monitor.step(1, lambda: predictor(beta), residual=0.0, **facts)
                return predictor(beta)
            zeros_w = torch.zeros(n, k, dtype=dtype, device=y.device) if every else None
            for it in range(1, maxiter + 1):
                refresh = every > 0 and it > 1 and (it - 1) % every == 0
                v = prec.apply(p)
                if refresh:
                    # [K^T K v, K^T (K alpha - y)] in one pass: the true residual at beta.
                    cols = torch.cat([v, prec.apply(beta)], dim=1).to(dtype)
                    out = op.fused_matmul(cols, torch.cat([zeros_w, -y], dim=1)).to(work) / n
                    kv, grad = out[:, :k], out[:, k:]
                    r = -(prec.apply_t(grad) + prec.regulariser(beta))
                    rs = (r * r).sum(0)
                else:
                    kv = op.fused_matmul(v.to(dtype)).to(work) / n
                wp = prec.apply_t(kv) + prec.regulariser(p)
                pwp = (p * wp).sum(0)
                # exact line search along p; r.p equals r.r except after a residual replacement
                rp = (r * p).sum(0) if refresh else rs
                ok = (pwp > 0) & (rs > 0)
                a = torch.where(ok, rp / torch.where(ok, pwp, torch.ones_like(pwp)), torch.zeros_like(pwp))
                beta.add_(p * a)
                r.sub_(wp * a)
                rs_new = (r * r).sum(0)
                ratio = torch.where(rs > 0, rs_new / torch.where(rs > 0, rs, torch.ones_like(rs)), torch.zeros_like(rs))
                p = r + p * ratio
                rs = rs_new
                rel = rs.sqrt() / scale
                residual = float(rel.max())
                stop = monitor.step(it, lambda: predictor(beta), residual=residual, **facts)
                if not math.isfinite(residual):
                    raise FloatingPointError(
                        f"solver 'falkon': CG residual became {residual} at iteration {it}; try float64 inputs, "
                        "a larger noise, or a larger 'jitter'"
                    )
                if stop or residual <= tol:
                    break
            return predictor(beta)


def _start_block(G: Tensor, block: int) -> Tensor:
    g = torch.Generator(device=G.device).manual_seed(0)
    return torch.randn(G.shape[0], min(block, G.shape[0]), generator=g, dtype=G.dtype, device=G.device)


def _largest_eigenvalue(G: Tensor, iters: int = 15, block: int = 8) -> float:
    """Ritz estimate (a lower bound) of the largest eigenvalue of symmetric ``G`` by subspace iteration.

    ``O(iters M^2 block)`` from a fixed seed. The product is formed as ``(V^T G)^T`` (G is
    symmetric), which ran 1.5-9x faster than ``G V`` for 8 columns at M = 10,000 here.
    """
    V = _start_block(G, block)
    for _ in range(iters):
        V = torch.linalg.qr((V.mT @ G).mT).Q
    return float(torch.linalg.eigvalsh(V.mT @ (V.mT @ G).mT)[-1])


def _smallest_eigenvalue(L: Tensor, iters: int = 15, block: int = 8) -> float:
    """Ritz estimate (an upper bound) of the smallest eigenvalue of ``L L^T`` by inverse subspace iteration.

    Two triangular solves per step with the Cholesky factor ``L``: ``O(iters M^2 block)`` against
    ``O(M^3)`` with a large constant for ``eigvalsh``. Capped by ``min L_ii^2``, also an upper bound.
    """
    V = _start_block(L, block)
    for _ in range(iters):
        V = torch.linalg.solve_triangular(L, V, upper=False)
        V = torch.linalg.qr(torch.linalg.solve_triangular(L.mT, V, upper=True)).Q
    R = L.mT @ V
    return min(float(torch.linalg.eigvalsh(R.mT @ R)[0]), float(L.diagonal().square().min()))


def _from_cholesky(
    L: Tensor, *, lam: float, d: Tensor | None, n_centers: int, keep: Tensor | None = None, m: int = 0
) -> _Preconditioner | None:
    """Def. 3 from a lower Cholesky factor ``L`` of the (kept block of) ``D K_MM D``; None if A fails.

    ``T = L^T`` and ``A = chol(T T^T / n_centers + lambda I)``. With ``keep`` (the pivoted path)
    ``Q`` is the column selection of the kept centers and ``n_centers`` their number q: when the
    dropped centers duplicate kept ones this is FALKON on the deduplicated centers.
    """
    T = L.mT  # upper triangular, T^T T = L L^T
    A = _upper_cholesky_of_scaled_product(L, 1.0 / n_centers, lam)
    if A is None:
        return None
    method = "cholesky" if keep is None else "pivoted"
    return _Preconditioner(lam=lam, d=d, T=T, A=A, keep=keep, m=m, method=method)


def _upper_cholesky_of_scaled_product(
    L: Tensor, scale: float, shift: float, use_lapack: bool | None = None
) -> Tensor | None:
    """Upper triangular ``A`` with ``A^T A = scale * L^T L + shift * I`` (None if not positive definite).

    On the CPU, LAPACK ``?lauum`` forms ``L^T L`` from the triangle (M^3 / 3 flops against 2 M^3 for a
    GEMM: 7.5 s instead of 25 s at M = 10,000 in float64 here) and ``?potrf`` factors it in place,
    so one M x M array is allocated besides ``L``. Elsewhere (or with ``use_lapack=False``): a GEMM
    and ``torch.linalg.cholesky_ex``.
    """
    if use_lapack is None:
        use_lapack = L.device.type == "cpu" and L.dtype in (torch.float32, torch.float64)
    if use_lapack:
        from scipy.linalg import lapack

        double = L.dtype == torch.float64
        lauum, potrf = (lapack.dlauum, lapack.dpotrf) if double else (lapack.slauum, lapack.spotrf)
        # L^T viewed in Fortran order is L's C-order memory; ?lauum (upper) gives U U^T = L^T L in
        # the upper triangle of a copy, whose lower triangle keeps L^T's zeros
        c, info = lauum(L.detach().numpy().T, lower=0, overwrite_c=0)
        if info != 0:
            raise RuntimeError(f"LAPACK ?lauum failed (info {info})")
        c *= scale
        c.flat[:: c.shape[0] + 1] += shift
        c, info = potrf(c, lower=0, overwrite_a=1, clean=1)
        return None if info != 0 else torch.from_numpy(c)
    P = L.mT @ L
    P.mul_(scale).diagonal().add_(shift)
    LA, info = torch.linalg.cholesky_ex(P)
    return None if int(info) != 0 else LA.mT


def _pivoted_cholesky(G: Tensor, tol: float) -> tuple[Tensor, Tensor]:
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


def _check_real(value: Any, name: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"solver option {name!r}: expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"solver option {name!r}: expected a finite number >= 0, got {value!r}")
    return value


@kgp.hookimpl
def register_solvers(register) -> None:
    register("falkon", FalkonSolver())
