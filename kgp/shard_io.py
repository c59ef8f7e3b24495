"""Reading one rank's rows of a data file without loading the rest (``kgp fit --distributed``).

A ``.npy`` table (``n x (d + 1)``, target in one column, last by default) is memory-mapped and only
this rank's contiguous row range is copied into memory: rank r of p reads rows
``[r n // p, (r + 1) n // p)``, the split :func:`row_range` defines, so the shards concatenate to the
file in rank order (the global row order of :mod:`kgp.distributed`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["launched_rank", "load_rows", "row_range"]


def row_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of rank ``rank`` when ``n`` rows are split into ``world_size`` near-equal parts."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"row_range: expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank * n // world_size, (rank + 1) * n // world_size


def load_rows(path: str | os.PathLike, target: str | None, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's ``(X, y)`` rows of a ``.npy`` table, read through a memory map.

    Parameters
    ----------
    path:
        A ``.npy`` file holding a 2-D numeric array; one of its columns is the target.
    target:
        Column index of the target (negative counts from the end); None: the last column.
    rank, world_size:
        This process's place in the group (:func:`row_range` says which rows it reads).

    Raises
    ------
    ValueError
        Not a ``.npy`` file, not a 2-D numeric table, or a bad target column.
    FileNotFoundError
        If ``path`` does not exist.
    """
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"--data: no such file {path}")
    if file.suffix != ".npy":
        raise ValueError(
            f"--data: a distributed fit reads its own rows through a memory map and needs a .npy table "
            f"(n x (d + 1), target in one column), got {file.name}; convert with numpy.save"
        )
    table = np.load(file, mmap_mode="r", allow_pickle=False)
    if table.ndim != 2 or table.shape[1] < 2 or table.dtype.kind not in "iuf":
        raise ValueError(
            f"--data: expected a 2-D numeric table with at least 2 columns, got shape {table.shape} {table.dtype}"
        )
    if target is None:
        col = table.shape[1] - 1
    else:
        try:
            col = int(target)
        except ValueError:
            raise ValueError(f"--target: expected a column index of {file.name}, got {target!r}") from None
        if not -table.shape[1] <= col < table.shape[1]:
            raise ValueError(f"--target: column {col} is outside the {table.shape[1]} columns of {file.name}")
        col %= table.shape[1]
    start, stop = row_range(table.shape[0], rank, world_size)
    rows = np.array(table[start:stop])  # the only copy: this rank's rows
    return np.delete(rows, col, axis=1), rows[:, col]


def launched_rank() -> tuple[int, int]:
    """``(rank, world_size)`` from the environment torchrun sets (``RANK``, ``WORLD_SIZE``); ``(0, 1)`` without."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
