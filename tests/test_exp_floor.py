"""The exponent floor of kernel blocks (kgp.kernels.exp_floor): float32 entries stay at or above sqrt(tiny).

A product of a kernel entry with a vector entry is subnormal when the entry is near float32's smallest
normal number; subnormal operands slow the products' GEMMs on some CPUs (UCI parkinsons' float32 FALKON
iteration takes twice as long with a floor of e^-80, docs/backend.md).
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

import kgp
from kgp.kernels.exp_floor import EXP_FLOOR

SQRT_TINY32 = torch.finfo(torch.float32).tiny ** 0.5  # 2^-63


def _kernel(family: str):
    if family == "rbf":
        k = gpytorch.kernels.RBFKernel()
    else:
        k = gpytorch.kernels.MaternKernel(nu={"matern12": 0.5, "matern32": 1.5, "matern52": 2.5}[family])
    k.lengthscale = torch.tensor(0.05)
    return k.to(torch.float32).requires_grad_(False)


@pytest.mark.parametrize("family", ["rbf", "matern12", "matern32", "matern52"])
def test_float32_blocks_hold_no_entry_whose_products_can_be_subnormal(family):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(300, 2, generator=g) * 20  # far apart at lengthscale 0.05: most true values underflow
    Z = torch.rand(200, 2, generator=g) * 20
    K = kgp.kernel_operator(_kernel(family), X, Z).to_dense()
    exact = kgp.kernel_operator(_kernel(family).double(), X.double(), Z.double()).to_dense()
    assert float((exact < SQRT_TINY32).double().mean()) > 0.9  # the case the floor is for
    assert float(K.min()) >= SQRT_TINY32
    # any vector entry of at least 2^-60 times a kernel entry is a normal number
    assert float(K.min()) * 2.0**-60 >= torch.finfo(torch.float32).tiny
    # the floor moves the entries it touches by less than 1e-15 (kernel values are at most 1; float32 resolves
    # 6e-8): e^-43 for the RBF kernel, e^-43 (1 + 43 + 43^2 / 3) for Matern 5/2
    floored = exact < SQRT_TINY32
    assert float((K.double() - exact)[floored].abs().max()) < 1e-15
    assert EXP_FLOOR[torch.float32] <= -43.0
