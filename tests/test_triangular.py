"""kgp.linalg.LowerFactor: block-row triangular solves against torch's LAPACK solve in float64."""

from __future__ import annotations

import math

import pytest
import torch

import kgp.linalg.lower_factor
from kgp.linalg.lower_factor import LowerFactor, threads_sleep_when_waiting

DTYPES = [torch.float32, torch.float64]


def lower_factor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The Cholesky factor of a Gaussian kernel matrix plus 0.1 I: condition number of L below about 30."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=g, dtype=torch.float64)
    K = torch.cdist(X, X).square().mul(-0.5).exp()
    K.diagonal().add_(0.1)
    return torch.linalg.cholesky(K).to(dtype)


def forward_error_bound(L: torch.Tensor) -> float:
    # substitution is backward stable with a relative backward error of order n eps (Higham, Thm 8.5),
    # so the forward error is at most cond(L) n eps; the inverted diagonal blocks add another cond(L_jj) eps
    n = L.shape[0]
    cond = float(torch.linalg.cond(L.double()))
    return 4 * cond * n * torch.finfo(L.dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "block"), [(1, 4), (7, 3), (130, 32), (257, 64), (300, 300), (300, 1024)])
@pytest.mark.parametrize("columns", [1, 3])
@pytest.mark.parametrize("transpose", [False, True])
def test_block_rows_match_a_float64_solve(n, block, columns, transpose, dtype):
    L = lower_factor(n, dtype)
    factor = LowerFactor(L, block=block)
    B = torch.randn(n, columns, generator=torch.Generator().manual_seed(1), dtype=dtype)
    op = L.double().mT if transpose else L.double()
    ref = torch.linalg.solve_triangular(op, B.double(), upper=transpose)
    X = factor._solve_blocks(B, transpose)
    assert X.dtype == dtype and X.shape == B.shape
    assert (X.double() - ref).norm() <= forward_error_bound(L) * ref.norm()
    # whichever path solve() picks, the answer is the same to the same bound
    assert (factor.solve(B, transpose=transpose).double() - ref).norm() <= forward_error_bound(L) * ref.norm()


def test_only_the_lower_triangle_is_read():
    L = lower_factor(200, torch.float64)
    stale = L + 1e3 * torch.ones_like(L).triu(1)
    B = torch.randn(200, 2, dtype=torch.float64)
    for transpose in (False, True):
        expect = LowerFactor(L, block=32)._solve_blocks(B, transpose)
        assert torch.equal(LowerFactor(stale, block=32)._solve_blocks(B, transpose), expect)


def test_any_strides_of_the_factor():
    L = lower_factor(150, torch.float64)
    column_major = L.mT.contiguous().mT
    B = torch.randn(150, 1, dtype=torch.float64)
    for transpose in (False, True):
        ref = torch.linalg.solve_triangular(L.mT if transpose else L, B, upper=transpose)
        X = LowerFactor(column_major, block=16)._solve_blocks(B, transpose)
        assert (X - ref).norm() <= forward_error_bound(L) * ref.norm()


@pytest.mark.parametrize(
    ("policy", "columns", "transpose", "blocks"),
    [
        ("PASSIVE", 1, False, True),
        ("passive", 1, True, True),
        ("PASSIVE", 2, False, False),
        ("PASSIVE", 2, True, True),
        (None, 1, False, False),
        (None, 1, True, False),
        ("ACTIVE", 1, True, False),
        (None, 4, True, True),
        (None, 4, False, False),
    ],
)
def test_which_solve_runs(monkeypatch, policy, columns, transpose, blocks):
    # the measured rule (kgp/linalg/lower_factor.py): block rows for one column with sleeping threads, and for L^T X = B
    # with several columns; LAPACK's solve otherwise
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert threads_sleep_when_waiting() is (policy is not None and policy.lower() == "passive")
    factor = LowerFactor(lower_factor(40, torch.float64), block=8)
    assert factor.uses_blocks(columns, transpose=transpose) is blocks
    # a factor of one block never runs block rows
    assert not LowerFactor(factor.L, block=40).uses_blocks(columns, transpose=transpose)
    calls = []
    monkeypatch.setattr(factor, "_solve_blocks", lambda B, t: calls.append(t) or torch.zeros_like(B))
    factor.solve(torch.ones(40, columns, dtype=torch.float64), transpose=transpose)
    assert calls == ([transpose] if blocks else [])


