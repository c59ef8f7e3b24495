"""The estimator end to end on a CUDA device, against float64 oracles computed on the CPU.

Every test here is marked ``cuda`` and skipped without a device (tests/conftest.py). They check what
the unit-level CUDA tests (test_operator, test_falkon, test_bless) and the conformance suite's device
checks do not: the public ``KernelRegressor`` path -- plan, recipe, learning, solve, predictive
variance -- keeps every tensor on the device and computes the same numbers as the dense oracles, and
a fit under a memory budget allocates no ``n x M`` block on the device (``torch.cuda`` counts every
allocation, so that bound is deterministic, unlike a host RSS reading).
"""

from __future__ import annotations

import pytest
import torch

import kgp
from kgp.operators.blocks import ACCELERATOR_BLOCK_BYTES

pytestmark = pytest.mark.cuda

F64, F32 = torch.float64, torch.float32
DEVICE = "cuda"


def data(n: int, d: int = 4, seed: int = 0, n_test: int = 400):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n + n_test, d, generator=g, dtype=F64)
    w = torch.randn(d, 1, generator=g, dtype=F64)
    y = (torch.sin(X @ w) + 0.1 * torch.randn(n + n_test, 1, generator=g, dtype=F64))[:, 0]
    return X[:n], y[:n], X[n:], y[n:]


def rbf(lengthscale: float):
    kernel = kgp.kernels.make_kernel("rbf", 1.0).to(F64).requires_grad_(False)
    # a float64 tensor: a Python float goes through GPyTorch's constraint in float32 (5e-8 off, 1e-7 in K)
    kernel.lengthscale = torch.tensor(lengthscale, dtype=F64)
    return kernel


def nystrom_oracle(X, y, Z, Xq, noise: float, lengthscale: float):
    """Predictions of the Nystrom KRR ``(K_nM^T K_nM + noise K_MM) a = K_nM^T y`` (Rudi et al. 2017, eq. 3),
    dense float64 on the CPU."""
    k = rbf(lengthscale)
    KnM = kgp.kernel_operator(k, X, Z).to_dense()
    KMM = kgp.kernel_operator(k, Z, Z).to_dense()
    a = torch.linalg.solve(KnM.T @ KnM + noise * KMM, KnM.T @ y[:, None])
    return (kgp.kernel_operator(k, Xq, Z).to_dense() @ a)[:, 0]


def exact_oracle(X, y, Xq, noise: float, lengthscale: float):
    """Posterior mean and latent variance of the exact GP (Rasmussen & Williams, eqs. 2.25-2.26), float64."""
    k = rbf(lengthscale)
    K = kgp.kernel_operator(k, X, X).to_dense() + noise * torch.eye(X.shape[0], dtype=F64)
    L = torch.linalg.cholesky(K)
    Kq = kgp.kernel_operator(k, Xq, X).to_dense()
    mean = Kq @ torch.cholesky_solve(y[:, None], L)
    V = torch.linalg.solve_triangular(L, Kq.T, upper=False)
    var = kgp.kernel_operator(k, Xq, Xq).diagonal() - (V * V).sum(0)
    return mean[:, 0], var


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [F64, F32])
def test_falkon_regressor_on_cuda_matches_the_nystrom_oracle(dtype):
    X, y, Xq, _ = data(4000)
    Z = X[:200]
    noise, ls = 0.05, 1.0  # cond(K_MM) ~ 4e5: the dense oracle itself is accurate to ~1e-10
    model = kgp.KernelRegressor(
        "rbf",
        lengthscale=ls,
        noise=noise,
        solver="falkon",
        centers=Z.to(DEVICE, dtype),
        solver_options={"maxiter": 200, "tol": 0.0},
        random_state=0,
    ).fit(X.to(DEVICE, dtype), y.to(DEVICE, dtype))
    assert model.predictor_.alpha.device.type == "cuda"
    pred = model.predict(Xq.to(DEVICE, dtype))
    assert pred.device.type == "cuda" and pred.dtype == dtype
    # Converged CG: the float64 fit is the oracle's solution to rounding; a float32 fit carries the input
    # rounding of K_nM (eps32 relative per entry) through a system whose preconditioned condition number
    # is O(1) (Def. 3), so its predictions are good to a small multiple of sqrt(n) eps32 relative.
    tol = 1e-8 if dtype == F64 else 50 * X.shape[0] ** 0.5 * torch.finfo(F32).eps
    assert rel(pred, nystrom_oracle(X, y, Z, Xq, noise, ls)) < tol


