"""A row's predicted mean and std do not depend on the other rows of the batch.

The variance pass once centred the kernel's distances on the query block: one far row in a
``return_std`` batch shifted the centre, and the expanded distances of every other row cancelled to
std 0 (185 of 1,000 rows at 1e9, all at 1e10, NaN at 1e155).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kgp


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("solver", "extra"), [("exact", {}), ("falkon", {"n_centers": 100})])
def test_a_far_row_changes_no_other_row(solver, extra, dtype):
    g = np.random.default_rng(0)
    X = g.normal(size=(400, 3))
    y = np.sin(X[:, 0]) + 0.1 * g.normal(size=400)
    Q = g.normal(size=(300, 3))
    model = kgp.KernelRegressor("rbf", noise=0.01, solver=solver, dtype=dtype, random_state=0, **extra).fit(X, y)
    mean, std = model.predict(Q, return_std=True)
    eps = torch.finfo(getattr(torch, dtype)).eps
    # the same arithmetic on each row up to the summation order of a differently sized GEMM: variances agree
    # to ~100 eps of the prior (1 here), so stds to sqrt of that (|sqrt a - sqrt b| <= sqrt |a - b|)
    atol = (100 * eps) ** 0.5
    far_values = [1e9, 1e10, 1e30] + ([1e155] if dtype == "float64" else [])
    for far in far_values:
        m2, s2 = model.predict(np.r_[Q, [[far, 0.0, 0.0]]], return_std=True)
        assert np.isfinite(s2).all() and np.isfinite(m2).all()
        np.testing.assert_allclose(s2[:-1], std, rtol=0, atol=atol)
        np.testing.assert_allclose(m2[:-1], mean, rtol=0, atol=atol)
        # the far row itself: no data near it, the prior (outputscale 1) and the prior mean 0
        assert s2[-1] == pytest.approx(1.0, abs=atol) and m2[-1] == pytest.approx(0.0, abs=atol)
    assert np.median(std) > 10 * atol  # the rows' stds are not 0 to begin with


def test_float32_nystrom_std_matches_float64_within_one_percent(tmp_path):
    """float32 FALKON std matches the same formula in float64 (float32 factors put it up to 57% off on pol)."""
    g = np.random.default_rng(3)
    X = g.normal(size=(3000, 6))
    y = np.sin(X[:, 0]) * np.cos(X[:, 1]) + 0.3 * X[:, 2] + 0.05 * g.normal(size=3000)
    Q = g.normal(size=(400, 6))
    common = dict(lengthscale=1.5, noise=0.003, solver="falkon", n_centers=600, random_state=0)
    m64 = kgp.KernelRegressor("rbf", dtype="float64", **common).fit(X, y)
    m32 = kgp.KernelRegressor("rbf", dtype="float32", **common).fit(X.astype(np.float32), y.astype(np.float32))
    _, s64 = m64.predict(Q, return_std=True)
    _, s32 = m32.predict(Q.astype(np.float32), return_std=True)
    assert s32.dtype == np.float32
    np.testing.assert_allclose(s32, s64, rtol=0.01)
    # the float64 factors survive a save and a load
    m32.save(tmp_path / "m32.pt")
    _, loaded = kgp.load(tmp_path / "m32.pt").predict(Q.astype(np.float32), return_std=True)
    np.testing.assert_allclose(loaded, s32, rtol=1e-6)


def test_exact_std_and_refit_respect_max_exact_size_and_the_memory_budget():
    """return_std on an exact model and refit_subset hold max_exact_size and the memory budget."""
    g = np.random.default_rng(5)
    X = g.normal(size=(300, 2))
    y = np.sin(X[:, 0])

    def unbuilt():
        # a fitted exact model holds the solver's factor; one whose factor is to be built (e.g. loaded) builds
        # the dense matrix on its first std, under the settings
        model = kgp.KernelRegressor("rbf", noise=0.01, solver="exact").fit(X, y)
        posterior = model.posterior_
        posterior.variance = kgp.variance.ExactVariance(posterior.kernel, posterior.predictor.centers, posterior.noise)
        return model

    model = unbuilt()
    with kgp.settings.max_exact_size(200):
        with pytest.raises(ValueError, match=r"return_std=True on an exact model needs a dense 300 x 300 matrix"):
            model.predict(X[:5], return_std=True)
    fresh = unbuilt()
    with kgp.settings.memory_budget(300 * 300 * 8 - 1):
        with pytest.raises(ValueError, match=r"exact model needs .*kgp.settings.memory_budget=719,999 bytes"):
            fresh.predict(X[:5], return_std=True)
    _, std = fresh.predict(X[:5], return_std=True)  # within the settings it works
    assert np.isfinite(std).all()
    with kgp.settings.max_exact_size(250):
        with pytest.raises(ValueError, match=r"learn_options\['refit_subset'\]=280 needs a dense 280 x 280"):
            kgp.KernelRegressor(
                "rbf", solver="falkon", n_centers=30, learn="sgpr", learn_options={"iterations": 2, "refit_subset": 280}
            ).fit(X, y)


def test_a_variance_that_cannot_be_factored_keeps_the_fitted_mean(monkeypatch):
    """keggdirected: the default GP's variance factor failed at fit and threw the fitted mean away with it."""
    import kgp.variance.nystrom

    g = np.random.default_rng(6)
    X = g.normal(size=(300, 2))
    y = np.sin(X[:, 0])

    def failing(*args, **kwargs):
        raise kgp.linalg.NotPSDError("noise*K_MM + K_Mn K_nM (30 x 30, torch.float64) is not positive definite")

    monkeypatch.setattr(kgp.variance.nystrom, "nystrom_factors", failing)
    with pytest.warns(kgp.ConvergenceWarning, match=r"predictive variance could not be built .*fitted mean is kept"):
        model = kgp.KernelRegressor(
            "rbf", learn="exact", solver="falkon", n_centers=30, learn_options={"iterations": 3}
        ).fit(X, y)
    assert np.isfinite(model.predict(X[:5])).all()
    with pytest.raises(kgp.linalg.NotPSDError, match="not positive definite"):
        model.predict(X[:5], return_std=True)
