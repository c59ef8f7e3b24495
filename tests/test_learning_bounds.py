"""The lengthscale floor of the learning loop (``learn_options['min_lengthscale']``, kgp.learning.bounds).

Oracles: the floor's closed form (``max|x_j| sqrt(eps / 1e-3)``), GP draws with known lengthscales
(a floor above the truth must bind, a floor of 0 must not), and the kernel's own constraint objects.
"""

from __future__ import annotations

import math
import warnings

import gpytorch
import pytest
import torch

import kgp
from kgp.learning import learn_hyperparameters
from kgp.learning.bounds import DISTANCE_TOLERANCE, LengthscaleFloors
from kgp.options import InvalidOptionError


def _draw(n: int, lengthscales, seed: int):
    gen = torch.Generator().manual_seed(seed)
    X = torch.rand(n, len(lengthscales), generator=gen, dtype=torch.float64) * 4 - 2
    k = gpytorch.kernels.RBFKernel(ard_num_dims=len(lengthscales)).double()
    k.lengthscale = torch.tensor(lengthscales)
    with torch.no_grad():
        K = k(X).to_dense() + 1e-8 * torch.eye(n, dtype=torch.float64)
    f = torch.linalg.cholesky(K) @ torch.randn(n, generator=gen, dtype=torch.float64)
    return X, f + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_floor_is_per_dimension_and_the_kernels_constraint_comes_back(dtype):
    X = torch.tensor([[1.0, -100.0, 3e2], [-2.0, 50.0, 1e2]], dtype=dtype)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)).to(dtype)
    kernel.base_kernel.lengthscale = torch.tensor([0.5, 2.0, 7.0])
    original = kernel.base_kernel.raw_lengthscale_constraint
    before = kernel.base_kernel.lengthscale.detach().clone()
    expected = torch.tensor([2.0, 100.0, 3e2], dtype=torch.float64) * math.sqrt(
        torch.finfo(dtype).eps / DISTANCE_TOLERANCE
    )
    with LengthscaleFloors(kernel, X.abs().amax(0), None):
        bound = kernel.base_kernel.raw_lengthscale_constraint
        assert isinstance(bound, gpytorch.constraints.GreaterThan)
        torch.testing.assert_close(bound.lower_bound.reshape(-1).double(), expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(kernel.base_kernel.lengthscale.detach(), before)
    assert kernel.base_kernel.raw_lengthscale_constraint is original
    torch.testing.assert_close(kernel.base_kernel.lengthscale.detach(), before)


def test_isotropic_floor_uses_the_largest_row_norm():
    kernel = gpytorch.kernels.RBFKernel().double()
    scale = torch.tensor([3.0, 4.0], dtype=torch.float64)
    with LengthscaleFloors(kernel, scale, None):
        low = float(kernel.raw_lengthscale_constraint.lower_bound.reshape(-1)[0])
    assert low == pytest.approx(5.0 * math.sqrt(torch.finfo(torch.float64).eps / DISTANCE_TOLERANCE), rel=1e-9)


def test_a_floor_above_the_truth_binds_and_warns_and_zero_disables_it():
    X, y = _draw(200, [0.3, 1.5], seed=0)
    options = {"optimizer": "lbfgs", "iterations": 40}
    free = gpytorch.kernels.RBFKernel(ard_num_dims=2).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.ConvergenceWarning)
        learn_hyperparameters("exact", X, y, free, noise=0.1, options={**options, "min_lengthscale": 0})
    free_ls = free.lengthscale.detach().reshape(-1)
    assert float(free_ls[0]) < 0.5  # the truth is 0.3 (measured 0.31)

    bounded = gpytorch.kernels.RBFKernel(ard_num_dims=2).double()
    bounded.lengthscale = 1.0
    with pytest.warns(kgp.ConvergenceWarning, match=r"ended on its numerical floor 0\.8"):
        learn_hyperparameters("exact", X, y, bounded, noise=0.1, options={**options, "min_lengthscale": 0.8})
    ls = bounded.lengthscale.detach().reshape(-1)
    assert 0.8 <= float(ls[0]) <= 0.8 * 1.01
    assert float(ls[1]) > 0.8
    assert isinstance(bounded.raw_lengthscale_constraint, gpytorch.constraints.Positive)


def test_an_initial_lengthscale_below_the_floor_is_raised_with_a_warning():
    X, y = _draw(60, [1.0], seed=1)
    kernel = gpytorch.kernels.RBFKernel().double()
    kernel.lengthscale = 0.1
    with pytest.warns(kgp.ConvergenceWarning, match="starting from twice the floor"):
        learn_hyperparameters("exact", X, y, kernel, noise=0.1, options={"iterations": 1, "min_lengthscale": 0.5})


def test_min_lengthscale_rejects_negative_values():
    X, y = _draw(30, [1.0], seed=2)
    with pytest.raises(InvalidOptionError, match="min_lengthscale"):
        learn_hyperparameters(
            "exact", X, y, gpytorch.kernels.RBFKernel().double(), noise=0.1, options={"min_lengthscale": -1.0}
        )
