"""EigenPro 3.0 (`eigenpro`) and EigenPro 2.0 (`eigenpro2`) against closed forms and dense solves.

Oracles: Lemma 6's fixed point of Algorithm 1, dense least squares / Nystrom ridge solves
(K_ZX K_XZ + sigma^2 K_ZZ) a = K_ZX y and K^{-1} y computed here in float64, and real-data error rates.
"""

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LargestOutput
from kgp_builtins.eigenpro import EIGENPRO2_DEFAULTS, EIGENPRO3_DEFAULTS
from kgp_builtins.oracles import eigenpro_exact_projection, lemma6_fixed_point

import kgp
from kgp.linalg import NotPSDError
from kgp.options import InvalidOptionError, option_default


def _problem(n=200, d=2, p=10, seed=0, center_scale=1.0):
    """Small float64 problem whose Lemma 6 iteration matrix is well conditioned (cond(K_ZZ^-1 G) ~ 90)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    Z = torch.randn(p, d, generator=g, dtype=torch.float64) * center_scale  # not training points
    y = torch.sin(2 * X[:, :1]) + 0.3 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return X, Z, y


def _kernel(name="laplacian", ls=0.7):
    return kgp.kernels.make_kernel(name, ls).double()


def _dense(kernel, A, B):
    with torch.no_grad():
        return kgp.kernel_operator(kernel, A, B).to_dense()


def _fit(X, y, Z, kernel, noise=0.05, solver="eigenpro", seed=0, **options):
    kwargs = {} if Z is None else {"centers": Z}
    model = kgp.KernelRegressor(kernel, noise=noise, solver=solver, solver_options=options, random_state=seed, **kwargs)
    return model.fit(X, y)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------- Algorithm 1 / Lemma 6
def test_exact_projection_converges_to_lemma6_closed_form():
    X, Z, y = _problem()
    k = _kernel()
    Kxx, Kxz, Kzz = _dense(k, X, X), _dense(k, X, Z), _dense(k, Z, Z)
    expected = lemma6_fixed_point(Kxx, Kxz, y, q=5)
    alpha = eigenpro_exact_projection(Kxx, Kxz, Kzz, y, q=5, iterations=600)
    assert _rel(alpha, expected) < 1e-6
    # With q > 0 the fixed point is a weighted LS solution, measurably not plain least squares.
    plain = torch.linalg.lstsq(Kxz, y).solution
    assert _rel(expected, plain) > 1e-3
    # q = 0: Lemma 6 reduces to least squares.
    assert _rel(lemma6_fixed_point(Kxx, Kxz, y, q=0), plain) < 1e-8


def test_algorithm2_paper_full_batch_reaches_lemma6_fixed_point():
    """Algorithm 2 with s = n (then Q_s gives exactly Q), one full batch, exact projection, lambda = 0."""
    X, Z, y = _problem()
    k = _kernel()
    Kxx, Kxz = _dense(k, X, X), _dense(k, X, Z)
    expected = lemma6_fixed_point(Kxx, Kxz, y, q=5)
    model = _fit(
        X,
        y,
        Z,
        k,
        correction="paper",
        regularization="none",
        subsample_size=200,
        q=5,
        batch_size=200,
        epochs=500,
        average_epochs=0,
    )
    assert _rel(model.predictor_.alpha, expected) < 1e-6


# ----------------------------------------------------------------------------- least squares / interpolation
def test_q0_interpolable_targets_match_nystrom_least_squares():
    X, Z, _ = _problem()
    k = _kernel()
    Kxz = _dense(k, X, Z)
    alpha_star = torch.randn(Z.shape[0], 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y = Kxz @ alpha_star  # interpolable: the least-squares residual is zero, so SGD noise vanishes at the optimum
    model = _fit(X, y, Z, k, q=0, regularization="none", epochs=150, average_epochs=0)
    ls = torch.linalg.lstsq(Kxz, y).solution
    assert _rel(model.predictor_.alpha, ls) < 1e-6


@pytest.mark.parametrize("correction", ["projected", "paper"])
def test_interpolable_targets_any_q_give_least_squares(correction):
    """For interpolable y the weighted and plain LS solutions coincide (digest 4.5)."""
    X, Z, _ = _problem()
    k = _kernel()
    Kxz = _dense(k, X, Z)
    alpha_star = torch.randn(Z.shape[0], 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    model = _fit(
        X,
        Kxz @ alpha_star,
        Z,
        k,
        q=8,
        subsample_size=100,
        regularization="none",
        correction=correction,
        epochs=100,
        average_epochs=0,
    )
    assert _rel(model.predictor_.alpha, alpha_star) < 1e-6


def _well_conditioned(seed=1):
    """Jittered 12 x 12 grid with unit spacing: with lengthscale 0.4, lambda_min(K) ~ 0.6 (cond ~ 3)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.stack(torch.meshgrid(torch.arange(12.0), torch.arange(12.0), indexing="ij"), -1).reshape(-1, 2)
    X = (grid + 0.1 * torch.rand(144, 2, generator=g)).double()
    y = torch.cos(X[:, :1]) + 0.1 * torch.randn(144, 1, generator=g, dtype=torch.float64)
    return X, y


def test_eigenpro2_interpolates_k_inverse_y():
    X, y = _well_conditioned()
    k = _kernel("laplacian", 0.4)
    K = _dense(k, X, X)
    expected = torch.linalg.solve(K, y)
    model = _fit(
        X, y, None, k, solver="eigenpro2", regularization="none", subsample_size=100, epochs=40, average_epochs=0
    )
    assert _rel(model.predictor_.alpha, expected) < 1e-6


