"""Row-block planning: how many rows of a kernel matrix one block holds.

The block loop is the unit a distributed backend would shard: every product in
:mod:`kgp.operators.kernel_operator` is a loop over ``row_slices(start, stop, rows)`` whose partial
results are either written to disjoint output rows (K v) or summed (K^T u, K^T (K v + w)). Giving
each rank its own ``[start, stop)`` and all-reducing the sums is all a sharded version needs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .. import settings

__all__ = ["plan_block_rows", "row_slices", "CPU_BLOCK_BYTES", "ACCELERATOR_BLOCK_BYTES"]

CPU_BLOCK_BYTES = 64 * 2**20
"""Preferred kernel-block size in bytes on the CPU.

Measured with benchmarks/bench_block_size.py on a 2-core Intel Xeon host (quiet,
two threads, ``OMP_WAIT_POLICY=PASSIVE`` as the kgp command, the Makefile and CI set it): a streamed
``K^T (K v)`` pass with 64 MiB blocks took 0.63-0.71x the time of 8 MB (cache-sized) blocks on
five shapes in both dtypes (n = 32,000-200,000, M = 500-20,000, d = 8-28); 32 and 128 MiB were 0.71-0.81x.
The cost the larger block removes is per block, not per byte: every torch op of a block is a parallel
region, and passive OpenMP threads sleep between regions, so their wake-up (tens of microseconds) was paid
several times per block, thousands of blocks per pass. With spinning threads (``OMP_WAIT_POLICY`` unset)
the 8 MB blocks were faster than with passive ones, and 64 MiB still 0.94x of them, so the larger block
wins under both policies (docs/benchmarks/kernel-pass.md)."""

ACCELERATOR_BLOCK_BYTES = 256 * 2**20
"""Preferred kernel-block size in bytes on a device other than the CPU (a GPU).

A GPU gains nothing from cache-sized blocks (its L2 holds tens of MB and every block costs several
kernel launches of ~5-10 us each): 8 MB blocks on an H100-class card move their bytes in ~4 us, so
launches would dominate (5-5.7x slower than 256 MiB on an H200). At 256 MiB a block's memory traffic
(~0.1 ms at 3-4 TB/s) dwarfs the launches while a 1e6 x 10,000 float32 pass still streams in ~150
blocks, far under the memory budget. Measured on the card in docs/backend.md ("On a GPU")."""


def plan_block_rows(
    n_rows: int, n_cols: int, itemsize: int, buffers: int = 1, device: torch.device | str | None = None
) -> int:
    """Rows per block for an ``n_rows x n_cols`` kernel matrix.

    Parameters
    ----------
    n_rows, n_cols:
        Shape of the (virtual) kernel matrix.
    itemsize:
        Bytes per element (4 for float32, 8 for float64).
    buffers:
        Number of block-sized buffers the kernel needs at once.
    device:
        Where the blocks live: the CPU (or None) prefers :data:`CPU_BLOCK_BYTES`, any other device
        :data:`ACCELERATOR_BLOCK_BYTES`.

    Returns
    -------
    int
        ``settings.block_rows`` if set, else the device's preferred size capped by the memory budget.

    Raises
    ------
    MemoryError
        If not even one row fits :data:`kgp.settings.memory_budget`.
    """
    forced = settings.block_rows.value()
    budget = settings.memory_budget.value(device)
    per_row = max(1, n_cols) * itemsize * buffers
    by_budget = budget // per_row
    if by_budget < 1:
        raise MemoryError(
            f"kgp.settings.memory_budget={budget} bytes cannot hold one row of a kernel block with "
            f"{n_cols} columns ({per_row} bytes); raise the budget"
        )
    if forced is not None:
        return max(1, min(forced, n_rows, by_budget))
    on_cpu = device is None or torch.device(device).type == "cpu"
    target = CPU_BLOCK_BYTES if on_cpu else ACCELERATOR_BLOCK_BYTES
    preferred = max(64, target // (max(1, n_cols) * itemsize))
    return max(1, min(n_rows, by_budget, preferred))


def row_slices(start: int, stop: int, rows: int) -> Iterator[slice]:
    """Consecutive slices of at most ``rows`` rows covering ``[start, stop)``."""
    for lo in range(start, stop, rows):
        yield slice(lo, min(lo + rows, stop))
