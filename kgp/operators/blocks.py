"""Row-block planning: how many rows of a kernel matrix one block holds.

The block loop is the unit a distributed backend would shard: every product in
:mod:`kgp.operators.kernel_operator` is a loop over ``row_slices(start, stop, rows)`` whose partial
results are either written to disjoint output rows (K v) or summed (K^T u, K^T (K v + w)). Giving
each rank its own ``[start, stop)`` and all-reducing the sums is all a sharded version needs.
"""

from __future__ import annotations

from collections.abc import Iterator

from .. import settings

__all__ = ["plan_block_rows", "row_slices", "CACHE_FRIENDLY_BYTES"]

CACHE_FRIENDLY_BYTES = 8_000_000
"""Preferred kernel-block size in bytes (1000 rows in float32, 500 in float64 at M = 2000).

Measured with benchmarks/bench_backend.py on the 2-core development machine (docs/backend.md), at
n = 1e5, M = 2000, d = 10, three runs: float64 was fastest with 500-row blocks in all three, float32
with 1000-row blocks in two (9% and 15% ahead of 500 rows) and 5% behind 500 rows in the third;
5000-row blocks were 1.1-1.4x slower (the block no longer stays in cache between the GEMM, the
nonlinearity and the two products). A byte size matches both dtypes' optimum."""


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
    preferred = max(64, CACHE_FRIENDLY_BYTES // (max(1, n_cols) * itemsize))
    return max(1, min(n_rows, by_budget, preferred))


def row_slices(start: int, stop: int, rows: int) -> Iterator[slice]:
    """Consecutive slices of at most ``rows`` rows covering ``[start, stop)``."""
    for lo in range(start, stop, rows):
        yield slice(lo, min(lo + rows, stop))