def test_eigenpro3_with_z_equal_x_interpolates():
    X, y = _well_conditioned()
    k = _kernel("laplacian", 0.4)
    expected = torch.linalg.solve(_dense(k, X, X), y)
    model = _fit(X, y, X.clone(), k, regularization="none", subsample_size=100, epochs=40, average_epochs=0)
    assert _rel(model.predictor_.alpha, expected) < 1e-6


# ----------------------------------------------------------------------------- ridge = GP posterior mean
def _nystrom_ridge(k, X, Z, y, noise):
    Kxz, Kzz = _dense(k, X, Z), _dense(k, Z, Z)
    return torch.linalg.solve(Kxz.T @ Kxz + noise * Kzz, Kxz.T @ y), Kxz


def _nystrom_ridge_predictions(k, X, Z, y, noise, X_test):
    """The Nystrom ridge predictions at ``X_test``, computed in the RKHS coordinates of the centers.

    When K_ZZ is numerically singular (cond 2e19 for 150 centers at lengthscale 1 in 2-D) the normal
    equations of :func:`_nystrom_ridge` are solved to no digit in their weak directions: its test
    predictions moved by 3% between MKL code paths (default against MKL_CBWR=COMPATIBLE with one
    thread), while EigenPro's agreed to 1e-4. Here the features are K_xZ U S^-1/2 over the eigenpairs
    of K_ZZ above 1e-14 of the largest (the ridge problem in those coordinates has condition
    ||F||^2 / noise); measured: the same predictions to 4e-7 on both code paths.
    """
    Kzz = _dense(k, Z, Z)
    evals, U = torch.linalg.eigh(Kzz)
    keep = evals > 1e-14 * evals.max()
    to_features = U[:, keep] / evals[keep].sqrt()
    F = _dense(k, X, Z) @ to_features
    w = torch.linalg.solve(F.T @ F + noise * torch.eye(F.shape[1], dtype=F.dtype), F.T @ y)
    return _dense(k, X_test, Z) @ (to_features @ w)


def test_ridge_full_batch_converges_to_nystrom_posterior_mean():
    X, Z, y = _problem()
    k = _kernel()
    noise = 0.05
    expected, _ = _nystrom_ridge(k, X, Z, y, noise)
    model = _fit(X, y, Z, k, noise=noise, batch_size=200, subsample_size=200, q=30, epochs=300, average_epochs=0)
    assert _rel(model.predictor_.alpha, expected) < 1e-6


def test_ridge_minibatch_approaches_nystrom_posterior_mean():
    """Minibatch SGD with a constant step hovers around a non-interpolating optimum (measured: 8%
    relative prediction error after 60 epochs); tail averaging of the last 20 of 40 epochs brings it
    to 0.5%. Stated tolerance: 2% with averaging, and averaging must beat the last iterate."""
    X, Z, y = _problem(n=1000, p=30)
    k = _kernel()
    noise = 0.05
    expected, Kxz = _nystrom_ridge(k, X, Z, y, noise)
    averaged = _fit(X, y, Z, k, noise=noise, subsample_size=300, epochs=40, average_epochs=20)
    last = _fit(X, y, Z, k, noise=noise, subsample_size=300, epochs=40, average_epochs=0)
    err_avg = _rel(Kxz @ averaged.predictor_.alpha, Kxz @ expected)
    err_last = _rel(Kxz @ last.predictor_.alpha, Kxz @ expected)
    assert err_avg < 2e-2 and err_avg < err_last


def test_eigenpro2_ridge_matches_exact_posterior_mean():
    X, Z, y = _problem(n=300)
    k = _kernel()
    noise = 0.5
    K = _dense(k, X, X)
    expected = torch.linalg.solve(K + noise * torch.eye(300, dtype=torch.float64), y)
    model = _fit(
        X,
        y,
        None,
        k,
        noise=noise,
        solver="eigenpro2",
        subsample_size=300,
        q=100,
        epochs=100,
        batch_size=300,
        average_epochs=0,
    )
    assert _rel(model.predictor_.alpha, expected) < 1e-6
    exact = kgp.KernelRegressor(k, noise=noise, solver="exact").fit(X, y)
    assert _rel(model.predict(X), exact.predict(X)) < 1e-6


def test_ridge_agrees_with_falkon_if_registered():
    names = {info.name for info in kgp.list_plugins() if info.kind == "solver"}
    if "falkon" not in names:
        pytest.skip("solver 'falkon' is not registered in this checkout")
    X, Z, y = _problem()
    k = _kernel()
    ep = _fit(X, y, Z, k, noise=0.05, batch_size=200, subsample_size=200, q=30, epochs=300, average_epochs=0)
    fk = kgp.KernelRegressor(k, noise=0.05, solver="falkon", centers=Z, random_state=0).fit(X, y)
    assert _rel(ep.predict(X), fk.predict(X)) < 1e-4


