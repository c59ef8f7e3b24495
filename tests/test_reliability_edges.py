"""Answers that must not go silently wrong at the edges of the inputs (docs/guarantees.md, "Edges").

Each test compares with an independent oracle: the same fit on data of ordinary magnitude, a dense
Cholesky solve, or the exact objective.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import kgp


def _data(n=240, d=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, d))
    y = np.sin(4 * X[:, 0]) + X[:, 1]
    return X, y


@pytest.mark.parametrize("scale", [1e160, 1e154, 1e-200, 1e-300])
def test_standardisation_of_extreme_features_equals_the_fit_at_scale_one(scale):
    # the squared deviations of features at 1e160 overflow float64 and those at 1e-200 underflow: the
    # standardisation used to give std inf / 1 and a constant predictor (R^2 ~ 0)
    X, y = _data()
    params = dict(kernel="rbf", lengthscale=0.3, noise=1e-2, solver="exact", normalize_X=True)
    reference = kgp.KernelRegressor(**params).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning: nothing is wrong with these inputs
        scaled = kgp.KernelRegressor(**params).fit(X * scale, y)
    queries = _data(50, seed=1)[0]
    expected = reference.predict(queries)
    got = scaled.predict(queries * scale)
    # scaling by a power of two is exact; the remaining difference is the rounding of X * scale itself
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9 * np.abs(expected).max())
    r2 = 1 - ((reference.predict(X) - y) ** 2).mean() / y.var()
    assert r2 > 0.99
    std = scaled.posterior_.input_scaling.std.numpy()
    np.testing.assert_allclose(std / scale, X.std(0), rtol=1e-12)


def test_standardisation_of_ordinary_features_is_bitwise_unchanged():
    # ordinary magnitudes are not divided at all: the statistics are those of the plain formula
    X, y = _data()
    model = kgp.KernelRegressor("rbf", normalize_X=True, solver="exact").fit(X, y)
    Xt = torch.from_numpy(X)
    assert torch.equal(model.posterior_.input_scaling.mean, Xt.mean(0))
    assert torch.equal(model.posterior_.input_scaling.std, Xt.std(0, correction=0))


def test_float32_cast_that_collapses_a_column_warns_naming_it():
    # integers near 2**40 that differ by less than float32's spacing there (2**16) all round to 2**40
    rng = np.random.default_rng(0)
    k = rng.integers(0, 1000, (300, 2))
    X = np.stack([2**40 + k[:, 0], k[:, 1]], axis=1).astype(np.int64)
    y = np.sin(k[:, 0] / 100.0)
    assert np.unique(X[:, 0].astype(np.float32)).size == 1  # the damage the warning reports
    with pytest.warns(kgp.AccuracyWarning) as record:
        kgp.KernelRegressor("rbf", dtype="float32", normalize_X=True).fit(X, y)
    message = str(record[0].message)
    assert "column 0" in message and "column 1" not in message
    assert f"{np.unique(k[:, 0]).size:,} distinct values become 1" in message
    assert "dtype='float64'" in message and "X.mean(axis=0)" in message
    # the remedy works: centred first, the float32 fit resolves the column
    Xc = X - X.mean(axis=0, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.AccuracyWarning)
        model = kgp.KernelRegressor("rbf", dtype="float32", normalize_X=True, lengthscale=0.3).fit(Xc, y)
    r2 = 1 - ((model.predict(Xc) - y) ** 2).mean() / y.var()
    assert r2 > 0.9


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_ordinary_features_cast_without_warning(dtype):
    X, y = _data()
    timestamps = 1.7e9 + 3e7 * X[:, :1]  # a year of seconds: float32's 128 s spacing is far below the spread
    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.AccuracyWarning)
        kgp.KernelRegressor("rbf", dtype=dtype).fit(np.hstack([X, timestamps]), y)
        kgp.KernelRegressor("rbf", dtype=dtype).fit(X.astype(np.float32), y)
