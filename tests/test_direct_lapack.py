"""LAPACK's potrf on a tensor's memory (kgp.linalg.lapack), flush-to-zero in torch's threads (kgp.linalg.subnormal)."""

from __future__ import annotations

import contextlib
import platform

import pytest
import torch

import kgp.linalg.cholesky
from kgp.linalg import NotPSDError, cholesky_in_place, gram_of_lower, lapack, subnormal

DTYPES = [torch.float32, torch.float64]
TINY32 = torch.finfo(torch.float32).tiny
# torch's Linux x86 wheels (CI's) carry MKL's LAPACK symbols and GNU OpenMP: there both must work, not be skipped
EXPECTED_HERE = platform.system() == "Linux" and platform.machine() == "x86_64" and torch.backends.mkl.is_available()


def spd(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, n + 5, generator=g, dtype=torch.float64)
    A = X @ X.mT / n
    A.diagonal().add_(0.5)  # condition number about 10
    return A.to(dtype)


def tolerance(n: int, dtype: torch.dtype) -> float:
    # backward-stable Cholesky, condition number ~10: forward error below 10 n eps (Higham, Thm 10.3)
    return 10 * n * torch.finfo(dtype).eps


def subnormal_survives() -> bool:
    """A parallel product of a subnormal float32 number with 1 keeps it, in every thread's share."""
    x = torch.full((65_536 * max(1, torch.get_num_threads()),), subnormal.SUBNORMAL_BITS, dtype=torch.int32)
    x = x.view(torch.float32)
    # bits, not floats: a comparison in a flushing thread reads a subnormal as 0
    return bool(((x * 1.0).view(torch.int32) == x.view(torch.int32)).all())


def test_the_direct_calls_are_available_on_this_platform():
    if not EXPECTED_HERE:
        pytest.skip("torch's LAPACK symbols and libgomp are expected in the Linux x86 MKL builds only")
    assert lapack.potrf_applies(spd(3, torch.float64))
    with subnormal.flush_denormals() as active:
        assert active


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 300])
def test_potrf_lower_factors_in_place_from_the_lower_triangle(n, dtype):
    A = spd(n, dtype)
    if not lapack.potrf_applies(A):
        pytest.skip("LAPACK's potrf is not exported by this torch build")
    ref = torch.linalg.cholesky(A.double())
    work = A.tril() + 1e3 * torch.ones(n, n, dtype=dtype).triu(1)  # a stale upper triangle must not matter
    ptr = work.data_ptr()
    assert lapack.potrf_lower(work) == 0
    assert work.data_ptr() == ptr
    assert torch.equal(work.triu(1), torch.zeros_like(work))
    assert (work.double() - ref).abs().max() <= tolerance(n, dtype) * ref.abs().max()


def test_potrf_lower_reports_the_first_non_positive_minor():
    A = torch.eye(6, dtype=torch.float64)
    A[4, 4] = -1.0
    if not lapack.potrf_applies(A):
        pytest.skip("LAPACK's potrf is not exported by this torch build")
    assert lapack.potrf_lower(A) == 5  # LAPACK counts from 1


def test_potrf_applies_only_to_what_lapack_can_read_in_place():
    A = spd(8, torch.float64)
    assert not lapack.potrf_applies(A[:, :6])  # not square
    assert not lapack.potrf_applies(spd(10, torch.float64)[1:9, 1:9])  # rows of 10: not contiguous
    assert not lapack.potrf_applies(A.to(torch.int64))
    assert not lapack.potrf_applies(A.clone().requires_grad_())
    with pytest.raises(ValueError, match="potrf_lower: expected a contiguous square"):
        lapack.potrf_lower(A[:, :6])


def test_flush_denormals_reads_subnormals_as_zero_in_every_thread_and_restores():
    with subnormal.flush_denormals() as active:
        if not active:
            pytest.skip("flush-to-zero cannot be set in torch's threads here")
        assert not subnormal_survives()
        with subnormal.flush_denormals() as inner:  # nested: already on, left on
            assert inner
        assert not subnormal_survives()
    assert subnormal_survives()


