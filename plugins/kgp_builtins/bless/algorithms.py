"""BLESS (Algorithm 1) and BLESS-R (Algorithm 2) of Rudi, Calandriello, Carratino and Rosasco (NeurIPS 2018).

Both sweep the decreasing path ``lambda_h = lambda_0 / q^h`` from ``lambda_0 = kappa^2 / min(t, 1)``
down to the target lambda, scoring points at each level with eq. 3 (:mod:`.scores`) against the
dictionary (J_{h-1}, A_{h-1}) of the level before.

Conventions: ``lam`` is the FALKON/BLESS per-sample lambda = sigma^2 / n (``request.lam``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .checks import check_inputs
from .options import BLESS_OPTIONS, BLESS_R_OPTIONS, parse_options
from .path import Level, LevelDraw, Sweep, run_path
from .result import BlessResult


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
    early_stop: bool = True,
    generator: torch.Generator | int | None = None,
    linalg_dtype: str = "float64",
    shard: Any = None,
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
        None: ``M_H = ceil(q2 d_H)`` draws as in the paper. Given: at the final level (see
        ``early_stop``), draw i.i.d. from P_H until exactly ``n_centers`` distinct centers are found
        (multiplicities kept in A and D); earlier levels are unchanged.
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
        Only with ``n_centers``. True (default): stop the path at the first lambda_h with
        ``q2 d_h >= n_centers`` and draw the centers there, i.e. choose ``lambda_bless >= lam`` so that
        d_eff matches the requested M, as the paper does for FALKON-BLESS (Sec. 4); cost then stays
        ~ n_centers^2 / lambda_h. False: run the whole path and draw the centers at ``lam``.
    generator:
        ``torch.Generator`` (CPU) or int seed for every random draw; None: torch's default seed.
    linalg_dtype:
        ``"float64"`` (default) or ``"input"``: dtype of the |J| x |J| factorisation and solves.
    shard:
        None, or a :class:`kgp.distributed.Shard`: ``X`` is this rank's rows (possibly none) of a
        row-sharded data set; every rank must call with the same arguments otherwise and gets the
        centers one process would select from all rows (``indices`` are global row numbers).

    Returns
    -------
    BlessResult
    """
    lam = check_inputs(X, kernel, lam, allow_empty=shard is not None)
    options = parse_options(
        "bless()", BLESS_OPTIONS, q=q, t=t, q1=q1, q2=q2, early_stop=early_stop, linalg_dtype=linalg_dtype
    )
    draw_level = functools.partial(_bless_level, q1=options.pop("q1"))
    return run_path(
        "bless", X, kernel, lam, n_centers=n_centers, generator=generator, draw_level=draw_level, shard=shard, **options
    )


