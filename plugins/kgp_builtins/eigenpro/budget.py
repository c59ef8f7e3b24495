"""Sizes of the dense blocks of ``eigenpro`` / ``eigenpro2`` from ``kgp.settings.memory_budget``.

Every dense kernel block either solver forms (the Nystrom matrix ``K(X_s, X_s)`` and its
eigenvectors, the held-out blocks of the curvature estimate, the minibatch rows of EigenPro 2.0)
is sized so that one block takes at most the budget, counted in float64 (the setup evaluates and
decomposes in float64 where the input is float32). Vectors of the model size (``alpha``, the
``p x q`` factors of the preconditioner) are not counted, as for every kgp solver.

:func:`check_center_sizes` runs before the setup: the arrays of the model size (and ``K(Z, Z)``'s
factorization for ``projection="cholesky"``) must fit the device's available memory, and a fit whose epochs
form more than ``LONG_RUN_ENTRIES`` kernel entries is announced (:class:`kgp.CostWarning`) with its size.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from kgp import settings
from kgp.plugin import Problem
from kgp.safeguards import CostWarning, check_memory, format_bytes

__all__ = [
    "CHOLESKY_PEAK_ARRAYS",
    "ITEMSIZE",
    "LONG_RUN_ENTRIES",
    "block_rows",
    "budget_side",
    "check_center_sizes",
    "kernel_diagonal",
]

#: Bytes per entry the budget is counted in (float64: the setup's eigendecomposition and curvature).
ITEMSIZE = 8

#: Float64 ``p x p`` arrays alive at once while :class:`.projection.CholeskyProjection` forms its factor:
#: ``K(Z, Z)``, its jittered copy and the factor.
CHOLESKY_PEAK_ARRAYS = 3


def block_rows(cols: int, device: torch.device | None = None) -> int:
    """Most rows of a dense ``rows x cols`` float64 block on ``device`` within the budget (at least 1)."""
    return max(1, settings.memory_budget.value(device) // (ITEMSIZE * max(cols, 1)))


def budget_side(device: torch.device | None = None) -> int:
    """Largest ``k`` with a ``k x k`` float64 block on ``device`` within the budget (at least 1)."""
    return max(1, math.isqrt(settings.memory_budget.value(device) // ITEMSIZE))


def kernel_diagonal(kop, points: Tensor) -> Tensor:
    """Exact ``k(x, x)`` for every point, from square diagonal blocks within the budget."""
    step = min(512, budget_side(points.device))
    return torch.cat([kop(c, c).to_dense().diagonal() for c in points.split(step)])


#: Kernel entries over all epochs above which a fit is announced: about 3 minutes at the 5e8 entries per
#: second an EigenPro 3.0 epoch reached on a 2-core CPU (200,000 centers streamed for more than 14 minutes);
#: an accelerator is given 100 times more.
LONG_RUN_ENTRIES = {"cpu": 1e11, "accelerator": 1e13}


def check_center_sizes(
    owner: str,
    problem: Problem,
    p: int,
    q: int,
    projection: str,
    epochs: int,
    outputs: int,
    *,
    training_centers: bool = False,
) -> None:
    """Before the setup: refuse model-size arrays that cannot fit, and announce a very long run.

    Memory: ``K(Z, Z)`` for ``projection="cholesky"`` is evaluated, copied and factored in float64 (three
    ``p x p`` arrays at the peak, :class:`.projection.CholeskyProjection`), next to the ``p x q`` block
    ``K(Z, X_s) E`` and four ``p x k`` iterates. Time: every epoch forms ``K(X_m, Z)`` for all of its
    batches, ``n p`` entries. ``training_centers``: the centers are the training rows (EigenPro 2.0).
    """
    centers = f"its {p:,} training rows as centers" if training_centers else f"n_centers={p:,}"
    fewer = "solver='eigenpro' with fewer centers (n_centers)" if training_centers else "fewer centers (n_centers)"
    itemsize = problem.X.element_size()
    needed = p * q * itemsize + 4 * p * outputs * itemsize
    what = f"{owner} with {centers}: its {p:,} x {q} preconditioner block and iterates"
    remedy = fewer
    if projection == "cholesky":
        needed += CHOLESKY_PEAK_ARRAYS * p * p * ITEMSIZE
        what = f"{owner} with n_centers={p:,} and projection='cholesky': three float64 {p:,} x {p:,} arrays"
        remedy = "lower n_centers, or use solver_options={'projection': 'eigenpro2'} (no p x p matrix)"
    check_memory(needed, what=what, remedy=remedy, device=problem.device)
    entries = float(epochs) * problem.n * p
    kind = "cpu" if problem.device.type == "cpu" else "accelerator"
    if entries >= LONG_RUN_ENTRIES[kind]:
        warnings.warn(
            f"{owner}: {epochs} epochs over n={problem.n:,} rows with {centers} form {entries:.3g} kernel "
            f"entries ({problem.n * p:.3g} per epoch, K(X, Z) in batches; model arrays "
            f"{format_bytes(needed)}): expect a run of many minutes{' on this CPU' if kind == 'cpu' else ''}. "
            f"Remedy: {fewer}, fewer epochs (solver_options={{'epochs': ...}}), or an accelerator",
            CostWarning,
            stacklevel=4,
        )