# ----------------------------------------------------------------------------- preconditioning
@pytest.mark.parametrize("kernel_name,ls", [("laplacian", 2.0), ("rbf", 1.0)])
def test_preconditioning_lowers_training_error_at_fixed_epochs(kernel_name, ls):
    """Excess training MSE over the least-squares optimum on the same centers after 3 epochs
    (measured: q = 100 gives 2.7x (Laplacian) and 1.7x (Gaussian) less than q = 0; the Gaussian's was 4x
    the batch floor M / 16 lifts q = 0's batch from m* = 7 to 25, which lowers
    q = 0's excess from 0.125 to 0.075; q = 100's batch, m* = 273, is unchanged)."""
    g = torch.Generator().manual_seed(5)
    X = torch.randn(2000, 4, generator=g, dtype=torch.float64)
    y = torch.sign(torch.sin(2 * X[:, :1]) * torch.cos(X[:, 1:2]))
    Z = X[torch.randperm(2000, generator=g)[:400]] + 0.05 * torch.randn(400, 4, generator=g, dtype=torch.float64)
    k = _kernel(kernel_name, ls)
    Kxz = _dense(k, X, Z)
    optimum = float(((Kxz @ torch.linalg.lstsq(Kxz, y).solution - y) ** 2).mean())
    excess = {}
    for q in (0, 100):
        model = _fit(X, y, Z, k, noise=1e-6, q=q, subsample_size=500, epochs=3, average_epochs=0)
        excess[q] = float(((Kxz @ model.predictor_.alpha - y) ** 2).mean()) - optimum
        # extras["q"]: the directions actually damped, those whose curvature exceeds the level left
        # outside the subsample (57 of 100 for the Laplacian here, docs)
        assert (model.history_[0].extras["q"] > 0) == (q > 0) and model.history_[0].extras["q"] <= q
    assert 0 < excess[100] < 0.7 * excess[0], excess


# ----------------------------------------------------------------------------- real data, centers off the data
def _kmeans(X, p, iters, gen):
    C = X[torch.randperm(X.shape[0], generator=gen)[:p]].clone()
    for _ in range(iters):
        lab = torch.cdist(X, C).argmin(1)
        for j in range(p):
            members = X[lab == j]
            if members.shape[0]:
                C[j] = members.mean(0)
    return C


def test_centers_not_in_training_set_improve_with_p_on_letter(shared_data):
    path = shared_data / "letter.npz"
    data = np.load(path)
    X, y = data["X"].astype(np.float64), data["y"]
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(y))[:4000]
    X = (X - X.mean(0)) / X.std(0)
    Xtr, ytr, Xte, yte = X[idx[:3000]], y[idx[:3000]], X[idx[3000:]], y[idx[3000:]]
    gen = torch.Generator().manual_seed(0)
    errors = []
    for p in (25, 100, 400):
        Z = _kmeans(torch.as_tensor(Xtr), p, 5, gen)  # k-means centroids: not training points
        clf = kgp.KernelClassifier(
            "laplacian",
            lengthscale=4.0,
            noise=1e-3,
            solver="eigenpro",
            centers=Z,
            solver_options={"epochs": 5, "subsample_size": 500},
            random_state=0,
        ).fit(Xtr, ytr)
        errors.append(1 - clf.score(Xte, yte))
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.30, errors


# ----------------------------------------------------------------------------- mechanics
def test_multi_output_equals_separate_fits_and_is_reproducible():
    X, Z, y = _problem()
    y2 = torch.cat([y, torch.cos(X[:, 1:2])], 1)
    k = _kernel()
    both = _fit(X, y2, Z, k, subsample_size=100, epochs=3, seed=7)
    again = _fit(X, y2, Z, k, subsample_size=100, epochs=3, seed=7)
    assert torch.equal(both.predictor_.alpha, again.predictor_.alpha)
    first = _fit(X, y2[:, :1], Z, k, subsample_size=100, epochs=3, seed=7)
    # Same seed, same batches and step: each output column evolves independently.
    assert _rel(both.predictor_.alpha[:, :1], first.predictor_.alpha) < 1e-10
    other = _fit(X, y2, Z, k, subsample_size=100, epochs=3, seed=8)
    assert not torch.equal(both.predictor_.alpha, other.predictor_.alpha)


def test_float32_and_predictor_type():
    X, Z, y = _problem(n=500, p=40)
    k = kgp.kernels.make_kernel("rbf", 0.7)
    model = kgp.KernelRegressor(
        k,
        noise=0.05,
        solver="eigenpro",
        centers=Z.float(),
        solver_options={"epochs": 20, "subsample_size": 200, "average_epochs": 10},
    ).fit(X.float(), y.float())
    assert isinstance(model.predictor_, kgp.KernelExpansion)
    assert model.predictor_.alpha.dtype == torch.float32 and model.predictor_.alpha.shape == (40, 1)
    expected, Kxz = _nystrom_ridge(_kernel("rbf", 0.7), X, Z, y, 0.05)
    assert _rel(Kxz @ model.predictor_.alpha.double(), Kxz @ expected) < 2e-2


def test_callback_early_stop_and_history_extras():
    X, Z, y = _problem()
    calls = []

    def stop_at_two(info):
        calls.append(info)
        return info.iteration == 2

    model = kgp.KernelRegressor(
        _kernel(),
        noise=0.05,
        solver="eigenpro",
        centers=Z,
        callback=stop_at_two,
        solver_options={"epochs": 10, "subsample_size": 100},
    ).fit(X, y, validation_data=(X, y))
    assert len(model.history_) == 2 and len(calls) == 2
    extras = model.history_[-1].extras
    for key in ("train_mse", "batch_size", "step_size", "time_gradient", "time_correction", "time_projection"):
        assert key in extras
    assert model.history_[-1].metric is not None and model.history_[-1].metric < float((y**2).mean())


def test_tol_stops_interpolation_early():
    X, y = _well_conditioned()
    model = _fit(
        X,
        y,
        None,
        _kernel("laplacian", 0.4),
        solver="eigenpro2",
        regularization="none",
        subsample_size=100,
        epochs=500,
        tol=1e-8,
    )
    assert len(model.history_) < 500
    assert model.history_[-1].extras["train_mse"] <= 1e-8 * float((y**2).mean())


