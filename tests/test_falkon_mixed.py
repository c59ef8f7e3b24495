"""FALKON's mixed-precision preconditioner (``precond_dtype="mixed"``) against dense float64 oracles.

The ``M^3`` factorizations run in float32 and the factors are applied in float64. Rudi et al. 2017,
Def. 3: CG on ``W = B^T H B`` converges to the same ``alpha = B beta`` for any fixed invertible ``B``,
provided the ``lambda K_MM`` part of ``W`` is the true one. So a converged fit on float64 inputs must
match exact KRR to float64 accuracy, far below float32's resolution, although ``T`` and ``A`` carry
float32 rounding; and it must stop matching once the regulariser's jitter correction is removed.
"""

from __future__ import annotations

import re

import pytest
import torch
from kgp_builtins.falkon import FalkonSolver
from kgp_builtins.falkon import preconditioner as falkon_prec

import kgp
from kgp.options import InvalidOptionError
from kgp.plugin import Problem

F64, F32 = torch.float64, torch.float32
EPS32 = torch.finfo(F32).eps


def rbf(lengthscale: float, dtype=F64):
    return kgp.kernels.make_kernel("rbf", lengthscale).to(dtype).requires_grad_(False)


def problem_of(X, y, Z, noise, **options) -> Problem:
    solver = FalkonSolver()
    return Problem(
        X=X,
        y=y,
        kernel=rbf(1.0, X.dtype),
        noise=noise,
        centers=kgp.Centers(Z),
        options=kgp.resolve_options("solver 'falkon'", solver, options),
        monitor=kgp.Monitor(),
    )


def fit(X, y, Z, noise, **options):
    problem = problem_of(X, y, Z, noise, **options)
    return FalkonSolver().fit(problem), problem.monitor


def data(n, d=3, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=F64)
    y = torch.sin(X @ torch.randn(d, 1, generator=g, dtype=F64)) + 0.1 * torch.randn(n, 1, generator=g, dtype=F64)
    return X.to(dtype), y.to(dtype)


def exact_krr(X, y, noise):
    """Fitted values ``K (K + noise I)^{-1} y`` by a dense float64 Cholesky, and ``K``."""
    X, y = X.to(F64), y.to(F64)
    K = kgp.kernel_operator(rbf(1.0), X, X).to_dense()
    L = torch.linalg.cholesky(K + noise * torch.eye(K.shape[0], dtype=F64))
    return K @ torch.cholesky_solve(y, L), K


def fitted(pred, K):
    return K @ pred.alpha.to(F64)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


# M = n: the Nystrom estimator is exact KRR (d = 5: K's smallest eigenvalue 3e-4, so CG converges to the
# oracle instead of stalling on a numerically singular W). jitter 1e-2: the correction it needs is large.
N, D, NOISE, JITTER = 400, 5, 0.05, 1e-2


def float32_bound(K) -> float:
    """What float32 factors may cost at convergence: eps32 ||K|| / noise.

    The regulariser uses ``T^T T = K_MM + shift I``; the float32 ``T`` satisfies it up to its backward
    error, about ``eps32 ||K_MM||`` (Higham, Thm. 10.3, times a growth factor), so the problem solved has
    ``K_MM`` perturbed by that much in the ``lambda`` term: a relative change of the solution of at most
    ``eps32 ||K|| / noise``. Dropping the correction perturbs it by the whole ``shift``, far more.
    """
    return EPS32 * float(torch.linalg.eigvalsh(K)[-1]) / NOISE


def test_mixed_converges_to_exact_krr():
    X, y = data(N, d=D)
    exact, K = exact_krr(X, y, NOISE)
    pred, mon = fit(X, y, X, NOISE, precond_dtype="mixed", jitter=JITTER, maxiter=150, tol=1e-13)
    assert mon.history[-1].extras["precond_dtype"] == "mixed"
    assert mon.history[-1].extras["residual"] < 1e-10
    assert rel(fitted(pred, K), exact) < float32_bound(K)


