"""FALKON solver plugin against dense float64 oracles (Rudi et al. 2017, Appendix A).

Oracles are computed here from dense kernel matrices: exact KRR (the ``exact`` plugin, a dense
Cholesky), the direct Nystrom solve ``(K_nM^T K_nM + lambda n K_MM) alpha = K_nM^T y`` and its
weighted form. Real-data tests read ../shared/data next to the checkout and skip without it.
"""

from __future__ import annotations

import gzip
import re

import numpy as np
import pytest
import torch
from kgp_builtins.falkon import FalkonSolver

import kgp
from kgp.linalg import NotPSDError, largest_eigenvalue, smallest_eigenvalue_from_cholesky
from kgp.options import InvalidOptionError
from kgp.plugin import Problem

F64 = torch.float64


# ---------------------------------------------------------------------------- helpers
def rbf(lengthscale: float, dtype=F64):
    return kgp.kernels.make_kernel("rbf", lengthscale).to(dtype).requires_grad_(False)


def dense(kernel, A, B):
    with torch.no_grad():
        return kgp.kernel_operator(kernel, A, B).to_dense()


def direct_nystrom(kernel, X, y, Z, noise, weights=None):
    """Dense float64 solve of the Nystrom system; with weights, solved in the basis D (Def. 3/4)."""
    K = dense(kernel, X.to(F64), Z.to(F64))
    Kmm = dense(kernel, Z.to(F64), Z.to(F64))
    y = y.to(F64)
    if weights is None:
        return torch.linalg.solve(K.T @ K + noise * Kmm, K.T @ y)
    D = torch.diag(weights.to(F64))
    gamma = torch.linalg.solve(D @ (K.T @ K + noise * Kmm) @ D, D @ K.T @ y)
    return D @ gamma


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    return float((a - b).norm() / b.norm())


def fit(X, y, Z, noise, kernel=None, weights=None, monitor=None, **options):
    solver = FalkonSolver()
    problem = Problem(
        X=X,
        y=y if y.dim() == 2 else y[:, None],
        kernel=kernel if kernel is not None else rbf(1.0, X.dtype),
        noise=noise,
        centers=None if Z is None else kgp.Centers(Z, weights=weights),
        options=kgp.resolve_options("solver 'falkon'", solver, options),  # as the model does, once
        monitor=monitor if monitor is not None else kgp.Monitor(),
    )
    return solver.fit(problem)