def test_block_inverses_are_computed_once():
    factor = LowerFactor(lower_factor(50, torch.float64), block=16)
    B = torch.randn(50, 1, dtype=torch.float64)
    factor._solve_blocks(B, False)
    first = factor._inverses
    assert len(first) == 4
    factor._solve_blocks(B, True)
    assert factor._inverses is first


def test_bad_input_is_refused_with_the_argument_named():
    L = lower_factor(10, torch.float64)
    with pytest.raises(ValueError, match="L must be a square matrix"):
        LowerFactor(L[:, :5])
    with pytest.raises(ValueError, match="block must be a positive integer"):
        LowerFactor(L, block=0)
    factor = LowerFactor(L)
    with pytest.raises(ValueError, match=r"B must have shape \(10, k\)"):
        factor.solve(torch.ones(10))
    with pytest.raises(ValueError, match="B must have the factor's dtype"):
        factor.solve(torch.ones(10, 1, dtype=torch.float32))


def test_solve_lower_wide_matches_a_float64_solve_and_leaves_no_subnormal_float32_entry():
    # a factor whose forward substitution builds chains of ever smaller values: in float32 they go
    # subnormal (slow on some CPUs); solve_lower_wide runs them in float64 and rounds the result once
    from kgp.linalg import solve_lower_wide

    g = torch.Generator().manual_seed(5)
    M, k = 700, 9
    x = torch.sort(torch.rand(M, generator=g, dtype=torch.float64) * 60).values
    K = torch.exp(-((x[:, None] - x[None, :]) ** 2) / (2 * 0.05**2))  # far-apart points: tiny entries
    K.diagonal().add_(1e-3)
    L64 = torch.linalg.cholesky(K)
    B64 = torch.exp(-((x[:, None] - torch.linspace(0, 60, k, dtype=torch.float64)[None, :]) ** 2))
    L32, B32 = L64.float(), B64.float()
    oracle = torch.linalg.solve_triangular(L32.double(), B32.double(), upper=False)
    for block in (64, 512, 1024):
        X = solve_lower_wide(L32, B32, block=block)
        assert X.dtype == torch.float32
        assert float((X.double() - oracle).abs().max() / oracle.abs().max()) < 4 * torch.finfo(torch.float32).eps
        tiny = torch.finfo(torch.float32).tiny
        assert int(((X != 0) & (X.abs() < tiny)).sum()) == 0
    # float64 in, float64 out: kernel columns floored near float64's smallest normal number (as kgp's
    # kernels floor exp) give the same solve to float64 rounding, flushed of entries too small to matter
    B_floor = B64.clamp_min(1e-300)
    oracle64 = torch.linalg.solve_triangular(L64, B_floor, upper=False)
    X64 = solve_lower_wide(L64, B_floor)
    assert X64.dtype == torch.float64
    assert float((X64 - oracle64).abs().max() / oracle64.abs().max()) < M * torch.finfo(torch.float64).eps
    tiny64 = torch.finfo(torch.float64).tiny
    assert int(((X64 != 0) & (X64.abs() < tiny64)).sum()) == 0
    assert float(X64[(X64 != 0)].abs().min()) >= math.sqrt(tiny64) * float(X64.abs().max()) * (1 - 1e-15)
    with pytest.raises(ValueError, match="solve_lower_wide"):
        solve_lower_wide(L32, B32[:-1])


# float32 factor, float64 right-hand sides: the native solve (triangular_mixed.c) widens each entry exactly,
# so it must agree with a float64 solve on the widened factor to float64's bound, far below float32's


