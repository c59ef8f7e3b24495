"""Matern-1/2 blocks are accurate near zero distance in float32 (issue 25).

The expanded squared distance |u|^2 + |v|^2 - 2 u.v has an absolute error of about (d + 2) eps (|u|^2 + |v|^2);
Matern 1/2 reads it through a square root, which turned that into 5e-4 (here up to 1e-2) on the zero-distance
entries of ``K[i, j]`` blocks. Close pairs are now recomputed from their differences; the bound below is the
error the rest keep (kgp/kernels/recipes.py, ``_NEAR``).
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

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
