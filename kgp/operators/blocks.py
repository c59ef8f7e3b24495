"""Row-block planning: how many rows of a kernel matrix one block holds.

The block loop is the unit a distributed backend would shard: every product in
:mod:`kgp.operators.kernel_operator` is a loop over ``row_slices(start, stop, rows)`` whose partial
results are either written to disjoint output rows (K v) or summed (K^T u, K^T (K v + w)). Giving
each rank its own ``[start, stop)`` and all-reducing the sums is all a sharded version needs.
"""

from __future__ import annotations

from typing import Iterator

from .. import settings

__all__ = ["plan_block_rows", "row_slices", "CACHE_FRIENDLY_ELEMENTS"]

CACHE_FRIENDLY_ELEMENTS = 1_000_000
"""Preferred kernel-block size in elements.

Measured on the 2-core development machine (docs/backend.md): at M = 2000 a pass is fastest with
500-1000-row blocks, where the block stays in cache between the GEMM, the nonlinearity and the
two products; 10k-row blocks were 1.6x slower."""


def plan_block_rows(n_rows: int, n_cols: int, itemsize: int, buffers: int = 1) -> int:
    """Rows per block for an ``n_rows x n_cols`` kernel matrix.

    Parameters
    ----------
    n_rows, n_cols:
        Shape of the (virtual) kernel matrix.
    itemsize:
        Bytes per element (4 for float32, 8 for float64).
    buffers:
        Number of block-sized buffers the kernel needs at once.

    Returns
    -------
    int
        ``settings.block_rows`` if set, else the cache-friendly size capped by the memory budget.

    Raises
    ------
    MemoryError
        If not even one row fits :data:`kgp.settings.memory_budget`.
    """
    forced = settings.block_rows.value()
    budget = settings.memory_budget.value()
    per_row = max(1, n_cols) * itemsize * buffers
    by_budget = budget // per_row
    if by_budget < 1:
        raise MemoryError(
            f"kgp.settings.memory_budget={budget} bytes cannot hold one row of a kernel block with "
            f"{n_cols} columns ({per_row} bytes); raise the budget"
        )
    if forced is not None:
        return max(1, min(forced, n_rows, by_budget))
    preferred = max(64, CACHE_FRIENDLY_ELEMENTS // max(1, n_cols))
    return max(1, min(n_rows, by_budget, preferred))


def row_slices(start: int, stop: int, rows: int) -> Iterator[slice]:
    """Consecutive slices of at most ``rows`` rows covering ``[start, stop)``."""
    for lo in range(start, stop, rows):
        yield slice(lo, min(lo + rows, stop))
