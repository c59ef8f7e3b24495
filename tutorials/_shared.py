"""Helpers the tutorials share: where the shared real data live, the UCI split, a matplotlib handle.

The data sets ship beside the checkout in ``../shared/data`` (``KGP_SHARED_DATA`` overrides the
path); a tutorial raises :class:`DataMissing` with the path when they are absent, and the test
suite turns that into a skip with the reason.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from kgp.datasets import standardized_split


class DataMissing(FileNotFoundError):
    """The shared data set a tutorial needs is not on this machine."""


def shared_data() -> Path:
    """``$KGP_SHARED_DATA`` or ``../shared/data`` next to the checkout."""
    env = os.environ.get("KGP_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def require(relative: str) -> Path:
    """Path of one shared data file, or :class:`DataMissing` naming where it was looked for."""
    path = shared_data() / relative
    if not path.is_file():
        raise DataMissing(f"{path} not found: the shared real data ship beside the repository (set KGP_SHARED_DATA)")
    return path


def uci_split(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The seeded 80/20 split of benchmarks/uci.py, z-scored with training statistics (float64)."""
    with gzip.open(require(f"uci/{name}.csv.gz"), "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    return standardized_split(raw[:, :-1], raw[:, -1])


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
