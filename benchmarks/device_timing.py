"""Wall-clock timing that covers queued device work: shared by the benchmarks that take ``--device``."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued device work, so a host clock read after it covers the work (no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_time(run: Callable[[], object], reps: int, device: torch.device | str) -> float:
    """Best wall time of ``reps`` calls of ``run`` after one untimed warm-up call, each waiting for ``device``."""
    run()
    best = float("inf")
    for _ in range(max(1, reps)):
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