def _bless_level(sweep: Sweep, level: Level, idx: Tensor, a: Tensor, *, q1: float) -> LevelDraw:
    """Alg. 1, lines 4-10: R_h uniform candidates, scores against (J_{h-1}, A_{h-1}), M_h draws from P_h."""
    X, n, gen, work = sweep.X, sweep.n, sweep.generator, sweep.work_dtype
    r = math.ceil(q1 * min(sweep.kappa2 / level.lam, n))
    if level.may_stop:  # enough distinct candidates to draw n_centers distinct centers from
        r = max(r, 2 * sweep.n_centers)
    if r >= n:  # a full pass is the R_h = n limit without the duplicate noise
        r, cand = n, torch.arange(n)
    else:
        cand = torch.randint(0, n, (r,), generator=gen)
    est = sweep.estimator(idx, a, level.lam)
    scores = est(cand.to(X.device))
    d_h = float(n / r * scores.sum())
    stop = sweep.stops(level, d_h)
    if stop and r < n and torch.unique(cand).numel() < sweep.n_centers:
        r, cand = n, torch.arange(n)
        scores = est(cand.to(X.device))
        d_h = float(scores.sum())
    p = (scores / scores.sum()).cpu()
    if stop:
        pos = _draw_until_distinct(p, cand, sweep.n_centers, gen)
    else:
        pos = torch.multinomial(p, max(1, math.ceil(sweep.q2 * d_h)), replacement=True, generator=gen)
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
    return LevelDraw(
        indices=uniq.to(X.device),
        a=(r * n_draws / n) * p_sel / counts.to(device=X.device, dtype=work),
        counts=counts.to(X.device),
        scores=scores[first_pos.to(X.device)],
        d_eff=d_h,
        candidates=r,
        draws=n_draws,
        stop=stop,
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
    early_stop: bool = True,
    generator: torch.Generator | int | None = None,
    linalg_dtype: str = "float64",
    shard: Any = None,
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
        None: |J_H| is random with mean ~ q2 d_eff(lam). Given: at the final level (see
        ``early_stop``), exactly ``n_centers`` points are drawn without replacement from U_H with
        probability proportional to their scores; A then holds the first-order inclusion
        probabilities ``beta_H min(n_centers l~_j / sum_U l~, 1)``.
    early_stop:
        As in :func:`bless` (default True).

    The other parameters (``shard`` included) are those of :func:`bless`. When ``p_{h,j} > beta_h`` the inclusion
    probability ``p / beta`` is clipped at 1, so the realised probability (and the A entry) is
    ``min(p, beta)``.

    Returns
    -------
    BlessResult
        ``d_eff`` is the Horvitz-Thompson estimate ``sum_{U_H} l~(x, lam) / beta_H``.
    """
    lam = check_inputs(X, kernel, lam, allow_empty=shard is not None)
    options = parse_options(
        "bless_r()",
        BLESS_R_OPTIONS,
        q=q,
        t=t,
        q2=q2,
        score_lambda=score_lambda,
        early_stop=early_stop,
        linalg_dtype=linalg_dtype,
    )
    draw_level = functools.partial(_bless_r_level, score_lambda=options.pop("score_lambda"))
    return run_path(
        "bless-r",
        X,
        kernel,
        lam,
        n_centers=n_centers,
        generator=generator,
        draw_level=draw_level,
        shard=shard,
        **options,
    )


def _bless_r_level(sweep: Sweep, level: Level, idx: Tensor, a: Tensor, *, score_lambda: str) -> LevelDraw:
    """Alg. 2, lines 4-13: Bernoulli(beta_h) candidates, scores against (J_{h-1}, A_{h-1}), Bernoulli inclusion."""
    X, n, gen = sweep.X, sweep.n, sweep.generator
    beta = min(sweep.q2 * sweep.kappa2 / (level.lam * n), 1.0)
    if level.may_stop:  # enough candidates to draw n_centers distinct centers from
        beta = max(beta, min(1.0, 2.0 * sweep.n_centers / n))
    cand = torch.arange(n) if beta >= 1.0 else torch.nonzero(torch.rand(n, generator=gen) < beta).squeeze(1)
    lam_score = level.lam if score_lambda == "current" else level.lam_prev
    est = sweep.estimator(idx, a, lam_score)
    scores = est(cand.to(X.device))
    scores_h = scores if score_lambda == "current" else None
    if score_lambda == "previous" and (level.last or level.may_stop):  # d_eff(lambda_h) needs scores at lambda_h
        est = sweep.estimator(idx, a, level.lam)
        scores_h = est(cand.to(X.device))
    d_h = float(scores_h.sum() / beta) if scores_h is not None else float("nan")
    stop = sweep.stops(level, d_h)
    if stop and cand.numel() < sweep.n_centers:
        beta, cand = 1.0, torch.arange(n)
        scores_h = scores = est(cand.to(X.device))
        d_h = float(scores_h.sum())
    if stop:
        w = scores_h.cpu()
        pos = torch.multinomial(w, sweep.n_centers, replacement=False, generator=gen)
        incl = beta * torch.clamp(sweep.n_centers * w[pos] / w.sum(), max=1.0)
        sel_scores = scores_h[pos.to(X.device)]
    else:
        p = torch.clamp(sweep.q2 * scores.cpu(), max=1.0)
        keep = torch.rand(cand.numel(), generator=gen) < p / beta
        pos = torch.nonzero(keep).squeeze(1)
        incl = torch.clamp(p[pos], max=beta)
        sel_scores = scores[pos.to(X.device)]
    indices = cand[pos].to(X.device)
    return LevelDraw(
        indices=indices,
        a=incl.to(device=X.device, dtype=sweep.work_dtype),
        counts=torch.ones(indices.numel(), dtype=torch.long, device=X.device),
        scores=sel_scores,
        d_eff=d_h,
        candidates=int(cand.numel()),
        draws=int(pos.numel()),
        stop=stop,
    )
