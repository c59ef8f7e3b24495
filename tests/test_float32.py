"""float32 you can trust: every solver's float32 fit matches its float64 fit on an ill-conditioned ARD problem.

The problem mimics what GP hyperparameter learning produces on real data: ARD lengthscales
spanning 100x (some features nearly switched off, one nearly a switch), noise 1e-3 next to an
outputscale of 1, standardised inputs. The backend pieces that make float32 accurate are tested
against float64 oracles too: float64 distances (``distance_dtype``) and float64 sums
(``accumulate``).
"""

from __future__ import annotations

import warnings

import gpytorch
import numpy as np
import pytest
import torch

import kgp

F64 = torch.float64


def ard_problem(n=3000, n_test=1000, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n + n_test, d, generator=g, dtype=F64)
    X[:, 0] = torch.round(X[:, 0] * 2)  # a discrete feature: learned lengthscales there are tiny
    lengthscale = torch.tensor([0.05, 0.3, 0.7, 1.5, 3.0, 5.0], dtype=F64)[:d]
    f = torch.sin(X[:, 1] * 2) + 0.5 * torch.cos(X[:, 2]) * X[:, 3] + 0.3 * (X[:, 0] % 2)
    y = f + 0.03 * torch.randn(n + n_test, generator=g, dtype=F64)
    return X[:n], y[:n], X[n:], y[n:], lengthscale


def ard_kernel(lengthscale, dtype):
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=lengthscale.numel()))
    kernel.base_kernel.lengthscale = lengthscale.reshape(1, -1)
    kernel.outputscale = 1.0
    return kernel.to(dtype)


def rmse(pred, y) -> float:
    return float(np.sqrt(np.mean((np.asarray(pred, dtype=np.float64) - np.asarray(y)) ** 2)))


@pytest.mark.parametrize("solver", ["exact", "falkon"])
def test_float32_matches_float64_on_ill_conditioned_ard(solver):
    X, y, Xt, yt, ls = ard_problem()
    results = {}
    for dtype in (torch.float32, F64):
        params = dict(noise=1e-3, solver=solver, random_state=0, dtype=dtype)
        if solver == "falkon":
            params["centers"] = X[:800].numpy()
        with warnings.catch_warnings():
            warnings.simplefilter("error", kgp.ConvergenceWarning)  # converged, and without a warning
            model = kgp.KernelRegressor(ard_kernel(ls, dtype), **params).fit(X.numpy(), y.numpy())
        results[dtype] = (rmse(model.predict(Xt.numpy()), yt), model)
    r32, r64 = results[torch.float32][0], results[F64][0]
    assert r64 < 0.35  # std(y) = 0.79: a meaningful fit, so the comparison below means something
    assert r32 <= 1.02 * r64, (r32, r64)
    if solver == "falkon":
        facts = results[torch.float32][1].history_[0].extras
        # the path float32 took: float64 sums, a Cholesky of K_MM with the float32 jitter, float64
        # distances (the 0.05 lengthscale on a feature with values up to +-8 breaks float32 distances)
        assert facts["accumulate"] == "float64" and facts["factorization"] == "cholesky"
        assert facts["distances"] == "float64" and facts["kernel_error"] < 1e-6
        assert facts["rank"] == 800 and facts["jitter"] >= 1e-3
        assert results[torch.float32][1].predictor_.distance_dtype == F64


def test_float32_distances_lose_accuracy_that_float64_distances_keep():
    X, _, _, _, ls = ard_problem(n=500, n_test=0)
    Z = X[:100]
    k32 = ard_kernel(ls, torch.float32)
    with torch.no_grad():
        ref = kgp.kernel_operator(ard_kernel(ls, F64), X, Z).to_dense()
        plain = kgp.kernel_operator(k32, X.float(), Z.float()).to_dense().double()
        wide = kgp.kernel_operator(k32, X.float(), Z.float(), distance_dtype=F64).to_dense().double()
    assert float((plain - ref).abs().max()) > 1e-5  # the cancellation the option exists for
    assert float((wide - ref).abs().max()) < 3e-7
    v = torch.randn(100, 2, dtype=torch.float32)
    op = kgp.kernel_operator(k32, X.float(), Z.float(), distance_dtype=F64)
    torch.testing.assert_close(op @ v, wide.float() @ v, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="distance_dtype"):
        kgp.kernel_operator(k32, X.float(), Z.float(), distance_dtype=torch.float16)