def mixed_case(n: int, columns: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    L = lower_factor(n, torch.float32, seed=seed)
    B = torch.randn(n, columns, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return L, B


needs_native_solve = pytest.mark.skipif(
    kgp.linalg.lower_factor.mixed_solve_error() is not None,
    reason=f"the native mixed-precision solve cannot be built here: {kgp.linalg.lower_factor.mixed_solve_error()}",
)


@needs_native_solve
@pytest.mark.parametrize(("n", "block"), [(1, 4), (7, 3), (130, 32), (257, 64), (300, 300), (300, 1024), (1100, 256)])
@pytest.mark.parametrize("columns", [1, 3])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_mixed_solve_matches_a_float64_solve_on_the_widened_factor(n, block, columns, transpose, threads):
    L, B = mixed_case(n, columns)
    above = torch.ones(n, n, dtype=torch.bool).triu(1)
    L = torch.where(above, torch.tensor(float("nan")), L)  # NaN above the diagonal: never read
    factor = LowerFactor(L, block=block)
    assert factor.uses_native(B)
    wide = L.double().tril()
    ref = torch.linalg.solve_triangular(wide.mT if transpose else wide, B, upper=transpose)
    before = B.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the panels split into that many shares (a share may be empty)
    try:
        X = factor.solve(B, transpose=transpose)
    finally:
        torch.set_num_threads(previous)
    assert X.dtype == torch.float64 and X.shape == B.shape
    assert torch.equal(B, before)  # the right-hand sides are not overwritten
    assert (X - ref).norm() <= forward_error_bound(wide) * ref.norm()


@needs_native_solve
def test_mixed_solve_takes_any_layout_of_the_right_hand_sides():
    L, B = mixed_case(300, 4)
    factor = LowerFactor(L, block=64)
    wide = L.double()
    for rhs in (B, B.mT.contiguous().mT, B[:, ::2]):
        for transpose in (False, True):
            ref = torch.linalg.solve_triangular(wide.mT if transpose else wide, rhs, upper=transpose)
            X = factor.solve(rhs, transpose=transpose)
            assert (X - ref).norm() <= forward_error_bound(wide) * ref.norm()


def test_mixed_solve_without_the_native_code_widens_the_factor_once(monkeypatch):
    # no compiler (or a factor whose rows are not contiguous): a float64 copy of the factor, the same answer
    monkeypatch.setattr(kgp.linalg.lower_factor, "_mixed_library", lambda: None)
    L, B = mixed_case(300, 2)
    factor = LowerFactor(L, block=64)
    assert not factor.uses_native(B)
    wide = L.double()
    for transpose in (False, True):
        ref = torch.linalg.solve_triangular(wide.mT if transpose else wide, B, upper=transpose)
        X = factor.solve(B, transpose=transpose)
        assert X.dtype == torch.float64
        assert (X - ref).norm() <= forward_error_bound(wide) * ref.norm()
    first = factor._wide
    assert first is not None and first.L.dtype == torch.float64
    factor.solve(B)
    assert factor._wide is first


def test_mixed_solve_of_a_column_major_factor_uses_the_widened_copy():
    L, B = mixed_case(200, 1)
    column_major = L.mT.contiguous().mT
    factor = LowerFactor(column_major, block=64)
    assert not factor.uses_native(B)
    ref = torch.linalg.solve_triangular(L.double(), B, upper=False)
    assert (factor.solve(B) - ref).norm() <= forward_error_bound(L.double()) * ref.norm()


def test_mixed_solve_refuses_other_dtype_pairs():
    L64 = lower_factor(10, torch.float64)
    with pytest.raises(ValueError, match="or float64 with a float32 factor"):
        LowerFactor(L64).solve(torch.ones(10, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="or float64 with a float32 factor"):
        LowerFactor(L64.float()).solve(torch.ones(10, 1, dtype=torch.float16))