def test_eigenpro2_projection_path_runs_and_converges():
    """Inexact projection by inner EigenPro 2.0 epochs (eq. 32): the fixed point is unchanged."""
    X, Z, y = _problem()
    k = _kernel()
    expected, Kxz = _nystrom_ridge(k, X, Z, y, 0.05)
    model = _fit(
        X,
        y,
        Z,
        k,
        projection="eigenpro2",
        projection_epochs=3,
        batch_size=200,
        subsample_size=200,
        q=60,
        epochs=100,
        average_epochs=0,
    )
    assert model.history_[0].extras["projection"] == "eigenpro2"
    # measured 1.1e-2 at 100 epochs (7e-4 with 10 inner epochs): slower than the exact projection
    assert _rel(Kxz @ model.predictor_.alpha, Kxz @ expected) < 3e-2


@pytest.mark.parametrize(
    "options,match",
    [
        ({"epochs": 0}, "option 'epochs': expected an integer >= 1, got 0"),
        ({"q": -1}, "option 'q': expected an integer >= 0 or None, got -1"),
        ({"q": 300}, "option 'q': expected an integer < subsample_size=200 or None, got 300"),
        ({"subsample_size": 10_000}, r"option 'subsample_size': expected an integer <= 200 \(the number of training"),
        ({"regularization": "l1"}, "option 'regularization': expected one of 'ridge', 'none', got 'l1'"),
        ({"correction": "both"}, "option 'correction': expected one of 'projected', 'paper', got 'both'"),
        ({"projection": "lu"}, "option 'projection': expected one of 'auto', 'cholesky', 'eigenpro2', got 'lu'"),
        ({"lr_scale": 0}, "option 'lr_scale': expected a finite number > 0, got 0"),
        ({"batch_size": 2.5}, "option 'batch_size': expected an integer >= 1 or None, got 2.5"),
        ({"average_epochs": 11}, "option 'average_epochs': expected an integer <= epochs=10, got 11"),
        (
            {"projection": "eigenpro2", "projection_subsample_size": 20},
            r"option 'projection_subsample_size': expected an integer <= 10 \(the number of centers",
        ),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_options_raise_value_error(options, match):
    X, Z, y = _problem()
    error = ValueError if "bogus" in options else InvalidOptionError
    with pytest.raises(error, match="solver 'eigenpro' " + match if "bogus" not in options else match):
        _fit(X, y, Z, _kernel(), **options)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"q": 150}, "option 'q': expected an integer < subsample_size=100 or None, got 150"),
        ({"average_epochs": 3, "epochs": 2}, "option 'average_epochs': expected an integer <= epochs=2, got 3"),
        ({"correction": "paper"}, "unknown option"),
    ],
)
def test_eigenpro2_bad_options(options, match):
    X, _, y = _problem()
    with pytest.raises(ValueError, match=match):
        _fit(X, y, None, _kernel(), solver="eigenpro2", subsample_size=100, **options)


def test_divergence_raises_divergence_error():
    """A step 1000x past the stability limit: kgp.DivergenceError (still a FloatingPointError) with cause and remedy."""
    X, Z, y = _problem()
    with pytest.raises(kgp.DivergenceError, match="'eigenpro': the iteration diverged at epoch 1 .*remedy: .*lr_scale"):
        _fit(X, y, Z, _kernel(), lr_scale=1e3, epochs=50)
    assert issubclass(kgp.DivergenceError, FloatingPointError)
    with pytest.raises(kgp.DivergenceError, match="'eigenpro2': the iteration diverged"):
        _fit(X, y, None, _kernel(), solver="eigenpro2", subsample_size=100, lr_scale=1e3, epochs=50)


def test_not_factorisable_centers_raise_not_psd_error():
    """Called directly (no model validation): non-finite centers make K(Z, Z) unfactorisable at every jitter."""
    X, Z, y = _problem()
    Z[0, 0] = float("nan")
    eigenpro = kgp.get_solver("eigenpro")
    options = kgp.resolve_options("solver 'eigenpro'", eigenpro, projection="cholesky")
    problem = kgp.Problem(X, y, _kernel(), 0.05, centers=Z, options=options)
    with pytest.raises(NotPSDError, match=r"K\(Z, Z\) \+ 2.2e-03 I of the eigenpro centers .* are centers duplicated"):
        eigenpro.fit(problem)


def test_option_defaults_documented_and_registered():
    assert set(EIGENPRO3_DEFAULTS) >= {"epochs", "batch_size", "subsample_size", "q", "regularization", "tol"}
    assert set(EIGENPRO2_DEFAULTS) == set(EIGENPRO3_DEFAULTS) - {
        "correction",
        "projection",
        "projection_epochs",
        "projection_subsample_size",
        "projection_q",
        "kernel_cache",
    }
    for declaration in {**EIGENPRO3_DEFAULTS, **EIGENPRO2_DEFAULTS}.values():
        assert isinstance(declaration, kgp.Option) and declaration.help
    assert option_default(EIGENPRO3_DEFAULTS["epochs"]) == 10
    assert kgp.get_solver("eigenpro").capabilities.uses_centers is True
    assert kgp.get_solver("eigenpro2").capabilities.uses_centers is False


def test_docs_options_table_matches_declarations():
    """docs/solvers/eigenpro.md lists every declared option with its default and what it accepts."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "solvers" / "eigenpro.md").read_text()
    rows = {}
    for line in page.splitlines():
        match = re.match(r"\| `(\w+)`[^|]*\| `([^`]*)` \| ([^|]*) \|", line)
        if match:
            rows[match[1]] = (match[2], match[3].strip())
    assert set(rows) == set(EIGENPRO3_DEFAULTS)
    for name, declaration in EIGENPRO3_DEFAULTS.items():
        default, accepts = rows[name]
        assert default == repr(declaration.default), name
        assert accepts.startswith(declaration.expected), name


def test_default_selector_centers_and_classifier_targets():
    """Without explicit centers the model's selector supplies them (training points here)."""
    X, _, y = _problem(n=400)
    labels = (y[:, 0] > 0).long().numpy()
    clf = kgp.KernelClassifier(
        _kernel(), noise=1e-3, solver="eigenpro", n_centers=40, solver_options={"subsample_size": 200}, random_state=0
    ).fit(X.numpy(), labels)
    assert clf.predictor_.alpha.shape == (40, 1)
    assert clf.score(X.numpy(), labels) > 0.8