def synthetic(n=1500, d=4, k=1, seed=0, dtype=F64, n_test=0):
    """``y = sin(X W) + noise``; with ``n_test``, also held-out points of the same function."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, k, generator=g, dtype=F64)
    X = torch.randn(n + n_test, d, generator=g, dtype=F64)
    y = torch.sin(X @ W) + 0.1 * torch.randn(n + n_test, k, generator=g, dtype=F64)
    X, y = X.to(dtype), y.to(dtype)
    if n_test:
        return X[:n], y[:n], X[n:], y[n:]
    return X, y


def zscore_split(X, y, n_train, n_test, seed=0):
    perm = np.random.default_rng(seed).permutation(X.shape[0])
    tr, te = perm[:n_train], perm[n_train : n_train + n_test]
    X = np.asarray(X, dtype=np.float64)
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    X = (X - mu) / sd
    return X[tr], y[tr], X[te], y[te]


def tamielectric_float32(shared):
    """UCI tamielectric: 10,000 float32 training points (n x 1 targets) and 3,000 float64 test
    points, features and target standardised with training statistics."""
    X, y = load_uci(shared, "tamielectric")
    Xtr, ytr, Xte, yte = zscore_split(X, y, 10_000, 3_000)
    mu, sd = ytr.mean(), ytr.std()
    ytr, yte = (ytr - mu) / sd, (yte - mu) / sd
    X32, y32 = torch.from_numpy(Xtr).float(), torch.from_numpy(ytr).float()[:, None]
    return X32, y32, torch.from_numpy(Xte), torch.from_numpy(yte)


def heldout_mse(pred, Xte, yte) -> float:
    """Test MSE of a fitted expansion, computed in float64."""
    return float(((pred.predict(Xte.to(pred.alpha.dtype)).double()[:, 0] - yte) ** 2).mean())


def load_uci(shared, name):
    with gzip.open(shared / "uci" / f"{name}.csv.gz", "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    return raw[:, :-1], raw[:, -1]


def airline_subset(shared, n_train=20_000, n_test=5_000):
    z = np.load(shared / "airline_nycflights13.npz")
    Xtr, ytr, Xte, yte = zscore_split(z["X"], z["y"].astype(np.float64), n_train, n_test)
    mu, sd = ytr.mean(), ytr.std()
    return Xtr, (ytr - mu) / sd, Xte, (yte - mu) / sd


# ---------------------------------------------------------------------------- oracles
def test_registered_with_documented_defaults():
    solver = kgp.get_solver("falkon")
    assert isinstance(solver, FalkonSolver)
    assert solver.capabilities.uses_centers is True
    assert solver.option_defaults["maxiter"].default == 20
    assert solver.option_defaults["residual_every"].default == 10
    assert kgp.resolve_options("solver 'falkon'", solver, residual_every=None)["residual_every"] is None
    X, y = synthetic(n=300, d=3)
    Z = X[:40]
    never = fit(X, y, Z, 0.1, residual_every=None, maxiter=15, tol=0.0).alpha
    assert torch.equal(never, fit(X, y, Z, 0.1, residual_every=0, maxiter=15, tol=0.0).alpha)  # None means never


def test_m_equals_n_one_iteration_is_exact_krr():
    # Oracle O1: with M = n and D = I, B B^T = H^{-1}, so W = I and one CG step solves the system.
    # It holds for the paper's preconditioner, without kgp's default jitter (which trades exactness
    # of B for conditioning on real data): jitter 0.
    X, y = synthetic(n=400, d=5)
    Xte, _ = synthetic(n=200, d=5, seed=1)
    noise = 0.1
    exact = kgp.KernelRegressor("rbf", lengthscale=0.7, noise=noise, solver="exact").fit(X, y)
    options = {"maxiter": 1, "tol": 0.0, "jitter": 0.0}
    model = kgp.KernelRegressor(
        "rbf", lengthscale=0.7, noise=noise, solver="falkon", centers=X, solver_options=options
    ).fit(X, y)
    assert len(model.history_) == 1
    assert rel(model.predictor_.alpha, exact.predictor_.alpha) < 1e-8
    assert rel(model.predict(Xte), exact.predict(Xte)) < 1e-8


def test_converges_to_direct_nystrom_solution():
    # Oracle O2 (Lemma 5): enough CG iterations give alpha = H^{-1} z.
    X, y = synthetic(n=2000, d=4)
    Z = X[:200]
    noise = 0.2  # lambda = 1e-4
    kernel = rbf(0.5)
    alpha_direct = direct_nystrom(kernel, X, y, Z, noise)
    pred = fit(X, y, Z, noise, kernel=kernel, maxiter=100, tol=0.0)
    assert rel(pred.alpha, alpha_direct) < 1e-6
    # and the default 20 iterations already predict within 1e-3 (cond(W) is O(1))
    pred20 = fit(X, y, Z, noise, kernel=kernel)
    K = dense(kernel, X, Z)
    assert rel(K @ pred20.alpha, K @ alpha_direct) < 1e-3


def test_multi_output_is_one_cg_per_column():
    X, Y = synthetic(n=1200, d=3, k=3)
    Y[:, 2] *= 100.0  # columns on different scales converge independently (column-wise CG)
    Z = X[:150]
    kernel = rbf(0.8)
    noise = 0.05
    together = fit(X, Y, Z, noise, kernel=kernel, maxiter=15, tol=0.0)
    for j in range(3):
        alone = fit(X, Y[:, j : j + 1], Z, noise, kernel=kernel, maxiter=15, tol=0.0)
        assert rel(together.alpha[:, j], alone.alpha[:, 0]) < 1e-6
    direct = direct_nystrom(kernel, X, Y, Z, noise)
    # the paper's preconditioner (jitter 0) converges fastest near the exact solution of this smooth problem
    converged = fit(X, Y, Z, noise, kernel=kernel, maxiter=100, tol=0.0, jitter=0.0)
    for j in range(3):
        assert rel(converged.alpha[:, j], direct[:, j]) < 1e-6


def test_weighted_centers_match_dense_weighted_nystrom():
    X, y = synthetic(n=1500, d=4, seed=3)
    g = torch.Generator().manual_seed(7)
    Z = X[torch.randperm(1500, generator=g)[:150]]
    w = torch.empty(150, dtype=F64).uniform_(0.2, 3.0, generator=g)
    kernel = rbf(0.6)
    noise = 0.15
    oracle = direct_nystrom(kernel, X, y, Z, noise, weights=w)
    pred = fit(X, y, Z, noise, kernel=kernel, weights=w, maxiter=150, tol=0.0)
    assert rel(pred.alpha, oracle) < 1e-6
    # The Appendix G code forgets D and solves (K^T K + lambda n D K_MM D) alpha = K^T y instead.
    K, Kmm, D = dense(kernel, X, Z), dense(kernel, Z, Z), torch.diag(w)
    wrong = torch.linalg.solve(K.T @ K + noise * D @ Kmm @ D, K.T @ y)
    assert rel(K @ pred.alpha, K @ oracle) < 1e-8
    assert rel(K @ wrong, K @ oracle) > 1e-3


def test_weights_from_bless_like_scores_need_no_special_case():
    # Def. 2: D_jj = 1 / sqrt(n p_j) for centers drawn with probabilities p (here proportional to
    # ridge leverage scores of the sample); FALKON consumes them like any weights.
    X, y = synthetic(n=1000, d=3, seed=5)
    kernel = rbf(0.7)
    noise = 0.1
    K = dense(kernel, X, X)
    lev = torch.diagonal(K @ torch.linalg.inv(K + noise * torch.eye(1000, dtype=F64)))
    p = lev / lev.sum()
    idx = torch.multinomial(p, 120, replacement=False, generator=torch.Generator().manual_seed(0))
    w = 1.0 / torch.sqrt(1000 * p[idx])
    Z = X[idx]
    oracle = direct_nystrom(kernel, X, y, Z, noise, weights=w)
    pred = fit(X, y, Z, noise, kernel=kernel, weights=w, maxiter=100, tol=0.0)
    assert rel(pred.alpha, oracle) < 1e-6


@pytest.mark.parametrize(
    "dtype,options",
    [
        (F64, {}),
        (F64, {"factorization": "eigh"}),
        (torch.float32, {}),
        (F64, {"jitter": 0.0}),
        (F64, {"factorization": "pivoted"}),
        (torch.float32, {"factorization": "pivoted"}),
    ],
    ids=["f64-auto", "f64-eigh", "f32-auto", "f64-nojitter", "f64-pivoted", "f32-pivoted"],
)
def test_duplicate_centers_predict_like_deduplicated(dtype, options):
    X, y = synthetic(n=1500, d=3, seed=2, dtype=dtype)
    Xte, _ = synthetic(n=300, d=3, seed=9, dtype=dtype)
    Z0 = X[:120]
    Z = torch.cat([Z0, Z0[:30], Z0[:10]])  # K_MM has rank 120 < M = 160
    kernel = rbf(0.8, dtype)
    noise = 0.3
    maxiter = 20 if dtype == torch.float32 else 60
    if "jitter" not in options and options.get("factorization") != "pivoted":
        maxiter *= 3  # the default jitter (1e-3) converges more slowly near the exact solution
    dup = fit(X, y, Z, noise, kernel=kernel, maxiter=maxiter, tol=0.0, **options)
    ref = fit(X, y, Z0, noise, kernel=kernel, maxiter=maxiter, tol=0.0, **options)
    assert torch.isfinite(dup.alpha).all()
    # float32: the passes resolve the kernel to float32 precision only
    tol = 1e-2 if dtype == torch.float32 else 1e-7
    assert rel(dup.predict(Xte), ref.predict(Xte)) < tol
    # and both equal the direct Nystrom prediction at the distinct centers
    K_te = dense(rbf(0.8), Xte.to(F64), Z0.to(F64))
    direct = K_te @ direct_nystrom(rbf(0.8), X, y, Z0, noise)
    assert rel(dup.predict(Xte), direct) < tol


def test_cholesky_only_raises_on_singular_kmm():
    X, y = synthetic(n=300, d=2)
    Z = torch.cat([X[:40], X[:40]])
    with pytest.raises(NotPSDError, match=r"D K_MM D \+ jitter .* factorization='auto', 'pivoted' or 'eigh'"):
        fit(X, y, Z, 0.1, factorization="cholesky", jitter=0.0)


def test_generic_kernel_float32_matches_dense_float64():
    # A kernel outside the backend's fast families (generic path), float32 input.
    X, y = synthetic(n=1000, d=3, seed=4)
    Z = X[:100]
    kernel = gpytorch_rq()
    oracle = direct_nystrom(kernel.to(F64), X, y, Z, 0.2)
    k32 = gpytorch_rq().to(torch.float32)
    pred = fit(X.float(), y.float(), Z.float(), 0.2, kernel=k32, maxiter=40, tol=0.0)
    K = dense(kernel.to(F64), X, Z)
    assert pred.alpha.dtype == torch.float32
    assert rel(K @ pred.alpha.double(), K @ oracle) < 1e-4


def gpytorch_rq():
    import gpytorch

    k = gpytorch.kernels.RQKernel()
    k.lengthscale = 0.8
    k.alpha = 1.5
    return k.double().requires_grad_(False)


# ---------------------------------------------------------------------------- stopping and monitor
def test_tolerance_stops_early():
    X, y = synthetic(n=1000, d=3)
    mon = kgp.Monitor()
    fit(X, y, X[:150], 0.1, maxiter=200, tol=1e-6, jitter=0.0, monitor=mon)
    res = [h.extras["residual"] for h in mon.history]
    assert len(res) < 200
    assert res[-1] <= 1e-6 < res[-2]


def test_residual_refresh_keeps_the_same_iterates():
    # The true residual, recomputed inside the fused pass, agrees with the CG recursion in float64
    # (compared at 12 iterations, before finite-precision CG paths can drift apart).
    X, y = synthetic(n=1000, d=3, k=2)
    Z = X[:100]
    kernel = rbf(1.0)
    a = fit(X, y, Z, 0.1, kernel=kernel, maxiter=12, tol=0.0, residual_every=0)
    mon = kgp.Monitor()
    b = fit(X, y, Z, 0.1, kernel=kernel, maxiter=12, tol=0.0, residual_every=1, monitor=mon)
    c = fit(X, y, Z, 0.1, kernel=kernel, maxiter=12, tol=0.0, residual_every=7)
    jitter = 1e-3  # the default: T^T T = K_MM + jitter * mean(diag) I
    assert rel(b.alpha, a.alpha) < 1e-8
    assert rel(c.alpha, a.alpha) < 1e-8
    # The reported residual is ||B'^T (z - H alpha)|| / ||B'^T z|| for the worst output (Def. 4).
    K, Kmm = dense(kernel, X, Z), dense(kernel, Z, Z)
    H, z = K.T @ K + 0.1 * Kmm, K.T @ y
    L = torch.linalg.cholesky(Kmm + jitter * Kmm.diagonal().mean() * torch.eye(100, dtype=F64))
    LA = torch.linalg.cholesky(L.T @ L / 100 + (0.1 / 1000) * torch.eye(100, dtype=F64))

    def bt(v):  # B'^T v = A^{-T} T^{-T} v with T = L^T, A = LA^T
        return torch.linalg.solve_triangular(LA, torch.linalg.solve_triangular(L, v, upper=False), upper=False)

    true = (bt(z - H @ b.alpha).norm(dim=0) / bt(z).norm(dim=0)).max()
    assert mon.history[-1].extras["residual"] == pytest.approx(float(true), rel=1e-4)


def test_callback_stop_and_validation_metric():
    X, y, Xv, yv = synthetic(n=1500, d=3, n_test=300)
    seen = []

    def callback(info):
        seen.append(info)
        return info.iteration == 4

    kw = dict(lengthscale=0.8, noise=0.1, solver="falkon", n_centers=150, random_state=0)
    model = kgp.KernelRegressor(callback=callback, solver_options={"maxiter": 20, "tol": 0.0}, **kw)
    model.fit(X, y, validation_data=(Xv, yv))
    assert [i.iteration for i in seen] == [1, 2, 3, 4]
    assert all(i.metric is not None and "residual" in i.extras for i in seen)
    # the stopped model is exactly the 4-iteration model
    with pytest.warns(kgp.ConvergenceWarning, match="maxiter=4"):  # 4 iterations are far from done
        four = kgp.KernelRegressor(solver_options={"maxiter": 4, "tol": 0.0}, **kw).fit(X, y)
    assert torch.equal(model.predictor_.alpha, four.predictor_.alpha)
    # the reported validation MSE is that of the iterate, and it improves
    final_mse = float(((model.predict(Xv) - yv) ** 2).mean())
    assert seen[-1].metric == pytest.approx(final_mse, rel=1e-10)
    assert seen[-1].metric < seen[0].metric


def test_float32_and_float64_dtype_follow_input():
    X, y = synthetic(n=800, d=3)
    for dtype in (torch.float32, F64):
        model = kgp.KernelRegressor(
            lengthscale=0.8, noise=0.1, solver="falkon", n_centers=100, random_state=1, dtype=dtype
        ).fit(X, y)
        assert model.predictor_.alpha.dtype == dtype
        assert model.predict(X.to(dtype)).dtype == dtype


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "options,match",
    [
        ({"maxiter": 0}, "'maxiter': expected an integer >= 1, got 0"),
        ({"maxiter": 2.5}, "'maxiter': expected an integer >= 1, got 2.5"),
        ({"maxiter": True}, "'maxiter': expected an integer >= 1, got True"),
        ({"tol": -1.0}, "'tol': expected a finite number >= 0, got -1.0"),
        ({"tol": "small"}, "'tol': expected a finite number >= 0, got 'small'"),
        ({"residual_every": -1}, "'residual_every': expected an integer >= 0 or None, got -1"),
        ({"jitter": -1e-3}, "'jitter': expected a finite number >= 0 or None, got -0.001"),
        ({"rcond": 1.5}, "'rcond': expected a finite number >= 0 and < 1 or None, got 1.5"),
        ({"factorization": "qr"}, "'factorization': expected one of 'auto', 'cholesky', 'pivoted', 'eigh', got 'qr'"),
        (
            {"precond_dtype": "float16"},
            "'precond_dtype': expected one of 'auto', 'float64', 'mixed', 'input', got 'float16'",
        ),
        ({"max_iter": 5}, r"unknown option(s) ['max_iter'] for solver 'falkon'"),
    ],
)
def test_bad_options_raise(options, match):
    X, y = synthetic(n=100, d=2)
    name = next(iter(options))
    error = ValueError if name == "max_iter" else InvalidOptionError
    prefix = "" if name == "max_iter" else "solver 'falkon' option "
    with pytest.raises(error, match=re.escape(prefix + match)):
        kgp.KernelRegressor(solver="falkon", n_centers=10, solver_options=options).fit(X, y)
    # a direct fit(problem) call (options not merged by a model) checks them the same way
    with pytest.raises(error, match=re.escape(prefix + match)):
        fit(X, y, X[:10], 0.1, **options)


def test_docs_options_table_matches_declarations():
    from pathlib import Path

    from kgp.options import describe_options

    page = (Path(__file__).resolve().parents[1] / "docs" / "solvers" / "falkon.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[2]
    declared = {name: expected for name, _, expected, _ in describe_options(FalkonSolver.option_defaults)}
    assert rows == declared


def test_bad_problem_raises():
    X, y = synthetic(n=100, d=2)
    with pytest.raises(ValueError, match="centers"):
        fit(X, y, None, 0.1)
    with pytest.raises(ValueError, match="center_weights"):
        fit(X, y, X[:10], 0.1, weights=-torch.ones(10, dtype=F64))
    with pytest.raises(ValueError, match="center_weights"):
        fit(X, y, X[:10], 0.1, weights=torch.ones(9, dtype=F64))
    with pytest.raises(ValueError, match="centers"):
        fit(X, y, X[:10, :1], 0.1)


def test_zero_targets_give_zero_coefficients():
    X, _ = synthetic(n=200, d=2)
    pred = fit(X, torch.zeros(200, 2, dtype=F64), X[:20], 0.1)
    assert torch.count_nonzero(pred.alpha) == 0


# ---------------------------------------------------------------------------- real data
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_airline_20_iterations_within_1pct_of_direct_nystrom(shared_data, dtype):
    Xtr, ytr, Xte, yte = airline_subset(shared_data, n_train=20_000)
    n, M, lam = Xtr.shape[0], 1000, 1e-6
    model = kgp.KernelRegressor(
        "rbf",
        lengthscale=1.0,
        noise=lam * n,
        solver="falkon",
        centers="uniform",
        n_centers=M,
        solver_options={"maxiter": 20},
        random_state=0,
        dtype=dtype,
    ).fit(Xtr, ytr)
    mse = float(np.mean((model.predict(Xte) - yte) ** 2))
    X64, Z64 = torch.from_numpy(Xtr), model.centers_.to(F64)
    alpha = direct_nystrom(rbf(1.0), X64, torch.from_numpy(ytr)[:, None], Z64, lam * n)
    pred = dense(rbf(1.0), torch.from_numpy(Xte), Z64) @ alpha
    mse_direct = float(((pred[:, 0] - torch.from_numpy(yte)) ** 2).mean())
    assert mse_direct < 0.95  # the kernel model explains part of the (standardised) delay
    assert abs(mse - mse_direct) <= 0.01 * mse_direct


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")  # lambda = 1e-9: 20 iterations leave ~0.07
def test_float32_small_lambda_does_not_diverge(shared_data):
    # UCI tamielectric (d = 3) at lambda = 1e-9: K_MM is numerically rank deficient at float32
    # precision. float32 sums diverge here with the paper's Cholesky preconditioner (residual
    # 1.1 -> 4.9, test MSE +40%): float32 sums of K_nM^T u over n rows err in the directions the
    # preconditioner amplifies. The float32 path sums them in float64 (runs of 8 rows in float32)
    # and factors K_MM in float64 with a jitter of at least 1e-3 of its mean diagonal, which the
    # regulariser takes out of the problem again: it converges and matches float64 in test MSE.
    X32, y32, Xte, yte = tamielectric_float32(shared_data)
    n, M, lam = X32.shape[0], 500, 1e-9
    X64, y64 = X32.double(), y32.double()
    mon = kgp.Monitor()
    # 20 iterations leave a residual of ~0.07 at lambda = 1e-9: reported, yet the test MSE matches
    with pytest.warns(kgp.ConvergenceWarning, match="relative residual"):
        p32 = fit(X32, y32, X32[:M], lam * n, monitor=mon)
    facts = mon.history[0].extras
    assert facts["factorization"] == "cholesky" and facts["rank"] == M
    assert facts["accumulate"] == "float64" and facts["jitter"] >= 1e-3
    assert facts["distances"] == "float32"  # d = 3 with lengthscale 1: float32 distances are accurate
    res = [h.extras["residual"] for h in mon.history]
    assert len(res) == 20 and all(np.isfinite(res))
    assert max(res[1:]) < 1.0 and res[-1] < 0.1
    p64 = fit(X64, y64, X64[:M], lam * n)  # float64 default: Cholesky with the same jitter
    p64_same = fit(X64, y64, X64[:M], lam * n, factorization="eigh", rcond=torch.finfo(torch.float32).eps)

    def mse(pred):
        return heldout_mse(pred, Xte, yte)

    assert abs(mse(p32) - mse(p64)) <= 0.01 * mse(p64)
    assert abs(mse(p32) - mse(p64_same)) <= 0.002 * mse(p64_same)


def test_float32_auto_takes_cholesky_when_no_eigenvalue_would_be_dropped():
    # auto factors K_MM by Cholesky (with the jitter, which the regulariser removes again); the eigh
    # path builds a different preconditioner for the same problem, so both reach the same solution:
    # the dense float64 Nystrom one.
    X, y = synthetic(n=2000, d=5, seed=3, dtype=torch.float32)
    Z = X[:150]
    G = dense(rbf(1.0), Z.to(F64), Z.to(F64))
    s = torch.linalg.eigvalsh(G)
    assert s[0] > 100 * torch.finfo(torch.float32).eps * s[-1]  # the premise of this test
    mon = kgp.Monitor()
    auto = fit(X, y, Z, 0.5, monitor=mon, maxiter=40, tol=0.0)
    assert mon.history[0].extras["factorization"] == "cholesky"
    assert mon.history[0].extras["rank"] == 150
    eig = fit(X, y, Z, 0.5, maxiter=40, tol=0.0, factorization="eigh")
    assert rel(auto.alpha, eig.alpha) < 1e-4
    oracle = direct_nystrom(rbf(1.0), X, y, Z, 0.5)
    assert rel(auto.alpha, oracle) < 1e-4


def test_extreme_eigenvalue_estimates_bracket_eigvalsh():
    for lengthscale, M in ((0.7, 300), (2.0, 300), (1.0, 40)):
        Z = torch.randn(M, 3, generator=torch.Generator().manual_seed(M), dtype=F64)
        G = dense(rbf(lengthscale), Z, Z)
        G.diagonal().add_(1e-6)
        s = torch.linalg.eigvalsh(G)
        lmin, lmax = smallest_eigenvalue_from_cholesky(torch.linalg.cholesky(G)), largest_eigenvalue(G)
        # Rayleigh quotients: lmin is an upper bound (15 steps), lmax a lower bound (converged)
        assert s[0] * (1 - 1e-9) <= lmin <= 2 * s[0]
        assert 0.999 * s[-1] <= lmax <= s[-1] * (1 + 1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_scaled_product_cholesky(dtype):
    from kgp_builtins.falkon.lapack import upper_cholesky_of_scaled_product

    Z = torch.randn(200, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    G = dense(rbf(1.0), Z, Z) + 1e-3 * torch.eye(200, dtype=F64)
    L = torch.linalg.cholesky(G).to(dtype)
    expected = (L.double().mT @ L.double()) / 200 + 1e-4 * torch.eye(200, dtype=F64)
    # the product and the Cholesky of a 200 x 200 matrix each have a backward error of at most
    # about n eps ||P|| (Higham, Accuracy and Stability, Thm 10.3 and 3.5)
    tol = 2 * 200 * torch.finfo(dtype).eps
    A = upper_cholesky_of_scaled_product(L, 1 / 200, 1e-4)
    assert A.dtype == dtype and torch.equal(A, A.triu())
    assert rel(A.mT.double() @ A.double(), expected) < tol
    # L is not overwritten
    assert torch.equal(L, torch.linalg.cholesky(G).to(dtype))
    # not positive definite: NotPSDError naming the matrix
    with pytest.raises(NotPSDError, match=r"the product \(200 x 200, torch.float\d\d\) is not positive definite"):
        upper_cholesky_of_scaled_product(L, 1 / 200, -1.0, what="the product")


def test_pivoted_full_rank_matches_direct_nystrom():
    # every pivot above the threshold: Q = a permutation, the preconditioner of Example 1.1
    X, y = synthetic(n=1200, d=4, seed=5)
    Z = X[:100]
    mon = kgp.Monitor()
    pred = fit(X, y, Z, 0.3, monitor=mon, factorization="pivoted", maxiter=60, tol=0.0)
    assert mon.history[0].extras["factorization"] == "pivoted"
    assert mon.history[0].extras["rank"] == 100
    assert rel(pred.alpha, direct_nystrom(rbf(1.0), X, y, Z, 0.3)) < 1e-6


def test_pivoted_weighted_centers_match_dense_weighted_nystrom():
    X, y = synthetic(n=1000, d=3, seed=6)
    Z = X[:80]
    w = torch.linspace(0.5, 2.0, 80, dtype=F64)
    pred = fit(X, y, Z, 0.2, weights=w, factorization="pivoted", maxiter=80, tol=0.0)
    assert rel(pred.alpha, direct_nystrom(rbf(1.0), X, y, Z, 0.2, weights=w)) < 1e-6


def test_pivoted_drops_dependent_centers_with_zero_coefficients():
    X, y = synthetic(n=800, d=2, seed=7)
    Z0 = X[:50]
    Z = torch.cat([Z0, Z0[:20]])
    mon = kgp.Monitor()
    pred = fit(X, y, Z, 0.2, monitor=mon, factorization="pivoted", maxiter=60, tol=0.0)
    assert mon.history[0].extras["rank"] == 50
    # one coefficient per distinct center, the duplicate's is exactly zero
    assert int((pred.alpha[:, 0] != 0).sum()) == 50
    assert rel(pred.predict(X), dense(rbf(1.0), X, Z0) @ direct_nystrom(rbf(1.0), X, y, Z0, 0.2)) < 1e-6


def test_pivoted_rcond_that_keeps_no_center_raises():
    # ten copies of one center: max eigenvalue 10 x the diagonal, so rcond = 0.5 stops before any pivot
    X, y = synthetic(n=200, d=2)
    Z = X[:1].repeat(10, 1)
    with pytest.raises(InvalidOptionError, match=r"solver 'falkon' option 'rcond': expected .* = 0.1 .* got 0.5"):
        fit(X, y, Z, 0.1, factorization="pivoted", rcond=0.5)
    pred = fit(X, y, Z, 0.1, factorization="pivoted", rcond=0.05)
    assert int((pred.alpha != 0).sum()) == 1


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")  # lambda = 1e-9: 20 iterations leave ~0.07
def test_float32_pivoted_small_lambda_does_not_diverge(shared_data):
    # the fast path for large M with low numerical rank: same setting as the eigh test above
    X32, y32, Xte, yte = tamielectric_float32(shared_data)
    n, M, lam = X32.shape[0], 500, 1e-9
    mon = kgp.Monitor()
    p32 = fit(X32, y32, X32[:M], lam * n, monitor=mon, factorization="pivoted")
    assert mon.history[0].extras["rank"] < M // 2
    res = [h.extras["residual"] for h in mon.history]
    assert all(np.isfinite(res)) and max(res[1:]) < 1.0 and res[-1] < 0.2
    p64 = fit(X32.double(), y32.double(), X32[:M].double(), lam * n)
    mse32, mse64 = heldout_mse(p32, Xte, yte), heldout_mse(p64, Xte, yte)
    assert abs(mse32 - mse64) <= 0.01 * mse64


def test_float32_precond_dtype_input_matches_float64_oracle():
    X, y = synthetic(n=1500, d=4, seed=8, dtype=torch.float32)
    Z = X[:100]
    pred = fit(X, y, Z, 0.5, precond_dtype="input", maxiter=40, tol=0.0)
    assert pred.alpha.dtype == torch.float32
    K = dense(rbf(1.0), X.to(F64), Z.to(F64))
    oracle = direct_nystrom(rbf(1.0), X, y, Z, 0.5)
    assert rel(K @ pred.alpha.double(), K @ oracle) < 1e-4


def test_float32_small_lambda_matches_float64_on_airline(shared_data):
    Xtr, ytr, Xte, yte = airline_subset(shared_data, n_train=10_000, n_test=3_000)
    n, M, lam = Xtr.shape[0], 600, 1e-9
    X64, y64 = torch.from_numpy(Xtr), torch.from_numpy(ytr)[:, None]
    p32 = fit(X64.float(), y64.float(), X64[:M].float(), lam * n)
    p64 = fit(X64, y64, X64[:M], lam * n)
    Xte_t = torch.from_numpy(Xte)
    f32, f64 = p32.predict(Xte_t.float()).double(), p64.predict(Xte_t)
    assert rel(f32, f64) < 0.1
    mse32, mse64 = (float(((f[:, 0] - torch.from_numpy(yte)) ** 2).mean()) for f in (f32, f64))
    assert abs(mse32 - mse64) <= 0.01 * mse64


def test_classifier_penbased_accuracy(shared_data):
    # 10 classes: one CG with 10 right-hand sides (+-1 one-vs-all targets).
    z = np.load(shared_data / "penbased.npz")
    Xtr, ytr, Xte, yte = zscore_split(z["X"], z["y"], 8_000, 2_992)
    clf = kgp.KernelClassifier(
        "rbf", lengthscale=1.5, noise=1e-6 * 8000, solver="falkon", n_centers=1000, random_state=0
    ).fit(Xtr, ytr)
    assert clf.predictor_.alpha.shape == (1000, 10)
    assert clf.score(Xte, yte) > 0.98


def test_classifier_magic_gamma_accuracy(shared_data):
    z = np.load(shared_data / "magic_gamma.npz")
    Xtr, ytr, Xte, yte = zscore_split(z["X"], z["y"], 10_000, 4_000)
    clf = kgp.KernelClassifier(
        "rbf", lengthscale=1.5, noise=1e-5 * 10_000, solver="falkon", n_centers=1000, random_state=0
    ).fit(Xtr, ytr)
    assert clf.score(Xte, yte) > 0.85


@pytest.mark.cuda
def test_cuda_matches_cpu():
    # Both converge to the dense Nystrom solution. Comparing two 30-iteration runs instead failed on an
    # H200 (alpha 8e-4 apart): with cond(K_MM) ~ 9e6 an unconverged CG's alpha moves by 4e-3
    # on the CPU alone when only the block size changes, so the devices' rounding cannot agree to 1e-8.
    X, y = synthetic(n=1000, d=3)
    Z = X[:100]
    cpu = fit(X, y, Z, 0.1, maxiter=300, tol=0.0)
    gpu = fit(X.cuda(), y.cuda(), Z.cuda(), 0.1, kernel=rbf(1.0).cuda(), maxiter=300, tol=0.0)
    assert gpu.alpha.device.type == "cuda"
    K = kgp.kernel_operator(rbf(1.0), X, Z).to_dense()
    KMM = kgp.kernel_operator(rbf(1.0), Z, Z).to_dense()
    oracle = torch.linalg.solve(K.T @ K + 0.1 * KMM, K.T @ y)
    # fitted values K alpha: well determined although alpha is not (converged CPU run: 8e-10 from the oracle)
    assert rel(K @ cpu.alpha, K @ oracle) < 1e-7
    assert rel(K @ gpu.alpha.cpu(), K @ oracle) < 1e-7


@pytest.mark.parametrize(
    "factorization, weighted, duplicate",
    [("cholesky", False, False), ("cholesky", True, False), ("pivoted", True, True), ("eigh", False, True)],
)
def test_shared_solves_give_the_dense_normal_operator(factorization, weighted, duplicate):
    # CG's W' u from forward/normal (four triangular solves) against the dense matrices of Def. 3/4:
    # W' u = B'^T kv + lambda B'^T K_MM B' u, with B' = D Q T^{-1} A^{-1} built column by column
    from kgp_builtins.falkon.preconditioner import build_preconditioner

    g = torch.Generator().manual_seed(7)
    X = torch.randn(400, 3, generator=g, dtype=F64)
    Z = X[:60].clone()
    if duplicate:
        Z[10] = Z[3]
    weights = torch.rand(60, generator=g, dtype=F64) + 0.5 if weighted else None
    kernel = rbf(1.0)
    problem = Problem(
        X=X, y=torch.zeros(400, 1, dtype=F64), kernel=kernel, noise=0.05, centers=kgp.Centers(Z, weights=weights)
    )
    prec = build_preconditioner(
        problem, weights, factorization=factorization, precond_dtype="float64", jitter=1e-3, rcond=None
    )
    q = prec.rank
    u = torch.randn(q, 2, generator=g, dtype=F64)
    kv = torch.randn(60, 2, generator=g, dtype=F64)
    v, solves = prec.forward(u)
    B = prec.apply(torch.eye(q, dtype=F64))
    Kmm = dense(kernel, Z, Z)
    expected = B.mT @ kv + problem.lam * (B.mT @ Kmm @ B @ u)
    # B' amplifies by at most 1 / sqrt(min eigenvalue of D K_MM D + jitter), ~1e3 here: the rounding of
    # a few solves of a 60 x 60 system, each about 60 eps relative, times that amplification
    assert rel(v, B @ u) < 1e-12
    assert rel(prec.normal(kv, solves), expected) < 1e-9
    assert rel(prec.normal(kv, solves), prec.apply_t(kv) + prec.regulariser(u)) < 1e-12
