"""``KernelOperator.residual_matmul``: ``u = K v + w`` and ``K^T u`` from one formation of each block, against a
float64 oracle from the pairwise differences, on the native CPU pass and the blocked pass alike."""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch

import kgp
from kgp import settings
from kgp.kernels.formulas import EXP_FLOOR
from kgp.operators import fused_cpu, residual
from kgp.testing import LargestTensor

NATIVE = fused_cpu.native_error() is None
FACTOR = {"matern12": 1.0, "matern32": math.sqrt(3.0), "matern52": math.sqrt(5.0)}


def _kernel(family: str, dtype: torch.dtype, lengthscale: float = 1.3, outputscale: float = 2.5):
    base = {
        "rbf": lambda: gpytorch.kernels.RBFKernel(),
        "matern12": lambda: gpytorch.kernels.MaternKernel(nu=0.5),
        "matern32": lambda: gpytorch.kernels.MaternKernel(nu=1.5),
        "matern52": lambda: gpytorch.kernels.MaternKernel(nu=2.5),
        "linear": lambda: gpytorch.kernels.LinearKernel(),
        "periodic": lambda: gpytorch.kernels.PeriodicKernel(),
    }[family]()
    if family not in ("linear", "periodic"):
        base.lengthscale = torch.tensor(lengthscale)
    kernel = gpytorch.kernels.ScaleKernel(base)
    kernel.outputscale = torch.tensor(outputscale)
    return kernel.to(dtype).requires_grad_(False)


