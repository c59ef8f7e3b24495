"""The Nystrom variance of a large fit: ``K_Mn K_nM`` estimated from a fixed uniform subset of
``max(GRAM_ROWS_PER_CENTER * M, GRAM_MIN_ROWS)`` rows, scaled by n / m. Checked against a dense oracle on the
same subset (exact), against the full Gram (the std moves by the sampling error only), and through a model
file. The tests lower ``GRAM_MIN_ROWS`` so that a few thousand rows are a large fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kgp
from kgp.variance import latent_variance, nystrom
from kgp.variance.nystrom import GRAM_ROWS_PER_CENTER, gram_rows, nystrom_factors

D = 3
M = 40


@pytest.fixture(autouse=True)
def small_floor(monkeypatch):
    monkeypatch.setattr(nystrom, "GRAM_MIN_ROWS", 100)


def test_below_the_floor_every_row_is_summed(monkeypatch):
    monkeypatch.setattr(nystrom, "GRAM_MIN_ROWS", 100_000)
    X = torch.randn(50_000, D, dtype=torch.float64)
    rows, scale = gram_rows(X, 10)
    assert rows is X and scale == 1.0


def _data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, D))
    y = np.sin(1.5 * X[:, 0]) + 0.5 * np.cos(X[:, 1]) + 0.1 * rng.normal(size=n)
    return X, y


def _model(n: int, **kwargs):
    X, y = _data(n)
    model = kgp.KernelRegressor(
        "rbf", lengthscale=1.2, noise=0.01, solver="falkon", n_centers=M, random_state=0, **kwargs
    ).fit(X, y)
    return model, X, y


def test_gram_rows_is_all_rows_up_to_the_limit_and_a_fixed_subset_above():
    X = torch.randn(GRAM_ROWS_PER_CENTER * M, D, dtype=torch.float64)
    rows, scale = gram_rows(X, M)
    assert rows is X and scale == 1.0
    X = torch.randn(5 * GRAM_ROWS_PER_CENTER * M + 3, D, dtype=torch.float64)
    rows, scale = gram_rows(X, M)
    m = GRAM_ROWS_PER_CENTER * M
    assert rows.shape == (m, D) and scale == X.shape[0] / m
    again, _ = gram_rows(X.clone(), M)
    assert torch.equal(rows, again)  # a function of the data only
    # distinct rows of X, in X's order
    index = {tuple(r.tolist()): i for i, r in enumerate(X)}
    positions = [index[tuple(r.tolist())] for r in rows]
    assert positions == sorted(set(positions))


def test_the_subsampled_factors_equal_a_dense_oracle_on_the_same_rows():
    model, X, _ = _model(4 * GRAM_ROWS_PER_CENTER * M)
    strategy = model.posterior_.variance
    n, m = X.shape[0], GRAM_ROWS_PER_CENTER * M
    assert strategy.train_X.shape[0] == m and strategy.gram_scale == pytest.approx(n / m, rel=0)
    kernel, Z = model.kernel_, strategy.centers
    with torch.no_grad():
        Xs = strategy.train_X
        Kmm = kernel(Z, Z).to_dense()
        Kmn = kernel(Z, Xs).to_dense()
        S = (n / m) * Kmn @ Kmn.T + 0.01 * Kmm
        xq = torch.as_tensor(_data(200, seed=5)[0])
        kq = kernel(Z, xq).to_dense()
        prior = kernel(xq, xq, diag=True)
        oracle = prior - (kq * torch.linalg.solve(Kmm, kq)).sum(0) + 0.01 * (kq * torch.linalg.solve(S, kq)).sum(0)
    got = strategy.latent_variance(xq)
    eps = torch.finfo(torch.float64).eps
    # the kernel's scale is 1 and the systems' condition numbers are below 1e8 here: a few 1e-8 at most
    torch.testing.assert_close(got, oracle.clamp_min(0), rtol=0, atol=1e8 * eps * float(prior.max()))


def test_the_std_moves_by_the_sampling_error_only():
    model, X, _ = _model(6 * GRAM_ROWS_PER_CENTER * M)
    xq = torch.as_tensor(_data(300, seed=7)[0])
    strategy = model.posterior_.variance
    full = nystrom_factors(model.kernel_, torch.as_tensor(X), strategy.centers, model.noise_)
    sub_std = (strategy.latent_variance(xq) + model.noise_).sqrt()
    full_std = (latent_variance(model.kernel_, xq, full) + model.noise_).sqrt()
    # m = 4 M rows: the relative error of the Gram's quadratic forms is of order sqrt(M / m) ~ 0.5 in the
    # worst direction, and the std's data term is a fraction of the noise: a few percent at most
    assert float(((sub_std - full_std).abs() / full_std).max()) < 0.05


def test_at_or_below_the_limit_the_full_gram_is_used_bitwise():
    model, X, _ = _model(GRAM_ROWS_PER_CENTER * M)
    strategy = model.posterior_.variance
    assert strategy.gram_scale == 1.0 and strategy.train_X.shape[0] == X.shape[0]
    xq = torch.as_tensor(_data(50, seed=3)[0])
    full = nystrom_factors(model.kernel_, torch.as_tensor(X), strategy.centers, model.noise_)
    assert torch.equal(strategy.latent_variance(xq), latent_variance(model.kernel_, xq, full))


def test_a_model_file_keeps_the_subset_and_its_scale(tmp_path):
    model, X, _ = _model(4 * GRAM_ROWS_PER_CENTER * M)
    xq = _data(100, seed=9)[0]
    path = tmp_path / "m.pt"
    model.save(path)
    loaded = kgp.load(path)
    assert loaded.posterior_.variance.gram_scale == model.posterior_.variance.gram_scale
    _, std = model.predict(xq, return_std=True)
    _, std_loaded = loaded.predict(xq, return_std=True)
    np.testing.assert_array_equal(std_loaded, std)