# ----------------------------------------------------------------------------- ordinary inputs that are hard
def _r2(pred, y):
    pred, y = np.asarray(pred, dtype=np.float64).reshape(-1), np.asarray(y, dtype=np.float64).reshape(-1)
    return 1.0 - float(((pred - y) ** 2).mean() / ((y - y.mean()) ** 2).mean())


def _nystrom_mean_at(kernel, X, y, Z, noise, Xt):
    """Oracle: Nystrom GP mean on Z at Xt, (K_ZX K_XZ + noise K_ZZ) a = K_ZX y, float64 lstsq (K_ZZ may be singular)."""
    k = kernel.double()
    X, y, Z, Xt = (torch.as_tensor(np.asarray(a), dtype=torch.float64) for a in (X, y, Z, Xt))
    Kxz, Kzz = _dense(k, X, Z), _dense(k, Z, Z)
    a = torch.linalg.lstsq(Kxz.T @ Kxz + noise * Kzz, Kxz.T @ y.reshape(-1, 1), rcond=1e-13).solution
    return (_dense(k, Xt, Z) @ a).reshape(-1).numpy()


def _fit_warn(solver, X, y, dtype, **kw):
    with pytest.warns() as record:
        import warnings

        warnings.simplefilter("always", kgp.ConvergenceWarning)
        model = kgp.KernelRegressor(solver=solver, random_state=0, dtype=dtype, **kw).fit(X, y)
        warnings.warn("sentinel", UserWarning, stacklevel=1)  # pytest.warns needs one warning
    warned = [str(w.message) for w in record if issubclass(w.category, kgp.ConvergenceWarning)]
    return model, warned


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_repeated_rows_match_exact_and_nystrom(dtype):
    """Binary features, 8 distinct rows among 1,000 (the reported case: eigenpro predicted ~1e-12, R^2 0 vs 0.77).

    Duplicates made K(X_s, X_s) rank 8 and its numerically-zero eigenvalues were inverted; now the
    directions below the rounding floor are not damped and the curvatures come from Rayleigh quotients.
    """
    rng = np.random.default_rng(0)
    X = rng.integers(0, 2, size=(1000, 3)).astype(float)
    y = X @ [1.0, -2.0, 0.5] + X[:, 0] * X[:, 1] + 0.5 * rng.standard_normal(1000)
    X, Xt, y, yt = X[:800], X[800:], y[:800], y[800:]
    common = dict(kernel="rbf", lengthscale=1.0, noise=0.25)
    exact = kgp.KernelRegressor(solver="exact", dtype="float64", **common).fit(X, y)
    r2_exact = _r2(exact.predict(Xt), yt)
    assert r2_exact > 0.8
    for solver, extra in (("eigenpro", {"n_centers": 200}), ("eigenpro2", {})):
        model, warned = _fit_warn(solver, X, y, dtype, **common, **extra)
        pred = np.asarray(model.predict(Xt)).reshape(-1)
        assert abs(_r2(pred, yt) - r2_exact) < 0.005, (solver, _r2(pred, yt), r2_exact)
        assert np.abs(pred - np.asarray(exact.predict(Xt)).reshape(-1)).max() < 0.05
        assert not warned, warned


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_smooth_kernel_close_to_exact_or_warns(dtype):
    """RBF lengthscale 2 on d = 3 (the reported case: test R^2 0.006 / 0.148 where exact reaches 0.999).

    The steep spectrum left eigenvalues below float rounding that the preconditioner inverted
    (amplifying rounding errors) and a step-size estimate scaled from them; measured after the fix:
    R^2 0.9935-0.9945 against exact 0.9942-0.9945, with a ConvergenceWarning where 10 epochs
    stop visibly short (eigenpro float64: 0.9835, estimated 58% more training-loss decrease to come).
    """
    rng = np.random.default_rng(0)
    rng.integers(0, 2, size=(1000, 3))  # the same stream as the reported sweep
    X = rng.standard_normal((1250, 3))
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] ** 2 / 2 + 0.3 * X[:, 2] + 0.05 * rng.standard_normal(1250)
    X, Xt, y, yt = X[:1000], X[1000:], y[:1000], y[1000:]
    common = dict(kernel="rbf", lengthscale=2.0, noise=1e-2)
    r2_exact = _r2(kgp.KernelRegressor(solver="exact", dtype="float64", **common).fit(X, y).predict(Xt), yt)
    assert r2_exact > 0.99
    for solver, extra in (("eigenpro", {"n_centers": 300}), ("eigenpro2", {})):
        model, warned = _fit_warn(solver, X, y, dtype, **common, **extra)
        r2 = _r2(model.predict(Xt), yt)
        assert r2 > r2_exact - 0.02, (solver, r2, r2_exact)
        if r2 < r2_exact - 0.003:
            assert warned and "far from convergence" in warned[0], (solver, r2, r2_exact)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_inputs_scaled_by_1e30(dtype):
    """Inputs and lengthscale scaled by 1e30 (the reported case: eigenpro2 float32 predicted ~1e5 for |y| <= 3).

    The cross-block form ||x||^2 + ||z||^2 - 2 x.z lost k(x, x) (0 instead of 1) and the float32 eigh failed;
    now the exact diagonal is used where a point meets itself and eigh retries in float64.
    """
    rng = np.random.default_rng(0)
    X = rng.standard_normal((600, 3))
    y = np.clip(np.sin(2 * X[:, 0]) + X[:, 1], -3, 3)
    X, Xt, y, yt = X[:500] * 1e30, X[500:] * 1e30, y[:500], y[500:]
    common = dict(kernel="rbf", lengthscale=1e30, noise=1e-2)
    r2_exact = _r2(kgp.KernelRegressor(solver="exact", dtype="float64", **common).fit(X, y).predict(Xt), yt)
    for solver, extra in (("eigenpro2", {}), ("eigenpro", {"n_centers": 200})):
        model, warned = _fit_warn(solver, X, y, dtype, **common, **extra)
        pred = np.asarray(model.predict(Xt)).reshape(-1)
        assert np.abs(pred).max() < 3.5
        r2 = _r2(pred, yt)
        if solver == "eigenpro":  # its oracle: the Nystrom GP mean on the same 200 centers
            oracle = _nystrom_mean_at(kgp.kernels.make_kernel("rbf", 1e30), X, y, model.centers_.double(), 1e-2, Xt)
            r2_exact = _r2(oracle, yt)
        assert r2 > r2_exact - 0.02, (solver, r2, r2_exact)
        # measured: eigenpro2 0.9864 vs exact 0.9916 (warned, residual 0.025 rms(y)); eigenpro 0.9866-0.9868 vs
        # the Nystrom oracle's 0.9914-0.9917 unwarned: its running MSE falls sublinearly (2.4e-3, 2.1e-3,
        # 2.07e-3 over the last epochs; 30 epochs: 9.4e-4, R^2 0.9889), which the geometric estimate misses
        if r2 < r2_exact - 0.006:
            assert warned, (solver, r2, r2_exact)
    # lengthscale 1 at inputs ~1e30: squared distances overflow float32 (inf): a clear error, not garbage
    if dtype == "float32":
        with pytest.raises(ValueError, match="non-finite entries .* standardise the inputs"):
            kgp.KernelRegressor(kernel="rbf", lengthscale=1.0, noise=1e-2, solver="eigenpro2", dtype=dtype).fit(X, y)


