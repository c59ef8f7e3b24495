"""kgp.datasets.PriorDraw: a GP prior draw with a known noise floor, generated in blocks, from disk."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kgp.datasets import PriorDraw, excess_rmse, make_gp_regression
from kgp.datasets.synthetic import CHUNK_ROWS, default_lengthscales


def test_rows_do_not_depend_on_block_size_start_or_n():
    draw = PriorDraw(3, seed=5, n_features=64)
    X, y = draw.sample(3 * CHUNK_ROWS + 17, block_rows=10**6)
    for start, n, block in [(0, 3 * CHUNK_ROWS + 17, 1), (5, 2000, 1000), (CHUNK_ROWS - 1, 3, 7), (1300, 1700, 3000)]:
        Xb, yb = draw.sample(n, start=start, block_rows=block)
        np.testing.assert_array_equal(Xb, X[start : start + n])
        np.testing.assert_array_equal(yb, y[start : start + n])
    # a new object with the same arguments is the same data; another seed is not
    X2, y2 = PriorDraw(3, seed=5, n_features=64).sample(100)
    np.testing.assert_array_equal(X2, X[:100])
    np.testing.assert_array_equal(y2, y[:100])
    assert not np.array_equal(PriorDraw(3, seed=6, n_features=64).sample(100)[0], X[:100])


def test_train_and_test_share_f_and_not_rows():
    draw = PriorDraw(2, seed=1, n_features=32, noise_std=0.0)
    X_tr, y_tr = draw.sample(500)
    X_te, y_te = make_gp_regression(500, 2, seed=1, split="test", noise_std=0.0, n_features=32)
    assert not np.isclose(X_tr[:, None, :], X_te[None, :, :]).all(-1).any()
    # noise-free: y is f on both splits (the same f), to rounding
    np.testing.assert_allclose(y_tr, draw.f(X_tr), rtol=0, atol=1e-12)
    np.testing.assert_allclose(y_te, draw.f(X_te), rtol=0, atol=1e-12)


def test_f_is_the_random_fourier_feature_sum():
    draw = PriorDraw(2, seed=3, n_features=5, lengthscale=[0.5, 2.0], outputscale=2.0)
    X = np.random.default_rng(0).standard_normal((7, 2))
    phase = X @ draw.frequencies
    expected = np.cos(phase) @ draw.weights[0] + np.sin(phase) @ draw.weights[1]
    np.testing.assert_allclose(draw.f(X), expected, rtol=1e-12, atol=1e-14)
    # weights N(0, outputscale / D), frequencies N(0, 1 / l^2): checked on a large draw by their moments
    big = PriorDraw(2, seed=3, n_features=20000, lengthscale=[0.5, 2.0], outputscale=2.0)
    se = math.sqrt(2.0 / 20000)  # relative standard error of a variance estimate from 20,000 normals
    np.testing.assert_allclose(big.frequencies.var(1) * big.lengthscale**2, 1.0, atol=5 * se)
    np.testing.assert_allclose(big.weights.var(1) * 20000 / 2.0, 1.0, atol=5 * se)


def test_noise_has_the_stated_std_within_sampling_error():
    n, sigma = 40000, 0.25
    draw = PriorDraw(4, seed=2, noise_std=sigma, n_features=128)
    X, y = draw.sample(n)
    noise = y - draw.f(X)
    # the sample std of n normals has standard error sigma / sqrt(2 n); five of them bound it
    assert abs(noise.std() - sigma) < 5 * sigma / math.sqrt(2 * n)
    assert abs(noise.mean()) < 5 * sigma / math.sqrt(n)
    # the inputs are standard normal
    assert np.abs(X.mean(0)).max() < 5 / math.sqrt(n)
    assert np.abs(X.var(0) - 1).max() < 5 * math.sqrt(2 / n)


def test_prior_moments_over_draws_are_the_rbf_kernel():
    """Over seeds, f(x) ~ N(0, outputscale) exactly and E f(x) f(x') = outputscale * RBF(x, x')."""
    d, s, draws = 2, 1.7, 3000
    ls = np.array([0.8, 1.6])
    X = np.array([[0.0, 0.0], [0.5, -0.3], [2.0, 1.0]])
    F = np.stack([PriorDraw(d, seed=k, n_features=16, lengthscale=ls, outputscale=s).f(X) for k in range(draws)])
    # f(x)^2 / s is chi-squared with one degree of freedom: mean 1, standard deviation sqrt(2)
    np.testing.assert_allclose((F**2).mean(0) / s, 1.0, atol=5 * math.sqrt(2 / draws))
    sq = (((X[:, None, :] - X[None, :, :]) / ls) ** 2).sum(-1)
    K = s * np.exp(-0.5 * sq)
    # E f(x) f(x') over draws: each product has variance at most s^2 (1 + k^2) <= 2 s^2
    np.testing.assert_allclose(F.T @ F / draws, K, atol=5 * s * math.sqrt(2 / draws))


def test_variance_of_one_large_draw_is_near_the_outputscale():
    # one draw's spatial variance is random (it is one function), but near s: within 20% at this size
    draw = PriorDraw(8, seed=0, outputscale=2.0)
    X, _ = draw.sample(4096)
    assert 0.8 < draw.f(X).var() / 2.0 < 1.2


def test_writes_memory_mapped_npy_files(tmp_path):
    draw = PriorDraw(3, seed=4, n_features=16)
    X_mem, y_mem = draw.sample(2500, block_rows=CHUNK_ROWS, X_out=tmp_path / "X.npy", y_out=tmp_path / "y.npy")
    assert isinstance(X_mem, np.memmap)
    X_ref, y_ref = draw.sample(2500)
    X, y = np.load(tmp_path / "X.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r")
    np.testing.assert_array_equal(X, X_ref)
    np.testing.assert_array_equal(y, y_ref)
    X32, _ = draw.sample(2500, dtype=np.float32, X_out=np.empty((2500, 3), np.float32))
    np.testing.assert_array_equal(X32, X_ref.astype(np.float32))


def test_writing_to_disk_holds_one_block_beyond_the_output(tmp_path):
    """numpy reports its allocations to tracemalloc; the memory-mapped output is file pages, not traced."""
    import tracemalloc

    n, d, block = 200_000, 8, 2 * CHUNK_ROWS
    draw = PriorDraw(d, seed=0, n_features=32)
    tracemalloc.start()
    try:
        draw.sample(n, block_rows=block, X_out=tmp_path / "X.npy", y_out=tmp_path / "y.npy")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one_block = block * (d + 1) * 8
    assert peak < 4 * one_block < n * d * 8 / 10, (peak, one_block)


def test_default_lengthscales_and_excess():
    ls = default_lengthscales(8)
    assert ls.shape == (8,) and math.isclose(ls[-1] / ls[0], 4.0)
    # the sum of inverse squared lengthscales is nearly the same for every d (15 / ln 16 = 5.41 as d grows)
    assert math.isclose((1 / default_lengthscales(28) ** 2).sum(), (1 / ls**2).sum(), rel_tol=0.07)
    assert excess_rmse(0.5, 0.3) == pytest.approx(0.4)
    assert excess_rmse(0.09, 0.1) == 0.0
    assert PriorDraw(2, noise_std=0.3, n_features=4).bayes_rmse == 0.3


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: PriorDraw(0), ValueError, "d: expected an integer >= 1"),
        (lambda: PriorDraw(2.5), TypeError, "d: expected an integer"),
        (lambda: PriorDraw(2, seed=-1), ValueError, "seed: expected an integer >= 0"),
        (lambda: PriorDraw(2, noise_std=-0.1), ValueError, "noise_std: expected a finite number >= 0"),
        (lambda: PriorDraw(2, noise_std=float("nan")), ValueError, "noise_std"),
        (lambda: PriorDraw(2, n_features=0), ValueError, "n_features: expected an integer >= 1"),
        (lambda: PriorDraw(2, outputscale=0.0), ValueError, "outputscale: expected a finite number > 0"),
        (lambda: PriorDraw(2, lengthscale=[1.0, 2.0, 3.0]), ValueError, "lengthscale: expected a number or 2"),
        (lambda: PriorDraw(2, lengthscale=[1.0, -2.0]), ValueError, "lengthscale: expected finite positive"),
        (lambda: PriorDraw(2, n_features=4).sample(0), ValueError, "n: expected an integer >= 1"),
        (lambda: PriorDraw(2, n_features=4).sample(True), TypeError, "n: expected an integer"),
        (lambda: PriorDraw(2, n_features=4).sample(3, start=-1), ValueError, "start: expected an integer >= 0"),
        (lambda: PriorDraw(2, n_features=4).sample(3, block_rows=0), ValueError, "block_rows"),
        (lambda: PriorDraw(2, n_features=4).sample(3, split="valid"), ValueError, "split: expected 'train'"),
        (lambda: PriorDraw(2, n_features=4).sample(3, dtype=np.int64), TypeError, "dtype: expected float32"),
        (lambda: PriorDraw(2, n_features=4).sample(3, X_out=np.empty((3, 3))), ValueError, "X_out: expected"),
        (lambda: PriorDraw(2, n_features=4).sample(3, y_out=[0, 0, 0]), TypeError, "y_out: expected None"),
        (lambda: PriorDraw(2, n_features=4).f(np.zeros((3, 3))), ValueError, r"X: expected shape \(n, 2\)"),
        (lambda: excess_rmse(-1.0, 0.1), ValueError, "rmse"),
    ],
)
def test_bad_arguments_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------- fitting from disk
def test_read_only_memmap_is_shared_not_copied(tmp_path):
    import torch

    from kgp.validation import to_tensor

    X_mem, _ = PriorDraw(3, seed=0, n_features=8).sample(2000, X_out=tmp_path / "X.npy", y_out=tmp_path / "y.npy")
    del X_mem
    X = np.load(tmp_path / "X.npy", mmap_mode="r")
    assert not X.flags.writeable
    Xt = to_tensor(X, "X", ndim=(2,), dtype=None, device=None)
    assert Xt.data_ptr() == X.ctypes.data  # the file's pages, not a copy
    np.testing.assert_array_equal(Xt.numpy(), X)
    # a conversion copies once, straight into the fit's dtype
    X32 = to_tensor(X, "X", ndim=(2,), dtype=torch.float32, device=None)
    assert X32.dtype == torch.float32 and X32.data_ptr() != X.ctypes.data


def test_fit_from_a_memory_mapped_file_equals_the_fit_in_memory(tmp_path):
    import kgp

    draw = PriorDraw(3, seed=1, n_features=64)
    draw.sample(1500, X_out=tmp_path / "X.npy", y_out=tmp_path / "y.npy")
    X, y = np.load(tmp_path / "X.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r")
    X_test, _ = draw.sample(200, split="test")
    options = {"n_centers": 100, "noise": 0.01, "lengthscale": 1.5, "random_state": 0}
    on_disk = kgp.KernelRegressor("rbf", **options).fit(X, y)
    in_memory = kgp.KernelRegressor("rbf", **options).fit(np.array(X), np.array(y))
    np.testing.assert_array_equal(on_disk.predict(X_test), in_memory.predict(X_test))
    np.testing.assert_array_equal(np.load(tmp_path / "X.npy"), X)  # the file is untouched


def test_finiteness_check_needs_no_full_size_temporaries(monkeypatch):
    """The check of a finite input never builds an input-sized mask (torch.isfinite's ``abs`` on the CPU)."""
    import torch

    from kgp import validation

    seen = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: seen.append(t.numel()) or real(t))
    X = np.random.default_rng(0).standard_normal((3000, 4))
    validation.to_tensor(X, "X", ndim=(2,), dtype=None, device=None)
    assert seen and max(seen) == 1
    # finite values whose sum overflows are accepted; a NaN or an infinity is counted
    big = np.full((4, 2), 1e308)
    assert validation.to_tensor(big, "X", ndim=(2,), dtype=None, device=None).shape == (4, 2)
    bad = X.copy()
    bad[5, 1], bad[2999, 3] = np.nan, -np.inf
    with pytest.raises(ValueError, match="X: contains 2 NaN or infinite"):
        validation.to_tensor(bad, "X", ndim=(2,), dtype=None, device=None)