def test_flush_denormals_leaves_a_mode_the_caller_set():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        with subnormal.flush_denormals() as active:
            if not active:
                pytest.skip("flush-to-zero cannot be set in torch's threads here")
        # the calling thread's mode, set before the block, is still on
        x = torch.tensor([subnormal.SUBNORMAL_BITS], dtype=torch.int32).view(torch.float32)
        assert int((x * 1.0).view(torch.int32)) == 0
    finally:
        torch.set_flush_denormal(False)
        with subnormal.flush_denormals():  # and the other threads' back to normal
            pass
    assert subnormal_survives()


def kernel_with_subnormals(n: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 Gaussian kernel matrix of far-apart points (entries down to e^-700 round to subnormals or 0)."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(n, 2, generator=g, dtype=torch.float64) * 40
    K = torch.exp(-0.5 * torch.cdist(x, x).square() / 0.7**2)
    K.diagonal().add_(1e-3)
    return K, K.to(torch.float32)


@pytest.mark.parametrize("flushing", [True, False])
def test_cholesky_with_flush_below_keeps_subnormals_out_at_any_size(monkeypatch, flushing):
    # above POTRF_MAX the direct potrf runs only under flush-to-zero; without that mode the blocked loop flushes
    K, A = kernel_with_subnormals()
    monkeypatch.setattr(kgp.linalg.cholesky, "POTRF_MAX", 100)
    calls = []
    real = kgp.linalg.cholesky._potrf_in_place
    monkeypatch.setattr(kgp.linalg.cholesky, "_potrf_in_place", lambda *a: calls.append(1) or real(*a))
    if not flushing:

        @contextlib.contextmanager
        def unavailable():
            yield False

        monkeypatch.setattr(kgp.linalg.cholesky, "flush_denormals", unavailable)
    assert int(((A != 0) & (A.abs() < TINY32)).sum()) > 0  # the input does hold subnormals
    L = cholesky_in_place(A.clone(), flush_below=2.0**-63)
    assert int(((L != 0) & (L.abs() < TINY32)).sum()) == 0
    ref = torch.linalg.cholesky(K)
    assert float((L.double() - ref).norm()) < tolerance(600, torch.float32) * float(ref.norm())
    if flushing and lapack.potrf_applies(A) and EXPECTED_HERE:
        assert calls, "the direct potrf should have run under flush-to-zero"
    if not flushing:
        assert not calls, "without flush-to-zero the blocked loop factors matrices above POTRF_MAX"
    assert subnormal_survives()  # the mode is off again after the factorization


def test_direct_path_raises_for_a_matrix_that_is_not_positive_definite():
    A = spd(40, torch.float64)
    A[20, 20] = -5.0
    with pytest.raises(NotPSDError, match="the kernel"):
        cholesky_in_place(A, what="the kernel", flush_below=1e-150)
    assert subnormal_survives()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["new", "out", "overwrite"])
def test_gram_of_lower_scales_each_block(dtype, mode):
    n, block, scale = 150, 40, 1.0 / 7.0
    L = torch.linalg.cholesky(spd(n, torch.float64)).to(dtype)
    expected = scale * (L.double().mT @ L.double()).tril()
    if mode == "new":
        G = gram_of_lower(L, block=block, scale=scale)
    elif mode == "out":
        out = torch.full((n, n), float("nan"), dtype=dtype)  # beta = 0: old contents, NaN too, are not read
        G = gram_of_lower(L, block=block, scale=scale, out=out)
        assert G.data_ptr() == out.data_ptr()
    else:
        work = L.clone()
        G = gram_of_lower(work, block=block, scale=scale, overwrite=True)
        assert G.data_ptr() == work.data_ptr()
    err = (G.double().tril() - expected).abs().max()
    assert err <= n * torch.finfo(dtype).eps * expected.abs().max()


def test_blocked_loop_writes_its_panels_in_place_and_matches_the_direct_path():
    A = spd(500, torch.float64)
    blocked = cholesky_in_place(A.clone(), block=96)
    direct = cholesky_in_place(A.clone())
    assert (blocked - direct).abs().max() <= tolerance(500, torch.float64) * direct.abs().max()
