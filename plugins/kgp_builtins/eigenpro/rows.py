r"""Where EigenPro 3.0 reads its training rows: this process's X, or a row shard of a distributed fit.

A distributed fit (``problem.shard``, docs/scaling-out.md) runs the one-process algorithm on every
rank with the same random draws (the problem's generator is seeded alike on every rank), so each
draw names *global* row numbers:

- the Nystrom subsample S and the held-out sample H (s + h rows, a few thousand at most) are
  gathered onto every rank by one exact all-reduce (:meth:`Shard.take_rows`); everything computed
  from them (preconditioner, projection, curvature, batch size and step) is then replicated;
- each epoch's permutation is drawn over all n rows; a batch is split by who holds its rows
  (:meth:`Shard.local_rows`), every rank computes its rows' part of the batch sums
  ``K(Z, X_m) g`` (and ``E^T K(X_s, X_m) g`` for ``correction="paper"``), and the parts are
  summed by one all-reduce per batch, in float64 for float32 inputs.

In a local fit every method here is the identity on the one-process computation (the same
operations in the same order), so the local path is unchanged to the bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp.plugin import Problem

__all__ = ["Rows"]


class Rows:
    """The training rows of one EigenPro 3.0 fit and the sums over ranks it needs (identities locally).

    Parameters
    ----------
    problem:
        The fit's problem; ``problem.shard`` is None for a local fit.
    """

    def __init__(self, problem: Problem):
        self.X = problem.X
        self.y = problem.y
        self.shard = problem.shard
        #: rows of the global problem (all ranks' rows in a distributed fit)
        self.n = problem.n

    @property
    def distributed(self) -> bool:
        return self.shard is not None

    def sample(self, idx_s: Tensor, idx_h: Tensor, exact: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``(points, idx_s, idx_h)`` for :func:`~.nystrom.nystrom_preconditioner`: S and H as rows of ``points``.

        Locally ``points`` is X itself. Distributed, it holds the gathered rows only: every row when
        ``exact`` (H is every point, n <= a few thousand; ``idx_s``, ``idx_h`` unchanged), otherwise
        S then H (``idx_s = 0..s-1``, ``idx_h = s..s+h-1``). The caller passes the global n along.
        """
        if self.shard is None:
            return self.X, idx_s, idx_h
        if exact:
            return self.shard.take_rows(self.X, idx_h), idx_s, idx_h
        s, h = idx_s.numel(), idx_h.numel()
        points = self.shard.take_rows(self.X, torch.cat([idx_s, idx_h]))
        arange = torch.arange(s + h, device=idx_s.device)
        return points, arange[:s], arange[s:]

    def batch(self, b: Tensor) -> tuple[Tensor, Tensor]:
        """This process's rows of the batch ``b`` (global row numbers): ``(X_b, y_b)``, possibly empty."""
        if self.shard is None:
            return self.X[b], self.y[b]
        _, rows = self.shard.local_rows(b)
        return self.X[rows], self.y[rows]

    def sum_(self, t: Tensor) -> Tensor:
        """``t`` (this rank's part of a batch sum) summed over the ranks; float32 parts are added in float64.

        Returns ``t`` itself locally, a new tensor of ``t``'s dtype otherwise.
        """
        if self.shard is None:
            return t
        if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return self.shard.all_reduce_(t.to(torch.float64)).to(t.dtype)
        return self.shard.all_reduce_(t)

    def sum_float(self, value: float) -> float:
        """A Python number summed over the ranks (one 8-byte all-reduce)."""
        return value if self.shard is None else self.shard.sum_floats(value)[0]

    def mean_square(self) -> float:
        """``mean(y^2)`` over all ranks' rows and outputs."""
        if self.shard is None:
            return float(self.y.pow(2).mean())
        return self.sum_float(float(self.y.double().pow(2).sum())) / (self.n * self.y.shape[1])

    def replicate_(self, tensors: list[Tensor], q: int) -> None:
        """Make the replicated setup identical on every rank (rank 0's where the last bits differ).

        The batch size, the step and the preconditioner's rank ``q`` decide how many collectives an
        epoch issues and what they carry, so they must agree exactly. ``q`` fixes the shapes of the
        setup's tensors; a ``q`` that differs between ranks (a direction on a rounding knife-edge)
        cannot be repaired by a broadcast and is refused on every rank.
        """
        if self.shard is None:
            return
        qs = self.shard.gather_rows([q])[:, 0]
        if not bool((qs == qs[0]).all()):
            per_rank = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(qs.tolist()))
            raise RuntimeError(
                f"eigenpro: the ranks' preconditioners damp different numbers of directions q ({per_rank}): "
                "the replicated setup differs beyond rounding (different torch builds or BLAS thread counts on "
                "the ranks); run every rank with the same torch build and OMP_NUM_THREADS"
            )
        self.shard.replicate_(tensors)  # column-major LAPACK factors included
