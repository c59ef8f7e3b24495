"""The reductions of a distributed ``dsg`` fit over ranks (identities in a local one)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Sums"]


class Sums:
    """The reductions of a distributed fit (``problem.shard``), identities in a local one.

    A distributed run draws the same global permutation and features on every rank (the problem's
    generator and the model seed are shared), so each step's batch is a set of global row numbers;
    each rank computes its rows' part of every sum and the sums are added over the ranks. The
    ``r x r`` solves, the coefficients and the step-size schedule are replicated.
    """

    def __init__(self, shard: Any):
        self.shard = shard

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (in place)."""
        return t if self.shard is None else self.shard.all_reduce_(t)

    def floats(self, *values: float) -> list[float]:
        """Python numbers summed over the ranks."""
        return list(values) if self.shard is None else self.shard.sum_floats(*values)

    def batch(self, idx: torch.Tensor, full: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(positions in the batch, rows of X)`` of this rank's part of the batch ``idx`` (global rows).

        A full batch is all of this rank's rows in row order (the least-squares step uses ``Phi_all``
        itself; a gradient is a sum, whatever the order), at their global row numbers.
        """
        if self.shard is None:
            return None, idx
        if full:
            rows = torch.arange(self.shard.n_local, device=idx.device)
            return rows + self.shard.offset, rows
        return self.shard.local_rows(idx)
