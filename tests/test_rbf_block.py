"""The RBF block's hand-written backward (kgp/kernels/rbf_block.py) against autograd and GPyTorch."""

from __future__ import annotations

import gpytorch
import pytest
import torch

import kgp
from kgp.kernels.rbf_block import rbf_block

F64 = torch.float64


def test_gradcheck_in_u_v_and_the_scale():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(7, 3, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(5, 3, generator=g, dtype=F64, requires_grad=True)
    s = torch.tensor(1.7, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: rbf_block(a, b, c), (u, v, s))
    assert torch.autograd.gradcheck(lambda a, b: rbf_block(a, b), (u, v))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_exact_learning_gradients_match_gpytorch_autograd(dtype):
    # the gradient of GPyTorch's exact marginal likelihood (its own autograd through its RBF) against
    # kgp's dense kernel path with the closed-form backward, on ARD lengthscales, outputscale and X
    g = torch.Generator().manual_seed(1)
    X = torch.randn(60, 4, generator=g, dtype=F64)
    y = torch.sin(X[:, 0]) + 0.1 * torch.randn(60, generator=g, dtype=F64)
    grads = {}
    for name in ("kgp", "gpytorch"):
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=4)).to(dtype)
        kernel.base_kernel.lengthscale = torch.tensor([0.7, 1.3, 2.0, 0.9])
        kernel.outputscale = 1.4
        Xg = X.to(dtype).clone().requires_grad_(True)
        if name == "kgp":
            K = kgp.kernel_operator(kernel, Xg).to_dense()
        else:
            with gpytorch.settings.lazily_evaluate_kernels(False):
                K = kernel(Xg, Xg).to_dense()
        C = K + 0.1 * torch.eye(60, dtype=dtype)
        L = torch.linalg.cholesky(C)
        alpha = torch.cholesky_solve(y.to(dtype)[:, None], L)
        nll = 0.5 * (y.to(dtype)[:, None] * alpha).sum() + torch.log(L.diagonal()).sum()
        nll.backward()
        grads[name] = [kernel.base_kernel.raw_lengthscale.grad, kernel.raw_outputscale.grad, Xg.grad]
    # float64: rounding of an n = 60 problem; float32: eps32 times the condition of C (~1e2)
    tol = 1e-9 if dtype == F64 else 2e-3
    for ours, theirs in zip(grads["kgp"], grads["gpytorch"]):
        assert (ours.double() - theirs.double()).abs().max() <= tol * theirs.double().abs().max()


def test_the_diagonal_of_k_x_x_is_exactly_the_outputscale():
    X = torch.randn(40, 3, generator=torch.Generator().manual_seed(2), dtype=F64) * 1e3
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(F64)
    kernel.outputscale = 2.5
    with torch.enable_grad():
        K = kgp.kernel_operator(kernel, X.requires_grad_(True)).to_dense()
    assert torch.equal(K.diagonal(), torch.full((40,), 2.5, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_far_pairs_stay_normal_numbers_and_their_gradients_vanish(dtype):
    from kgp.kernels.exp_floor import EXP_FLOOR

    # pairs 30-60 lengthscales apart: exp(-d^2 / 2) is subnormal or zero, which made exp 7-10x slower, and
    # entries left at the floor made the backward's GEMMs 4x slower
    g = torch.Generator().manual_seed(4)
    u = (torch.randn(50, 3, generator=g, dtype=F64) * 20).to(dtype).requires_grad_(True)
    v = (torch.randn(40, 3, generator=g, dtype=F64) * 20).to(dtype).requires_grad_(True)
    K = rbf_block(u, v)
    floor = torch.exp(torch.tensor(EXP_FLOOR[dtype], dtype=dtype))
    d2 = torch.cdist(u.detach().double(), v.detach().double()).square()
    assert (d2 > -2 * EXP_FLOOR[dtype]).float().mean() > 0.3  # the case the cap is for
    assert bool(((K == 0) | (K >= floor * (1 - 1e-6))).all())  # no subnormal entry
    exact = torch.exp(-0.5 * d2)
    # every entry is the exact value, or 0 where the exact value lies below the floor; the expanded
    # distance |u|^2 + |v|^2 - 2 u.v errs by about eps (|u|^2 + |v|^2), and K relatively by half of that
    norms = float(u.detach().double().square().sum(1).max() + v.detach().double().square().sum(1).max())
    rtol = 10 * torch.finfo(dtype).eps * norms
    expected = torch.where(exact < float(floor) * (1 - rtol), 0.0, exact)
    near = (exact - float(floor)).abs() <= rtol * float(floor)  # either side of the floor, within rounding
    assert torch.allclose(K.double()[~near], expected[~near], rtol=rtol, atol=0)
    # gradients against autograd through the uncapped double-precision formula: the capped entries'
    # terms are of the floor's size, so they agree to that absolute level plus rounding of the rest
    w = torch.randn(50, 40, generator=g, dtype=F64)
    (K.double() * w).sum().backward()
    u64, v64 = u.detach().double().requires_grad_(True), v.detach().double().requires_grad_(True)
    (torch.exp(-0.5 * torch.cdist(u64, v64).square()) * w).sum().backward()
    scale = float(u64.grad.abs().max()) + 1.0
    atol = 1e3 * float(floor) + 100 * torch.finfo(dtype).eps * scale
    assert torch.allclose(u.grad.double(), u64.grad, rtol=0, atol=atol)
    assert torch.allclose(v.grad.double(), v64.grad, rtol=0, atol=atol)
