"""kgp.datasets: the shipped demo data and the split protocol of the benchmarks and tutorials."""

import numpy as np
import pytest
from sklearn.preprocessing import StandardScaler

from kgp.datasets import load_demo, standardized_split


def test_demo_data_are_the_shipped_concrete_set():
    X, y = load_demo()
    assert X.shape == (1030, 8) and y.shape == (1030,)
    assert X.dtype == y.dtype == np.float64 and np.isfinite(X).all() and np.isfinite(y).all()
    assert 2.0 < y.min() < y.max() < 83.0  # compressive strength in MPa


def test_standardized_split_matches_a_scaler_fitted_on_the_training_rows():
    rng = np.random.default_rng(3)
    X = rng.normal(loc=5.0, scale=[1.0, 10.0, 0.1], size=(50, 3))
    X[:, 2] = 7.0  # constant column: kept, scale 1
    y = rng.normal(loc=-2.0, scale=4.0, size=50)
    X_tr, y_tr, X_te, y_te = standardized_split(X, y, seed=4, train_fraction=0.7)

    perm = np.random.default_rng(4).permutation(50)
    train, test = perm[:35], perm[35:]
    scaler = StandardScaler().fit(X[train])
    np.testing.assert_allclose(X_tr, scaler.transform(X[train]), atol=1e-12)
    np.testing.assert_allclose(X_te, scaler.transform(X[test]), atol=1e-12)
    y_scaler = StandardScaler().fit(y[train, None])
    np.testing.assert_allclose(y_tr, y_scaler.transform(y[train, None])[:, 0], atol=1e-12)
    np.testing.assert_allclose(y_te, y_scaler.transform(y[test, None])[:, 0], atol=1e-12)
    assert np.all(X_tr[:, 2] == 0.0)


@pytest.mark.parametrize(
    ("X", "y", "kwargs", "match"),
    [
        (np.ones((4, 2)), np.ones(3), {}, "X, y: expected shapes"),
        (np.ones(4), np.ones(4), {}, "X, y: expected shapes"),
        (np.ones((4, 2)), np.ones(4), {"train_fraction": 1.0}, "train_fraction: expected a number strictly"),
    ],
)
def test_standardized_split_rejects_bad_input(X, y, kwargs, match):
    with pytest.raises(ValueError, match=match):
        standardized_split(X, y, **kwargs)
