"""normalize_y with targets whose squares overflow: a clear error naming y, not std inf and NaN predictions
(y near 1e160 would give every prediction NaN without a word)."""

from __future__ import annotations

import numpy as np
import pytest

import kgp

_rng = np.random.default_rng(0)
X = _rng.uniform(-2, 2, size=(50, 2))
Y = np.sin(X[:, 0]) + 2.0


@pytest.mark.parametrize(("scale", "dtype"), [(1e160, "float64"), (1e300, "float64")])
def test_targets_whose_variance_overflows_are_refused_by_name(scale, dtype):
    model = kgp.KernelRegressor(noise=0.1, normalize_y=True, dtype=dtype)
    with pytest.raises(ValueError, match=rf"^y: normalize_y=True cannot standardize targets of magnitude .*{dtype}"):
        model.fit(X, Y * scale)
    assert not hasattr(model, "predictor_")


def test_large_targets_that_fit_the_dtype_scale_the_predictions_exactly():
    """normalize_y makes the fit scale-free: y * 1e150 (squares 1e300, still finite) predicts 1e150 times y's fit."""
    small = kgp.KernelRegressor(noise=0.1, normalize_y=True).fit(X, Y)
    large = kgp.KernelRegressor(noise=0.1, normalize_y=True).fit(X, Y * 1e150)
    pred = large.predict(X)
    assert np.isfinite(pred).all()
    np.testing.assert_allclose(pred / 1e150, small.predict(X), rtol=1e-10)
