"""Matern-1/2 blocks are accurate near zero distance in float32.

The expanded squared distance |u|^2 + |v|^2 - 2 u.v has an absolute error of about (d + 2) eps (|u|^2 + |v|^2);
Matern 1/2 reads it through a square root, which turned that into 5e-4 (here up to 1e-2) on the zero-distance
entries of ``K[i, j]`` blocks. Close pairs are now recomputed from their differences; the bound below is the
error the rest keep (kgp/kernels/formulas.py, ``_NEAR``).
"""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch

from kgp.kernels import formulas
from kgp.operators import kernel_operator


@pytest.mark.parametrize("d", [2, 5, 20])
@pytest.mark.parametrize("grad", [False, True], ids=["fast-path", "differentiable-path"])
def test_matern12_blocks_near_zero_distance(d, grad):
    g = torch.Generator().manual_seed(d)
    X = torch.randn(400, d, generator=g) * 3 + 2
    kernel = gpytorch.kernels.MaternKernel(nu=0.5)
    kernel.lengthscale = 1.3
    kernel.raw_lengthscale.requires_grad_(grad)
    i = torch.randint(0, 400, (150,), generator=g)
    j = torch.cat([i[:75], torch.randint(0, 400, (75,), generator=g)])  # 75 zero distances, 75 others
    with torch.set_grad_enabled(grad):
        block = kernel_operator(kernel, X, X)[i][:, j].to_dense().detach().double()
    Xd = X.double() / 1.3
    expected = torch.exp(-(Xd[i].unsqueeze(1) - Xd[j].unsqueeze(0)).pow(2).sum(-1).sqrt())
    # the kept error: 5 (d + 2) eps sqrt(|u|^2 + |v|^2), the norms taken about the columns' mean at most
    norms = (Xd - Xd[j].mean(0)).pow(2).sum(1).max()
    bound = 5 * (d + 2) * torch.finfo(torch.float32).eps * float((2 * norms).sqrt())
    assert (block - expected).abs().max() <= bound
    assert torch.equal(block.diagonal()[:75], torch.ones(75, dtype=torch.float64))  # k(x, x) = 1 exactly


