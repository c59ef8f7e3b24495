"""The training rows of a fit and their communicator.

A single-process fit and a data-parallel fit (:mod:`kgp.distributed`) run the same stages: the only
difference is the communicator. :class:`LocalComm` does nothing (every sum is already global); a
:class:`ShardComm` sums over the ranks of a :class:`kgp.distributed.Shard`. Plugins keep receiving
``problem.shard`` (None in a single process), so that a plugin that is not distributed never sees one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import distributed as _dist

__all__ = ["LocalComm", "ShardComm", "TrainingRows"]


class LocalComm:
    """The communicator of a single-process fit: every collective is the identity."""

    shard = None
    rank = 0
    world_size = 1

    def __init__(self, n: int):
        self.n_total = n

    def all_reduce_(self, t: Tensor) -> Tensor:
        return t

    def broadcast_(self, t: Tensor) -> Tensor:
        return t

    def replicate_(self, tensors: Sequence[Tensor]) -> bool:
        return False

    def identical(self, tensors: Sequence[Tensor]) -> bool:
        return True

    def same_predictor(self, predictor: Any, kernel: Any) -> Any:
        return predictor


class ShardComm:
    """The communicator of a distributed fit: collectives over the ranks of ``shard``."""

    def __init__(self, shard: _dist.Shard):
        self.shard = shard
        self.rank = shard.rank
        self.world_size = shard.world_size
        self.n_total = shard.n_total

    def all_reduce_(self, t: Tensor) -> Tensor:
        return self.shard.all_reduce_(t)

    def broadcast_(self, t: Tensor) -> Tensor:
        return self.shard.broadcast_(t.to(self.shard._device())).to(t.device)

    def replicate_(self, tensors: Sequence[Tensor]) -> bool:
        return self.shard.replicate_(list(tensors))

    def identical(self, tensors: Sequence[Tensor]) -> bool:
        return self.shard.identical(list(tensors))

    def same_predictor(self, predictor: Any, kernel: Any) -> Any:
        """The fitted predictor, made bitwise identical on every rank (rank 0's where they differ)."""
        state = predictor.state_dict()
        names = [k for k, v in state.items() if isinstance(v, Tensor)]
        device = self.shard._device()
        moved = {k: state[k].to(device) for k in names}
        if not self.shard.replicate_(list(moved.values())):
            return predictor
        rebuilt = {**state, **{k: v.to(state[k].device) for k, v in moved.items()}}
        return type(predictor).from_state(rebuilt, kernel)


@dataclass
class TrainingRows:
    """The rows a fit works on: inputs ``X`` (n x d), targets ``Y`` (n x k, 2-D) and the communicator.

    In a distributed fit ``X`` and ``Y`` are this rank's rows and :attr:`n` counts all ranks' rows.
    """

    X: Tensor
    Y: Tensor
    comm: LocalComm | ShardComm

    @property
    def n(self) -> int:
        return self.comm.n_total

    @property
    def shard(self) -> _dist.Shard | None:
        return self.comm.shard

    def column_mean(self, Y: Tensor | None = None) -> Tensor:
        """Mean of each column of ``Y`` (default: the targets) over all ranks' rows."""
        Y = self.Y if Y is None else Y
        if self.comm.shard is None:
            return Y.mean(0)
        return self.comm.all_reduce_(Y.sum(0)).div_(self.n)

    def column_std(self, Y: Tensor, mean: Tensor) -> Tensor:
        """Standard deviation (no correction) of each column over all ranks' rows, about ``mean``."""
        if self.comm.shard is None:
            return Y.std(0, correction=0)
        return self.comm.all_reduce_((Y - mean).square().sum(0)).div_(self.n).sqrt_()


def comm_for(shard: _dist.Shard | None, n: int) -> LocalComm | ShardComm:
    """The communicator of a fit: :class:`ShardComm` for a shard, else :class:`LocalComm` of ``n`` rows."""
    return LocalComm(n) if shard is None else ShardComm(shard)


def broadcast_seed(comm: LocalComm | ShardComm, seed: int) -> int:
    """The seed of rank 0 on every rank (``random_state=None`` draws a different one on each)."""
    if comm.shard is None:
        return seed
    return int(comm.broadcast_(torch.tensor([seed], dtype=torch.int64)).item())
