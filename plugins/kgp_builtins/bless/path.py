"""The lambda path that BLESS (Alg. 1) and BLESS-R (Alg. 2) share, and the driver that walks it.

Both algorithms of Rudi, Calandriello, Carratino and Rosasco (NeurIPS 2018) start from
``lambda_0 = kappa^2 / min(t, 1)`` (``kappa^2 = max_i K_ii``) and sweep ``lambda_h = lambda_0 / q^h``
down to the target lambda, ``H = ceil(log(lambda_0 / lambda) / log q)`` levels; at level h they
score candidates with eq. 3 against the dictionary (J_{h-1}, A_{h-1}) of the level before and draw
(J_h, A_h). Only the per-level draw differs (Alg. 1 lines 4-10, Alg. 2 lines 4-13): :func:`run_path`
does everything else once (setup, level bookkeeping, the ``n_centers`` / ``early_stop`` stopping
rule, packaging the :class:`~.result.BlessResult`) and calls the algorithm's ``draw_level`` per level.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gpytorch
import torch
from torch import Tensor

from kgp.operators import kernel_operator

from .checks import as_generator, check_n_centers, work_dtype
from .result import BlessResult, center_weights
from .scores import ScoreEstimator


def _lambda_path(lam0: float, lam: float, q: float) -> list[float]:
    """Geometric path from lam0 / q' down to exactly lam, with q' <= q and H = ceil(log(lam0/lam)/log q)."""
    if lam0 <= lam:
        return [lam]
    h_levels = max(1, math.ceil(math.log(lam0 / lam) / math.log(q) - 1e-12))
    return [lam0 * (lam / lam0) ** (h / h_levels) for h in range(1, h_levels + 1)]


def _kappa2(X: Tensor, kernel, shard: Any = None) -> float:
    """``max_i K_ii`` over all rows (all ranks' rows in a distributed selection)."""
    local = float(kernel_operator(kernel, X).diagonal().max()) if X.shape[0] else 0.0  # K_ii >= 0
    return local if shard is None else float(shard.gather_rows([local]).max())


@dataclass(frozen=True)
class Sweep:
    """What every level of one run sees: the data, the request and the constants of the path."""

    X: Tensor
    kernel: gpytorch.kernels.Kernel
    n_centers: int | None
    early_stop: bool
    q2: float
    generator: torch.Generator
    work_dtype: torch.dtype
    kappa2: float
    # distributed selection (kgp.distributed): X is this rank's rows; indices are global row numbers
    shard: Any = None

    @property
    def n(self) -> int:
        """Rows of the data set (all ranks' rows in a distributed selection)."""
        return self.X.shape[0] if self.shard is None else self.shard.n_total

    def estimator(self, indices: Tensor, a: Tensor, lam: float) -> ScoreEstimator:
        """Eq. 3 at ``lam`` for the dictionary (J, A) = (indices, diag a)."""
        return ScoreEstimator(self.X, self.kernel, indices, a, lam, self.work_dtype, self.shard)

    def stops(self, level: Level, d_eff: float) -> bool:
        """Whether ``n_centers`` are drawn at this level: the last one, or with ``early_stop`` the first
        whose ``q2 d_h`` reaches ``n_centers`` (the paper's lambda_bless >= lambda practice, Sec. 4)."""
        return self.n_centers is not None and (level.last or (self.early_stop and self.q2 * d_eff >= self.n_centers))


@dataclass(frozen=True)
class Level:
    """Level h of the path: ``lam`` = lambda_h, ``lam_prev`` = lambda_{h-1} (at h = 1: max(lambda_0, lambda_1))."""

    h: int
    lam: float
    lam_prev: float
    last: bool
    # n_centers given and this level may be the one that draws them: enough candidates are needed
    may_stop: bool


@dataclass(frozen=True)
class LevelDraw:
    """What one level drew: the dictionary (J_h, A_h) and its bookkeeping."""

    indices: Tensor  # J_h, distinct, on X's device
    a: Tensor  # diagonal of A_h, in the working dtype
    counts: Tensor  # draws per center (ones without replacement)
    scores: Tensor  # l~ of the selected centers, as they were sampled
    d_eff: float  # d_h (NaN where the level did not score at lambda_h)
    candidates: int  # |U_h|
    draws: int
    stop: bool


DrawLevel = Callable[[Sweep, Level, Tensor, Tensor], LevelDraw]


def run_path(
    name: str,
    X: Tensor,
    kernel: gpytorch.kernels.Kernel,
    lam: float,
    *,
    n_centers: int | None,
    q: float,
    t: float,
    q2: float,
    early_stop: bool,
    generator: torch.Generator | int | None,
    linalg_dtype: str,
    draw_level: DrawLevel,
    shard: Any = None,
) -> BlessResult:
    """Walk the lambda path, calling ``draw_level(sweep, level, J_{h-1}, diag A_{h-1})`` at each level.

    ``name`` ("bless" / "bless-r") names the algorithm in errors. The other arguments are those of
    :func:`~.algorithms.bless`; ``lam`` and the options are already checked.

    Distributed (``shard``): every random draw is over global row numbers from the shared generator,
    so every rank walks the same path and draws the same centers as one process holding all rows;
    the ranks only sum their rows' scores (:class:`~.scores.ScoreEstimator`) and ``max K_ii``.
    """
    n = X.shape[0] if shard is None else shard.n_total
    n_centers = check_n_centers(n_centers, n)
    gen = as_generator(generator)
    work = work_dtype(X, linalg_dtype)
    with torch.no_grad():
        kappa2 = _kappa2(X, kernel, shard)
        lam0 = kappa2 / min(t, 1.0)
        path = _lambda_path(lam0, lam, q)
        sweep = Sweep(X, kernel, n_centers, early_stop, q2, gen, work, kappa2, shard)
        idx = torch.empty(0, dtype=torch.long, device=X.device)
        a = torch.empty(0, dtype=work, device=X.device)
        levels: list[dict[str, float]] = []
        lam_prev = max(lam0, path[0])
        for h, lam_h in enumerate(path, start=1):
            last = h == len(path)
            level = Level(h, lam_h, lam_prev, last, may_stop=n_centers is not None and (last or early_stop))
            draw = draw_level(sweep, level, idx, a)
            idx, a = draw.indices, draw.a
            levels.append(
                {
                    "lam": lam_h,
                    "candidates": draw.candidates,
                    "draws": draw.draws,
                    "centers": int(idx.numel()),
                    "d_eff": draw.d_eff,
                }
            )
            lam_prev = lam_h
            if draw.stop:
                path = path[:h]
                break
        if idx.numel() == 0:
            raise ValueError(
                f"{name} selected no centers at the final lambda; increase q2 or pass n_centers explicitly"
            )
        return BlessResult(
            indices=idx,
            a=a.to(X.dtype),
            weights=center_weights(a, n).to(X.dtype),
            counts=draw.counts,
            leverage_scores=draw.scores.to(X.dtype),
            d_eff=draw.d_eff,
            lambda_path=list(path),
            levels=levels,
        )