@pytest.mark.parametrize("outlier", [False, True], ids=["", "far-point"])
@pytest.mark.parametrize("n_hit", [0, 12, 60, 120], ids=["no-row", "few-rows", "half", "all-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_near_zero_pairs_found_whichever_share_of_rows_holds_one(n_hit, dtype, outlier):
    """Rows holding a zero distance are found from the row minima, then pair by pair: every pair is within
    the kept bound of the float64 oracle, and the duplicates give exactly 1. A far point (a center 40x
    the others' spread) makes a block-wide threshold pass most pairs; the pair test must still find these."""
    d = 6
    g = torch.Generator().manual_seed(n_hit)
    X = (torch.randn(120, d, generator=g, dtype=torch.float64) * 3 + 2).to(dtype)
    Z = torch.randn(50, d, generator=g, dtype=torch.float64).to(dtype) * 3 + 2
    if outlier:
        Z[7] = 120.0
    rows = torch.randperm(120, generator=g)[:n_hit]
    cols = torch.randint(0, 50, (n_hit,), generator=g)
    X[rows] = Z[cols]  # n_hit rows of X duplicate a center
    kernel = gpytorch.kernels.MaternKernel(nu=0.5).to(dtype)
    kernel.lengthscale = torch.tensor(1.3, dtype=dtype)  # a Python float goes through float32 in GPyTorch
    kernel.raw_lengthscale.requires_grad_(False)
    block = kernel_operator(kernel, X, Z).to_dense().double()
    Xd, Zd = X.double() / 1.3, Z.double() / 1.3
    expected = torch.exp(-(Xd.unsqueeze(1) - Zd.unsqueeze(0)).pow(2).sum(-1).sqrt())
    norms = torch.cat([Xd - Zd.mean(0), Zd - Zd.mean(0)]).pow(2).sum(1).max()
    bound = 5 * (d + 2) * torch.finfo(dtype).eps * float((2 * norms).sqrt())
    assert (block - expected).abs().max() <= bound
    assert torch.equal(block[rows, cols], torch.ones(n_hit, dtype=torch.float64))


@pytest.mark.parametrize("d", [3, 16])
def test_float32_rows_with_a_near_pair_are_recomputed_in_float64(d):
    """A float32 block whose rows all hold a near pair (integer features with many duplicates, as UCI letter):
    every row is recomputed by a float64 GEMM of the rounded inputs, so each entry is within a few float32
    roundings of the float64 oracle, plus the float64 expanded form's error read through the square root at
    the smallest nonzero distance. The pair test in float32 alone leaves 1.0e-6-1.5e-6 here, above it."""
    g = torch.Generator().manual_seed(d)
    Z = torch.randint(0, 16, (300, d), generator=g).double()
    X = torch.cat([Z[:150], torch.randint(0, 16, (50, d), generator=g).double()])
    X[150:] = Z[torch.randint(0, 300, (50,), generator=g)] + (torch.rand(50, d, generator=g) < 0.1).double()
    kernel = gpytorch.kernels.MaternKernel(nu=0.5)
    kernel.lengthscale = 2.0
    kernel.raw_lengthscale.requires_grad_(False)
    block = kernel_operator(kernel, X.float(), Z.float()).to_dense().double()
    dist = ((X / 2.0).unsqueeze(1) - (Z / 2.0).unsqueeze(0)).pow(2).sum(-1).sqrt()  # integers: exact inputs
    expected = torch.exp(-dist)
    # the kernel reads a = log2(e) r against the norms |u|^2 + |v|^2 of those scaled inputs about Z's mean
    scale = math.log2(math.e)
    centred = (torch.cat([X, Z]) / 2.0 - (Z / 2.0).mean(0)) * scale
    norms = 2 * float(centred.pow(2).sum(1).max())
    nearest = scale * float(dist[dist > 0].min())
    eps32, eps64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
    bound = 4 * eps32 + 4 * (d + 2) * eps64 * norms / nearest
    assert (block - expected).abs().max() <= bound
    assert bound < 5 * (d + 2) * eps32 * math.sqrt(norms) / 20  # far tighter than the pair test's bound
    dup = (X[:150] == Z[:150]).all(1)
    assert torch.equal(block[:150][dup, torch.arange(150)[dup]], torch.ones(int(dup.sum()), dtype=torch.float64))


@pytest.mark.parametrize("d", [formulas.WIDE_ROWS_MAX_FEATURES - 1, formulas.WIDE_ROWS_MAX_FEATURES, 784])
def test_float32_blocks_switch_to_the_pair_test_at_many_features(d, monkeypatch):
    """From ``WIDE_ROWS_MAX_FEATURES`` features on a float32 block with every row a candidate (the rows are
    centers) takes the pair test, below it the wide rows; either way within the kept bound of the float64
    oracle and exactly 1 on the duplicates."""
    calls = []
    for name in ("_wide_rows", "_exact_pairs"):
        original = getattr(formulas, name)
        monkeypatch.setattr(formulas, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    g = torch.Generator().manual_seed(d)
    Z = torch.rand(60, d, generator=g, dtype=torch.float64)  # pixel-like inputs in [0, 1)
    X = torch.cat([Z, torch.rand(20, d, generator=g, dtype=torch.float64)])
    kernel = gpytorch.kernels.MaternKernel(nu=0.5)
    kernel.lengthscale = 3.0
    kernel.raw_lengthscale.requires_grad_(False)
    block = kernel_operator(kernel, X.float(), Z.float()).to_dense().double()
    Xd, Zd = X.float().double() / 3.0, Z.float().double() / 3.0
    expected = torch.exp(-(Xd.unsqueeze(1) - Zd.unsqueeze(0)).pow(2).sum(-1).sqrt())
    norms = torch.cat([Xd - Zd.mean(0), Zd - Zd.mean(0)]).pow(2).sum(1).max()
    bound = 5 * (d + 2) * torch.finfo(torch.float32).eps * float((2 * norms).sqrt())
    assert (block - expected).abs().max() <= bound
    assert torch.equal(block[:60].diagonal(), torch.ones(60, dtype=torch.float64))
    wide = d < formulas.WIDE_ROWS_MAX_FEATURES
    assert calls and set(calls) == {"_wide_rows" if wide else "_exact_pairs"}
