"""The progress bar shows the learning objective and noise, the solver's residual and the variance pass."""

from __future__ import annotations

import contextlib
import io

import numpy as np

import kgp


def test_the_bar_shows_objective_noise_residual_and_the_variance_stage():
    g = np.random.default_rng(0)
    X = g.normal(size=(300, 2))
    y = np.sin(X[:, 0])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        kgp.KernelRegressor(
            "rbf", learn="exact", solver="falkon", n_centers=50, progress=True, learn_options={"iterations": 5}
        ).fit(X, y)
    text = err.getvalue()
    assert "learn exact" in text and "objective=" in text and "noise=" in text
    assert "falkon" in text and "residual=" in text
    assert "variance (nystrom)" in text
    # off by default in the Python API: nothing is printed
    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet):
        kgp.KernelRegressor("rbf", learn="exact", learn_options={"iterations": 3}).fit(X, y)
    assert quiet.getvalue() == ""