def _oracle(kernel, family: str, X: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    """The scaled kernel in float64 from the rounded inputs: stationary families from the differences (RBF
    floored as kgp floors it), others by GPyTorch in float64."""
    scale = float(kernel.outputscale)
    if family in ("linear", "periodic"):
        with torch.no_grad():
            return kernel.double()(X.double(), Z.double()).to_dense()
    lengthscale = float(kernel.base_kernel.lengthscale)
    r2 = (X.double()[:, None, :] / lengthscale - Z.double()[None, :, :] / lengthscale).square().sum(-1)
    if family == "rbf":
        return scale * torch.exp(-0.5 * r2).clamp_min(math.exp(EXP_FLOOR[X.dtype]))
    a = FACTOR[family] * r2.sqrt()
    poly = {"matern12": 1.0, "matern32": 1 + a, "matern52": 1 + a + a * a / 3}[family]
    return scale * poly * torch.exp(-a)


def _problem(dtype, k, n=203, m=157, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    Z = torch.randn(m, d, generator=g, dtype=torch.float64)
    # the first 50 rows are points among the columns, at scattered positions
    own = torch.full((n,), -1, dtype=torch.long)
    own[:50] = torch.randperm(m, generator=g)[:50]
    X[:50] = Z[own[:50]]
    v = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    return X.to(dtype), Z.to(dtype), own, v.to(dtype), w.to(dtype)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, terms: int) -> None:
    """Within the rounding of a sum of ``terms`` products of kernel entries each within about 32 eps (the
    distance GEMM's cancellation at |x| ~ 3 lengthscales; the exponential's own rounding is below 1 eps)."""
    eps = torch.finfo(dtype).eps
    scale = float(expected.abs().max())
    err = float((got.double() - expected).abs().max())
    assert err <= 64 * eps * math.sqrt(terms) * scale, (err / scale, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", ["rbf", "matern32", "matern52", "matern12", "linear", "periodic"])
@pytest.mark.parametrize("mode", ["auto", "never"])
@pytest.mark.parametrize("k", [1, 3])
def test_residual_and_its_transpose_against_the_dense_oracle(dtype, family, mode, k):
    """Both outputs, with an offset, own columns whose entry is the exact ``k(x, x)`` (the outputscale), an
    outputscale, rows and columns that fill no tile or vector, on the native pass ("auto": RBF and Matern 3/2,
    5/2) and the blocked one ("never"; Matern 1/2, Linear and the generic Periodic kernel always)."""
    X, Z, own, v, w = _problem(dtype, k)
    kernel = _kernel(family, dtype)
    K = _oracle(kernel, family, X, Z)
    rows = torch.arange(50)
    K[rows, own[:50]] = _oracle(kernel, family, X[:50], X[:50]).diagonal()
    u_expected = K @ v.double() + w.double()
    t_expected = K.T @ u_expected
    op = kgp.kernel_operator(kernel, X, Z)
    with settings.fused_kernels(mode), torch.no_grad():
        u, t = op.residual_matmul(v, w, own_columns=own)
        u_only, none = op.residual_matmul(v, w, own_columns=own, transpose=False)
    assert none is None and u.dtype == t.dtype == dtype and u.shape == (203, k) and t.shape == (157, k)
    _close(u, u_expected, dtype, 157)
    _close(t, t_expected, dtype, 203 * 157)
    torch.testing.assert_close(u_only, u, rtol=0, atol=0)
    if family in ("rbf", "matern32", "matern52", "matern12"):  # the own entries are exact: k(x, x) = outputscale
        op_rows = kgp.kernel_operator(kernel, X[:50], Z)
        e = torch.zeros(157, 1, dtype=dtype)
        for i in (0, 17, 49):
            e.zero_()
            e[own[i]] = 1.0
            with settings.fused_kernels(mode), torch.no_grad():
                col = op_rows.residual_matmul(e, own_columns=own[:50], transpose=False)[0]
            assert float(col[i]) == float(kernel.outputscale)


@pytest.mark.skipif(not NATIVE, reason="the native CPU pass cannot be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_path_runs_without_a_block_and_matches_the_blocked_pass(dtype, monkeypatch):
    """Where the native pass applies it runs (once per call), forms no ``n x m`` tensor and agrees with the
    blocked pass to rounding; vector input gives vectors."""
    X, Z, own, v, w = _problem(dtype, 1, n=1003, m=517, seed=1)
    kernel = _kernel("rbf", dtype)
    calls = []
    original = fused_cpu.native_residual
    monkeypatch.setattr(fused_cpu, "native_residual", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    monkeypatch.setattr(residual, "native_residual", fused_cpu.native_residual)
    op = kgp.kernel_operator(kernel, X, Z)
    with torch.no_grad(), LargestTensor() as probe:
        u, t = op.residual_matmul(v[:, 0], w[:, 0], own_columns=own)
    assert calls == [1]
    assert probe.largest < 1003 * 517 // 8, probe.shape
    assert u.shape == (1003,) and t.shape == (517,)
    with settings.fused_kernels("never"), torch.no_grad():
        u_b, t_b = op.residual_matmul(v, w, own_columns=own)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(u, u_b[:, 0], rtol=64 * eps, atol=64 * eps * float(u_b.abs().max()))
    torch.testing.assert_close(t, t_b[:, 0], rtol=64 * eps, atol=64 * eps * float(t_b.abs().max()) * 32)


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_square_operator_keeps_its_exact_diagonal(mode):
    """On ``K(X, X)`` the residual uses the exact diagonal (as ``K @ v`` on the blocked pass) without own
    columns; at |x| / lengthscale ~ 1e12 the distance GEMM cancels to noise and only that diagonal is right,
    so ``K = outputscale I`` there (the other entries at the exponent's floor): ``u = 2.5 v + w``."""
    g = torch.Generator().manual_seed(2)
    X = torch.randn(300, 4, generator=g, dtype=torch.float64) * 1e12
    v = torch.randn(300, 1, generator=g, dtype=torch.float64)
    w = torch.randn(300, 1, generator=g, dtype=torch.float64)
    kernel = _kernel("rbf", torch.float64)
    with settings.fused_kernels(mode), torch.no_grad():
        u, t = kgp.kernel_operator(kernel, X, X.clone()).residual_matmul(v, w)
        blocked = kgp.kernel_operator(kernel, X, X.clone()) @ v
    scale = float(kernel.outputscale)  # 2.5 as GPyTorch's softplus holds it
    torch.testing.assert_close(u, scale * v + w, rtol=1e-15, atol=0)
    torch.testing.assert_close(t, scale * u, rtol=1e-15, atol=0)
    torch.testing.assert_close(u, blocked + w, rtol=1e-15, atol=1e-15 * float(u.abs().max()))


def test_bad_arguments_are_refused():
    X, Z, own, v, w = _problem(torch.float64, 1)
    op = kgp.kernel_operator(_kernel("rbf", torch.float64), X, Z)
    with pytest.raises(ValueError, match="expected v of shape"):
        op.residual_matmul(v[:10])
    with pytest.raises(ValueError, match="own_columns"):
        op.residual_matmul(v, own_columns=own.double())
    with pytest.raises(TypeError, match="dtype"):
        op.residual_matmul(v.float())
    with pytest.raises(NotImplementedError, match="no_grad"):
        op.residual_matmul(v.clone().requires_grad_(True))
