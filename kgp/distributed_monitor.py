"""The progress monitor of a distributed fit: one stop decision and one validation metric for all ranks."""

from __future__ import annotations

from typing import Any

from .distributed import Shard
from .monitor import Monitor

__all__ = ["ShardedMonitor"]


class ShardedMonitor(Monitor):
    """A :class:`kgp.Monitor` whose stop decision and validation metric are shared by all ranks.

    Stop: if one rank's callback stops, all stop. Without this a callback that stops on one rank
    only (a time limit) would leave the other ranks waiting in the next pass. Costs one scalar
    all-reduce per iteration.

    Validation: each rank may hold its own validation rows (or none); the metric reported on every
    rank is that of all ranks' validation rows together, ``sum_r n_r m_r / sum_r n_r`` with ``m_r``
    the metric on rank r's ``n_r`` rows: exact for a metric that is a mean over rows (the built-in
    mean squared error and error rate). One more all-reduce of two numbers per iteration.
    """

    def __init__(self, shard: Shard, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shard = shard
        # every rank must join the metric's all-reduce, ranks without validation rows included
        self._validation_anywhere = shard.any(self.validation is not None)

    @property
    def wants_predictor(self) -> bool:
        return self._validation_anywhere

    def _validation_metric(self, predictor) -> float | None:
        if not self._validation_anywhere:
            return None
        rows = 0 if self.validation is None or predictor is None else self.validation[0].shape[0]
        local = super()._validation_metric(predictor) if rows else 0.0
        weighted, total = self.shard.sum_floats(local * rows, rows)
        return weighted / total if total else None

    def step(self, iteration: int, predictor=None, **extras: Any) -> bool:
        return self.shard.any(super().step(iteration, predictor, **extras))
