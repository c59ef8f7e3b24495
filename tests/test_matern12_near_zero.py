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
