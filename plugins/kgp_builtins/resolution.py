"""How much of the kernel the Nystrom centers resolve, measured on a few rows, and the warning when little.

A Nystrom solver (FALKON, EigenPro 3.0) fits ``f = sum_j alpha_j k(., z_j)``: only functions in the span
of the M centers' kernel columns. Where the kernel varies faster than the centers are spread (short
lengthscales, many dimensions), that span misses most of it, and with fixed hyperparameters the fit is far
below the exact solve's with no other sign (kin40k, 2,400 rows, lengthscale 1 on standardised inputs, the
default 245 centers: test R^2 0.47 against 0.87). The part of the prior variance the centers leave out at a
row x is the Nystrom residual ``k(x, x) - k_xM K_MM^{-1} k_Mx`` (the diagonal of ``K_nn - K_nM K_MM^{-1}
K_Mn``; Williams & Seeger 2001). Its mean over ``SAMPLE_ROWS`` rows spread over the data, relative to the
mean of ``k(x, x)``, estimates ``tr(K_nn - K_nM K_MM^{-1} K_Mn) / tr(K_nn)``: on the kin40k rows above 0.75
(245 centers) and 0.36 (1,000 centers, R^2 0.78); at lengthscale 2, 0.12 (R^2 0.67 against 0.93) and 0.015
(1,000 centers, R^2 0.90).

:func:`warn_if_under_resolved` warns (:class:`kgp.AccuracyWarning`) when that fraction is at least
``TRACE_LIMIT`` and the mean residual at least ``NOISE_MULTIPLE`` times the noise variance (a residual
under the noise costs the fit little), naming the remedy: more centers, or learned hyperparameters. It
uses the solver's own factor of ``K_MM`` (no second ``M^3`` factorization): ``r M^2`` flops for ``r``
rows, and one ``r x M`` kernel block within ``kgp.settings.memory_budget``. It applies to learned
hyperparameters too (a learned noise is usually large enough to keep the residual below it); it is skipped in
a distributed fit (the rows are spread over ranks) and where there are at least as many centers as rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kgp import settings
from kgp.plugin import Problem
from kgp.safeguards import warn_accuracy

__all__ = ["NOISE_MULTIPLE", "SAMPLE_ROWS", "TRACE_LIMIT", "unresolved_fraction", "warn_if_under_resolved"]

SAMPLE_ROWS = 256
TRACE_LIMIT = 0.05
NOISE_MULTIPLE = 3.0
_FEWEST_ROWS = 16  # fewer sample rows than this (a tiny memory budget): no estimate


def unresolved_fraction(
    problem: Problem, Z: Tensor, whiten: Callable[[Tensor], Tensor]
) -> tuple[float, float, int] | None:
    """``(fraction, mean residual, rows)``: the estimated ``tr(K - Q) / tr(K)`` and the mean of ``k - q`` on
    the sample rows, or None where no estimate is made.

    ``whiten(K_Mr)`` maps an ``M x r`` float64 block of kernel columns to ``W`` with
    ``k_xM K_MM^{-1} k_Mx = ||W[:, x]||^2`` (the solver's factor of ``K_MM``, jitter included: with it the
    residual is overestimated by about the jitter, far below ``TRACE_LIMIT``).
    """
    X = problem.X
    n, m = X.shape[0], Z.shape[0]
    budget_rows = settings.memory_budget.value(X.device) // (8 * max(m, 1))
    rows = min(SAMPLE_ROWS, n, budget_rows)
    if rows < _FEWEST_ROWS or m >= n:
        return None
    # evenly spaced rows: deterministic, no draw from problem.generator (the solver's stream stays as it was)
    index = torch.linspace(0, n - 1, rows, device=X.device).round().long()
    sample = X[index]
    with torch.no_grad():
        k_sm = problem.kernel_operator(sample, Z).to_dense().to(torch.float64)
        diagonal = problem.kernel(sample, diag=True).detach().to(torch.float64).reshape(-1)
        explained = whiten(k_sm.mT).square().sum(0)
    residual = (diagonal - explained).clamp_min(0.0)
    total = float(diagonal.sum())
    if not total > 0:
        return None
    return float(residual.sum()) / total, float(residual.mean()), rows


def warn_if_under_resolved(owner: str, problem: Problem, Z: Tensor, whiten: Callable[[Tensor], Tensor]) -> None:
    """Warn when the centers clearly under-resolve the kernel on these data (see the module docstring)."""
    if problem.shard is not None:
        return
    measured = unresolved_fraction(problem, Z, whiten)
    if measured is None:
        return
    fraction, mean_residual, rows = measured
    noise = float(problem.noise)
    if fraction < TRACE_LIMIT or mean_residual < NOISE_MULTIPLE * noise:
        return
    m, n = Z.shape[0], problem.n
    warn_accuracy(
        f"{owner}: the {m:,} Nystrom centers resolve the kernel poorly on these data: on {rows} rows spread over "
        f"the training set they leave {fraction:.0%} of the kernel's trace unexplained (tr(K_nn - K_nM K_MM^-1 "
        f"K_Mn) / tr(K_nn)), {mean_residual / noise:.3g}x the noise variance, so the fit can be far less "
        f"accurate than the exact solve. Remedy: more centers (n_centers={min(n, 4 * m):,}, or as many as "
        "memory allows), or learned hyperparameters (learn='auto'), whose lengthscales and noise match what "
        "the centers can resolve",
        stacklevel=3,
    )