def test_mixed_without_the_jitter_correction_is_wrong(monkeypatch):
    # the regulariser's correction -lambda shift (T T^T)^{-1} is what removes the jitter from the problem;
    # dropped, the fit solves KRR with an extra lambda n shift ||alpha||^2 and misses by far more
    build = falkon_prec.mixed_cholesky

    def without_correction(*args, **kwargs):
        prec = build(*args, **kwargs)
        prec.shift = 0.0
        return prec

    monkeypatch.setattr(falkon_prec, "mixed_cholesky", without_correction)
    X, y = data(N, d=D)
    exact, K = exact_krr(X, y, NOISE)
    pred, _ = fit(X, y, X, NOISE, precond_dtype="mixed", jitter=JITTER, maxiter=150, tol=1e-13)
    assert rel(fitted(pred, K), exact) > 10 * float32_bound(K)


def test_mixed_on_float32_inputs_is_as_close_as_the_float64_preconditioner():
    # float32 inputs: the float32 kernel passes already perturb the problem at the eps32 ||K|| / noise
    # level; the float32 factors must not add more than that
    X, y = data(N, d=D, dtype=F32)
    exact, K = exact_krr(X, y, NOISE)
    opts = dict(jitter=JITTER, maxiter=150, tol=1e-10)
    mixed, _ = fit(X, y, X, NOISE, precond_dtype="mixed", **opts)
    full, _ = fit(X, y, X, NOISE, precond_dtype="float64", **opts)
    bound = float32_bound(K)
    assert rel(fitted(full, K), exact) < bound
    assert rel(fitted(mixed, K), exact) < bound


