"""Sizes of the dense blocks of ``eigenpro`` / ``eigenpro2`` from ``kgp.settings.memory_budget``.

Every dense kernel block either solver forms (the Nystrom matrix ``K(X_s, X_s)`` and its
eigenvectors, the held-out blocks of the curvature estimate, the minibatch rows of EigenPro 2.0)
is sized so that one block takes at most the budget, counted in float64 (the setup evaluates and
decomposes in float64 where the input is float32). Vectors of the model size (``alpha``, the
``p x q`` factors of the preconditioner) are not counted, as for every kgp solver.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kgp import settings

__all__ = ["ITEMSIZE", "block_rows", "budget_side", "kernel_diagonal"]

#: Bytes per entry the budget is counted in (float64: the setup's eigendecomposition and curvature).
ITEMSIZE = 8


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