def test_ill_conditioned_ard_float32_matches_float64():
    """ARD lengthscales spanning 100x, noise 1e-3: float32 test RMSE within 2% of float64's, near the Nystrom oracle."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(2500, 3, generator=g, dtype=torch.float64)
    y = (
        torch.sin(2 * X[:, 0])
        + 0.5 * X[:, 1]
        + 0.1 * X[:, 2]
        + 0.03 * torch.randn(2500, generator=g, dtype=torch.float64)
    )
    X, Xt, y, yt = X[:2000], X[2000:], y[:2000], y[2000:]
    Z = X[torch.randperm(2000, generator=g)[:300]]
    import gpytorch

    kernel = gpytorch.kernels.RBFKernel(ard_num_dims=3)
    kernel.lengthscale = torch.tensor([[1.0, 10.0, 100.0]])
    oracle = _nystrom_mean_at(kernel, X, y, Z, 1e-3, Xt)
    rmse_oracle = float(np.sqrt(((oracle - yt.numpy()) ** 2).mean()))
    rmse = {}
    for dtype in (torch.float32, torch.float64):
        model = kgp.KernelRegressor(kernel, noise=1e-3, solver="eigenpro", centers=Z, random_state=0, dtype=dtype)
        model.fit(X, y)
        pred = np.asarray(model.predict(Xt), dtype=np.float64).reshape(-1)
        rmse[dtype] = float(np.sqrt(((pred - yt.numpy()) ** 2).mean()))
    # measured: 0.03800 / 0.03806 (0.2% apart); before the float32-level eigenvalue floor, float64
    # damped directions down to 1e-10 lambda_1 and lost (RMSE 0.71 against 0.049 with lengthscales 0.3/3/30)
    assert abs(rmse[torch.float32] / rmse[torch.float64] - 1) < 0.02, rmse
    # 10 default epochs stop 25% above the Nystrom optimum here (0.0381 vs 0.0305; docs: not yet fixed)
    assert rmse[torch.float64] < 1.3 * rmse_oracle, (rmse, rmse_oracle)


def test_convergence_warning_fires_when_truncated_not_when_converged():
    """epochs=1 on a hard problem (Laplacian, noise 1e-6) warns; converged runs do not.

    eigenpro2 needs 100 epochs on _problem (Laplacian, noise 0.05): after its default 10 its predictions
    were still 9% off the exact solve (residual 0.12 rms(y)) and it warned, rightly.
    """
    g = torch.Generator().manual_seed(5)
    X = torch.randn(2000, 4, generator=g, dtype=torch.float64)
    y = torch.sign(torch.sin(2 * X[:, :1]) * torch.cos(X[:, 1:2]))
    Z = X[:400]
    k = _kernel("laplacian", 2.0)
    for solver, centers in (("eigenpro", Z), ("eigenpro2", None)):
        with pytest.warns(kgp.ConvergenceWarning, match=f"solver '{solver}': stopped after 1 epoch.* far from conv"):
            _fit(X[:1000], y[:1000], centers, k, noise=1e-6, solver=solver, epochs=1)
    X, Z, y = _problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.ConvergenceWarning)
        model = _fit(X, y, Z, _kernel())
        assert model.history_[-1].extras["remaining"] < 0.25 * model.history_[-1].extras["train_mse"]
        model = _fit(X, y, None, _kernel(), solver="eigenpro2", epochs=100)
        exact = kgp.KernelRegressor(_kernel(), noise=0.05, solver="exact").fit(X, y)
        assert _rel(model.predict(X), exact.predict(X)) < 2e-3


# ----------------------------------------------------------------------------- memory budget


@pytest.mark.parametrize("solver", ["eigenpro", "eigenpro2"])
def test_memory_budget_bounds_every_block(solver):
    """Under a 256 KiB budget no n x M (or n x s, s x s beyond the budget) block is formed, and the fit still
    matches its dense oracle (unbounded blocks would peak at 431 / 392 MB at n = 5,000 under this budget)."""
    g = torch.Generator().manual_seed(3)
    n, p, budget = 1200, 150, 256 * 2**10
    X = torch.randn(n, 2, generator=g, dtype=torch.float64)
    y = torch.sin(2 * X[:, :1]) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    Z = X[:p] + 0.01  # centers that are not training points
    k = _kernel("rbf", 1.0)
    with kgp.settings.memory_budget(budget), LargestOutput() as rec, warnings.catch_warnings():
        warnings.simplefilter("ignore", kgp.ConvergenceWarning)
        model = _fit(X, y, Z if solver == "eigenpro" else None, k, noise=0.05, solver=solver, epochs=20)
    assert model.history_[-1].extras["s"] == 181  # the side of a float64 square within 256 KiB
    # the only objects above the budget are vectors of length n (targets, permutations)
    assert rec.largest * 8 <= budget or rec.largest <= n, (rec.largest, rec.op)
    Xt = torch.randn(200, 2, generator=g, dtype=torch.float64)
    if solver == "eigenpro":
        oracle = _nystrom_ridge_predictions(k, X, Z, y, 0.05, Xt)
    else:
        oracle = kgp.KernelRegressor(k, noise=0.05, solver="exact").fit(X, y).predict(Xt)
    # measured: 0.0055 (eigenpro, 20 epochs, s = 181; the same under MKL_CBWR=COMPATIBLE and one thread)
    # relative to the oracle's norm; eigenpro2 (20 epochs,
    # the residual still falling at 0.065 rms(y)) below the bound
    assert _rel(model.predict(Xt), oracle) < (0.02 if solver == "eigenpro" else 0.05)


def test_default_q_damps_every_direction_when_the_subsample_is_every_point():
    """q = s - 1 by default when s = n and the model spans the points, else s // 10; measured gain of the rule.

    eigenpro2, Laplacian, 1,000 points, noise 1e-6, 10 epochs: 0.6% from the exact solve with the default
    (s = n = 1,000, q = 999) against 6.2% with q = s // 10 = 100.
    """
    from kgp_builtins.eigenpro.options import resolve_subsample

    assert resolve_subsample("x", 500, None, None) == (500, 499)
    assert resolve_subsample("x", 500, None, None, model_spans_points=False) == (500, 50)
    assert resolve_subsample("x", 5000, None, None) == (2000, 200)
    g = torch.Generator().manual_seed(5)
    X = torch.randn(1200, 4, generator=g, dtype=torch.float64)
    y = torch.sign(torch.sin(2 * X[:, :1]) * torch.cos(X[:, 1:2]))
    X, Xt, y = X[:1000], X[1000:], y[:1000]
    k = _kernel("laplacian", 2.0)
    exact = kgp.KernelRegressor(k, noise=1e-6, solver="exact").fit(X, y).predict(Xt)
    errors = {}
    for q in (None, 100):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", kgp.ConvergenceWarning)
            model = _fit(X, y, None, k, noise=1e-6, solver="eigenpro2", q=q)
        errors[q] = _rel(model.predict(Xt), exact)
        # the convergence warning follows: silent at 0.6%, raised at 6%
        assert any(issubclass(w.category, kgp.ConvergenceWarning) for w in caught) == (q == 100), (q, errors)
    assert errors[None] < 0.02 and errors[100] > 3 * errors[None], errors


# ----------------------------------------------------------------------------- batch floor
def test_batch_floor_rule_closed_form():
    """m* = beta / (lam_top / n); the default batch is max(m*, floor) capped at n; an explicit batch is kept;
    the step m / (beta + (m - 1) lam) stays below the full-gradient stability bound 2 / lam."""
    from kgp_builtins.eigenpro.nystrom import batch_floor, critical_batch, critical_batch_and_step

    beta, lam_top, n = 2.0, 1000.0, 1000  # lam = 1, m* = 2
    assert critical_batch(beta, lam_top, n) == 2
    m, step = critical_batch_and_step(beta, lam_top, n, None, floor=10)
    assert m == 10 and step(10) == pytest.approx(10 / 11) and step(10) < 2.0
    assert step(2) == pytest.approx(2 / 3)  # at m*: half the saturated step 1 / lam
    assert critical_batch_and_step(beta, lam_top, n, 3, floor=10)[0] == 3
    assert critical_batch_and_step(beta, lam_top, n, None, floor=5000)[0] == n
    assert critical_batch_and_step(beta, 10.0, n, None, floor=10)[0] == 200  # m* = 200 above the floor
    assert batch_floor(5000) == 313 and batch_floor(1600) == 100 and batch_floor(1) == 1


def test_small_critical_batch_is_floored_and_still_matches_the_oracle():
    """A smooth kernel (l = 8, d = 2, noise 1): m* = 28 below the floor M / 16 = 50 for M = 800 centers
    (on tamielectric m* = 14 made an epoch 2,600 batches of two 5,000^2 triangular solves). The floored
    batch takes the saturated step and matches the Nystrom oracle as closely as the batch m*."""
    g = torch.Generator().manual_seed(0)
    n, p = 3000, 800
    X = torch.randn(n + 500, 2, generator=g, dtype=torch.float64)
    y = torch.sin(2 * X[:, 0]) + 0.3 * X[:, 1] + 0.3 * torch.randn(n + 500, generator=g, dtype=torch.float64)
    Z = X[torch.randperm(n, generator=g)[:p]]
    k = kgp.kernels.make_kernel("rbf", 8.0)
    oracle = torch.as_tensor(_nystrom_mean_at(k, X[:n], y[:n], Z, 1.0, X[n:]))
    floored = _fit(X[:n], y[:n], Z, k, noise=1.0)
    extras = floored.history_[-1].extras
    assert extras["batch_size"] == 50 and extras["critical_batch"] == 28
    at_mstar = _fit(X[:n], y[:n], Z, k, noise=1.0, batch_size=28)
    assert at_mstar.history_[-1].extras["batch_size"] == 28
    err_floor = _rel(floored.predict(X[n:]), oracle)
    err_mstar = _rel(at_mstar.predict(X[n:]), oracle)
    # measured: 0.0037 (floor) and 0.0038 (m*)
    assert err_floor < 0.01 and err_floor < 1.5 * err_mstar


# ----------------------------------------------------------------------------- whitened features


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_whitened_features_are_k_times_the_inverse_factor(dtype):
    """``Phi = K(X, Z) L^{-T}``: ``Phi L^T`` gives back the kernel block to the solve's backward error
    (``p eps |Phi| |L^T|``), and a budget below ``Phi`` or ``kernel_cache("never")`` keeps none."""
    from kgp_builtins.eigenpro.features import whitened_features

    X, Z, _ = _problem(n=500, p=60)
    X, Z = X.to(dtype), Z.to(dtype)
    k = _kernel("rbf", 0.8).to(dtype)
    kop = lambda A, B: kgp.kernel_operator(k, A, B)  # noqa: E731
    Kzz = _dense(k, Z.double(), Z.double())
    L = torch.linalg.cholesky(Kzz + 1e-6 * torch.eye(60, dtype=torch.float64)).to(dtype)
    with kgp.settings.kernel_cache("auto"):
        phi = whitened_features(kop, X, Z, L)
    assert phi is not None and phi.shape == (500, 60) and phi.dtype == dtype
    back = phi.double() @ L.double().mT
    bound = 60 * torch.finfo(dtype).eps * (phi.double().abs() @ L.double().abs().mT)
    assert bool(((back - _dense(k, X, Z).double()).abs() <= bound + torch.finfo(dtype).eps).all())
    with kgp.settings.kernel_cache("never"):
        assert whitened_features(kop, X, Z, L) is None
    with kgp.settings.kernel_cache("auto"), kgp.settings.memory_budget(500 * 60 * X.element_size()):
        assert whitened_features(kop, X, Z, L) is None


def test_features_pay_where_their_solve_costs_less_than_the_steps_solves():
    """``2 E max(k, SOLVE_BALANCE) >= m``: Phi's ``n p^2`` against ``E n / m`` steps of two solves."""
    from kgp_builtins.eigenpro.features import SOLVE_BALANCE, features_pay

    assert features_pay(10, 2 * 10 * SOLVE_BALANCE, 1) and not features_pay(10, 2 * 10 * SOLVE_BALANCE + 1, 1)
    assert features_pay(10, 459, 26) and not features_pay(10, 589, 1) and features_pay(10, 313, 1)
    assert features_pay(10, 2 * 10 * 40, 40) and not features_pay(10, 2 * 10 * 40 + 1, 40)