def test_mixed_factors_are_float32_triangles_in_one_buffer(monkeypatch):
    # K_MM in several 96-row blocks; both factors stay float32 (the CG reads them in float64 arithmetic,
    # kgp.linalg.lower_factor) and share one buffer of 2 M^2 float32 entries
    monkeypatch.setattr(falkon_prec, "MIXED_ROWS", 96)
    X, y = data(700, d=4, seed=3)
    Z = X[:500]
    problem = problem_of(X, y, Z, 0.1)
    prec = falkon_prec.build_preconditioner(
        problem, None, factorization="auto", precond_dtype="mixed", jitter=JITTER, rcond=None
    )
    assert prec.precision == "mixed" and prec.T.dtype == F32 and prec.A.dtype == F32 and prec.dtype == F64
    M = Z.shape[0]
    assert prec.A.mT.data_ptr() == prec.T.mT.data_ptr() + 4 * M * M  # G then P in one allocation
    assert torch.equal(prec.T, prec.T.triu()) and torch.equal(prec.A, prec.A.triu())
    T, A = prec.T.to(F64), prec.A.to(F64)
    G = kgp.kernel_operator(rbf(1.0), Z, Z).to_dense()
    G.diagonal().add_(prec.shift)
    # float32 factors: backward errors of a few eps32 times the matrices' scale
    assert float((T.mT @ T - G).abs().max()) < 50 * EPS32 * float(G.diagonal().max())
    P = T @ T.mT / M
    extra = falkon_prec.MIXED_A_SHIFT * EPS32 * float(G.diagonal().mean())
    P.diagonal().add_(problem.lam + extra)
    assert float((A.mT @ A - P).abs().max()) < 50 * EPS32 * float(P.diagonal().max())
    # the map B' u = T^{-1} A^{-1} u in float64 on the widened factors, to float64 rounding
    u = torch.randn(M, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    expect = torch.linalg.solve_triangular(T, torch.linalg.solve_triangular(A, u, upper=True), upper=True)
    assert rel(prec.apply(u), expect) < 1e3 * torch.finfo(F64).eps


def test_mixed_factors_hold_no_subnormal_float32_values(monkeypatch, cholesky_path):
    # far-apart centers (short lengthscale against the spread, as on bike): K_MM's float64 values down to
    # e^-700 round to float32 subnormals, which slowed the float32 GEMMs of the setup 10x on an Intel host.
    # They are flushed (TINY_FRACTION of the scale) while the factors keep their backward error, on each path of
    # the Cholesky (the cholesky_path fixture).
    monkeypatch.setattr(falkon_prec, "MIXED_ROWS", 128)
    X, y = data(1500, d=2, seed=4)
    X = X * 20
    Z = X[:1200]
    problem = problem_of(X, y, Z, 0.1)
    prec = falkon_prec.build_preconditioner(
        problem, None, factorization="cholesky", precond_dtype="mixed", jitter=JITTER, rcond=None
    )
    assert prec.precision == "mixed"
    tiny = torch.finfo(F32).tiny
    for factor in (prec.T, prec.A):
        assert factor.dtype == F32
        assert int(((factor != 0) & (factor.abs() < tiny)).sum()) == 0
        # nothing kept below eps32 / M of the factor's scale (the flush that also cuts the triangular
        # solves' chains of subnormal intermediates), which the backward error below must absorb
        scale = float(factor.diagonal().square().mean().sqrt())
        floor = falkon_prec.factor_flush(factor.shape[0]) * scale
        assert floor == pytest.approx(EPS32 / factor.shape[0] * scale)
        assert int(((factor != 0) & (factor.abs() < 0.5 * floor)).sum()) == 0
    G = kgp.kernel_operator(rbf(1.0), Z, Z).to_dense()
    G.diagonal().add_(prec.shift)
    assert int(((G != 0) & (G.abs() < tiny)).sum()) > 0  # the matrix itself has entries in that range
    T = prec.T.to(F64)
    assert float((T.mT @ T - G).abs().max()) < 50 * EPS32 * float(G.diagonal().max())


def test_float64_factors_hold_no_subnormal_values(cholesky_path):
    # the same trap in float64: K_MM's values below 2^-511 have subnormal products in the factorizations'
    # GEMMs (UCI parkinsons: a 78 s setup instead of 1.2 s on an Intel host). They are flushed
    # (tiny_fraction(float64) = 2^-511 of the scale) and the factors keep float64's backward error, on each path
    # of the Cholesky (the cholesky_path fixture).
    X, y = data(1100, d=2, seed=4)
    X = X * 20
    Z = X[:900]
    problem = problem_of(X, y, Z, 0.1)
    prec = falkon_prec.build_preconditioner(
        problem, None, factorization="cholesky", precond_dtype="float64", jitter=JITTER, rcond=None
    )
    assert prec.dtype == F64 and prec.precision == ""
    tiny = torch.finfo(F64).tiny
    for factor in (prec.T, prec.A):
        assert int(((factor != 0) & (factor.abs() < tiny)).sum()) == 0
    G = kgp.kernel_operator(rbf(1.0), Z, Z).to_dense()
    # kgp's kernels floor exp at about 1e-304, but products of such entries are subnormal: the matrix has many
    assert int(((G != 0) & (G.abs() < kgp.linalg.tiny_fraction(F64))).sum()) > 1000
    G.diagonal().add_(prec.shift)
    # Cholesky's backward error, of order M eps |L| |L^T| (Higham, Thm 10.3); a flush at a threshold far above
    # 2^-511 of the scale (1e-12, say) would exceed it
    bound = 4 * Z.shape[0] * torch.finfo(F64).eps
    assert float((prec.T.mT @ prec.T - G).abs().max()) < bound * float(G.diagonal().max())
    P = prec.T @ prec.T.mT / Z.shape[0]
    P.diagonal().add_(problem.lam)
    assert float((prec.A.mT @ prec.A - P).abs().max()) < bound * float(P.diagonal().max())


@pytest.mark.parametrize("dtype,expected", [(F32, "mixed"), (F64, "float64")])
def test_precond_dtype_auto_follows_the_input_dtype(dtype, expected):
    X, y = data(300, dtype=dtype)
    _, mon = fit(X, y, X[:50], 0.1, maxiter=3)
    assert mon.history[-1].extras["precond_dtype"] == expected


@pytest.mark.parametrize("factorization", ["eigh", "pivoted"])
def test_mixed_with_eigen_or_pivoted_factorization_runs_in_float64(factorization):
    X, y = data(300)
    _, mon = fit(X, y, X[:50], 0.1, precond_dtype="mixed", factorization=factorization, maxiter=3)
    assert mon.history[-1].extras["precond_dtype"] == "float64"


def test_bad_precond_dtype_names_the_option_and_the_choices():
    X, y = data(100)
    msg = "solver 'falkon' option 'precond_dtype': expected one of 'auto', 'float64', 'mixed', 'input', got 'half'"
    with pytest.raises(InvalidOptionError, match=re.escape(msg)):
        kgp.KernelRegressor(solver="falkon", n_centers=10, solver_options={"precond_dtype": "half"}).fit(X, y)
