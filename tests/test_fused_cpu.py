"""The native fused CPU pass (kgp/operators/fused_cpu.py): its kernel entries against a float64 oracle, its
products against the blocked pass's, and when it runs. Skipped where no C compiler builds it."""

from __future__ import annotations

import functools
import math
import warnings

import gpytorch
import numpy as np
import pytest
import torch

import kgp
from kgp import settings
from kgp.kernels.formulas import EXP_FLOOR
from kgp.operators import fused_cpu

pytestmark = pytest.mark.skipif(fused_cpu.native_error() is not None, reason="the native CPU pass cannot be built")

LOG2E = math.log2(math.e)
# the operator dtypes with the sums the products take (None: the operator's own)
DTYPE_SUMS = [(torch.float32, None), (torch.float32, torch.float64), (torch.float64, None)]


def _rbf(lengthscale: float, dtype: torch.dtype):
    return kgp.kernels.make_kernel("rbf", lengthscale).to(dtype).requires_grad_(False)


FACTOR = {"matern32": math.sqrt(3.0), "matern52": math.sqrt(5.0)}


def _oracle(X: torch.Tensor, Z: torch.Tensor, lengthscale: float, dtype: torch.dtype, family: str = "rbf"):
    """The kernel in float64 from the rounded inputs (RBF floored as kgp floors it)."""
    # from the differences: cdist's expanded form would add its own cancellation
    r2 = (X.double()[:, None, :] / lengthscale - Z.double()[None, :, :] / lengthscale).square().sum(-1)
    if family == "rbf":
        return torch.exp(-0.5 * r2).clamp_min(math.exp(EXP_FLOOR[dtype]))
    a = FACTOR[family] * r2.sqrt()
    poly = 1 + a if family == "matern32" else 1 + a + a * a / 3
    return poly * torch.exp(-a)