def test_fit_on_whitened_features_is_the_fit_on_kernel_blocks(monkeypatch):
    """The same steps either way (``K(X_m, Z) alpha = Phi_m b``, ``L^{-1} K(Z, X_m) g = Phi_m^T g``), with
    ridge and without, averaged: in float64 the predictions at the training points agree to the rounding of
    8 epochs of steps (measured 1e-12; without ridge the coefficients themselves are ill-determined); in
    float32 the two fits are far closer to each other than to the float64 fit."""
    import kgp_builtins.eigenpro.ep3 as ep3

    kept_rows = []

    def recording(kop, X, Z, L):
        phi = whitened_features(kop, X, Z, L)
        kept_rows.append(None if phi is None else phi.shape[0])
        return phi

    from kgp_builtins.eigenpro.features import whitened_features

    monkeypatch.setattr(ep3, "whitened_features", recording)
    X, Z, y = _problem(n=800, p=40)
    k = _kernel("rbf", 0.8)
    Kxz = _dense(k, X, Z)
    for options in ({}, {"regularization": "none"}):
        fits = {}
        for dtype in (torch.float64, torch.float32):
            Xd, Zd, yd, kd = X.to(dtype), Z.to(dtype), y.to(dtype), _kernel("rbf", 0.8).to(dtype)
            for cache in ("auto", "never"):
                kept_rows.clear()
                model = _fit(Xd, yd, Zd, kd, noise=0.05, epochs=8, average_epochs=4, kernel_cache=cache, **options)
                # "auto": the held-out rows, then all 800 rows (the batch is small enough for Phi to pay)
                assert (800 in kept_rows) == (cache == "auto"), (cache, kept_rows)
                fits[dtype, cache] = Kxz @ model.predictor_.alpha.double()
        reference = fits[torch.float64, "never"]
        assert _rel(fits[torch.float64, "auto"], reference) < 1e-9, options
        # float32 (jitter from its own evaluation error) is 2.2% / 7.4% from float64 either way; the two float32
        # fits differ by 1.3e-4 / 5.5e-4 (measured): far less than either differs from float64
        blocks = _rel(fits[torch.float32, "never"], reference)
        between = _rel(fits[torch.float32, "auto"], fits[torch.float32, "never"])
        assert between <= 0.1 * blocks, (options, between, blocks)