def test_exact_regressor_on_cuda_mean_and_std_match_the_exact_gp():
    X, y, Xq, _ = data(1500)
    noise, ls = 0.05, 1.2
    model = kgp.KernelRegressor("rbf", lengthscale=ls, noise=noise, solver="exact").fit(X.to(DEVICE), y.to(DEVICE))
    mean, std = model.predict(Xq.to(DEVICE), return_std=True)
    assert mean.device.type == "cuda" and std.device.type == "cuda"
    ref_mean, ref_var = exact_oracle(X, y, Xq, noise, ls)
    # float64 Cholesky of K + noise I, condition ~ 7e3: rounding ~ eps64 * 7e3 ~ 2e-12, and the variance
    # subtracts two O(1) numbers where the data pin f down (relative error there grows by 1 / var)
    assert rel(mean, ref_mean) < 1e-10
    assert rel(std**2, ref_var.clamp_min(0)) < 1e-8


def test_learned_gp_on_cuda_matches_the_cpu_fit():
    # learn="auto" on 1,200 rows: the subset is every row, so the CPU and the device optimise the same
    # exact marginal likelihood from the same start; only rounding differs between them.
    X, y, Xq, yq = data(1200, d=3, seed=1)
    kwargs = dict(ard=True, learn="auto", random_state=0)
    cpu = kgp.KernelRegressor("rbf", **kwargs).fit(X, y)
    gpu = kgp.KernelRegressor("rbf", **kwargs).fit(X.to(DEVICE), y.to(DEVICE))
    assert next(gpu.kernel_.parameters()).device.type == "cuda"
    pred_cpu, pred_gpu = cpu.predict(Xq), gpu.predict(Xq.to(DEVICE))
    assert pred_gpu.device.type == "cuda"
    rmse_cpu = float(((pred_cpu - yq) ** 2).mean().sqrt())
    rmse_gpu = float(((pred_gpu.cpu() - yq) ** 2).mean().sqrt())
    # the optimiser may stop a step apart on the two devices; the fitted GP must be the same one
    assert rmse_gpu < 1.02 * rmse_cpu
    assert rel(pred_gpu, pred_cpu) < 1e-2
    assert abs(gpu.noise_ - cpu.noise_) < 0.05 * cpu.noise_


def test_falkon_fit_on_cuda_allocates_no_n_by_m_block_under_a_budget():
    n, m, d = 200_000, 1_000, 5
    g = torch.Generator().manual_seed(3)
    X = torch.randn(n, d, generator=g).to(DEVICE)
    y = X[:, 0].sin()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    budget = 32 * 2**20
    with kgp.settings.memory_budget(budget):
        kgp.KernelRegressor(
            "rbf",
            lengthscale=2.0,
            noise=1e-3,
            solver="falkon",
            n_centers=m,
            solver_options={"maxiter": 5},
            random_state=0,
        ).fit(X, y)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    n_by_m = n * m * 4  # 800 MB in float32
    # the budget plus the M x M factors (float64 for a float32 fit: a few 8 MB arrays) and O(n) vectors
    assert peak < budget + 8 * m * m * 8 + 16 * n * 8
    assert peak < n_by_m / 4


def test_operator_on_cuda_uses_accelerator_sized_blocks():
    X = torch.randn(100_000, 3, device=DEVICE)
    Z = X[:2_000]
    op = kgp.kernel_operator(rbf(1.0).to(F32).to(DEVICE), X, Z)
    rows = op.block_rows()
    assert rows * Z.shape[0] * 4 > 64 * 2**20  # larger than a CPU's block
    assert rows <= max(64, ACCELERATOR_BLOCK_BYTES // (Z.shape[0] * 4))
    v = torch.randn(2_000, 1, device=DEVICE)
    dense = kgp.kernel_operator(rbf(1.0), X.double().cpu(), Z.double().cpu()).to_dense()
    ref = dense.T @ (dense @ v.double().cpu())
    assert rel(op.fused_matmul(v), ref) < 100 * torch.finfo(F32).eps * X.shape[0] ** 0.5


def test_automatic_budget_on_the_card_is_at_most_a_fifth_of_its_memory(monkeypatch):
    from kgp import settings

    device = torch.device(DEVICE, torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    assert settings.device_memory_budget(device) == total // 5
    # an automatic host default larger than the card (8 GiB is not, on a 40 GiB or larger card)
    monkeypatch.setattr(settings.memory_budget, "_default", settings._AutomaticBudget(total))
    assert settings.memory_budget.value(device) == total // 5
    assert settings.memory_budget.value("cpu") == total
    with settings.memory_budget(total):  # a budget the user sets applies as it is
        assert settings.memory_budget.value(device) == total