def _assert_no_further_from(exact: torch.Tensor, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` no further from the float64 ``exact`` than twice ``ref`` (the path it replaces) is, or within
    16 of ``dtype``'s rounding, both relative to ``exact``'s largest entry."""
    scale = float(exact.abs().max())
    err = float((got.double() - exact).abs().max()) / scale
    err_ref = float((ref.double() - exact).abs().max()) / scale
    assert err <= max(2 * err_ref, 16 * torch.finfo(dtype).eps), (err, err_ref)


def _kernel(family: str, lengthscale: float, dtype: torch.dtype):
    return kgp.kernels.make_kernel(family, lengthscale).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("family", ["rbf", "matern32", "matern52"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_entries_are_the_oracle_to_the_exponent_rounding(dtype, family):
    """One row against centers at every distance out past the RBF floor: with ``v = e_0`` (column 0 is the
    row's own point, ``k = 1``) the pass returns the row of K itself. Each entry is within the rounding of
    the augmented GEMM, at most ``delta = (d + 2) eps (|u|^2 + |v|^2)`` in its exponent (RBF: times ln 2
    relative in K) or in ``a^2`` (Matern: at most ``delta (1 + a) exp(-a) / 2`` in K, as dK/da is
    ``a (1 + a) exp(-a) / 3`` or less), plus a few roundings of the exponential and the polynomial."""
    d, m = 5, 999
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, d, generator=g, dtype=torch.float64)
    # RBF's r^2 / 2 out to 1.2x the floor's exponent (43 in float32, 700 in float64)
    radii = torch.linspace(0.0, math.sqrt(2.4 * -EXP_FLOOR[dtype]), m, dtype=torch.float64)
    directions = torch.nn.functional.normalize(torch.randn(m, d, generator=g, dtype=torch.float64), dim=1)
    X = x.to(dtype)
    Z = (x + radii[:, None] * directions).to(dtype)
    Z[0] = X[0]
    v = torch.zeros(m, 1, dtype=dtype)
    v[0] = 1.0
    kernel = _kernel(family, 1.0, dtype)
    op = kgp.kernel_operator(kernel, X, Z)
    with settings.kernel_cache("never"), settings.fused_kernels("always"):
        assert fused_cpu.use_native(op.workspace, 1, v)
        row = op.fused_matmul(v)[:, 0].double()
    # the lengthscale as the kernel holds it (GPyTorch's softplus of a raw value: not exactly 1.0)
    lengthscale = float(kernel.lengthscale)
    expected = _oracle(X, Z, lengthscale, dtype, family)[0]
    assert float(expected[0]) == 1.0
    eps = torch.finfo(dtype).eps
    centred = (torch.cat([X, Z]).double() - Z.double().mean(0)) / lengthscale
    norms = centred[0].square().sum() + centred[1:].square().sum(1)
    if family == "rbf":
        tolerance = expected * ((d + 2) * eps * norms * LOG2E * math.log(2) + 8 * eps)
    else:
        delta = (d + 2) * eps * norms * FACTOR[family] ** 2
        a = FACTOR[family] * (X.double() / lengthscale - Z.double() / lengthscale).norm(dim=1)
        tolerance = (delta / 2 + 8 * eps * (1 + a)) * (1 + a) * torch.exp(-a)
    assert bool(((row - expected).abs() <= tolerance).all()), float(((row - expected).abs() / tolerance).max())
    if family == "rbf":
        assert float(expected[-1]) == math.exp(EXP_FLOOR[dtype])  # the floor was reached, and kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("with_w", [False, True], ids=["", "w"])
@pytest.mark.parametrize("accumulate", [None, torch.float64], ids=["", "float64-sums"])
@pytest.mark.parametrize("family", ["rbf", "matern52"])
def test_native_pass_is_as_close_to_the_oracle_as_the_blocked_pass(dtype, k, with_w, accumulate, family):
    """``K^T (K v + w)`` with rows and centers that fill no whole tile or vector (n = 1,003, M = 517), an
    outputscale and several columns: within twice the blocked pass's error from the float64 oracle (or a few
    roundings of the result where that error is smaller)."""
    if accumulate is not None and dtype == torch.float64:
        pytest.skip("float64 sums are the float64 pass")
    g = torch.Generator().manual_seed(k)
    X = torch.randn(1003, 6, generator=g, dtype=torch.float64).to(dtype)
    Z = torch.randn(517, 6, generator=g, dtype=torch.float64).to(dtype)
    base = gpytorch.kernels.RBFKernel() if family == "rbf" else gpytorch.kernels.MaternKernel(nu=2.5)
    kernel = gpytorch.kernels.ScaleKernel(base).to(dtype)
    kernel.base_kernel.lengthscale = torch.tensor(1.3, dtype=dtype)
    kernel.outputscale = torch.tensor(2.5, dtype=dtype)
    kernel.requires_grad_(False)
    v = torch.randn(517, k, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(1003, k, generator=g, dtype=torch.float64).to(dtype) if with_w else None
    K = float(kernel.outputscale) * _oracle(X, Z, float(kernel.base_kernel.lengthscale), dtype, family)
    expected = K.T @ (K @ v.double() + (0 if w is None else w.double()))
    results = {}
    for mode in ("never", "always"):
        op = kgp.kernel_operator(kernel, X, Z)
        with settings.kernel_cache("never"), settings.fused_kernels(mode):
            assert fused_cpu.use_native(op.workspace, k, v, w) == (mode == "always")
            results[mode] = op.fused_matmul(v, w, accumulate=accumulate)
    assert results["always"].dtype == (accumulate or dtype)
    _assert_no_further_from(expected, results["always"], results["never"], dtype)


@pytest.mark.parametrize("k", [1, 3])
def test_float32_transpose_product_summed_in_float64_runs_natively(k, monkeypatch):
    """``K^T w`` with float64 sums (FALKON's right-hand side ``K_nM^T y`` for float32 inputs) runs as the native
    ``K^T (K 0 + w)``: as close to the float64 oracle as the blocked pass, or within a few roundings."""
    g = torch.Generator().manual_seed(7)
    X = torch.randn(1003, 6, generator=g, dtype=torch.float64).float()
    Z = torch.randn(517, 6, generator=g, dtype=torch.float64).float()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    kernel.base_kernel.lengthscale = torch.tensor(1.3)
    kernel.outputscale = torch.tensor(2.5)
    kernel.requires_grad_(False)
    w = torch.randn(1003, k, generator=g, dtype=torch.float64).float()
    K = 2.5 * _oracle(X, Z, float(kernel.base_kernel.lengthscale), torch.float32)
    expected = K.T @ w.double()
    calls = []
    original = fused_cpu.native_pass
    monkeypatch.setattr(fused_cpu, "native_pass", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    results = {}
    for mode in ("never", "auto"):
        op = kgp.kernel_operator(kernel, X, Z)
        with settings.fused_kernels(mode):
            results[mode] = op.transpose_matmul(w, accumulate=torch.float64)
    assert calls == [1]  # the "auto" product only
    assert results["auto"].dtype == torch.float64 and results["auto"].shape == (517, k)
    _assert_no_further_from(expected, results["auto"], results["never"], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 3])
def test_transpose_product_in_the_operators_dtype_runs_natively(dtype, k, monkeypatch):
    """``K^T u`` in the operator's own dtype (``op.T @ u``: FALKON's right-hand side for float64 inputs) runs as
    the native ``K^T (K 0 + u)``, and from the third use reads the stored K: each as close to the float64
    oracle as the blocked pass, or within a few roundings."""
    g = torch.Generator().manual_seed(12)
    X = torch.randn(1003, 6, generator=g, dtype=torch.float64).to(dtype)
    Z = torch.randn(517, 6, generator=g, dtype=torch.float64).to(dtype)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    kernel.base_kernel.lengthscale = torch.tensor(1.3, dtype=dtype)
    kernel.outputscale = torch.tensor(2.5, dtype=dtype)
    kernel.requires_grad_(False)
    u = torch.randn(1003, k, generator=g, dtype=torch.float64).to(dtype)
    K = 2.5 * _oracle(X, Z, float(kernel.base_kernel.lengthscale), dtype)
    expected = K.T @ u.double()
    calls = []
    for name in ("native_pass", "stored_pass"):
        original = getattr(fused_cpu, name)
        fake = functools.partial(
            lambda original, name, *a, **kw: calls.append(name) or original(*a, **kw), original, name
        )
        monkeypatch.setattr(fused_cpu, name, fake)  # what transpose_pass calls
    op = kgp.kernel_operator(kernel, X, Z)
    with settings.fused_kernels("never"):
        blocked = op.T @ u
    with settings.kernel_cache("auto"):
        results = [op.T @ u for _ in range(3)]
    assert calls == ["native_pass", "native_pass", "stored_pass"]
    for got in results:
        assert got.dtype == dtype and got.shape == (517, k)
        _assert_no_further_from(expected, got, blocked, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_pass_exponential_is_within_one_rounding(dtype):
    """The pass's ``2^x`` on ``[EXP_FLOOR log2(e), 0]`` (random points, and table boundaries ``-j/16`` with
    their neighbours) against an extended-precision oracle: the table entry and the final fused operation round
    once each (``eps/2`` relative), the polynomial's remainder is below ``eps/12`` and its own rounding acts
    on ``2^f - 1 <= 0.044``: within 1.25 ``eps``."""
    if np.finfo(np.longdouble).eps > 1e-18:
        pytest.skip("numpy's long double is not wider than float64 here: no extended-precision oracle")
    g = torch.Generator().manual_seed(13)
    lo = EXP_FLOOR[dtype] * math.log2(math.e)
    boundaries = torch.arange(0, 1600, dtype=torch.float64) / -16
    x = torch.cat(
        [
            torch.rand(1 << 18, generator=g, dtype=torch.float64) * lo,
            torch.rand(1 << 14, generator=g, dtype=torch.float64) * -0.5,
            boundaries,
            boundaries - 2e-9,
            boundaries + 2e-9,
        ]
    ).clamp(lo, 0)
    x = x.to(dtype)
    got = fused_cpu._exp2_values(x).numpy().astype(np.longdouble)
    exact = np.exp2(x.numpy().astype(np.longdouble))
    relative = float(np.max(np.abs(got - exact) / exact))
    assert relative <= 1.25 * torch.finfo(dtype).eps, relative / torch.finfo(dtype).eps


def test_native_pass_runs_only_where_it_applies():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 4, generator=g)
    Z = torch.randn(40, 4, generator=g)
    v = torch.randn(40, 1, generator=g)
    rbf = _rbf(1.0, torch.float32)
    with settings.kernel_cache("never"):
        assert fused_cpu.native_applies(kgp.kernel_operator(rbf, X, Z).workspace, 1, v)
        with settings.fused_kernels("never"):
            assert not fused_cpu.native_applies(kgp.kernel_operator(rbf, X, Z).workspace, 1, v)
        # K(X, X): the blocked pass sets the diagonal to exactly 1
        assert not fused_cpu.native_applies(kgp.kernel_operator(rbf, X, X.clone()).workspace, 1, v)
        # Matern 1/2: its near-zero recomputation is the blocked pass's
        laplacian = gpytorch.kernels.MaternKernel(nu=0.5).requires_grad_(False)
        assert not fused_cpu.native_applies(kgp.kernel_operator(laplacian, X, Z).workspace, 1, v)
        # float64 distances for a float32 operator (FALKON's switch) are the blocked pass's
        wide = kgp.kernel_operator(rbf, X, Z, distance_dtype=torch.float64)
        assert not fused_cpu.native_applies(wide.workspace, 1, v)
        tracked = v.clone().requires_grad_(True)
        assert not fused_cpu.native_applies(kgp.kernel_operator(rbf, X, Z).workspace, 1, tracked)
    # with kernel_cache="auto" the second product stores K as the native pass forms it (it fits the budget),
    # and the stored pass reads it from then on
    op = kgp.kernel_operator(rbf, X, Z)
    with settings.kernel_cache("auto"):
        assert fused_cpu.use_native(op.workspace, 1, v) and "storing" not in op._cache
        op.fused_matmul(v)  # the operator's first use is the line above; this is its second
        assert op._cache.get("stored") is not None and "storing" not in op._cache
        assert fused_cpu.use_stored(op.workspace, 1, v) and not fused_cpu.native_applies(op.workspace, 1, v)


def test_without_a_compiler_auto_falls_back_silently_and_always_warns(monkeypatch, tmp_path):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(200, 3, generator=g)
    Z = torch.randn(30, 3, generator=g)
    v = torch.randn(30, 1, generator=g)
    rbf = _rbf(1.0, torch.float32)
    monkeypatch.setenv("CC", "kgp-no-such-compiler")
    monkeypatch.setenv("KGP_CACHE_DIR", str(tmp_path))
    fused_cpu._library.cache_clear()
    try:
        assert "kgp-no-such-compiler" in fused_cpu.native_error()
        with settings.kernel_cache("never"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                blocked = kgp.kernel_operator(rbf, X, Z).fused_matmul(v)
            with settings.fused_kernels("always"), pytest.warns(RuntimeWarning, match="native CPU pass"):
                again = kgp.kernel_operator(rbf, X, Z).fused_matmul(v)
        with settings.fused_kernels("never"), settings.kernel_cache("never"):
            assert torch.equal(blocked, kgp.kernel_operator(rbf, X, Z).fused_matmul(v))
        assert torch.equal(blocked, again)
    finally:
        monkeypatch.undo()
        fused_cpu._library.cache_clear()
    assert fused_cpu.native_error() is None


def test_the_library_is_built_once_into_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("KGP_CACHE_DIR", str(tmp_path))
    fused_cpu._library.cache_clear()
    try:
        assert fused_cpu.native_error() is None
        built = list(tmp_path.glob("fused_cpu-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        fused_cpu._library.cache_clear()
        assert fused_cpu.native_error() is None
        assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
        assert list(tmp_path.iterdir()) == built  # no temporary file left behind
    finally:
        monkeypatch.undo()
        fused_cpu._library.cache_clear()


def test_an_operator_without_rows_gives_zeros():
    """A rank of a distributed fit may hold no rows: its part of the sum is zero, and no error (an error on one
    rank only would leave the others waiting in the all-reduce)."""
    Z = torch.randn(33, 4, generator=torch.Generator().manual_seed(2))
    op = kgp.kernel_operator(_rbf(1.0, torch.float32), torch.empty(0, 4), Z)
    v = torch.ones(33, 2)
    with settings.kernel_cache("never"):
        assert fused_cpu.use_native(op.workspace, 2, v)
        out = op.fused_matmul(v, accumulate=torch.float64)
    assert out.shape == (33, 2) and out.dtype == torch.float64 and not bool(out.any())


def test_concurrent_callers_get_the_sequential_result():
    """Several Python threads in the native pass at once (it shares one pool of worker threads per thread
    count): each gets exactly the result of a call on its own, whose row shares and sums are fixed."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(4)
    X = torch.randn(2000, 5, generator=g)
    Z = torch.randn(300, 5, generator=g)
    vs = [torch.randn(300, 1, generator=g) for _ in range(6)]
    op = kgp.kernel_operator(_rbf(0.8, torch.float32), X, Z)
    with settings.kernel_cache("never"):
        alone = [op.fused_matmul(v) for v in vs]

        def run(v):
            with settings.kernel_cache("never"):
                return op.fused_matmul(v)

        with ThreadPoolExecutor(max_workers=4) as pool:
            together = list(pool.map(run, vs))
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype, accumulate", DTYPE_SUMS)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("with_w", [False, True])
def test_the_stored_pass_is_the_native_pass_on_the_entries_it_stored(dtype, accumulate, k, with_w):
    """Under ``kernel_cache="auto"`` the second product stores K as the native pass forms it and later products
    read it once (``stored_pass``) with the native pass's sums: with M a multiple of every vector width
    (no tail), the result is bitwise the native pass's, and the stored entries are the oracle's to the
    exponent's rounding."""
    g = torch.Generator().manual_seed(6)
    n, m = 1001, 64
    X = torch.randn(n, 5, generator=g, dtype=dtype)
    Z = torch.randn(m, 5, generator=g, dtype=dtype)
    v = torch.randn(m, k, generator=g, dtype=dtype)
    w = torch.randn(n, k, generator=g, dtype=dtype) if with_w else None
    kernel = _rbf(1.3, dtype)
    op = kgp.kernel_operator(kernel, X, Z)
    with settings.kernel_cache("auto"):
        first = op.fused_matmul(v, w, accumulate=accumulate)
        assert op._cache.get("stored") is None
        second = op.fused_matmul(v, w, accumulate=accumulate)
        stored = op._cache.get("stored")
        assert stored is not None and stored.shape == (n, m) and stored.dtype == dtype
        assert fused_cpu.use_stored(op.workspace, k, v, w)
        third = op.fused_matmul(v, w, accumulate=accumulate)
    assert torch.equal(first, second) and torch.equal(first, third)
    # the entries within the augmented GEMM's rounding of the oracle (as in the first test of this module)
    lengthscale = float(kernel.lengthscale)
    entries = _oracle(X, Z, lengthscale, dtype)
    eps = torch.finfo(dtype).eps
    centred = (torch.cat([X, Z]).double() - Z.double().mean(0)) / lengthscale
    norms = centred[:n].square().sum(1, keepdim=True) + centred[n:].square().sum(1)
    tolerance = entries * (7 * eps * norms + 8 * eps)
    assert bool(((stored.double() - entries).abs() <= tolerance).all())


@pytest.mark.parametrize("dtype, accumulate", DTYPE_SUMS)
@pytest.mark.parametrize("m", [37, 200])
def test_the_stored_pass_is_as_close_to_the_oracle_as_the_blocked_pass(dtype, accumulate, m):
    """Any M (a vector tail) and K^T w alone (FALKON's right-hand side, ``transpose_matmul``): the stored
    pass against a float64 oracle on the stored entries, no further from it than torch's blocked products
    over the same stored K."""
    g = torch.Generator().manual_seed(7)
    n, k = 777, 2
    X = torch.randn(n, 4, generator=g, dtype=dtype)
    Z = torch.randn(m, 4, generator=g, dtype=dtype)
    v = torch.randn(m, k, generator=g, dtype=dtype)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    op = kgp.kernel_operator(_rbf(0.9, dtype), X, Z)
    with settings.kernel_cache("auto"):
        op.fused_matmul(v, w, accumulate=accumulate)
        op.fused_matmul(v, w, accumulate=accumulate)
        K = op._cache["stored"].double()
        assert fused_cpu.use_stored(op.workspace, k, v, w)
        native = op.fused_matmul(v, w, accumulate=accumulate)
        rhs = op.transpose_matmul(w, accumulate=accumulate)
        with settings.fused_kernels("never"):
            assert not fused_cpu.use_stored(op.workspace, k, v, w)
            blocked = op.fused_matmul(v, w, accumulate=accumulate)
            blocked_rhs = op.transpose_matmul(w, accumulate=accumulate)
    expected = K.T @ (K @ v.double() + w.double())
    expected_rhs = K.T @ w.double()
    for got, ref, exp in ((native, blocked, expected), (rhs, blocked_rhs, expected_rhs)):
        assert got.dtype == (accumulate or dtype)
        _assert_no_further_from(exp, got, ref, dtype)


def test_the_stored_pass_steps_aside_where_it_does_not_apply():
    """More than MAX_COLUMNS columns: the blocked products read the stored K, with the same result to the
    dtype's rounding; through autograd (whose forward runs without it) the same result and gradient."""
    g = torch.Generator().manual_seed(8)
    X = torch.randn(500, 3, generator=g, dtype=torch.float64)
    Z = torch.randn(48, 3, generator=g, dtype=torch.float64)
    op = kgp.kernel_operator(_rbf(1.0, torch.float64), X, Z)
    wide = torch.randn(48, fused_cpu.MAX_COLUMNS + 1, generator=g, dtype=torch.float64)
    with settings.kernel_cache("auto"):
        op.fused_matmul(wide[:, :1])
        op.fused_matmul(wide[:, :1])
        assert op._cache.get("stored") is not None
        assert not fused_cpu.use_stored(op.workspace, wide.shape[1], wide)
        tracked = wide[:, :1].clone().requires_grad_(True)
        assert not fused_cpu.use_stored(op.workspace, 1, tracked)
        out_wide = op.fused_matmul(wide)
        out_tracked = op.fused_matmul(tracked)
        out_tracked.sum().backward()
        singles = torch.cat([op.fused_matmul(wide[:, i : i + 1]) for i in range(wide.shape[1])], dim=1)
    torch.testing.assert_close(out_wide, singles, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_tracked.detach(), singles[:, :1], rtol=1e-12, atol=1e-12)
    K = op._cache["stored"]
    torch.testing.assert_close(tracked.grad, (K.T @ K).sum(0, keepdim=True).T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("accumulate", [None, torch.float64])
def test_an_operator_without_rows_reads_its_empty_stored_k(accumulate):
    """A rank holding no rows whose K the blocked pass stored (float64 distances: not the native pass's):
    from the third product on the stored pass serves it, and its part of the sum is zero."""
    Z = torch.randn(33, 3, generator=torch.Generator().manual_seed(10))
    op = kgp.kernel_operator(_rbf(1.0, torch.float32), torch.empty(0, 3), Z, distance_dtype=torch.float64)
    v = torch.ones(33, 2)
    with settings.kernel_cache("auto"):
        for _ in range(3):
            out = op.fused_matmul(v, accumulate=accumulate)
            rhs = op.transpose_matmul(torch.empty(0, 2), accumulate=accumulate)
        assert op._cache.get("stored") is not None and fused_cpu.use_stored(op.workspace, 2, v)
    for t in (out, rhs):
        assert t.shape == (33, 2) and t.dtype == (accumulate or torch.float32) and not bool(t.any())


def test_k_too_large_for_the_budget_for_one_tile_is_never_stored():
    """A budget with room for the augmented rows but not for one tile of K's rows next to a block of scratch:
    the native pass forms K at every product, nothing is stored."""
    g = torch.Generator().manual_seed(9)
    X = torch.randn(200, 3, generator=g)
    Z = torch.randn(300, 3, generator=g)
    v = torch.randn(300, 1, generator=g)
    op = kgp.kernel_operator(_rbf(1.0, torch.float32), X, Z)
    budget = 200 * 5 * 4 * 2  # the augmented rows (n (d + 2) floats), twice: 6 rows of K
    assert op.formula.buffers_needed == 1 and budget // (300 * 4) < fused_cpu.TILE
    with settings.kernel_cache("auto"), settings.memory_budget(budget):
        results = [op.fused_matmul(v, accumulate=torch.float64) for _ in range(3)]
        assert not {"stored", "stored_head", "storing"} & set(op._cache)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("family", ["rbf", "matern32"])
@pytest.mark.parametrize("dtype, accumulate", DTYPE_SUMS)
@pytest.mark.parametrize("k", [1, 3])
def test_a_head_of_k_is_stored_where_the_whole_k_does_not_fit(family, dtype, accumulate, k):
    """Under a budget below K (n M entries) the second product stores the leading whole tiles of rows that fit
    next to a block of scratch, as the native pass forms them (bitwise the whole K's rows that a large budget
    stores; the storing product and later ones bitwise the same, M being a multiple of the vector width), and
    later products read them and form the rest: ``K^T (K v + w)``, ``K^T w`` and ``K v`` as close
    to a float64 oracle as the native pass without a stored head."""
    g = torch.Generator().manual_seed(11)
    n, m = 3001, 96
    X = torch.randn(n, 4, generator=g, dtype=dtype)
    Z = torch.randn(m, 4, generator=g, dtype=dtype)
    v = torch.randn(m, k, generator=g, dtype=dtype)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    kernel = _kernel(family, 1.1, dtype)
    itemsize = torch.finfo(dtype).bits // 8
    budget = n * m * itemsize // 2
    op = kgp.kernel_operator(kernel, X, Z)
    with settings.kernel_cache("auto"), settings.memory_budget(budget):
        spare = op.block_rows() if op.formula.buffers_needed > 1 else 0
        first = op.fused_matmul(v, w, accumulate=accumulate)
        assert not {"stored", "stored_head"} & set(op._cache)
        second = op.fused_matmul(v, w, accumulate=accumulate)
        head = op._cache.get("stored_head")
        assert head is not None and "stored" not in op._cache and not fused_cpu.use_stored(op.workspace, k, v, w)
        rows = head.shape[0]
        assert rows == (budget // (m * itemsize) - spare) // fused_cpu.TILE * fused_cpu.TILE and 0 < rows < n
        third = op.fused_matmul(v, w, accumulate=accumulate)
        rhs = op.transpose_matmul(w, accumulate=accumulate)
        kv = op @ v
        assert op._cache.get("stored_head") is head  # read, not rebuilt
    with settings.kernel_cache("never"):
        alone = op.fused_matmul(v, w, accumulate=accumulate)
        alone_rhs = op.transpose_matmul(w, accumulate=accumulate)
        alone_kv = op @ v
    whole = kgp.kernel_operator(kernel, X, Z)
    with settings.kernel_cache("auto"):
        whole.fused_matmul(v, w, accumulate=accumulate)
        whole.fused_matmul(v, w, accumulate=accumulate)
    assert torch.equal(head, whole._cache["stored"][:rows])
    # the storing product adds the head's part and the rest's as the products reading the head do
    assert torch.equal(second, third)
    K = _oracle(X, Z, float(kernel.lengthscale), dtype, family)
    exact = K.T @ (K @ v.double() + w.double())
    for got, ref, exp in (
        (first, alone, exact),
        (second, alone, exact),
        (third, alone, exact),
        (rhs, alone_rhs, K.T @ w.double()),
        (kv, alone_kv, K @ v.double()),
    ):
        _assert_no_further_from(exp, got, ref, dtype)


@pytest.mark.parametrize("family", ["rbf", "matern32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 3])
def test_native_k_v_alone_is_as_close_to_the_oracle_as_the_blocked_pass(family, dtype, k):
    """``K v`` (predictions: ``op @ v``) from the pass's first half, rows written by each thread's share: within
    twice the blocked product's error from the float64 oracle, row by row."""
    g = torch.Generator().manual_seed(k)
    X = torch.randn(1003, 4, generator=g, dtype=torch.float64).to(dtype)
    Z = torch.randn(517, 4, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(517, k, generator=g, dtype=torch.float64).to(dtype)
    kernel = _kernel(family, 1.1, dtype)
    expected = _oracle(X, Z, float(kernel.lengthscale), dtype, family) @ v.double()
    results = {}
    for mode in ("never", "always"):
        op = kgp.kernel_operator(kernel, X, Z)
        with settings.kernel_cache("never"), settings.fused_kernels(mode):
            assert fused_cpu.use_native(op.workspace, k, v) == (mode == "always")
            results[mode] = op @ v
    assert results["always"].shape == (1003, k) and results["always"].dtype == dtype
    _assert_no_further_from(expected, results["always"], results["never"], dtype)


@pytest.mark.parametrize("family", ["rbf", "matern52"])
def test_a_row_whose_norm_overflows_gives_the_blocked_result(family):
    """A far row (1e30 in float32: its augmented squared norm is inf) has kernel values at the floor, not NaN:
    the padding centers must not turn ``inf * 0`` into NaN (they repeat a real center)."""
    g = torch.Generator().manual_seed(6)
    Z = torch.randn(50, 3, generator=g)  # 50 centers: padded to 64
    X = torch.cat([torch.randn(9, 3, generator=g), torch.tensor([[1e30, 0.0, 0.0]])])
    v = torch.randn(50, 2, generator=g)
    op = kgp.kernel_operator(_kernel(family, 1.0, torch.float32), X, Z)
    with settings.kernel_cache("never"):
        with settings.fused_kernels("never"):
            blocked_kv, blocked_pass = op @ v, op.fused_matmul(v)
        assert fused_cpu.use_native(op.workspace, 2, v)
        native_kv, native_pass = op @ v, op.fused_matmul(v)
    assert bool(torch.isfinite(native_kv).all()) and bool(torch.isfinite(native_pass).all())
    torch.testing.assert_close(native_kv[-1], blocked_kv[-1])
    torch.testing.assert_close(native_pass, blocked_pass, rtol=1e-5, atol=1e-6)


def test_a_head_is_dropped_when_a_larger_budget_stores_the_whole_k():
    """A head stored under a small budget, then a product under a budget that holds all of K through the blocked
    products (more than MAX_COLUMNS columns): K is stored whole and the head dropped, not both kept."""
    g = torch.Generator().manual_seed(14)
    X = torch.randn(2000, 3, generator=g, dtype=torch.float64)
    Z = torch.randn(64, 3, generator=g, dtype=torch.float64)
    v = torch.randn(64, 1, generator=g, dtype=torch.float64)
    wide = torch.randn(64, fused_cpu.MAX_COLUMNS + 1, generator=g, dtype=torch.float64)
    kernel = _rbf(1.0, torch.float64)
    op = kgp.kernel_operator(kernel, X, Z)
    with settings.kernel_cache("auto"):
        with settings.memory_budget(2000 * 64 * 8 // 2):
            op.fused_matmul(v)
            op.fused_matmul(v)
            assert "stored_head" in op._cache and "stored" not in op._cache
        out = op.fused_matmul(wide)
        assert "stored" in op._cache and "stored_head" not in op._cache
    K = _oracle(X, Z, float(kernel.lengthscale), torch.float64)
    torch.testing.assert_close(out, K.T @ (K @ wide), rtol=1e-10, atol=1e-10)
