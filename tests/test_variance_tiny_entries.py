"""The variance's cross-kernel has no entries whose products are subnormal (short lengthscales).

With short lengthscales most query-to-data kernel values are far below ``1e-150`` (float64), and the
triangular solves of the variance multiply them into subnormal numbers, which Intel CPUs process
10-100x slower (the learned default GP on UCI parkinsons: 6.3 s for one solve against 0.19 s once they
are set to 0). :func:`kgp.variance.cross_kernel` sets them to 0; the std must not move.
"""

from __future__ import annotations

import numpy as np
import torch

import kgp
from kgp.linalg import tiny_fraction
from kgp.variance import cross_kernel


def rbf_matrix(A: np.ndarray, B: np.ndarray, lengthscale: float) -> np.ndarray:
    sq = ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)
    return np.exp(-0.5 * sq / lengthscale**2)


def test_exact_std_with_tiny_cross_kernel_values_matches_the_dense_oracle():
    g = np.random.default_rng(0)
    X = g.normal(size=(500, 5))
    y = np.sin(X[:, 0]) + 0.1 * g.normal(size=500)
    Q = np.r_[X[:50] + 0.01 * g.normal(size=(50, 5)), g.normal(size=(150, 5))]  # near and far queries
    ls, noise = 0.12, 0.01
    raw = rbf_matrix(Q, X, ls)
    threshold = tiny_fraction(torch.float64)  # the kernel's scale is 1
    assert ((raw > 0) & (raw < threshold)).mean() > 0.25  # the case the flush is for (35% here)

    model = kgp.KernelRegressor("rbf", lengthscale=ls, noise=noise, solver="exact", dtype="float64").fit(X, y)
    kernel = model.posterior_.kernel
    with torch.no_grad():
        Xq = model.posterior_.inputs(torch.as_tensor(Q))
        points = model.posterior_.variance.points  # the training rows the exact variance solves on
        kx = cross_kernel(kernel, Xq, points, torch.ones(Q.shape[0], dtype=torch.float64))
    assert kx.shape == (500, 200)
    assert not bool(((kx != 0) & (kx.abs() < threshold)).any())

    # R&W eq. 2.26 without the flush, dense float64: k(x, x) - k_*^T (K + noise I)^{-1} k_*
    C = rbf_matrix(X, X, ls) + noise * np.eye(500)
    var = 1.0 - np.einsum("ij,ji->i", raw, np.linalg.solve(C, raw.T))
    _, std = model.predict(Q, return_std=True)
    # cond(C) <= 1 + 500 / noise: the variance to a small multiple of n eps cond, relative to the prior 1;
    # the std to the square root of that where the variance is near 0 (|sqrt a - sqrt b| <= sqrt |a - b|)
    atol = (500 * np.finfo(np.float64).eps * (1 + 500 / noise)) ** 0.5
    np.testing.assert_allclose(std, np.sqrt(np.clip(var, 0, None)), rtol=0, atol=atol)
