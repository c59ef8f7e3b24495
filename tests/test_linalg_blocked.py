"""Blocked in-place Cholesky, triangular solves and L^T L (kgp.linalg) against torch's dense routines."""

from __future__ import annotations

import pytest
import torch

from kgp.linalg import NotPSDError, cholesky_in_place, gram_of_lower, solve_lower_in_place

DTYPES = [torch.float32, torch.float64]


def spd(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, n + 5, generator=g, dtype=torch.float64)
    A = X @ X.mT / n
    A.diagonal().add_(0.5)  # condition number about 10: the error bounds below are not dominated by it
    return A.to(dtype)


def tolerance(n: int, dtype: torch.dtype) -> float:
    # Cholesky and substitution are backward stable with an error of order n eps (Higham, Thm 10.3 and
    # 8.5); with condition number ~10 the forward error of the factor stays below 10 n eps
    return 10 * n * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "block"), [(1, 4), (7, 3), (130, 32), (257, 64), (300, 1024), (1, None), (300, None), (2100, None)]
)
def test_blocked_cholesky_matches_torch_and_reads_only_the_lower_triangle(n, block, dtype):
    A = spd(n, dtype)
    ref = torch.linalg.cholesky(A.double())
    work = A.tril() + 1e3 * torch.ones(n, n, dtype=dtype).triu(1)  # a stale upper triangle must not matter
    L = cholesky_in_place(work, block=block)
    assert L.data_ptr() == work.data_ptr()
    assert torch.equal(L.triu(1), torch.zeros_like(L))
    assert (L.double() - ref).abs().max() <= tolerance(n, dtype) * ref.abs().max()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_lapack_path_refuses_a_non_finite_entry_below_the_diagonal(bad):
    # only the diagonal of the factor is checked: a non-finite entry anywhere in the lower triangle must
    # reach a later pivot (or make potrf stop)
    for i, j in ((1, 0), (40, 3), (49, 48)):
        A = spd(50, torch.float64)
        A[i, j] = bad
        with pytest.raises(NotPSDError):
            cholesky_in_place(A)


