"""A row's predicted mean and std do not depend on the other rows of the batch (issue 23, item 5).

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
