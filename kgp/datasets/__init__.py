"""Small real data shipped inside the package (no downloads); synthetic data of any size with a known noise floor."""

from __future__ import annotations

from importlib import resources

import numpy as np

from .synthetic import PriorDraw, excess_rmse, make_gp_regression

__all__ = ["PriorDraw", "excess_rmse", "load_demo", "make_gp_regression", "standardized_split"]


def load_demo() -> tuple[np.ndarray, np.ndarray]:
    """UCI Concrete Compressive Strength (Yeh 1998): 1,030 x 8 inputs, strength in MPa.

    Features: cement, blast-furnace slag, fly ash, water, superplasticizer, coarse aggregate,
    fine aggregate (kg/m^3) and age (days). License: CC BY 4.0 (UCI Machine Learning Repository);
    see kgp/datasets/README.md.

    Returns
    -------
    X, y:
        float64 arrays of shape (1030, 8) and (1030,).
    """
    with resources.files(__package__).joinpath("concrete.npz").open("rb") as fh:
        with np.load(fh, allow_pickle=False) as z:
            return z["X"].astype(np.float64), z["y"].astype(np.float64)


def standardized_split(
    X: np.ndarray, y: np.ndarray, *, seed: int = 0, train_fraction: float = 0.8
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The split protocol of kgp's benchmarks and tutorials: seeded, z-scored with training statistics.

    Rows are permuted by ``numpy.random.default_rng(seed).permutation(n)``; the first
    ``int(train_fraction * n)`` train. Features and target are centred and scaled with the
    training rows' mean and standard deviation (a constant training column keeps scale 1), so
    the test rows carry no information into the scaling.

    Parameters
    ----------
    X:
        Inputs, shape (n, d).
    y:
        Targets, shape (n,).
    seed:
        Seed of the permutation.
    train_fraction:
        Fraction of rows that train, strictly between 0 and 1.

    Returns
    -------
    X_train, y_train, X_test, y_test:
        float64 arrays.
    """
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or y.ndim != 1 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X, y: expected shapes (n, d) and (n,), got {X.shape} and {y.shape}")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction: expected a number strictly between 0 and 1, got {train_fraction!r}")
    perm = np.random.default_rng(seed).permutation(X.shape[0])
    n_train = int(train_fraction * X.shape[0])
    train, test = perm[:n_train], perm[n_train:]
    mu, sd = X[train].mean(0), X[train].std(0)
    sd[sd == 0] = 1.0
    y_mu, y_sd = y[train].mean(), y[train].std()
    y_sd = y_sd if y_sd > 0 else 1.0
    Xs, ys = (X - mu) / sd, (y - y_mu) / y_sd
    return Xs[train], ys[train], Xs[test], ys[test]