def test_lapack_path_stays_differentiable_for_an_input_that_requires_grad():
    B = torch.randn(30, 35, generator=torch.Generator().manual_seed(4), dtype=torch.float64, requires_grad=True)
    ref = torch.linalg.cholesky(B @ B.mT / 35 + torch.eye(30, dtype=torch.float64))
    (grad_ref,) = torch.autograd.grad(ref.sum(), B)
    L = cholesky_in_place(B @ B.mT / 35 + torch.eye(30, dtype=torch.float64))
    (grad,) = torch.autograd.grad(L.sum(), B)
    assert torch.allclose(L, ref, rtol=0, atol=1e-13)
    assert torch.allclose(grad, grad_ref, rtol=0, atol=1e-12 * grad_ref.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_lapack_path_factors_a_strided_view_in_place(dtype):
    big = spd(120, dtype)
    view = big[10:110, 10:110]  # not contiguous: rows of 120
    ref = torch.linalg.cholesky(view.double())
    L = cholesky_in_place(view)
    assert L.data_ptr() == view.data_ptr()
    assert torch.equal(big[10:110, 10:110].triu(1), torch.zeros(100, 100, dtype=dtype))
    assert (big[10:110, 10:110].double() - ref).abs().max() <= tolerance(100, dtype) * ref.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_blocked_triangular_solve(dtype, transpose):
    n, block = 200, 48
    L = torch.linalg.cholesky(spd(n, torch.float64))
    B = torch.randn(n, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected = torch.linalg.solve_triangular(L.mT if transpose else L, B, upper=transpose)
    out = solve_lower_in_place(L.to(dtype), B.to(dtype), transpose=transpose, block=block)
    assert (out.double() - expected).abs().max() <= tolerance(n, dtype) * expected.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gram_of_lower_is_the_lower_triangle_of_LtL(dtype):
    n, block = 150, 40
    L = torch.linalg.cholesky(spd(n, torch.float64)).to(dtype)
    G = gram_of_lower(L, block=block)
    expected = (L.double().mT @ L.double()).tril()
    assert (G.double().tril() - expected).abs().max() <= n * torch.finfo(dtype).eps * expected.abs().max()


def test_not_positive_definite_names_the_matrix():
    A = torch.eye(5, dtype=torch.float64)
    A[3, 3] = -1.0
    with pytest.raises(NotPSDError, match=r"the kernel \(5 x 5, torch.float64\) is not positive definite; add noise"):
        cholesky_in_place(A, what="the kernel", remedy="add noise", block=2)
    A = torch.eye(5, dtype=torch.float64)
    A[4, 4] = float("nan")
    with pytest.raises(NotPSDError):
        cholesky_in_place(A, block=2)
    for bad in (-1.0, float("nan")):  # the default: LAPACK's potrf at this size
        A = torch.eye(5, dtype=torch.float64)
        A[2, 2] = bad
        with pytest.raises(NotPSDError, match=r"the kernel \(5 x 5, torch.float64\) is not positive definite"):
            cholesky_in_place(A, what="the kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block"), [(1, 4), (9, 4), (130, 32), (300, 256)])
def test_inverse_from_cholesky_matches_the_inverse(n, block, dtype):
    from kgp.linalg import inverse_from_cholesky

    A = spd(n, torch.float64)
    L = torch.linalg.cholesky(A).to(dtype)
    inverse = inverse_from_cholesky(L, block=block)
    expected = torch.linalg.inv(A)
    assert inverse.dtype == dtype and torch.equal(inverse, inverse.mT)  # exactly symmetric
    # condition number ~10: a backward-stable inverse errs by a small multiple of n eps cond(A)
    assert (inverse.double() - expected).abs().max() <= 10 * tolerance(n, dtype) * expected.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block"), [(1, 4), (9, 4), (130, 32), (300, 256)])
def test_inverse_from_cholesky_in_the_factors_memory_equals_the_copying_one(n, block, dtype):
    from kgp.linalg import inverse_from_cholesky

    A = spd(n, torch.float64)
    L = torch.linalg.cholesky(A).to(dtype).contiguous()
    L = L.tril() + torch.full((n, n), 7.0, dtype=dtype).triu(1)  # garbage above the diagonal: never read
    expected = inverse_from_cholesky(L.clone(), block=block, flush=True)
    got = inverse_from_cholesky(L, block=block, flush=True, overwrite=True)
    assert got.data_ptr() == L.data_ptr()  # formed where the factor was
    # the same operations in the same order, on other addresses (MKL's kernels may round differently
    # with the alignment): equal to rounding, cond(A) ~ 10
    assert (got.double() - expected.double()).abs().max() <= tolerance(n, dtype) * expected.double().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block"), [(1, 4), (9, 4), (130, 32), (300, 256), (700, 256)])
@pytest.mark.parametrize("order", ["row-major", "column-major"])
def test_inverse_of_lower_reads_only_the_lower_triangle(n, block, dtype, order):
    from kgp.linalg import inverse_of_lower

    A = spd(n, torch.float64)
    L64 = torch.linalg.cholesky(A)
    # garbage in the strict upper triangle (cholesky_in_place leaves A's entries there on some paths)
    L = (L64 + torch.randn(n, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64).triu(1)).to(dtype)
    if order == "column-major":
        L = L.mT.contiguous().mT
    W = inverse_of_lower(L, block=block)
    expected = torch.linalg.solve_triangular(L64, torch.eye(n, dtype=torch.float64), upper=False)
    assert W.dtype == dtype and torch.equal(W, W.tril())
    # cond(L) = sqrt(cond(A)) ~ 3: backward-stable block substitution errs by a small multiple of n eps cond
    assert (W.double() - expected).abs().max() <= 10 * tolerance(n, dtype) * expected.abs().max()


@pytest.mark.parametrize("n", [1, 5, 257, 600])
def test_mirror_lower_copies_the_lower_triangle(n):
    from kgp.linalg import mirror_lower

    A = torch.randn(n, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = A.tril() + A.tril(-1).mT
    assert torch.equal(mirror_lower(A, block=128), expected)


@pytest.mark.parametrize("n", [1, 5, 257, 600])
def test_mirror_upper_copies_the_upper_triangle(n):
    from kgp.linalg import mirror_upper

    A = torch.randn(n, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    expected = A.triu() + A.triu(1).mT
    assert torch.equal(mirror_upper(A, block=128), expected)


def test_flush_below_keeps_subnormals_out_of_the_factor():
    # a Gaussian kernel matrix of far-apart points in float32: entries down to e^-700 in float64 round to
    # subnormals (or 0) in float32, and the blocked factorization creates more in its panels. With
    # flush_below (FALKON's mixed precision passes 2^-63 of the scale) no subnormal survives, and the
    # factor is the plain one to float32 rounding: the flushed entries are 1e-19 of the scale.
    g = torch.Generator().manual_seed(3)
    x = torch.rand(600, 2, generator=g, dtype=torch.float64) * 40
    K = torch.exp(-0.5 * torch.cdist(x, x).square() / 0.7**2)
    K.diagonal().add_(1e-3)
    A = K.to(torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    assert int(((A != 0) & (A.abs() < tiny)).sum()) > 0  # the input does hold subnormals
    flushed = cholesky_in_place(A.clone(), block=64, flush_below=2.0**-63)
    plain = cholesky_in_place(A.clone(), block=64)
    assert int(((flushed != 0) & (flushed.abs() < tiny)).sum()) == 0
    ref = torch.linalg.cholesky(K)
    bound = tolerance(600, torch.float32) * float(ref.norm())
    assert float((flushed.double() - ref).norm()) < bound
    assert float((flushed - plain).norm()) < 1e-6 * float(plain.norm())


def test_zero_small_entries_equals_a_dense_where_by_any_row_block():
    from kgp.linalg import zero_small_entries

    g = torch.Generator().manual_seed(5)
    X = torch.randn(37, 11, generator=g, dtype=torch.float64) * torch.logspace(-30, 0, 11, dtype=torch.float64)
    expected = torch.where(X.abs() < 1e-12, torch.zeros_like(X), X)
    for rows in (1, 8, 37, 100, None):  # None: all rows at once
        out = zero_small_entries(X.clone(), 1e-12, rows=rows)
        assert torch.equal(out, expected)
    assert int((expected == 0).sum()) > 0 and int((expected != 0).sum()) > 0
    # strictly below the threshold (rounded to the dtype), as a comparison: an entry equal to it is kept
    for dtype in (torch.float32, torch.float64):
        t = float(torch.tensor(1e-12, dtype=dtype))
        below = float(torch.nextafter(torch.tensor(t, dtype=dtype), torch.tensor(0.0, dtype=dtype)))
        Z = torch.tensor([t, -t, below, -below, 0.0, float("nan"), float("inf"), -float("inf"), 1.0], dtype=dtype)
        out = zero_small_entries(Z.clone().reshape(3, 3), 1e-12).reshape(-1)
        keep = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
        assert torch.equal(out[~keep], torch.zeros(3, dtype=dtype))
        assert torch.equal(out[keep].nan_to_num(), Z[keep].nan_to_num()) and bool(out[5].isnan())
        # a threshold of 0 or below zeroes nothing
        assert torch.equal(zero_small_entries(Z.clone(), 0.0).nan_to_num(), Z.nan_to_num())
    # a strided view (the lower-triangle blocks of the float32 preconditioner): only its entries change
    Y = X.clone()
    zero_small_entries(Y[5:20, :7], 1e-12)
    assert torch.equal(Y[5:20, :7], expected[5:20, :7])
    outside = torch.ones_like(X, dtype=torch.bool)
    outside[5:20, :7] = False
    assert torch.equal(Y[outside], X[outside])


def test_flush_for_cholesky_zeroes_entries_below_tiny_fraction_of_the_mean_diagonal():
    from kgp.linalg import flush_for_cholesky, tiny_fraction

    for dtype in (torch.float32, torch.float64):
        t = tiny_fraction(dtype)
        assert t == torch.finfo(dtype).tiny ** 0.5
        A = torch.tensor([[4.0, 3.0 * t, 5.0 * t], [3.0 * t, 4.0, 1e-3], [5.0 * t, 1e-3, 4.0]], dtype=dtype)
        flush = flush_for_cholesky(A)
        # mean diagonal 4: entries below 4 t go (3 t), entries above stay (5 t); the factor's threshold is 2 t
        assert A[0, 1] == 0 and A[1, 0] == 0 and float(A[0, 2]) == float(torch.tensor(5.0 * t, dtype=dtype))
        assert flush == t * 2.0
        B = torch.tensor([[0.0, 1e-300], [1e-300, 0.0]], dtype=torch.float64)
        assert flush_for_cholesky(B) is None and float(B[0, 1]) == 1e-300  # no positive scale: unchanged


@pytest.mark.parametrize("dtype", DTYPES)
def test_flush_below_scale_zeroes_exactly_the_entries_below_the_fraction(dtype):
    from kgp.linalg import flush_below_scale, tiny_fraction

    threshold = tiny_fraction(dtype) * 3.0
    X = torch.tensor([[threshold * 0.5, -threshold * 0.9, threshold * 2], [1.0, 0.0, -threshold * 4]], dtype=dtype)
    expected = X.clone()
    expected[0, :2] = 0.0
    assert flush_below_scale(X, 3.0) and torch.equal(X, expected)
    for bad in (0.0, -1.0, float("nan"), float("inf")):  # nothing changed, and said so
        Y = torch.full((2, 2), threshold * 0.5, dtype=dtype)
        assert not flush_below_scale(Y, bad) and bool((Y == threshold * 0.5).all())
