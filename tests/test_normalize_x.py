"""``normalize_X``: inputs standardised with the training rows' statistics, on by default when learning.

Oracle: a fit on inputs the user standardised by hand (the workaround users had to know) and the
invariance of a standardised fit to any per-feature affine change of units.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_uci

import kgp

rng = np.random.default_rng(5)
Z = rng.normal(size=(200, 3))
Y = np.sin(Z[:, 0]) + 0.5 * Z[:, 1] ** 2 + 0.05 * rng.normal(size=200)
ZQ = rng.normal(size=(30, 3))
UNITS = np.array([1e-8, 1.0, 1e8])  # the features' units differ by 16 orders of magnitude
SHIFT = np.array([3e-8, -2.0, 5e9])


def _gp(**params):
    return kgp.KernelRegressor("rbf", learn="exact", random_state=0, learn_options={"iterations": 40}, **params)


def test_learning_standardises_inputs_by_default_and_equals_a_fit_on_standardised_inputs():
    X, Xq = Z * UNITS + SHIFT, ZQ * UNITS + SHIFT
    model = _gp().fit(X, Y)
    assert model.posterior_.input_scaling is not None
    mu, sd = X.mean(0), X.std(0)
    by_hand = _gp(normalize_X=False).fit((X - mu) / sd, Y)
    mean, std = model.predict(Xq, return_std=True)
    ref_mean, ref_std = by_hand.predict((Xq - mu) / sd, return_std=True)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(std, ref_std, rtol=1e-6, atol=1e-8)
    assert model.score(Xq, np.sin(ZQ[:, 0]) + 0.5 * ZQ[:, 1] ** 2) > 0.9


def test_without_standardisation_the_same_data_learn_nothing_useful():
    """The failure the default removes: a 1e8-scale feature swamps the distances (R^2 near 0)."""
    X, Xq = Z * UNITS + SHIFT, ZQ * UNITS + SHIFT
    truth = np.sin(ZQ[:, 0]) + 0.5 * ZQ[:, 1] ** 2
    raw = _gp(normalize_X=False).fit(X, Y)
    assert raw.score(Xq, truth) < 0.5 < _gp().fit(X, Y).score(Xq, truth)


def test_a_standardised_fit_does_not_depend_on_the_units():
    a = _gp().fit(Z, Y)
    b = _gp().fit(Z * UNITS + SHIFT, Y)
    np.testing.assert_allclose(a.predict(ZQ), b.predict(ZQ * UNITS + SHIFT), rtol=1e-6, atol=1e-8)


def test_centers_are_reported_and_taken_in_the_users_units(tmp_path):
    X = Z * UNITS + SHIFT
    given = X[:25].copy()
    model = kgp.KernelRegressor(
        "rbf", lengthscale=1.0, noise=0.05, solver="falkon", centers=given, normalize_X=True
    ).fit(X, Y)
    np.testing.assert_allclose(model.centers_.numpy(), given, rtol=1e-12)
    model.save(tmp_path / "m.pt")
    loaded = kgp.load(tmp_path / "m.pt")
    np.testing.assert_array_equal(loaded.predict(X[:5]), model.predict(X[:5]))
    np.testing.assert_allclose(loaded.centers_.numpy(), given, rtol=1e-12)


def test_the_switches_are_off_without_learning_and_validated():
    model = kgp.KernelRegressor("rbf", solver="exact").fit(Z, Y)
    assert model.posterior_.input_scaling is None
    with pytest.raises(TypeError, match="normalize_X: expected True, False or None"):
        kgp.KernelRegressor(normalize_X="yes").fit(Z, Y)
    with pytest.raises(ValueError, match="partial_fit: learn, normalize_y and normalize_X"):
        kgp.KernelRegressor(solver="dsg", normalize_X=True).partial_fit(Z, Y)


def test_raw_protein_features_give_a_sensible_fit(shared_data):
    """Raw protein features through `learn` without normalize_X give training R^2 0.0000 (constant predictions)."""
    X, y = load_uci(shared_data, "protein")
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[:1500], order[1500:2500]
    model = kgp.KernelRegressor("rbf", learn="exact", random_state=0, learn_options={"iterations": 30})
    model.fit(X[train], y[train])
    # measured: linear regression on these rows 0.31, this GP 0.42, the same GP on raw inputs -0.0001
    assert model.score(X[test], y[test]) > 0.35
    assert torch.is_tensor(model.posterior_.input_scaling.std)
