"""kmeans++ selector: coverage, the potential bound, reproducibility, duplicates, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kgp
from kgp.plugin import SelectionRequest


def _request(X, m, seed=0, **options):
    X = torch.as_tensor(X, dtype=torch.float64)
    kernel = kgp.kernels.make_kernel("rbf", 1.0).double()
    # resolved as the model resolves them (invalid values raise here)
    opts = kgp.resolve_options("selector 'kmeans++'", kgp.get_selector("kmeans++"), options)
    return SelectionRequest(X, m, kernel, 1e-2, torch.Generator().manual_seed(seed), opts)


def _select(X, m, seed=0, **options):
    return kgp.get_selector("kmeans++").select(_request(X, m, seed, **options))


def _blobs(n_blobs=6, per=40, spread=0.01, seed=0):
    rng = np.random.default_rng(seed)
    means = 10.0 * np.eye(n_blobs)[:, :4] if n_blobs <= 4 else 10.0 * rng.standard_normal((n_blobs, 4))
    X = np.concatenate([m + spread * rng.standard_normal((per, 4)) for m in means])
    return X, np.repeat(np.arange(n_blobs), per)


@pytest.mark.parametrize("metric", ["kernel", "euclidean"])
def test_one_center_per_separated_blob(metric):
    """D^2 sampling on well-separated blobs puts one center in each (inter/intra distance ratio ~1e4)."""
    X, label = _blobs()
    for seed in range(8):
        centers = _select(X, 6, seed, metric=metric)
        assert sorted(label[centers.indices.numpy()]) == list(range(6)), seed


def test_potential_is_the_kernel_distance_sum_and_bounds_the_nystrom_error():
    rng = np.random.default_rng(3)
    X = rng.uniform(-2, 2, size=(200, 2))
    centers = _select(X, 25, seed=4)
    Z = centers.points.numpy()

    def k(a, b):
        return np.exp(-((a[:, None] - b[None]) ** 2).sum(-1) / 2)

    d2 = (2 - 2 * k(X, Z)).min(axis=1)  # k(x, x) = 1 for the RBF kernel
    assert centers.info["potential"] == pytest.approx(d2.sum(), rel=1e-9)
    knm = k(X, Z)
    nystrom_error = np.trace(k(X, X) - knm @ np.linalg.pinv(k(Z, Z), rcond=1e-12) @ knm.T)
    assert 0 < nystrom_error <= centers.info["potential"]


def test_better_nystrom_error_than_uniform_on_uneven_density():
    """A dense clump plus sparse background: uniform sampling wastes centers in the clump (measured 33.2 vs 72.6)."""
    rng = np.random.default_rng(5)
    X = np.concatenate([0.05 * rng.standard_normal((400, 2)), rng.uniform(-4, 4, size=(100, 2))])
    Xt = torch.as_tensor(X)
    kernel = kgp.kernels.make_kernel("rbf", 0.7).double()

    @torch.no_grad()
    def trace_error(idx):
        knm = kgp.kernel_operator(kernel, Xt, Xt[idx]).to_dense()
        kmm = kgp.kernel_operator(kernel, Xt[idx]).to_dense()
        return float(len(X) - torch.trace(knm @ torch.linalg.pinv(kmm, hermitian=True, rtol=1e-12) @ knm.T))

    kpp, uni = [], []
    for seed in range(5):
        req = _request(X, 30, seed)
        req.kernel = kernel
        kpp.append(trace_error(kgp.get_selector("kmeans++").select(req).indices))
        uni.append(trace_error(kgp.get_selector("uniform").select(req).indices))
    assert np.mean(kpp) < 0.5 * np.mean(uni), (kpp, uni)


def test_greedy_trials_lower_the_potential():
    X = np.random.default_rng(6).uniform(-3, 3, size=(300, 3))
    plain = [_select(X, 20, s).info["potential"] for s in range(6)]
    greedy = [_select(X, 20, s, n_local_trials=5).info["potential"] for s in range(6)]
    assert np.mean(greedy) < np.mean(plain), (greedy, plain)


def test_fewer_distinct_points_than_centers():
    X = np.repeat(np.arange(5.0)[:, None] * np.ones((1, 2)), 4, axis=0)  # 20 rows, 5 distinct points
    centers = _select(X, 8, seed=1)
    idx = centers.indices.numpy()
    assert len(set(idx)) == 8
    assert {tuple(p) for p in centers.points.numpy()} == {tuple(p) for p in np.unique(X, axis=0)}


def test_same_seed_same_centers_and_dtype_follow_x():
    X = np.random.default_rng(7).standard_normal((100, 3)).astype(np.float32)
    a = _select(X, 10, seed=9)
    b = _select(X, 10, seed=9)
    assert torch.equal(a.indices, b.indices)
    req = _request(X, 10, 9)
    req.X = torch.as_tensor(X)
    req.kernel = req.kernel.float()
    assert kgp.get_selector("kmeans++").select(req).points.dtype == torch.float32


def test_option_and_size_errors():
    X = np.zeros((10, 2)) + np.arange(10)[:, None]
    with pytest.raises(
        ValueError, match="selector 'kmeans\\+\\+' option 'metric': expected one of 'kernel', 'euclidean', got 'cosine'"
    ):
        _select(X, 3, metric="cosine")
    with pytest.raises(
        ValueError, match="selector 'kmeans\\+\\+' option 'n_local_trials': expected an integer >= 1, got 0"
    ):
        _select(X, 3, n_local_trials=0)
    with pytest.raises(ValueError, match="n_centers: expected 1 <= n_centers <= n_samples=10"):
        _select(X, 11)
