"""Center selectors ``bless`` and ``bless-r``: approximate ridge leverage-score sampling.

Implements Rudi, Calandriello, Carratino and Rosasco, "On Fast Leverage Score Sampling and Optimal
Learning" (NeurIPS 2018): Algorithm 1 (BLESS, sampling with replacement) and Algorithm 2 (BLESS-R,
sampling without replacement), both sweeping the decreasing path
``lambda_h = lambda_0 / q^h`` from ``lambda_0 = kappa^2 / min(t, 1)`` down to the target lambda, and
scoring points with the estimator of eq. 3,

    l~_J(i, lambda) = (lambda n)^{-1} (K_ii - K_{J,i}^T (K_{J,J} + lambda n A)^{-1} K_{J,i}).

The selected centers come with the weights of FALKON's weighted Nystrom (Rudi et al. 2017, Appendix
A, Def. 2): the diagonal of D with ``D_jj^2 = (M / n) / A_jj`` for the M returned (distinct) centers.
That is ``D_jj = 1 / sqrt(n p_j)`` for a center drawn once with per-draw probability ``p_j``, and
reduces to D = I for uniform sampling (A = (M/n) I); see :func:`center_weights` and
docs/selectors/bless.md for the treatment of duplicates.

Conventions: ``lam`` is the FALKON/BLESS per-sample lambda = sigma^2 / n (``request.lam``). Every
kernel block goes through :func:`kgp.kernel_operator`; nothing n x n (except in
:func:`kgp_builtins.oracles.exact_leverage_scores`, the O(n^3) oracle of the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import gpytorch
import torch
from torch import Tensor

import kgp
from kgp.operators import kernel_operator, plan_block_rows, row_slices
from kgp.plugin import Centers, SelectionRequest

__all__ = [
    "BlessResult",
    "BlessRSelector",
    "BlessSelector",
    "bless",
    "bless_r",
    "center_weights",
    "estimate_leverage_scores",
]

_LINALG_DTYPES = ("float64", "input")
_SCORE_LAMBDAS = ("current", "previous")


# ---------------------------------------------------------------------------------------------- checks
def _check_inputs(X: Any, kernel: Any, lam: Any) -> float:
    if not isinstance(X, Tensor):
        raise TypeError(f"X: expected a torch.Tensor (n x d), got {type(X).__name__}")
    if X.dim() != 2 or X.shape[0] < 1:
        raise ValueError(f"X: expected a non-empty 2-D tensor (n x d), got shape {tuple(X.shape)}")
    if X.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"X: expected dtype float32 or float64, got {X.dtype}")
    if not isinstance(kernel, gpytorch.kernels.Kernel):
        raise TypeError(f"kernel: expected a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
    return _positive(lam, "lam")


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite positive number, got {value!r}")
    return float(value)


def _check_options(
    *, q: Any, t: Any, q2: Any, q1: Any = 1.0, linalg_dtype: Any = "float64", score_lambda: Any = "current"
) -> None:
    _positive(q, "q")
    if q <= 1:
        raise ValueError(f"q: expected a lambda step > 1, got {q!r}")
    _positive(t, "t")
    _positive(q1, "q1")
    _positive(q2, "q2")
    if linalg_dtype not in _LINALG_DTYPES:
        raise ValueError(f"linalg_dtype: expected one of {_LINALG_DTYPES}, got {linalg_dtype!r}")
    if score_lambda not in _SCORE_LAMBDAS:
        raise ValueError(f"score_lambda: expected one of {_SCORE_LAMBDAS}, got {score_lambda!r}")


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def _check_n_centers(n_centers: Any, n: int) -> int | None:
    if n_centers is None:
        return None
    if isinstance(n_centers, bool) or not isinstance(n_centers, int):
        raise ValueError(f"n_centers: expected None or a positive integer, got {n_centers!r}")
    if not 1 <= n_centers <= n:
        raise ValueError(f"n_centers: expected 1 <= n_centers <= n_samples={n}, got {n_centers}")
    return n_centers


def _as_generator(generator: torch.Generator | int | None) -> torch.Generator:
    if generator is None:
        return torch.Generator()  # torch's fixed default seed: reproducible
    if isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        return torch.Generator().manual_seed(generator)
    raise TypeError(f"generator: expected a torch.Generator, an int seed or None, got {type(generator).__name__}")


def _work_dtype(X: Tensor, linalg_dtype: str) -> torch.dtype:
    return torch.float64 if linalg_dtype == "float64" else X.dtype


# ---------------------------------------------------------------------------------------------- eq. 3
class _ScoreEstimator:
    """The estimator ``l~_J(., lam)`` of BLESS eq. 3 for a fixed column set J and weights A.

    ``K_{J,J} + lam n A`` is factorised through ``W = A^{-1/2} K_{J,J} A^{-1/2} + lam n I`` (its
    eigenvalues are >= lam n, so the Cholesky is safe even when K_{J,J} is singular), and
    ``K_{J,i}^T (K_{J,J} + lam n A)^{-1} K_{J,i} = ||L^{-1} A^{-1/2} K_{J,i}||^2``.
    """

    def __init__(self, X: Tensor, kernel, idx: Tensor, a: Tensor, lam: float, work_dtype: torch.dtype):
        self.X, self.kernel, self.work_dtype = X, kernel, work_dtype
        self.lam_n = lam * X.shape[0]
        self.XJ = X[idx]
        self.chol = None
        if idx.numel() > 0:
            kjj = kernel_operator(kernel, self.XJ).to_dense().to(work_dtype)
            self.s = a.to(device=X.device, dtype=work_dtype).rsqrt()
            w = self.s[:, None] * kjj * self.s[None, :]
            w.diagonal().add_(self.lam_n)
            chol, info = torch.linalg.cholesky_ex(w)
            jitter = torch.finfo(work_dtype).eps * w.diagonal().max()
            while int(info) != 0:  # only rounding can make W indefinite: add growing jitter
                w.diagonal().add_(jitter)
                jitter = jitter * 10
                chol, info = torch.linalg.cholesky_ex(w)
            self.chol = chol

    def __call__(self, rows: Tensor) -> Tensor:
        """Scores of ``X[rows]`` (in ``work_dtype``, on X's device)."""
        xr = self.X[rows]
        diag = kernel_operator(self.kernel, xr).diagonal().to(self.work_dtype)
        if self.chol is None:
            return diag / self.lam_n
        m = self.XJ.shape[0]
        # kernel block, its working-dtype copy and the triangular-solve result: 3 buffers per row
        block = plan_block_rows(xr.shape[0], m, torch.finfo(self.work_dtype).bits // 8, buffers=3)
        quad = torch.empty_like(diag)
        for sl in row_slices(0, xr.shape[0], block):
            kb = kernel_operator(self.kernel, xr[sl], self.XJ).to_dense().to(self.work_dtype)
            kb.mul_(self.s[None, :])
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
    lam = _check_inputs(X, kernel, lam)
    _check_options(q=2.0, t=1.0, q2=1.0, linalg_dtype=linalg_dtype)
    if indices.dim() != 1 or a.shape != indices.shape:
        raise ValueError(
            f"indices, a: expected two 1-D tensors of equal length, got {tuple(indices.shape)}, {tuple(a.shape)}"
        )
    rows = torch.arange(X.shape[0], device=X.device) if rows is None else rows.to(X.device)
    with torch.no_grad():
        est = _ScoreEstimator(X, kernel, indices.to(X.device), a, lam, _work_dtype(X, linalg_dtype))
        return est(rows).to(X.dtype)


# ---------------------------------------------------------------------------------------------- results
@dataclass
class BlessResult:
    """Output of :func:`bless` / :func:`bless_r` at the final lambda.

    Attributes
    ----------
    indices:
        Distinct indices of the M selected centers in X (order of first selection).
    a:
        Diagonal of A_H for these centers (Alg. 1 line 10 / Alg. 2 line 13; duplicates of Alg. 1
        merged as ``A_jj / c_j``, which leaves eq. 3 unchanged). Use with
        :func:`estimate_leverage_scores`.
    weights:
        Diagonal of FALKON's D (Appendix A, Def. 2): ``sqrt((M / n) / a)``.
    counts:
        How often each center was drawn (all ones for BLESS-R).
    leverage_scores:
        Estimated ``l~(x_j, lam)`` of the selected centers at the final level (the scores they were
        sampled with).
    d_eff:
        Estimate of ``d_eff(lam)`` from the final level (Alg. 1: ``d_H``).
    lambda_path:
        ``[lambda_1, ..., lambda_H]`` (lambda_H = lam).
    levels:
        One dict per level: ``lam``, ``candidates`` (|U_h|), ``draws``, ``centers``, ``d_eff``.
    """

    indices: Tensor
    a: Tensor
    weights: Tensor
    counts: Tensor
    leverage_scores: Tensor
    d_eff: float
    lambda_path: list[float]
    levels: list[dict[str, float]] = field(default_factory=list)

    def to_centers(self, X: Tensor) -> Centers:
        """Package as :class:`kgp.Centers` (points, D weights, indices, diagnostics)."""
        info = {
            "leverage_scores": self.leverage_scores,
            "d_eff": self.d_eff,
            "lambda_path": list(self.lambda_path),
            "a": self.a,
            "counts": self.counts,
            "levels": list(self.levels),
        }
        return Centers(points=X[self.indices], weights=self.weights, indices=self.indices, info=info)


def center_weights(a: Tensor, n: int) -> Tensor:
    """FALKON's D diagonal from BLESS's A diagonal: ``D_jj = sqrt((M / n) / A_jj)``, M = len(a).

    With this choice ``(n/M) K_MM D^2 K_MM = sum_j K_{J,j} K_{j,J} / A_jj`` is the importance-sampling
    estimate of ``K_nM^T K_nM`` that FALKON's preconditioner approximates (Appendix A, Def. 3), for
    every sampling rule: multinomial (A = M_draws diag(p), duplicates merged as A_jj / c_j),
    Bernoulli inclusion (A = diag(p)) and uniform without replacement (A = (M/n) I, so D = I).
    """
    m = a.shape[0]
    return torch.sqrt((m / n) / a)


def _lambda_path(lam0: float, lam: float, q: float) -> list[float]:
    """Geometric path from lam0 / q' down to exactly lam, with q' <= q and H = ceil(log(lam0/lam)/log q)."""
    if lam0 <= lam:
        return [lam]
    h_levels = max(1, math.ceil(math.log(lam0 / lam) / math.log(q) - 1e-12))
    return [lam0 * (lam / lam0) ** (h / h_levels) for h in range(1, h_levels + 1)]


def _kappa2(X: Tensor, kernel) -> float:
    return float(kernel_operator(kernel, X).diagonal().max())


def _first_distinct(values: Tensor, m: int) -> int | None:
    """Length of the shortest prefix of ``values`` holding m distinct entries; None if it has fewer."""
    uniq, inverse = torch.unique(values, return_inverse=True)
    if uniq.numel() < m:
        return None
    first = torch.full((uniq.numel(),), values.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(values.numel()), reduce="amin")
    return int(first.sort().values[m - 1]) + 1


def _draw_until_distinct(p: Tensor, labels: Tensor, m: int, generator: torch.Generator) -> Tensor:
    """i.i.d. draws of positions from p until their ``labels`` hold m distinct values.

    Multiplicities are kept (they enter A and D). Equivalent to successive sampling without
    replacement for the set, while the counts keep the with-replacement importance weights.
    """
    draws = torch.empty(0, dtype=torch.long)
    while draws.numel() < 100 * m:
        batch = torch.multinomial(p, max(2 * m, 64), replacement=True, generator=generator)
        draws = torch.cat([draws, batch])
        cut = _first_distinct(labels[draws], m)
        if cut is not None:
            return draws[:cut]
    # the mass sits on fewer than m points: complete the set without replacement
    rest = p.clone()
    rest[torch.isin(labels, labels[draws])] = 0
    have = torch.unique(labels[draws]).numel()
    extra = torch.multinomial(rest, m - have, replacement=False, generator=generator)
    return torch.cat([draws, extra])


# ---------------------------------------------------------------------------------------------- Alg. 1
def bless(
    X: Tensor,
    kernel: gpytorch.kernels.Kernel,
    lam: float,
    *,
    n_centers: int | None = None,
    q: float = 2.0,
    t: float = 1.0,
    q1: float = 2.0,
    q2: float = 3.0,
    early_stop: bool = False,
    generator: torch.Generator | int | None = None,
    linalg_dtype: str = "float64",
) -> BlessResult:
    """BLESS, Algorithm 1 of Rudi et al. (2018): leverage-score sampling with replacement.

    For ``h = 1..H``: ``lambda_h = lambda_{h-1} / q``; draw ``R_h = q1 min(kappa^2 / lambda_h, n)``
    candidates U_h uniformly; score them with eq. 3 using (J_{h-1}, A_{h-1}); set
    ``d_h = (n / R_h) sum_U l~`` and draw ``M_h = ceil(q2 d_h)`` centers J_h i.i.d. from U_h with
    probabilities ``p_{h,k} = l~_k / sum_U l~``; ``A_h = (R_h M_h / n) diag(p_{h,j})``.

    Parameters
    ----------
    X:
        ``n x d`` inputs (float32/float64, any device).
    kernel:
        GPyTorch kernel.
    lam:
        Target per-sample lambda (sigma^2 / n).
    n_centers:
        None: ``M_H = ceil(q2 d_H)`` draws as in the paper. Given: at the final level, draw i.i.d. from
        P_H until exactly ``n_centers`` distinct centers are found (multiplicities kept in A and D);
        earlier levels are unchanged.
    q:
        Lambda step (> 1); the path is ``lambda_0 / q^h`` with the last step shortened so that
        lambda_H = lam exactly.
    t:
        Accuracy parameter of Thm. 1; sets ``lambda_0 = kappa^2 / min(t, 1)``.
    q1, q2:
        Oversampling constants of Alg. 1 (candidates per level, centers per unit of d_eff). The
        theoretical values of Thm. 1 are in the hundreds; defaults (2, 3) are measured choices
        (docs/selectors/bless.md).
    early_stop:
        Only with ``n_centers``: stop the path at the first lambda_h with ``q2 d_h >= n_centers`` and
        draw the centers there, i.e. choose ``lambda_bless >= lam`` so that d_eff matches the requested
        M, as the paper does for FALKON-BLESS (Sec. 4). Cost then stays ~ n_centers^2 / lambda_h.
    generator:
        ``torch.Generator`` (CPU) or int seed for every random draw; None: torch's default seed.
    linalg_dtype:
        ``"float64"`` (default) or ``"input"``: dtype of the |J| x |J| factorisation and solves.

    Returns
    -------
    BlessResult
    """
    lam = _check_inputs(X, kernel, lam)
    _check_options(q=q, t=t, q1=q1, q2=q2, linalg_dtype=linalg_dtype)
    n = X.shape[0]
    n_centers = _check_n_centers(n_centers, n)
    _check_bool(early_stop, "early_stop")
    gen = _as_generator(generator)
    work = _work_dtype(X, linalg_dtype)
    with torch.no_grad():
        kappa2 = _kappa2(X, kernel)
        path = _lambda_path(kappa2 / min(t, 1.0), lam, q)
        idx = torch.empty(0, dtype=torch.long, device=X.device)
        a = torch.empty(0, dtype=work, device=X.device)
        levels: list[dict[str, float]] = []
        for h, lam_h in enumerate(path, start=1):
            last = h == len(path)
            exact_m = n_centers is not None and (last or early_stop)
            r = math.ceil(q1 * min(kappa2 / lam_h, n))
            if exact_m:  # enough distinct candidates to draw n_centers distinct centers from
                r = max(r, 2 * n_centers)
            if r >= n:  # a full pass is the R_h = n limit without the duplicate noise
                r, cand = n, torch.arange(n)
            else:
                cand = torch.randint(0, n, (r,), generator=gen)
            est = _ScoreEstimator(X, kernel, idx, a, lam_h, work)
            scores = est(cand.to(X.device))
            d_h = float(n / r * scores.sum())
            stop = n_centers is not None and (last or (early_stop and q2 * d_h >= n_centers))
            if stop and r < n and torch.unique(cand).numel() < n_centers:
                r, cand = n, torch.arange(n)
                scores = est(cand.to(X.device))
                d_h = float(scores.sum())
            p = (scores / scores.sum()).cpu()
            if stop:
                pos = _draw_until_distinct(p, cand, n_centers, gen)
            else:
                pos = torch.multinomial(p, max(1, math.ceil(q2 * d_h)), replacement=True, generator=gen)
            n_draws = pos.numel()
            # merge repeated dataset indices: eq. 3 depends on A only through sum_copies 1/A_jj
            chosen = cand[pos]
            uniq, inverse, counts = torch.unique(chosen, return_inverse=True, return_counts=True)
            order = torch.full((uniq.numel(),), n_draws, dtype=torch.long)
            order.scatter_reduce_(0, inverse, torch.arange(n_draws), reduce="amin")
            perm = order.argsort()
            uniq, counts = uniq[perm], counts[perm]
            first_pos = pos[order[perm]]
            p_sel = p[first_pos].to(device=X.device, dtype=work)
            a = (r * n_draws / n) * p_sel / counts.to(device=X.device, dtype=work)
            idx = uniq.to(X.device)
            sel_scores = scores[first_pos.to(X.device)]
            levels.append({"lam": lam_h, "candidates": r, "draws": n_draws, "centers": int(idx.numel()), "d_eff": d_h})
            if stop:
                path = path[:h]
                break
        return BlessResult(
            indices=idx,
            a=a.to(X.dtype),
            weights=center_weights(a, n).to(X.dtype),
            counts=counts.to(X.device),
            leverage_scores=sel_scores.to(X.dtype),
            d_eff=d_h,
            lambda_path=list(path),
            levels=levels,
        )


# ---------------------------------------------------------------------------------------------- Alg. 2
def bless_r(
    X: Tensor,
    kernel: gpytorch.kernels.Kernel,
    lam: float,
    *,
    n_centers: int | None = None,
    q: float = 2.0,
    t: float = 1.0,
    q2: float = 3.0,
    score_lambda: str = "current",
    early_stop: bool = False,
    generator: torch.Generator | int | None = None,
    linalg_dtype: str = "float64",
) -> BlessResult:
    """BLESS-R, Algorithm 2 of Rudi et al. (2018): leverage-score sampling without replacement.

    For ``h = 1..H``: ``beta_h = min(q2 kappa^2 / (lambda_h n), 1)``; U_h includes each point
    independently with probability beta_h; each ``j in U_h`` gets ``p_{h,j} = min(q2 l~_{J_{h-1}}(x_j), 1)``
    and joins J_h with probability ``p_{h,j} / beta_h``; ``A_h = diag(p_{h,j})``.

    Parameters
    ----------
    score_lambda:
        ``"current"`` (default): score with lambda_h, as Alg. 1 does; ``"previous"``: lambda_{h-1}, as
        Alg. 2 is printed. The two differ by at most a factor q; "current" slightly oversamples and
        gives d_eff(lam) at the final level without an extra pass.
    n_centers:
        None: |J_H| is random with mean ~ q2 d_eff(lam). Given: at the final level, exactly
        ``n_centers`` points are drawn without replacement from U_H with probability proportional to
        their scores; A then holds the first-order inclusion probabilities
        ``beta_H min(n_centers l~_j / sum_U l~, 1)``.

    early_stop:
        As in :func:`bless`.

    The other parameters are those of :func:`bless`. When ``p_{h,j} > beta_h`` the inclusion
    probability ``p / beta`` is clipped at 1, so the realised probability (and the A entry) is
    ``min(p, beta)``.

    Returns
    -------
    BlessResult
        ``d_eff`` is the Horvitz-Thompson estimate ``sum_{U_H} l~(x, lam) / beta_H``.
    """
    lam = _check_inputs(X, kernel, lam)
    _check_options(q=q, t=t, q2=q2, linalg_dtype=linalg_dtype, score_lambda=score_lambda)
    n = X.shape[0]
    n_centers = _check_n_centers(n_centers, n)
    _check_bool(early_stop, "early_stop")
    gen = _as_generator(generator)
    work = _work_dtype(X, linalg_dtype)
    with torch.no_grad():
        kappa2 = _kappa2(X, kernel)
        lam0 = kappa2 / min(t, 1.0)
        path = _lambda_path(lam0, lam, q)
        idx = torch.empty(0, dtype=torch.long, device=X.device)
        a = torch.empty(0, dtype=work, device=X.device)
        levels: list[dict[str, float]] = []
        lam_prev = max(lam0, path[0])
        for h, lam_h in enumerate(path, start=1):
            last = h == len(path)
            exact_m = n_centers is not None and (last or early_stop)
            beta = min(q2 * kappa2 / (lam_h * n), 1.0)
            if exact_m:  # enough candidates to draw n_centers distinct centers from
                beta = max(beta, min(1.0, 2.0 * n_centers / n))
            cand = torch.arange(n) if beta >= 1.0 else torch.nonzero(torch.rand(n, generator=gen) < beta).squeeze(1)
            lam_score = lam_h if score_lambda == "current" else lam_prev
            est = _ScoreEstimator(X, kernel, idx, a, lam_score, work)
            scores = est(cand.to(X.device))
            scores_h = scores if score_lambda == "current" else None
            if score_lambda == "previous" and (last or exact_m):  # d_eff(lambda_h) needs scores at lambda_h
                est = _ScoreEstimator(X, kernel, idx, a, lam_h, work)
                scores_h = est(cand.to(X.device))
            d_h = float(scores_h.sum() / beta) if scores_h is not None else float("nan")
            stop = n_centers is not None and (last or (early_stop and q2 * d_h >= n_centers))
            if stop and cand.numel() < n_centers:
                beta, cand = 1.0, torch.arange(n)
                scores_h = scores = est(cand.to(X.device))
                d_h = float(scores_h.sum())
            if stop:
                w = scores_h.cpu()
                pos = torch.multinomial(w, n_centers, replacement=False, generator=gen)
                incl = beta * torch.clamp(n_centers * w[pos] / w.sum(), max=1.0)
                sel_scores = scores_h[pos.to(X.device)]
            else:
                p = torch.clamp(q2 * scores.cpu(), max=1.0)
                keep = torch.rand(cand.numel(), generator=gen) < p / beta
                pos = torch.nonzero(keep).squeeze(1)
                incl = torch.clamp(p[pos], max=beta)
                sel_scores = scores[pos.to(X.device)]
            idx = cand[pos].to(X.device)
            a = incl.to(device=X.device, dtype=work)
            levels.append(
                {
                    "lam": lam_h,
                    "candidates": int(cand.numel()),
                    "draws": int(pos.numel()),
                    "centers": int(idx.numel()),
                    "d_eff": d_h,
                }
            )
            lam_prev = lam_h
            if stop:
                path = path[:h]
                break
        if idx.numel() == 0:
            raise ValueError(
                "bless-r selected no centers at the final lambda; increase q2 or pass n_centers explicitly"
            )
        return BlessResult(
            indices=idx,
            a=a.to(X.dtype),
            weights=center_weights(a, n).to(X.dtype),
            counts=torch.ones(idx.numel(), dtype=torch.long, device=X.device),
            leverage_scores=sel_scores.to(X.dtype),
            d_eff=d_h,
            lambda_path=list(path),
            levels=levels,
        )


# ---------------------------------------------------------------------------------------------- plugins
def _selector_lam(request: SelectionRequest, options: dict[str, Any]) -> float:
    lam = options.get("lam")
    if lam is None:
        return request.lam
    return _positive(lam, "lam")


class _BlessFamilySelector:
    """Adapter from the selector contract to :func:`bless` / :func:`bless_r`.

    The option names are exactly the keyword arguments of ``run`` besides the data, so one
    ``select`` serves both algorithms.
    """

    def __init__(self, run, option_defaults: dict[str, Any]):
        self._run = run
        self.option_defaults = option_defaults

    def select(self, request: SelectionRequest) -> Centers:
        options = dict(request.options)
        lam = _selector_lam(request, options)
        options.pop("lam", None)
        result = self._run(
            request.X,
            request.kernel,
            lam,
            n_centers=request.n_centers,
            generator=request.generator,
            **options,
        )
        return result.to_centers(request.X)


BlessSelector = _BlessFamilySelector(
    bless,
    {"q": 2.0, "t": 1.0, "q1": 2.0, "q2": 3.0, "lam": None, "early_stop": True, "linalg_dtype": "float64"},
)
"""Selector ``bless``: :func:`bless` (Alg. 1) at ``request.lam`` (or the ``lam`` option)."""

BlessRSelector = _BlessFamilySelector(
    bless_r,
    {
        "q": 2.0,
        "t": 1.0,
        "q2": 3.0,
        "lam": None,
        "score_lambda": "current",
        "early_stop": True,
        "linalg_dtype": "float64",
    },
)
"""Selector ``bless-r``: :func:`bless_r` (Alg. 2) at ``request.lam`` (or the ``lam`` option)."""


@kgp.hookimpl
def register_selectors(register) -> None:
    register("bless", BlessSelector)
    register("bless-r", BlessRSelector)
