"""What both solvers do with their iterates: tail averaging, the divergence check, the targets.

Tail (Polyak-Ruppert) averaging is not in the EigenPro papers: constant-step SGD hovers around a
non-interpolating optimum (ridge, p << n), and the mean of the iterates of the last epochs removes
that noise floor (measurements in docs/solvers/eigenpro.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp.plugin import Problem

__all__ = ["TailAverage", "check_finite", "checked_targets"]


class TailAverage:
    """Running mean of the iterates (tail averaging), switched on for the last epochs."""

    def __init__(self, alpha: Tensor):
        self.alpha = alpha
        self.mean = torch.zeros_like(alpha)
        self.count = 0

    def __call__(self) -> None:
        self.count += 1
        self.mean.add_(self.alpha - self.mean, alpha=1.0 / self.count)

    def current(self) -> Tensor:
        return self.mean if self.count else self.alpha


def checked_targets(problem: Problem) -> Tensor:
    y = problem.y
    if y.dim() != 2 or y.shape[0] != problem.n:
        raise ValueError(f"eigenpro: expected y of shape (n, k) with n={problem.n}, got {tuple(y.shape)}")
    return y


def check_finite(alpha: Tensor, epoch: int, name: str) -> None:
    """Raise ``FloatingPointError`` (as kgp's other iterative solvers do on divergence) on a non-finite iterate."""
    if not bool(torch.isfinite(alpha).all()):
        raise FloatingPointError(
            f"{name}: the iteration diverged at epoch {epoch}; lower solver_options['lr_scale'] "
            "or increase 'subsample_size' (better eigenvalue estimates)"
        )
