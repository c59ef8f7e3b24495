"""The fused GPU pass (kgp.operators.fused_gpu) against dense float64 oracles and the blocked pass.

The CUDA tests are skipped without a device (tests/conftest.py). On the CPU only the gating is
tested: the fused kernels never run there, and the setting validates its value.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings

import gpytorch
import pytest
import torch

import kgp
from kgp.operators import fused_gpu, products
from kgp.operators.fused_gpu import fused_applies

F64, F32 = torch.float64, torch.float32
EPS = {F32: torch.finfo(F32).eps, F64: torch.finfo(F64).eps}


def kernel(family: str, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if family == "rbf":
        base = gpytorch.kernels.RBFKernel(ard_num_dims=d)
    else:
        base = gpytorch.kernels.MaternKernel(nu={"matern32": 1.5, "matern52": 2.5}[family], ard_num_dims=d)
    k = gpytorch.kernels.ScaleKernel(base).to(dtype).requires_grad_(False)
    k.outputscale = torch.tensor(1.7, dtype=dtype)
    k.base_kernel.lengthscale = (0.8 + torch.rand(d, generator=g, dtype=F64)).to(dtype) * d**0.5
    return k


def problem(n: int, m: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=F64) + 2.0  # off-center: the operator's centering matters
    Z = torch.randn(m, d, generator=g, dtype=F64) + 2.0
    v = torch.randn(m, 1, generator=g, dtype=F64)
    w = torch.randn(n, 1, generator=g, dtype=F64)
    return X, Z, v, w


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def tolerance(dtype: torch.dtype, n: int, d: int) -> float:
    # every kernel entry carries the exponent's rounding, ~eps (d + 2) |u|^2 with |u|^2 ~ d here, and a sum
    # of n terms adds ~eps sqrt(n) relative; 20x covers both, and is ~1e3x below any real defect
    return 20 * EPS[dtype] * ((d + 2) * d + n**0.5)


def test_fused_kernels_never_run_on_the_cpu():
    X, Z, _, _ = problem(50, 10, 3)
    op = kgp.kernel_operator(kernel("rbf", 3, F32), X.float(), Z.float())
    for mode in ("auto", "always"):
        with kgp.settings.fused_kernels(mode):
            assert not fused_applies(op.workspace, 1)


def test_fused_kernels_setting_validates_its_value_and_defaults_to_auto():
    assert kgp.settings.fused_kernels.value() == "auto"
    with pytest.raises(ValueError, match="fused_kernels"):
        kgp.settings.fused_kernels("sometimes")
    for mode in ("always", "never", "auto"):
        with kgp.settings.fused_kernels(mode):
            assert kgp.settings.fused_kernels.value() == mode


def test_fused_kernels_apply_only_where_they_were_measured_faster(monkeypatch):
    # the gate without a GPU: pretend the interpreter runs the kernels on the CPU
    monkeypatch.setattr(fused_gpu, "_interpreting", lambda: True)
    monkeypatch.setattr(fused_gpu, "_kernels", lambda: object())
    X, Z, _, _ = problem(60, 12, 3)
    X32, Z32 = X.float(), Z.float()

    def applies(op, k=1, **settings):
        with kgp.settings.fused_kernels("auto"), kgp.settings.memory_budget(settings.get("budget", 2**31)):
            return fused_applies(op.workspace, k)

    assert applies(kgp.kernel_operator(kernel("rbf", 3, F32), X32, Z32))
    assert applies(kgp.kernel_operator(kernel("matern32", 3, F32), X32, Z32))
    assert applies(kgp.kernel_operator(kernel("matern52", 3, F32), X32, Z32))
    op = kgp.kernel_operator(kernel("rbf", 3, F32), X32, Z32)
    with kgp.settings.fused_kernels("never"):
        assert not fused_applies(op.workspace, 1)  # the default
    assert not applies(op, k=2)  # several columns: the blocked pass's GEMMs
    # the tensor-core form runs fixed tile shapes: no tuner, so no 1 GiB floor on the budget
    assert fused_gpu._form(X32.device) == "dot"
    assert applies(op, budget=fused_gpu.TUNING_BUDGET - 1)
    assert not applies(op, budget=4 * 60 * 5 * 4 - 1)  # the transposed rows must fit the budget
    # wider than the tensor-core kernels were measured for: the blocked pass (the FMA loop has no such cap)
    d_wide = fused_gpu.DOT_MAX_DIM - 1
    Xw, Zw, _, _ = problem(60, 12, d_wide)
    assert not applies(kgp.kernel_operator(kernel("rbf", d_wide, F32), Xw.float(), Zw.float()))
    assert applies(kgp.kernel_operator(kernel("rbf", d_wide - 1, F32), Xw[:, :-1].float(), Zw[:, :-1].float()))
    monkeypatch.setattr(fused_gpu, "TENSOR_CORES", False)  # the FMA loop: tuned on first use
    assert applies(kgp.kernel_operator(kernel("rbf", d_wide, F32), Xw.float(), Zw.float()))
    assert applies(op)
    assert not applies(op, budget=fused_gpu.TUNING_BUDGET - 1)  # tuning would exceed the budget
    monkeypatch.setattr(fused_gpu, "TENSOR_CORES", True)
    assert not applies(kgp.kernel_operator(kernel("rbf", 3, F64), X, Z))  # float64: measured slower
    assert not applies(kgp.kernel_operator(kernel("rbf", 3, F32), X32, Z32, distance_dtype=F64))
    assert not applies(kgp.kernel_operator(kernel("rbf", 3, F32), Z32, Z32))  # K(X, X): exact diagonal
    m12 = gpytorch.kernels.MaternKernel(nu=0.5)
    assert not applies(kgp.kernel_operator(m12, X32, Z32))  # needs the blocked small-distance correction
    v = torch.ones(12, 1, requires_grad=True)
    with kgp.settings.fused_kernels("auto"), kgp.settings.memory_budget(2**31):
        assert fused_applies(op.workspace, 1, v.detach())
        assert not fused_applies(op.workspace, 1, v)  # a right-hand side that records a gradient: the blocked path
        with torch.no_grad():
            assert fused_applies(op.workspace, 1, v)
    with kgp.settings.kernel_cache("auto"):
        stored = kgp.kernel_operator(kernel("rbf", 3, F32), X32, Z32)
        with kgp.settings.fused_kernels("never"):
            stored.fused_matmul(torch.ones(12, 1))
            stored.fused_matmul(torch.ones(12, 1))  # K is kept from the second product on
        assert not applies(stored)  # reading the stored K is faster still


def test_fused_kernels_without_triton_fall_back_and_warn_only_when_asked_for(monkeypatch):
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("Triton is installed here")
    monkeypatch.setattr(fused_gpu, "_interpreting", lambda: True)  # past the device check, to the import
    fused_gpu._kernels.cache_clear()
    fused_gpu._triton_error.cache_clear()
    X, Z, _, _ = problem(40, 8, 3)
    op = kgp.kernel_operator(kernel("rbf", 3, F32), X.float(), Z.float())
    try:
        with kgp.settings.fused_kernels("always"), kgp.settings.memory_budget(2**31):
            with pytest.warns(RuntimeWarning, match="Triton is not usable"):
                assert not fused_applies(op.workspace, 1)
        with kgp.settings.fused_kernels("auto"), kgp.settings.memory_budget(2**31), warnings.catch_warnings():
            warnings.simplefilter("error")  # the default: the blocked pass, without a word
            assert not fused_applies(op.workspace, 1)
    finally:
        fused_gpu._kernels.cache_clear()
        fused_gpu._triton_error.cache_clear()


def test_auto_leaves_cards_without_tensor_cores_to_the_blocked_pass(monkeypatch):
    monkeypatch.setattr(fused_gpu, "_interpreting", lambda: True)
    monkeypatch.setattr(fused_gpu, "_kernels", lambda: object())
    monkeypatch.setattr(fused_gpu, "_tensor_cores", lambda device: False)  # a card before compute capability 8.0
    X, Z, _, _ = problem(60, 12, 3)
    op = kgp.kernel_operator(kernel("rbf", 3, F32), X.float(), Z.float())
    assert fused_gpu._form(X.device) == "fma"
    with kgp.settings.memory_budget(2**31):
        with kgp.settings.fused_kernels("auto"):
            assert not fused_applies(op.workspace, 1)
        with kgp.settings.fused_kernels("always"):  # the tuned FMA loop, where a user asks for it
            assert fused_applies(op.workspace, 1)


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_only_the_fma_loop_leaves_k_to_be_stored(monkeypatch, tensor_cores):
    # the tensor-core form was faster than reading a stored K (docs/backend.md): it never stores one,
    # so FALKON's kernel_cache="auto" keeps the n x M matrix off the card; the FMA loop stores it as before
    monkeypatch.setattr(fused_gpu, "_interpreting", lambda: True)
    monkeypatch.setattr(fused_gpu, "_kernels", lambda: object())
    monkeypatch.setattr(fused_gpu, "TENSOR_CORES", tensor_cores)
    X, Z, _, _ = problem(60, 12, 3)
    with kgp.settings.kernel_cache("auto"), kgp.settings.memory_budget(2**31), torch.no_grad():
        op = kgp.kernel_operator(kernel("rbf", 3, F32), X.float(), Z.float())
        uses = [fused_gpu.use_fused(op.workspace, 1) for _ in range(3)]
    if tensor_cores:
        assert uses == [True, True, True] and op._cache.get("stored") is None
    else:
        assert uses == [True, False, False]  # K is stored at the second use and read from then on
        assert op._cache.get("stored") is not None


# (family, d): d = 20 takes the kernels' loop over DIM = 22 > UNROLL_DIM instead of the unrolled steps
CASES = [("rbf", 6), ("matern32", 6), ("matern52", 6), ("rbf", 20)]


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["dot", "fma"])
@pytest.mark.parametrize("family,d", CASES)
def test_fused_products_on_cuda_match_the_dense_oracle(family, d, form, monkeypatch):
    """Both forms of the distance part: tensor cores (3xTF32, compute capability 8.0 on) and the FMA loop."""
    if form == "dot" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 tensor cores need compute capability 8.0")
    monkeypatch.setattr(fused_gpu, "TENSOR_CORES", form == "dot")
    assert fused_gpu._form(torch.device("cuda")) == form
    n, m = 20_000, 700  # several row splits of the K^T u kernel and a partial last tile
    X, Z, v, w = problem(n, m, d)
    k64 = kernel(family, d, F64)
    dense = k64(X, Z).to_dense()
    oracle = {"Kv": dense @ v, "KTw": dense.T @ w, "fused": dense.T @ (dense @ v + w)}
    k = kernel(family, d, F32).to("cuda")
    Xd, Zd, vd, wd = (t.to("cuda", F32) for t in (X, Z, v, w))
    with torch.no_grad(), kgp.settings.fused_kernels("auto"), kgp.settings.memory_budget(2**32):
        op = kgp.kernel_operator(k, Xd, Zd)
        assert fused_applies(op.workspace, 1)
        got = {"Kv": op @ vd, "KTw": op.mT @ wd, "fused": op.fused_matmul(vd, wd)}
        wide = op.fused_matmul(vd, wd, accumulate=F64)
        with kgp.settings.fused_kernels("never"):
            blocked = kgp.kernel_operator(k, Xd, Zd).fused_matmul(vd, wd)
    tol = tolerance(F32, n, d)
    for name, value in got.items():
        assert value.device.type == "cuda" and value.dtype == F32
        assert rel(value, oracle[name]) < tol, name
    # against the blocked pass on the same float32 inputs: only the exponent's rounding differs (the FMA
    # loop's order, or 3xTF32's dropped low-by-low product, ~eps32 relative), no sum over n; a plain TF32
    # exponent would be off by ~1e-3
    assert rel(got["fused"], blocked) < 20 * EPS[F32] * (d + 2) * d
    assert wide.dtype == F64 and rel(wide, oracle["fused"]) < tol


@pytest.mark.cuda
def test_fused_pass_on_cuda_allocates_no_kernel_block():
    n, m, d = 200_000, 4_000, 8
    X, Z, v, w = problem(n, m, d, seed=1)
    k = kernel("rbf", d, F32).to("cuda")
    Xd, Zd, vd, wd = (t.to("cuda", F32) for t in (X, Z, v, w))
    with torch.no_grad(), kgp.settings.fused_kernels("auto"), kgp.settings.memory_budget(2**32):
        op = kgp.kernel_operator(k, Xd, Zd)
        op.fused_matmul(vd, wd)  # tuning and prepared inputs, outside the measured call
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        op.fused_matmul(vd, wd)
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - start
    # the blocked pass holds a 256 MiB block; the fused one only u (n) and the float64 partial sums
    # (at most 2 x multiprocessors x m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert extra <= 4 * n + 8 * (2 * sms + 1) * m + 2**20


def nystrom_oracle(X, y, Z, Xq, noise: float, k):
    """Nystrom KRR ``(K_nM^T K_nM + noise K_MM) a = K_nM^T y`` (Rudi et al. 2017, eq. 3), dense float64."""
    KnM = k(X, Z).to_dense()
    a = torch.linalg.solve(KnM.T @ KnM + noise * k(Z, Z).to_dense(), KnM.T @ y[:, None])
    return (k(Xq, Z).to_dense() @ a)[:, 0]


@pytest.mark.cuda
def test_float32_falkon_on_cuda_with_fused_kernels_matches_the_nystrom_oracle(monkeypatch):
    passes = []
    monkeypatch.setattr(products, "rows_product", lambda *a, **kw: passes.append(1) or fused_gpu.rows_product(*a, **kw))
    n, m, d = 4_000, 200, 4
    X, _, _, _ = problem(n + 400, 1, d, seed=2)
    y = torch.sin(X[:, 0]) + 0.1 * X[:, 1]
    Z = X[:m]
    # lengthscale 1 as in tests/test_cuda.py (cond(K_MM) ~ 4e5); at 2.0 the float32 blocked fit itself sits
    # 1.1e-3 from the oracle (float64 on the float32-rounded inputs: 4.4e-4), beyond what eps32 rounding bounds
    noise, lengthscale = 0.05, 1.0
    k64 = gpytorch.kernels.RBFKernel().to(F64).requires_grad_(False)
    k64.lengthscale = torch.tensor(lengthscale, dtype=F64)
    oracle = nystrom_oracle(X[:n], y[:n], Z, X[n:], noise, k64)
    preds = {}
    for mode in ("auto", "never"):
        with kgp.settings.fused_kernels(mode):
            model = kgp.KernelRegressor(
                "rbf",
                lengthscale=lengthscale,
                noise=noise,
                solver="falkon",
                centers=Z.to("cuda", F32),
                # K not stored, so that every CG pass streams (a stored K is read instead of fused)
                solver_options={"maxiter": 200, "tol": 0.0, "kernel_cache": "never"},
            ).fit(X[:n].to("cuda", F32), y[:n].to("cuda", F32))
            preds[mode] = model.predict(X[n:].to("cuda", F32))
    # as tests/test_cuda.py: converged float32 CG carries the input rounding of K_nM (eps32 per entry)
    # through a preconditioned system of condition O(1) (Def. 3): a small multiple of sqrt(n) eps32
    tol = 50 * n**0.5 * EPS[F32]
    assert len(passes) > 100  # the CG passes ran fused (all but the two-column residual refreshes)
    assert rel(preds["auto"], oracle) < tol
    assert rel(preds["never"], oracle) < tol


@pytest.mark.skipif(
    os.environ.get("KGP_TEST_TRITON_INTERPRETER") != "1",
    reason="Triton's CPU interpreter check runs only with KGP_TEST_TRITON_INTERPRETER=1 and Triton installed",
)
def test_fused_kernels_under_the_triton_interpreter_match_the_blocked_pass():
    # The interpreter runs the same kernel source on the CPU: a check of the kernels' arithmetic on a
    # machine without a GPU (slow: a few tiles only).
    script = textwrap.dedent(
        """
        import torch
        import kgp
        from test_fused_gpu import kernel, problem, rel, tolerance
        from kgp.operators import fused_gpu
        from kgp.operators.fused_gpu import fused_applies
        kgp.settings.fused_kernels("auto")
        kgp.settings.memory_budget(2**31)  # the fused path needs 1 GiB (Triton's tuner); RAM / 5 may be less
        cases = [(family, d, tc) for tc in (True, False) for family, d in
                 (("rbf", 4), ("matern52", 4), ("matern32", 4), ("rbf", 20))]
        for family, d, tc in cases:
            fused_gpu.TENSOR_CORES = tc  # both forms: tl.dot (3xTF32 on a card) and the FMA loop
            dtype = torch.float32
            X, Z, v, w = problem(300, 70, d)
            k = kernel(family, d, dtype)
            X, Z, v, w = (t.to(dtype) for t in (X, Z, v, w))
            with torch.no_grad():
                op = kgp.kernel_operator(k, X, Z)
                assert fused_applies(op.workspace, 1)
                fused = op.fused_matmul(v, w)
                with kgp.settings.fused_kernels("never"):
                    blocked = kgp.kernel_operator(k, X, Z).fused_matmul(v, w)
            assert rel(fused, blocked) < 20 * torch.finfo(dtype).eps * (d + 2) * d, (family, d)
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