@torch.no_grad()  # the kernel's parameters require grad; these products need none
def test_accumulate_sums_in_float64():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4003, 3, generator=g)  # not a multiple of the 16-row runs
    Z = X[:300]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    kernel.outputscale = 2.0
    op = kgp.kernel_operator(kernel, X, Z)
    K = op.to_dense().double()
    v = torch.randn(300, 2, generator=g, dtype=F64)
    w = torch.randn(4003, 2, generator=g)
    out = op.fused_matmul(v, w, accumulate=F64)
    assert out.dtype == F64
    ref = K.T @ (K @ v + w.double())
    # K v + w stays float32 (relative error ~1e-7 of its terms); the transposed sum is float64
    assert float((out - ref).norm() / ref.norm()) < 1e-6
    # the sums alone (v = 0): float32 products summed over runs of 16 rows err by a few eps32, a float32
    # sum over all 4,003 rows by more. The blocked pass, whose K is the reference's to the bit (the CPU's
    # native pass forms its entries in another order, which alone differs from this K by ~eps32 per entry)
    with kgp.settings.fused_kernels("never"):
        only_w = op.fused_matmul(torch.zeros(300, 2, dtype=F64), w, accumulate=F64)
        exact = K.T @ w.double()
        err64 = float((only_w - exact).norm() / exact.norm())
        err32 = float((op.fused_matmul(torch.zeros(300, 2), w).double() - exact).norm() / exact.norm())
    assert err64 < 1e-6 and err32 > 2 * err64, (err64, err32)
    with kgp.settings.fused_kernels("never"):
        kt = op.transpose_matmul(w, accumulate=F64)
    torch.testing.assert_close(kt, only_w, rtol=0, atol=0)  # K^T w: the same sums as fused_matmul(0, w)
    # by default (the CPU's native pass where it builds) too: both are the same pass's K^T (K 0 + w)
    zero = torch.zeros(300, 2)
    torch.testing.assert_close(
        op.transpose_matmul(w, accumulate=F64), op.fused_matmul(zero, w, accumulate=F64), rtol=0, atol=0
    )
    assert float((op.transpose_matmul(w, accumulate=F64) - exact).norm() / exact.norm()) < 1e-6
    torch.testing.assert_close(op.transpose_matmul(w), (K.T @ w.double()).float(), rtol=1e-4, atol=1e-3)
    with pytest.raises(TypeError, match="accumulate"):
        op.fused_matmul(v, w, accumulate=torch.float16)


def test_kernel_expansion_keeps_its_distance_dtype_through_save_and_load():
    X, _, _, _, ls = ard_problem(n=300, n_test=0)
    k32 = ard_kernel(ls, torch.float32)
    alpha = torch.randn(50, 1)
    pred = kgp.KernelExpansion(k32, X[:50].float(), alpha, distance_dtype=F64)
    state = pred.state_dict()
    assert state["distance_dtype"] == "float64"
    again = kgp.KernelExpansion.from_state(state, k32)
    assert again.distance_dtype == F64
    torch.testing.assert_close(again.predict(X.float()), pred.predict(X.float()))
    with pytest.raises(ValueError, match="distance_dtype"):
        kgp.KernelExpansion.from_state({**state, "distance_dtype": "float8"}, k32)


def test_falkon_float32_large_lengthscale_keeps_every_center(shared_data):
    # Found by a sweep of ordinary inputs: FALKON float32 at lengthscale 10 on kin40k kept rank 157 of
    # 1,000 (the truncated eigh) and lost test R^2 0.80 -> 0.57, visible only in history_ extras.
    from conftest import load_uci

    X, y = load_uci(shared_data, "kin40k")
    X = (X - X.mean(0)) / X.std(0)
    y = (y - y.mean()) / y.std()
    Xtr, ytr, Xte, yte = X[:8000], y[:8000], X[-2000:], y[-2000:]
    scores = {}
    for dtype in ("float32", "float64"):
        model = kgp.KernelRegressor(
            "rbf", lengthscale=10.0, noise=1e-3, solver="falkon", n_centers=1000, random_state=0, dtype=dtype
        ).fit(Xtr, ytr)
        scores[dtype] = model.score(Xte, yte)
        assert model.history_[0].extras["rank"] == 1000
    assert scores["float64"] > 0.5
    assert scores["float32"] >= scores["float64"] - 0.01


def test_falkon_warns_when_it_stops_far_from_converged_and_raises_on_divergence():
    X, y, _, _, ls = ard_problem(n=2000, n_test=0)
    kernel = ard_kernel(ls, F64)
    Z = X[:600].numpy()
    with pytest.warns(kgp.ConvergenceWarning, match=r"solver 'falkon': stopped at maxiter=2 with relative residual"):
        kgp.KernelRegressor(kernel, noise=1e-4, solver="falkon", centers=Z, solver_options={"maxiter": 2}).fit(
            X.numpy(), y.numpy()
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.ConvergenceWarning)
        kgp.KernelRegressor(kernel, noise=1e-1, solver="falkon", centers=Z).fit(X.numpy(), y.numpy())
