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
    X, y = raw[:, :-1], raw[:, -1]
    perm = np.random.default_rng(0).permutation(X.shape[0])
    n_train = int(0.8 * X.shape[0])
    tr, te = perm[:n_train], perm[n_train:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    ymu, ysd = y[tr].mean(), y[tr].std()
    return (X[tr] - mu) / sd, (y[tr] - ymu) / ysd, (X[te] - mu) / sd, (y[te] - ymu) / ysd


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
