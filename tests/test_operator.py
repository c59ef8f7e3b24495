"""The lazy kernel backend against GPyTorch's own evaluation, plus its memory, cache and error contracts.

Oracle: ``kernel(X, Z).to_dense()`` (GPyTorch) in the same dtype. Errors are measured relative to the
magnitude of what is compared (max |K| for entries, max of |K| |v| for products), on standardized data.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch
from conftest import LargestOutput

import kgp
from kgp import settings
from kgp.operators import KernelOperator, kernel_operator

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

FAST = [
    "rbf",
    "rbf_ard",
    "matern12",
    "matern32",
    "matern52",
    "linear",
    "polynomial",
    "scale_rbf",
    "scale_rbf_ard",
    "scale_matern12",
    "scale_matern32",
    "scale_matern52",
    "scale_linear",
    "scale_polynomial",
]


def make_kernel(name: str, d: int, dtype: torch.dtype = torch.float64) -> gpytorch.kernels.Kernel:
    scaled = name.startswith("scale_")
    base = name.removeprefix("scale_")
    if base == "rbf":
        k = gpytorch.kernels.RBFKernel()
        k.lengthscale = 1.4
    elif base == "rbf_ard":
        k = gpytorch.kernels.RBFKernel(ard_num_dims=d)
        k.lengthscale = torch.linspace(0.7, 2.0, d)
    elif base.startswith("matern"):
        k = gpytorch.kernels.MaternKernel(nu={"matern12": 0.5, "matern32": 1.5, "matern52": 2.5}[base])
        k.lengthscale = 1.2
    elif base == "linear":
        k = gpytorch.kernels.LinearKernel()
        k.variance = 0.4
    elif base == "polynomial":
        k = gpytorch.kernels.PolynomialKernel(power=3)
        k.offset = 0.8
    else:
        raise KeyError(name)
    if scaled:
        k = gpytorch.kernels.ScaleKernel(k)
        k.outputscale = 2.3
    return k.to(dtype)


def data(n=257, m=67, d=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype)
    Z = torch.randn(m, d, generator=gen, dtype=torch.float64).to(dtype)
    return X, Z


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | float) -> float:
    return ((a - b).abs().max() / scale).item()


def gpytorch_dense(kernel, X, Z=None) -> torch.Tensor:
    with torch.no_grad():
        return kernel(X, X if Z is None else Z).to_dense()


# --------------------------------------------------------------------- fast paths == GPyTorch
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", FAST)
def test_fast_path_matches_gpytorch(name, dtype):
    X, Z = data(dtype=dtype)
    kernel = make_kernel(name, X.shape[1], dtype)
    op = kernel_operator(kernel, X, Z)
    assert op.formula.family != "generic"
    K = gpytorch_dense(kernel, X, Z)
    kmax = K.abs().max()
    tol = TOL[dtype]
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(Z.shape[0], 3, generator=gen, dtype=torch.float64).to(dtype)
    u = torch.randn(X.shape[0], 3, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(X.shape[0], 3, generator=gen, dtype=torch.float64).to(dtype)
    with torch.no_grad(), settings.block_rows(50):  # several blocks, a ragged last one
        assert rel_err(op.to_dense(), K, kmax) < tol
        assert rel_err(op @ v, K @ v, (K.abs() @ v.abs()).max()) < tol
        assert rel_err(op.T @ u, K.T @ u, (K.abs().T @ u.abs()).max()) < tol
        assert rel_err(op @ v[:, 0], K @ v[:, 0], (K.abs() @ v[:, 0].abs()).max()) < tol
        fused_ref = K.T @ (K @ v + w)
        fused_scale = (K.abs().T @ (K.abs() @ v.abs() + w.abs())).max()
        assert rel_err(op.fused_matmul(v, w), fused_ref, fused_scale) < tol
        assert rel_err(op.fused_matmul(v[:, 0]), K.T @ (K @ v[:, 0]), fused_scale) < tol
        rows = torch.tensor([0, 5, 256, 17, 17])
        cols = torch.tensor([3, 66, 0, 17, 40])
        assert rel_err(op[rows, cols], K[rows, cols], kmax) < tol
        assert rel_err(op.T[cols, rows], K[rows, cols], kmax) < tol
        # square K(X, X): diagonal and the dense matrix (incl. its exact diagonal)
        sq = kernel_operator(kernel, X)
        Kxx = gpytorch_dense(kernel, X)
        assert rel_err(sq.diagonal(), kernel(X, X, diag=True), Kxx.abs().max()) < tol
        assert rel_err(sq.to_dense(), Kxx, Kxx.abs().max()) < tol
        assert rel_err(sq @ u, Kxx @ u, (Kxx.abs() @ u.abs()).max()) < tol
        assert rel_err(sq.fused_matmul(u), Kxx @ (Kxx @ u), (Kxx.abs() @ (Kxx.abs() @ u.abs())).max()) < tol


@pytest.mark.parametrize(
    "kernel",
    [
        gpytorch.kernels.PeriodicKernel(),
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RQKernel()),
        gpytorch.kernels.RBFKernel() + gpytorch.kernels.LinearKernel(),
        gpytorch.kernels.RBFKernel(active_dims=(0, 2)),
        gpytorch.kernels.MaternKernel(nu=2.5) * gpytorch.kernels.PeriodicKernel(),
    ],
    ids=["periodic", "scale_rq", "sum", "active_dims", "product"],
)
def test_generic_fallback_matches_gpytorch(kernel):
    X, Z = data()
    kernel = kernel.to(torch.float64)
    op = kernel_operator(kernel, X, Z)
    K = gpytorch_dense(kernel, X, Z)
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(Z.shape[0], 2, generator=gen, dtype=torch.float64)
    w = torch.randn(X.shape[0], 2, generator=gen, dtype=torch.float64)
    with torch.no_grad(), settings.block_rows(40):
        assert rel_err(op.to_dense(), K, K.abs().max()) < 1e-12
        assert rel_err(op @ v, K @ v, (K.abs() @ v.abs()).max()) < 1e-12
        assert rel_err(op.T @ w, K.T @ w, (K.abs().T @ w.abs()).max()) < 1e-12
        ref = K.T @ (K @ v + w)
        assert rel_err(op.fused_matmul(v, w), ref, ref.abs().max()) < 1e-12
        stacked = torch.cat([b.clone() for _, b in op.blocks()])
        assert rel_err(stacked, K, K.abs().max()) < 1e-12
        sq = kernel_operator(kernel, X)
        assert rel_err(sq.diagonal(), kernel(X, X, diag=True), K.abs().max()) < 1e-12


@pytest.mark.parametrize(
    "kernel",
    [make_kernel("scale_rbf_ard", 5), make_kernel("matern32", 5), gpytorch.kernels.PeriodicKernel().double()],
    ids=["scale_rbf_ard", "matern32", "generic_periodic"],
)
@pytest.mark.parametrize("m", [67, 601], ids=["one_panel", "three_panels"])
def test_gram_equals_dense_kt_k(kernel, m):
    # the panelled upper triangle, mirrored, must equal the plain product, over several row blocks
    X, Z = data(n=700, m=m)
    K = gpytorch_dense(kernel, X, Z)
    with settings.block_rows(97):
        got = kernel_operator(kernel, X, Z).gram()
    ref = K.T @ K
    assert not got.requires_grad
    assert torch.equal(got, got.T)
    assert rel_err(got, ref, ref.abs().max()) < 1e-12


def test_gram_stays_under_budget():
    n, m = 30_000, 300
    X, Z = data(n=n, m=m, d=4, dtype=torch.float32)
    budget = 2**20
    op = kernel_operator(make_kernel("scale_matern52", 4, torch.float32), X, Z)
    with settings.memory_budget(budget), LargestOutput() as rec:
        op.gram()
    # the m x m result and its mirrored copy are the largest objects; nothing n x m
    assert rec.largest <= max(m * m, n * 6), (rec.largest, rec.op)


def test_matern_ard_is_fast():
    # ARD lengthscales are a diagonal rescaling: the fast path covers them
    op = kernel_operator(gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=3), torch.randn(4, 3))
    assert op.formula.family == "matern32"


# --------------------------------------------------------------------- autograd
@pytest.mark.parametrize("name", ["scale_rbf_ard", "matern12", "scale_matern52", "linear", "scale_polynomial"])
def test_hyperparameter_gradients_match_gpytorch(name):
    X, Z = data(n=120, m=30, d=4)
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(Z.shape[0], 2, generator=gen, dtype=torch.float64)
    w = torch.randn(X.shape[0], 2, generator=gen, dtype=torch.float64)
    kernel = make_kernel(name, X.shape[1])

    def grads(loss):
        kernel.zero_grad()
        loss.backward()
        return {k: p.grad.clone() for k, p in kernel.named_parameters()}

    ref_mv = grads((kernel(X, Z).to_dense() @ v).pow(2).sum())
    Kd = kernel(X, Z).to_dense()
    ref_fused = grads((Kd.T @ (Kd @ v + w)).sin().sum())
    with settings.block_rows(32):
        got_mv = grads((kernel_operator(kernel, X, Z) @ v).pow(2).sum())
        got_fused = grads(kernel_operator(kernel, X, Z).fused_matmul(v, w).sin().sum())
        got_t = grads((kernel_operator(kernel, Z, X).T @ v).pow(2).sum())
    for key, ref in ref_mv.items():
        assert torch.allclose(got_mv[key], ref, rtol=1e-8, atol=1e-12), key
        assert torch.allclose(got_t[key], ref, rtol=1e-8, atol=1e-12), key
        assert torch.allclose(got_fused[key], ref_fused[key], rtol=1e-8, atol=1e-12), key


def test_generic_hyperparameter_gradients_match_gpytorch():
    X, Z = data(n=90, m=20, d=3)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel()).to(torch.float64)
    v = torch.randn(Z.shape[0], 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    kernel.zero_grad()
    (kernel(X, Z).to_dense() @ v).pow(2).sum().backward()
    ref = {k: p.grad.clone() for k, p in kernel.named_parameters()}
    kernel.zero_grad()
    with settings.block_rows(25):
        (kernel_operator(kernel, X, Z) @ v).pow(2).sum().backward()
    for k, p in kernel.named_parameters():
        assert torch.allclose(p.grad, ref[k], rtol=1e-9, atol=1e-12), k


def test_fused_matmul_gradients_wrt_v_w_and_inputs():
    X, Z = data(n=60, m=15, d=3)
    kernel = make_kernel("scale_matern32", 3)
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(15, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(60, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    Xg, Zg = X.clone().requires_grad_(), Z.clone().requires_grad_()
    with settings.block_rows(16):
        out = kernel_operator(kernel, Xg, Zg).fused_matmul(v, w)
    got = torch.autograd.grad(out.pow(2).sum(), (v, w, Xg, Zg))
    Xr, Zr = X.clone().requires_grad_(), Z.clone().requires_grad_()
    K = kernel(Xr, Zr).to_dense()
    ref = torch.autograd.grad((K.T @ (K @ v + w)).pow(2).sum(), (v, w, Xr, Zr))
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, rtol=1e-9, atol=1e-11)


def test_no_autograd_graph_without_grad():
    X, Z = data(n=50, m=10, d=2)
    kernel = make_kernel("rbf", 2)
    with torch.no_grad():
        out = kernel_operator(kernel, X, Z).fused_matmul(torch.ones(10, dtype=torch.float64))
    assert not out.requires_grad


# --------------------------------------------------------------------- memory


def test_product_never_allocates_n_by_m_under_budget():
    n, m, d = 200_000, 2_000, 3
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, d, generator=gen)
    Z = torch.randn(m, d, generator=gen)
    v = torch.randn(m, 1, generator=gen)
    budget = 16 * 2**20  # 16 MiB; n x M float32 is 1.6 GB
    kernel = make_kernel("scale_rbf", d, torch.float32)
    with settings.memory_budget(budget), settings.kernel_cache("auto"), torch.no_grad():
        op = kernel_operator(kernel, X, Z)
        with LargestOutput() as rec:
            kv = op @ v
            op.T @ kv  # a second product: "auto" would store here if n x M fitted the budget
        assert rec.largest * 4 <= budget, (rec.largest, rec.op)
        assert rec.largest < n * m
        assert "stored" not in op._cache or op._cache["stored"] is None
    # spot-check the values against a few dense rows
    rows = torch.tensor([0, 123_456, n - 1])
    with torch.no_grad():
        ref = kernel(X[rows], Z).to_dense() @ v
    assert torch.allclose(kv[rows], ref, rtol=1e-5, atol=1e-5)


def test_fused_and_transposed_products_stay_under_budget():
    n, m = 30_000, 500
    X, Z = data(n=n, m=m, d=4, dtype=torch.float32)
    budget = 2**20
    op = kernel_operator(make_kernel("matern52", 4, torch.float32), X, Z)
    with settings.memory_budget(budget), torch.no_grad(), LargestOutput() as rec:
        op.fused_matmul(torch.ones(m, 2), torch.ones(n, 2))
        op.T @ torch.ones(n, 1)
    # the prepared n x (d + 2) rows and the n x k inputs are the largest allowed objects
    assert rec.largest * 4 <= budget, (rec.largest, rec.op)
    # with autograd on (GPyTorch hyperparameters require grad) the forward still streams, even for
    # v = I (K^T K): nothing n x M is kept for the backward pass
    assert any(p.requires_grad for p in op.kernel.parameters())
    with settings.memory_budget(budget), LargestOutput() as rec:
        gram = op.fused_matmul(torch.eye(m))
    assert gram.requires_grad
    assert rec.largest < n * m and rec.largest * 4 <= budget, (rec.largest, rec.op)


# --------------------------------------------------------------------- settings
def test_kernel_cache_auto_stores_when_it_fits():
    X, Z = data(n=300, m=40, d=3)
    kernel = make_kernel("scale_matern32", 3)
    v = torch.randn(40, 2, dtype=torch.float64)
    w = torch.randn(300, 2, dtype=torch.float64)
    K = gpytorch_dense(kernel, X, Z)
    with settings.kernel_cache("auto"), torch.no_grad():
        op = kernel_operator(kernel, X, Z)
        first = op.fused_matmul(v, w)
        assert op._cache.get("stored") is None  # a single product never pays for storing
        second = op.fused_matmul(v, w)
        stored = op._cache.get("stored")
        assert stored is not None and stored.shape == (300, 40)
        assert torch.allclose(stored * kernel.outputscale, K, rtol=0, atol=1e-12)
        third = op.T.fused_matmul(v, w)
        assert op._cache["stored"] is stored  # reused (also by the transposed view), not rebuilt
        assert torch.allclose(first, second, rtol=1e-12, atol=1e-12)
        assert torch.allclose(first, third, rtol=1e-12, atol=1e-12)
        assert torch.allclose(op @ v, K @ v, rtol=1e-12, atol=1e-12)
        assert torch.allclose(op.T @ w, K.T @ w, rtol=1e-12, atol=1e-12)


def test_blocks_are_copies_of_the_stored_matrix():
    X, Z = data(n=64, m=12, d=3)
    kernel = make_kernel("rbf", 3)
    K = gpytorch_dense(kernel, X, Z)
    v = torch.randn(12, 1, dtype=torch.float64)
    with settings.kernel_cache("auto"), settings.block_rows(16), torch.no_grad():
        op = kernel_operator(kernel, X, Z)
        op @ v
        op.T @ (op @ v)  # second product: now stored
        assert op._cache.get("stored") is not None
        for _, block in op.blocks():
            block.zero_()  # a caller may scribble on its block
        assert torch.allclose(op @ v, K @ v, rtol=1e-12, atol=1e-13)
        assert torch.allclose(torch.cat([b.clone() for _, b in op.blocks()]), K, rtol=1e-13, atol=1e-15)


def test_cache_is_shared_by_rebuilt_operators_and_follows_in_place_changes():
    X, Z = data(n=80, m=10, d=3)
    kernel = make_kernel("matern32", 3)  # hyperparameters require grad: products go through Matmul
    v = torch.randn(10, 1, dtype=torch.float64)
    with settings.kernel_cache("auto"):
        op = kernel_operator(kernel, X, Z)
        op @ v
        op @ v
        assert op._cache.get("stored") is not None  # the operator rebuilt inside Matmul shared the cache
        X.mul_(0.5)  # in place: the stored matrix and prepared rows are stale now
        with torch.no_grad():
            got = op @ v
            ref = gpytorch_dense(kernel, X, Z) @ v
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-13)


def test_inference_mode_inputs():
    X, Z = data(n=40, m=6, d=2)
    kernel = make_kernel("scale_rbf", 2)
    ref = gpytorch_dense(kernel, X, Z) @ torch.ones(6, 1, dtype=torch.float64)
    with torch.inference_mode():
        op = kernel_operator(kernel, X.clone(), Z.clone())
        got = op @ torch.ones(6, 1, dtype=torch.float64)
        fused = op.fused_matmul(torch.ones(6, dtype=torch.float64))
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-13)
    assert fused.shape == (6,)


def test_kernel_cache_auto_never_above_budget():
    X, Z = data(n=300, m=40, d=3)
    budget = 300 * 40 * 8 - 1  # one byte short of the whole matrix
    with settings.kernel_cache("auto"), settings.memory_budget(budget), torch.no_grad():
        op = kernel_operator(make_kernel("rbf", 3), X, Z)
        with LargestOutput() as rec:
            for _ in range(3):
                op.fused_matmul(torch.ones(40, dtype=torch.float64))
        assert op._cache.get("stored") is None
        assert rec.largest * 8 <= budget


def test_kernel_cache_never_stores_nothing():
    X, Z = data(n=50, m=10, d=2)
    op = kernel_operator(make_kernel("rbf", 2), X, Z)
    with settings.kernel_cache("never"), torch.no_grad():
        for _ in range(3):
            op @ torch.ones(10, 1, dtype=torch.float64)
    assert op._cache.get("stored") is None


def test_block_rows_setting_and_blocks_cover_all_rows():
    X, Z = data(n=103, m=20, d=3)
    kernel = make_kernel("scale_rbf", 3)
    op = kernel_operator(kernel, X, Z)
    K = gpytorch_dense(kernel, X, Z)
    with settings.block_rows(10):
        assert op.block_rows() == 10
        seen = []
        for rows, block in op.blocks():
            assert block.shape == (rows.stop - rows.start, 20)
            assert torch.allclose(block * op.outputscale(), K[rows], rtol=1e-12, atol=1e-14)
            seen.append((rows.start, rows.stop))
        assert seen == [(lo, min(lo + 10, 103)) for lo in range(0, 103, 10)]
        sub = [(r.start, r.stop) for r, _ in op.blocks(15, 42)]
        assert sub == [(15, 25), (25, 35), (35, 42)]
    with settings.block_rows(10**6):
        assert op.block_rows() == 103  # capped by n
    with settings.memory_budget(20 * 8 * 7):
        assert op.block_rows() == 7  # capped by the budget
    with pytest.raises(ValueError, match="block_rows"):
        settings.block_rows.set(0)


def test_budget_too_small_for_one_row_raises_memory_error():
    X, Z = data(n=10, m=10, d=2)
    op = kernel_operator(make_kernel("rbf", 2), X, Z)
    with settings.memory_budget(16), pytest.raises(MemoryError, match="memory_budget"):
        op @ torch.ones(10, 1, dtype=torch.float64)


# --------------------------------------------------------------------- bad input
def test_dtype_and_shape_errors():
    X, Z = data(n=10, m=4, d=2)
    kernel = make_kernel("rbf", 2)
    op = kernel_operator(kernel, X, Z)
    with pytest.raises(TypeError, match="dtype"):
        op @ torch.ones(4, 1, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        op.fused_matmul(torch.ones(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="fused_matmul"):
        op.fused_matmul(torch.ones(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="fused_matmul"):
        op.fused_matmul(torch.ones(4, dtype=torch.float64), torch.ones(9, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype"):
        kernel_operator(kernel, X, Z.float())
    with pytest.raises(ValueError, match="features"):
        kernel_operator(kernel, X, torch.ones(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        kernel_operator(kernel, X[0], Z)
    with pytest.raises(TypeError, match="float32 or float64"):
        kernel_operator(kernel, X.half(), Z.half())
    with pytest.raises(TypeError, match="kernel"):
        kernel_operator("rbf", X, Z)
    with pytest.raises(TypeError, match="x1"):
        kernel_operator(kernel, X.numpy(), Z)
    with pytest.raises(ValueError, match="start"):
        next(op.blocks(5, 3))


# --------------------------------------------------------------------- structure
def test_transpose_shares_cache_and_square_symmetry():
    X, Z = data(n=40, m=9, d=3)
    kernel = make_kernel("matern12", 3)
    op = kernel_operator(kernel, X, Z)
    assert isinstance(op.T, KernelOperator) and op.T.shape == (9, 40)
    assert op.T._cache is op._cache
    assert torch.equal(op.T.to_dense(), op.to_dense().T)
    with torch.no_grad():
        sq = kgp.kernel_operator(kernel, X).to_dense()
    assert torch.allclose(sq, sq.T, rtol=0, atol=1e-15)
    assert torch.equal(sq.diagonal(), torch.ones(40, dtype=torch.float64))


def test_float32_matern12_diagonal_is_exact_on_square_operator():
    # the augmented GEMM leaves ~1e-6 rounding in d^2 at coincident points; sqrt makes it ~1e-3
    X = torch.randn(500, 6) * 3 + 5
    kernel = make_kernel("matern12", 6, torch.float32)
    with settings.block_rows(64):
        dense = kernel_operator(kernel, X).to_dense()
    assert torch.equal(dense.diagonal(), torch.ones(500))


def test_device_follows_inputs_cpu():
    X, Z = data(n=20, m=5, d=2, dtype=torch.float32)
    out = kernel_operator(make_kernel("rbf", 2, torch.float64), X, Z) @ torch.ones(5, 1)
    assert out.dtype == torch.float32 and out.device == X.device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_device_follows_inputs_cuda(dtype):
    X, Z = data(n=3000, m=200, d=4, dtype=dtype)
    kernel = make_kernel("scale_matern52", 4, dtype)
    K = gpytorch_dense(kernel, X, Z)
    v = torch.randn(200, 2, dtype=dtype)
    w = torch.randn(3000, 2, dtype=dtype)
    Xc, Zc, vc, wc = X.cuda(), Z.cuda(), v.cuda(), w.cuda()
    op = kernel_operator(kernel, Xc, Zc)  # kernel stays on the CPU: hyperparameters follow the inputs
    with torch.no_grad():
        out = op.fused_matmul(vc, wc)
        kv = op @ vc
    assert out.device == Xc.device and kv.device == Xc.device
    ref = K.T @ (K @ v + w)
    assert rel_err(out.cpu(), ref, ref.abs().max()) < 10 * TOL[dtype]
    assert rel_err(kv.cpu(), K @ v, (K.abs() @ v.abs()).max()) < 10 * TOL[dtype]
    assert rel_err(op[:5, :7].to_dense().cpu(), K[:5, :7], K.abs().max()) < 10 * TOL[dtype]


def test_block_rows_follow_the_device():
    from kgp.operators.blocks import ACCELERATOR_BLOCK_BYTES, CPU_BLOCK_BYTES, plan_block_rows

    n, m = 10**7, 2_000
    with settings.memory_budget(4 * 2**30):
        cpu = plan_block_rows(n, m, 4)
        assert cpu == plan_block_rows(n, m, 4, device="cpu") == CPU_BLOCK_BYTES // (m * 4)
        # any device but the CPU ("meta" stands in for a GPU here): launch-bound, so large blocks
        assert plan_block_rows(n, m, 4, device="meta") == ACCELERATOR_BLOCK_BYTES // (m * 4)
    # the budget still caps an accelerator's block: 3 buffers of 4 bytes x m per row
    with settings.memory_budget(64 * 2**20):
        assert plan_block_rows(n, m, 4, buffers=3, device="meta") == 64 * 2**20 // (3 * 4 * m)
