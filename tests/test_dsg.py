"""Solver ``dsg`` (Dai et al., NIPS 2014) against independent oracles.

Oracles: GPyTorch's own kernel values (random-feature estimates), closed-form kernels, a numpy
transcription of Algorithm 1, dense Cholesky KRR, a dense float64 Nystrom solve and the ``falkon``
solver on a real UCI set.
"""

import math
import warnings
from pathlib import Path

import gpytorch
import numpy as np
import pytest
import torch
from conftest import load_uci
from kgp_builtins.dsg import (
    DSGSolver,
    RandomFeatureExpansion,
    RandomFeatureMap,
    SpectralSampler,
    spectral_sampler,
    step_seed,
)
from linear_operator.operators import LinearOperator

import kgp
from kgp.options import InvalidOptionError, describe_options
from kgp.testing import OracleSpec, SolverConformance

F64 = torch.float64


def _kernel(name, lengthscale=1.0, outputscale=None, ard=None):
    if name == "rbf":
        base = gpytorch.kernels.RBFKernel(ard_num_dims=ard)
    else:
        nu = {"laplacian": 0.5, "matern32": 1.5, "matern52": 2.5}[name]
        base = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=ard)
    base.lengthscale = lengthscale
    if outputscale is None:
        return base.to(F64)
    scaled = gpytorch.kernels.ScaleKernel(base)
    scaled.outputscale = outputscale
    return scaled.to(F64)


def _pairs(d=3, seed=0):
    """Points at assorted distances (0.2 to 2.5 lengthscales) from the origin, and the origin."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(5, d, generator=g, dtype=F64)
    dirs = dirs / dirs.norm(dim=1, keepdim=True)
    radii = torch.tensor([0.2, 0.5, 1.0, 1.6, 2.5], dtype=F64)
    return torch.cat([torch.zeros(1, d, dtype=F64), dirs * radii[:, None]])


def _gpytorch_values(kernel, X):
    with torch.no_grad():
        return kernel(X[:1], X[1:]).to_dense()[0]


def _per_feature_products(kernel, X, n_features, seed):
    """D per-feature products ``D phi_l(x_0) phi_l(x_j)``: their mean is the D-feature estimate."""
    Phi = RandomFeatureMap(kernel, seed, n_features, 1).features(X)
    return Phi[:1] * Phi[1:] * n_features  # (points - 1) x D


# ------------------------------------------------------------------------------------------------
# random-feature kernel estimates
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rbf", "laplacian"])
def test_rf_kernel_estimate_error_falls_like_inverse_sqrt_D(name):
    kernel = _kernel(name, lengthscale=0.8)
    X = _pairs()
    exact = _gpytorch_values(kernel, X)
    Ds = [16, 64, 256, 1024, 4096]
    rms = []
    for D in Ds:
        errs = []
        for rep in range(40):
            Phi = RandomFeatureMap(kernel, 1000 * D + rep, D, 1).features(X)
            errs.append(Phi[1:] @ Phi[0] - exact)
        rms.append(float(torch.stack(errs).square().mean().sqrt()))
    slope = np.polyfit(np.log(Ds), np.log(rms), 1)[0]
    assert -0.62 < slope < -0.38, (name, slope, rms)


@pytest.mark.parametrize(
    "name,ard,outputscale",
    [("rbf", 3, 1.7), ("laplacian", None, None), ("laplacian", 3, 0.6), ("matern32", 3, 2.0), ("matern52", None, 0.9)],
)
def test_rf_kernel_estimate_is_unbiased(name, ard, outputscale):
    """The mean over many features matches GPyTorch's kernel value within 4.5 standard errors."""
    lengthscale = torch.tensor([[0.7, 1.3, 1.0]], dtype=F64) if ard else 0.9
    kernel = _kernel(name, lengthscale, outputscale, ard)
    X = _pairs()
    exact = _gpytorch_values(kernel, X)
    prods = torch.cat([_per_feature_products(kernel, X, 2**15, seed) for seed in range(4)], dim=1)
    mean = prods.mean(dim=1)
    se = prods.std(dim=1) / math.sqrt(prods.shape[1])
    z = (mean - exact) / se
    assert bool((z.abs() < 4.5).all()), (name, mean, exact, z)
    # and the estimate is informative: the standard errors are small next to the kernel values
    assert float(se.max()) < 0.02 * (outputscale or 1.0)


def test_laplacian_sampler_is_multivariate_cauchy_not_a_product():
    """GPyTorch's Matern 1/2 uses the Euclidean norm: its spectral density is the multivariate Cauchy.

    A product of d one-dimensional Cauchys estimates exp(-||x - x'||_1 / l) instead; at d = 3 the two
    kernels differ by far more than the Monte Carlo error, so the test tells them apart.
    """
    d, ls = 3, 1.0
    kernel = _kernel("laplacian", ls)
    X = _pairs(d)
    ours = torch.cat([_per_feature_products(kernel, X, 2**15, seed) for seed in range(4)], dim=1)
    g = torch.Generator().manual_seed(7)
    D = ours.shape[1]
    w = torch.distributions.Cauchy(0.0, 1.0).icdf(torch.rand(d, D, generator=g, dtype=F64).clamp(1e-12, 1 - 1e-12))
    b = torch.rand(D, generator=g, dtype=F64) * 2 * math.pi
    phi = torch.cos(X @ w / ls + b) * math.sqrt(2.0)
    prod_products = phi[:1] * phi[1:]
    l1 = torch.exp(-(X[1:] - X[:1]).abs().sum(1) / ls)
    l2 = _gpytorch_values(kernel, X)
    se = ours.std(dim=1) / math.sqrt(D)
    assert bool(((ours.mean(1) - l2).abs() < 4.5 * se).all())
    # the product construction matches the L1 kernel, and misses GPyTorch's (L2) kernel
    se_p = prod_products.std(dim=1) / math.sqrt(D)
    assert bool(((prod_products.mean(1) - l1).abs() < 4.5 * se_p).all())
    far = (l1 - l2).abs() > 0.05
    assert bool(far.any()) and bool(((prod_products.mean(1) - l2).abs()[far] > 10 * se_p[far]).all())


def test_matern_samplers_have_the_student_t_tails():
    """Matern nu: ||z||^2 / d ~ F(d, 2 nu): check the second moment E||z||^2 = d (2 nu) / (2 nu - 2)."""
    sampler = SpectralSampler("matern52", torch.ones(1, dtype=F64), 1.0)
    z, b = sampler.sample(123, 4, 200_000)
    assert abs(float(z.square().sum(0).mean()) - 4 * 5 / 3) < 0.1  # dof 5: E||z||^2 = d * 5 / 3
    assert 0.0 <= float(b.min()) and float(b.max()) < 2 * math.pi
    gauss = SpectralSampler("rbf", torch.ones(1, dtype=F64), 1.0).sample(123, 4, 200_000)[0]
    assert abs(float(gauss.square().sum(0).mean()) - 4.0) < 0.05


@pytest.mark.parametrize(
    "kernel",
    [
        gpytorch.kernels.PeriodicKernel(),
        gpytorch.kernels.LinearKernel(),
        gpytorch.kernels.MaternKernel(nu=2.5) + gpytorch.kernels.RBFKernel(),
        gpytorch.kernels.RBFKernel(active_dims=[0]),
    ],
)
def test_kernels_without_a_sampler_are_refused(kernel):
    with pytest.raises(ValueError, match="no spectral sampler"):
        spectral_sampler(kernel)
    X = torch.randn(20, 2, dtype=F64)
    model = kgp.KernelRegressor(kernel, solver="dsg", noise=0.1)
    with pytest.raises(ValueError, match="no spectral sampler"):
        model.fit(X, X[:, 0])


def test_sampler_reads_ard_lengthscale_and_outputscale():
    kernel = _kernel("matern32", torch.tensor([[0.5, 2.0]], dtype=F64), 3.0, ard=2)
    s = spectral_sampler(kernel)
    assert s.family == "matern32" and s.outputscale == pytest.approx(3.0)
    assert torch.allclose(s.lengthscale, torch.tensor([0.5, 2.0], dtype=F64))


# ------------------------------------------------------------------------------------------------
# Algorithm 1 against a numpy transcription
# ------------------------------------------------------------------------------------------------
def _numpy_algorithm_1(X, y, kernel, seed, r, T, theta, nu):
    """Algorithm 1 with full batches, written out as printed: shrink every earlier alpha each step."""
    sampler = spectral_sampler(kernel)
    X = X - X.mean(0)  # the solver centres the inputs (same kernel, smaller phases)
    U = X.numpy() / sampler.lengthscale.numpy()
    amp = math.sqrt(2 * sampler.outputscale / r)
    feats, alphas = [], []
    for t in range(1, T + 1):
        z, b = (a.numpy() for a in sampler.sample(step_seed(seed, t), X.shape[1], r))
        f = sum((amp * np.cos(U @ zi + bi)) @ ai for (zi, bi), ai in zip(feats, alphas)) if feats else 0 * y
        gamma = theta / t
        phi = amp * np.cos(U @ z + b)
        grad = phi.T @ (f - y) / len(y)
        alphas = [(1 - gamma * nu) * a for a in alphas]  # alpha_j = (1 - gamma_i nu) alpha_j, j < i
        alphas.append(-gamma * grad)
        feats.append((z, b))
    return np.stack(alphas)


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")  # 30 steps: deliberately short
@pytest.mark.parametrize("theta_nu", [1.0, 1.5, 2.0])
def test_solver_matches_numpy_algorithm_1(theta_nu):
    """Global-scale trick, seeds and update rule against the literal algorithm (t0 = 0: gamma_t = theta / t)."""
    g = torch.Generator().manual_seed(3)
    X = torch.rand(25, 2, generator=g, dtype=F64) * 4 - 2
    y = torch.sin(X.sum(1, keepdim=True))
    kernel = _kernel("rbf", 1.0)
    nu = 0.2
    opts = dict(
        batch_size=25, features_per_step=8, max_steps=30, passes=100, nu=nu, theta=theta_nu / nu, t0=0.0,
        gamma_max=1.0, seed=11, update="gradient",
    )  # fmt: skip
    for mode in ("cache", "recompute"):
        dsg = kgp.get_solver("dsg")
        options = kgp.resolve_options("solver 'dsg'", dsg, opts, train_predictions=mode)
        pred = dsg.fit(kgp.Problem(X=X, y=y, kernel=kernel, noise=1.0, options=options))
        ref = _numpy_algorithm_1(X, y.numpy(), kernel, 11, 8, 30, theta_nu / nu, nu)
        np.testing.assert_allclose(pred.coef.numpy(), ref, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# seeds
# ------------------------------------------------------------------------------------------------
def _toy(n=300, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=F64) * 4 - 2
    y = torch.sin(X @ torch.tensor([1.0, -0.5, 0.3], dtype=F64)[:d]) + 0.05 * torch.randn(n, generator=g, dtype=F64)
    return X, y


@pytest.mark.filterwarnings("ignore:solver 'dsg'.*away from the training data:kgp.ConvergenceWarning")
def test_same_seed_reproduces_and_other_seed_changes_predictions():
    # 30 blocks of 16 features on 32 points each: a poor model (test R^2 -0.2 / -5.8 against exact 0.99,
    # the off-data check warns rightly); only the seeds matter here
    X, y = _toy()
    opts = dict(passes=3, batch_size=32, features_per_step=16)
    fit = lambda seed: kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", random_state=seed, solver_options=opts)  # noqa: E731
    a = fit(1).fit(X, y).predict(X)
    b = fit(1).fit(X, y).predict(X)
    c = fit(2).fit(X, y).predict(X)
    assert torch.equal(a, b)
    assert float((a - c).abs().max()) > 1e-3


def test_predict_regenerates_the_training_features():
    """Training-time values: the cache path keeps f_t on X with features drawn once at each step;
    the recompute path regenerates every earlier block from its seed at every step (Algorithm 2 inside
    Algorithm 1). Identical coefficients and predictions mean the seeds are aligned."""
    X, y = _toy(120)
    base = dict(passes=3, batch_size=16, features_per_step=8, seed=5, update="gradient")
    models = {
        mode: kgp.KernelRegressor(
            "rbf", noise=0.05, solver="dsg", random_state=0, solver_options={**base, "train_predictions": mode}
        ).fit(X, y)
        for mode in ("cache", "recompute")
    }
    c1, c2 = models["cache"].predictor_.coef, models["recompute"].predictor_.coef
    torch.testing.assert_close(c1, c2, rtol=1e-9, atol=1e-12)
    # predict == Phi @ a with Phi regenerated blockwise from the seeds
    pred = models["cache"].predictor_
    Phi = pred.features(X)
    torch.testing.assert_close(pred.predict(X), Phi @ pred.coef.reshape(-1, 1), rtol=1e-10, atol=1e-12)
    # and a different seed gives different features
    other = RandomFeatureMap(pred.kernel, pred.seed + 1, pred.features_per_step, pred.n_steps).features(X)
    assert float((other - Phi).abs().max()) > 0.1


# ------------------------------------------------------------------------------------------------
# convergence to exact KRR
# ------------------------------------------------------------------------------------------------
def test_function_error_to_exact_krr_decays_like_one_over_t():
    """Thm. 4: E|f_t(x) - f_*(x)|^2 = O(1/t) for gamma_t = theta / t (theta nu = 1, clock offset t0)."""
    n, nu = 100, 0.02
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 2, generator=g, dtype=F64) * 4 - 2
    y = torch.sin(X.sum(1)) + 0.1 * torch.randn(n, generator=g, dtype=F64)
    X_eval = torch.rand(150, 2, generator=g, dtype=F64) * 4 - 2
    kernel = _kernel("rbf", 1.0)
    with torch.no_grad():  # f_* = K(x, X) (K + n nu I)^{-1} y by dense Cholesky (lambda = nu)
        K = kernel(X).to_dense() + n * nu * torch.eye(n, dtype=F64)
        f_star = kernel(X_eval, X).to_dense() @ torch.cholesky_solve(y[:, None], torch.linalg.cholesky(K))
    curves = []
    for seed in range(4):
        hist = []
        kgp.KernelRegressor(
            kernel,
            noise=n * nu,
            solver="dsg",
            random_state=seed,
            solver_options=dict(
                batch_size=10, features_per_step=10, max_steps=4000, passes=10**6, report_every=250, update="gradient"
            ),
            callback=lambda info, h=hist: h.append((info.extras["step"], info.metric)),
        ).fit(X, y, validation_data=(X_eval, f_star))
        curves.append(hist)
    steps = np.array([s for s, _ in curves[0]], dtype=float)
    err = np.array([[m for _, m in c] for c in curves]).mean(0)
    keep = steps >= 500
    slope = np.polyfit(np.log(steps[keep]), np.log(err[keep]), 1)[0]
    assert -1.3 < slope < -0.7, (slope, err)
    assert err[-1] < 1e-3 * float(f_star.square().mean())


# ------------------------------------------------------------------------------------------------
# real data
# ------------------------------------------------------------------------------------------------
def _nystrom_rmse(X, y, Xt, yt, kernel, noise, m, seed):
    """Dense float64 Nystrom KRR with m uniform centers: (K_nM^T K_nM + sigma^2 K_MM) a = K_nM^T y."""
    idx = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(seed))[:m]
    Z = X[idx]
    with torch.no_grad():
        KnM = kernel(X, Z).to_dense()
        H = KnM.T @ KnM + noise * kernel(Z).to_dense()
        a = torch.linalg.lstsq(H, KnM.T @ y[:, None]).solution
        pred = kernel(Xt, Z).to_dense() @ a
    return float((pred[:, 0] - yt).square().mean().sqrt())


def test_real_data_rmse_within_10_percent_of_falkon(shared_data):
    """UCI protein (3,000 train / 1,000 test, standardised), RBF l = 1, sigma^2 = 0.3; dsg after 5 passes."""
    Xn, yn = load_uci(shared_data, "protein")
    perm = np.random.default_rng(0).permutation(len(yn))[:4000]
    Xn, yn = Xn[perm], yn[perm]
    mu, sd = Xn[:3000].mean(0), Xn[:3000].std(0)
    Xn = (Xn - mu) / np.where(sd > 0, sd, 1)
    yn = (yn - yn[:3000].mean()) / yn[:3000].std()
    X, y, Xt, yt = (torch.tensor(a) for a in (Xn[:3000], yn[:3000], Xn[3000:], yn[3000:]))
    noise, kernel = 0.3, _kernel("rbf", 1.0)
    dsg = kgp.KernelRegressor(
        kernel, noise=noise, solver="dsg", random_state=0,
        solver_options=dict(passes=5, batch_size=64, features_per_step=256, update="gradient"),
    ).fit(X, y)  # fmt: skip
    rmse = float((dsg.predict(Xt) - yt).square().mean().sqrt())
    nystrom = _nystrom_rmse(X, y, Xt, yt, kernel, noise, 500, 0)
    assert rmse <= 1.10 * nystrom, (rmse, nystrom)
    if "falkon" not in kgp.registry.registry.names("solver"):
        pytest.skip(f"solver 'falkon' not installed: compared with the dense Nystrom solve only (dsg {rmse:.4f})")
    falkon = kgp.KernelRegressor(kernel, noise=noise, solver="falkon", n_centers=500, random_state=0).fit(X, y)
    rmse_f = float((falkon.predict(Xt) - yt).square().mean().sqrt())
    assert rmse <= 1.10 * rmse_f, (rmse, rmse_f)


# ------------------------------------------------------------------------------------------------
# persistence, streaming, linear operator
# ------------------------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path):
    X, y = _toy()
    model = kgp.KernelRegressor(
        "matern32", lengthscale=1.2, noise=0.05, solver="dsg", random_state=3,
        solver_options=dict(passes=2, batch_size=32, features_per_step=16, update="gradient"),
    ).fit(X, y)  # fmt: skip
    model.save(tmp_path / "dsg.pt")
    loaded = kgp.load(tmp_path / "dsg.pt")
    assert isinstance(loaded.predictor_, RandomFeatureExpansion)
    assert torch.equal(loaded.predict(X), model.predict(X))
    # the file holds the coefficients, one seed and the centring shift (d numbers)
    state = model.predictor_.state_dict()
    assert set(state) == {"coef", "seed", "schedule", "shift"} and state["coef"].shape == (2 * 10, 16, 1)
    torch.testing.assert_close(state["shift"], X.mean(0))


def test_partial_fit_continues_the_step_counter_and_the_schedule():
    X, y = _toy(400)
    opts = dict(batch_size=50, features_per_step=16, partial_fit_passes=1, update="gradient")
    model = kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", random_state=0, solver_options=opts)
    model.partial_fit(X[:200], y[:200])
    first = model.predictor_
    model.partial_fit(X[200:], y[200:])
    second = model.predictor_
    assert first.n_steps == 4 and second.n_steps == 8 and second.seed == first.seed
    assert second.schedule["n_seen"] == 400 and second.schedule["nu"] == pytest.approx(0.05 / 400)
    # the earlier blocks are only shrunk: a_i <- prod_{t=5..8} (1 - gamma_t nu) a_i
    sch = second.schedule
    shrink = math.prod(1 - sch["theta"] / (t + sch["t0"]) * sch["nu"] for t in range(5, 9))
    torch.testing.assert_close(second.coef[:4], first.coef * shrink, rtol=1e-10, atol=0)
    # the new blocks use the features of steps 5..8: predict == features @ coef
    Phi = second.features(X, range(5, 9))
    torch.testing.assert_close(
        second.predict(X)
        - RandomFeatureExpansion(second.kernel, second.coef[:4], second.seed, shift=second.shift).predict(X),
        Phi @ second.coef[4:].reshape(-1, 1),
    )


def test_partial_fit_on_chunks_approaches_fit_on_all():
    X, y = _toy(1200)
    Xt, yt = _toy(300, seed=1)
    opts = dict(batch_size=30, features_per_step=32, passes=3, partial_fit_passes=3, update="gradient")
    full = kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", random_state=0, solver_options=opts).fit(X, y)
    stream = kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", random_state=0, solver_options=opts)
    for chunk in range(4):
        rows = slice(300 * chunk, 300 * (chunk + 1))
        stream.partial_fit(X[rows], y[rows])
    rmse = lambda m: float((m.predict(Xt) - yt).square().mean().sqrt())  # noqa: E731
    assert stream.predictor_.n_steps == full.predictor_.n_steps
    assert rmse(stream) < 1.3 * rmse(full) and rmse(full) < 0.5 * float(yt.std())


def test_partial_fit_refuses_a_different_number_of_features():
    X, y = _toy(100)
    model = kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", solver_options=dict(features_per_step=8))
    model.partial_fit(X, y)
    model.solver_options = dict(features_per_step=16)
    with pytest.raises(InvalidOptionError, match="option 'features_per_step': expected 8 .*, got 16"):
        model.partial_fit(X, y)


def test_feature_map_as_linear_operator():
    X, _ = _toy(60)
    kernel = _kernel("rbf", 1.5)
    fmap = RandomFeatureMap(kernel, seed=0, features_per_step=256, n_steps=64)  # D = 16,384
    op = fmap.operator(X)
    assert isinstance(op, LinearOperator) and op.shape == (60, 60)
    v = torch.randn(60, 2, dtype=F64)
    Phi = fmap.features(X)
    torch.testing.assert_close(op @ v, Phi @ (Phi.T @ v) / 64)
    with torch.no_grad():
        K = kernel(X).to_dense()
    assert float((op.to_dense() - K).abs().max()) < 0.05
    with kgp.settings.memory_budget(1024), pytest.raises(ValueError, match="memory_budget"):
        fmap.operator(X)


def test_bad_options_are_named():
    X, y = _toy(50)
    for bad, name in [
        ({"batch_size": 0}, "batch_size"),
        ({"theta": -1.0}, "theta"),
        ({"t0": "soon"}, "t0"),
        ({"train_predictions": "maybe"}, "train_predictions"),
        ({"features_per_step": 2.5}, "features_per_step"),
    ]:
        with pytest.raises(InvalidOptionError, match=f"solver 'dsg' option '{name}': expected "):
            kgp.KernelRegressor("rbf", solver="dsg", solver_options=bad).fit(X, y)


def test_docs_options_table_matches_the_declarations():
    """docs/solvers/dsg.md lists every declared option with its default and what it accepts."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "solvers" / "dsg.md").read_text()
    for name, default, expected, help_line in describe_options(DSGSolver.option_defaults):
        assert help_line, name
        assert f"| `{name}` | {default} | {expected} |" in text, name


class TestDSGConformance(SolverConformance):
    solver_name = "dsg"
    solver_options = {"passes": 100, "batch_size": 32, "features_per_step": 64, "update": "gradient"}
    rtol = 0.1  # stochastic: relative error of the predictions against exact KRR after 100 passes
    rtol_float32 = 0.1
    iterative = True
    invalid_options = ({"passes": 0}, {"nu": -1.0}, {"gamma_max": "big"}, {"seed": -3})
    spec = OracleSpec()


# ------------------------------------------------------------------------------------------------
# hard inputs, float32, divergence and convergence checks
# ------------------------------------------------------------------------------------------------
def _energy(shared_data, rounded):
    """UCI energy, z-scored, 600 train / 168 test (seeded); optionally X = round(3 X) (discrete inputs)."""
    Xn, yn = load_uci(shared_data, "energy")
    Xn, yn = (Xn - Xn.mean(0)) / Xn.std(0), (yn - yn.mean()) / yn.std()
    perm = np.random.default_rng(0).permutation(len(yn))
    X, Xt = torch.tensor(Xn[perm[:600]]), torch.tensor(Xn[perm[600:]])
    if rounded:
        X, Xt = torch.round(3 * X), torch.round(3 * Xt)
    return X, torch.tensor(yn[perm[:600]]), Xt, torch.tensor(yn[perm[600:]])


def _exact(kernel, X, y, Xt, noise):
    with torch.no_grad():
        K = kernel(X).to_dense() + noise * torch.eye(X.shape[0], dtype=F64)
        return kernel(Xt, X).to_dense() @ torch.cholesky_solve(y[:, None], torch.linalg.cholesky(K))[:, 0]


def _r2(pred, ref):
    return 1.0 - float((pred - ref).square().mean() / (ref - ref.mean()).square().mean())


def test_rounded_inputs_match_the_exact_oracle(shared_data):
    """X = round(3 X) (many ties, a lattice): the default update tracks exact KRR; the plain gradient step does not.

    Measured: R^2 against the exact predictions 0.970 (default, least_squares) and 0.690 (the
    plain gradient step with its own defaults), RBF l = 2, sigma^2 = 1e-2 (docs/solvers/dsg.md).
    """
    X, y, Xt, _ = _energy(shared_data, rounded=True)
    kernel = _kernel("rbf", 2.0)
    ref = _exact(kernel, X, y, Xt, 1e-2)
    pred = kgp.KernelRegressor(kernel, noise=1e-2, solver="dsg", random_state=0).fit(X, y).predict(Xt)
    assert _r2(pred, ref) > 0.95


@pytest.mark.parametrize("scale, dtype", [(1e30, torch.float64), (1e6, torch.float32)])
def test_inputs_beyond_the_phase_precision_are_refused(scale, dtype):
    """Inputs scaled far beyond the lengthscale: every random feature would be rounding noise (a fit
    would predict ~1e5 for |y| <= 3 at 1e30): a ValueError names the spread and the remedy."""
    X, y = _toy(100)
    model = kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", random_state=0, dtype=dtype)
    with pytest.raises(ValueError, match="kernel lengthscales from its mean.*Rescale X"):
        model.fit((X * scale).to(dtype), y.to(dtype))


def test_ill_conditioned_ard_float32_matches_float64():
    """ARD lengthscales spanning 100x, noise 1e-3: float32 within 2% of float64 test RMSE, both near exact KRR."""
    g = torch.Generator().manual_seed(0)
    n, d = 800, 4
    X = torch.randn(n + 400, d, generator=g, dtype=F64) * torch.tensor([1.0, 1.0, 3.0, 30.0], dtype=F64)
    f = torch.sin(X[:, 0] / 0.3) + torch.cos(X[:, 1]) + X[:, 3] / 30
    y = f + 0.03 * torch.randn(n + 400, generator=g, dtype=F64)
    kernel = gpytorch.kernels.RBFKernel(ard_num_dims=d).to(F64)
    kernel.lengthscale = torch.tensor([0.3, 1.0, 3.0, 30.0], dtype=F64)
    ref = _exact(kernel, X[:n], y[:n], X[n:], 1e-3)
    rmse_exact = float((ref - y[n:]).square().mean().sqrt())
    rmse = {}
    for dtype in (torch.float64, torch.float32):
        model = kgp.KernelRegressor(kernel.to(dtype), noise=1e-3, solver="dsg", random_state=0, dtype=dtype)
        pred = model.fit(X[:n].to(dtype), y[:n].to(dtype)).predict(X[n:].to(dtype)).double()
        rmse[dtype] = float((pred - y[n:]).square().mean().sqrt())
    assert abs(rmse[torch.float32] / rmse[torch.float64] - 1) < 0.02, rmse
    assert rmse[torch.float64] < 1.15 * rmse_exact, (rmse, rmse_exact)


def test_convergence_warning_fires_on_a_truncated_run_only(shared_data):
    X, y, _, _ = _energy(shared_data, rounded=False)
    kernel = _kernel("rbf", 1.0)
    fit = lambda **opts: kgp.KernelRegressor(  # noqa: E731
        kernel, noise=1e-3, solver="dsg", random_state=0, solver_options=opts
    ).fit(X, y)
    with pytest.warns(kgp.ConvergenceWarning, match="still moving"):
        fit(passes=4, features_per_step=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.ConvergenceWarning)
        model = fit()
    assert model.predictor_.schedule["moved"] < 0.05


def test_divergence_raises_with_cause_and_remedy():
    """A plain gradient step far above the stable range: the loss explodes -> DivergenceError, not a RuntimeWarning."""
    X, y = _toy(200)
    model = kgp.KernelRegressor(
        "rbf", noise=0.05, solver="dsg", random_state=0, solver_options={"update": "gradient", "gamma_max": 1e8}
    )
    with pytest.raises(kgp.DivergenceError, match="solver 'dsg': .*likely cause: .*remedy: lower the option gamma_max"):
        model.fit(X, y)


def test_least_squares_partial_fit_continues_and_approaches_fit_on_all():
    """Default update in streaming: the step counter, seed, update and shift carry over; chunks approach fit."""
    X, y = _toy(600)
    Xt, yt = _toy(300, seed=1)
    opts = dict(features_per_step=64)
    full = kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", random_state=0, solver_options=opts).fit(X, y)
    stream = kgp.KernelRegressor("rbf", noise=0.05, solver="dsg", random_state=0, solver_options=opts)
    steps = []
    for chunk in range(4):
        rows = slice(150 * chunk, 150 * (chunk + 1))
        stream.partial_fit(X[rows], y[rows])
        steps.append(stream.predictor_.n_steps)
    pred = stream.predictor_
    assert steps == [47, 94, 141, 188]  # ceil(20 * 150 / 64) = 47 steps per chunk
    assert pred.schedule["update"] == "least_squares" and pred.schedule["n_seen"] == 600
    torch.testing.assert_close(pred.shift, X[:150].mean(0))  # the first chunk's mean, kept
    rmse = lambda m: float((m.predict(Xt) - yt).square().mean().sqrt())  # noqa: E731
    assert rmse(stream) < 1.3 * rmse(full) and rmse(full) < 0.5 * float(yt.std())


def _rounded_synthetic(d):
    """n = 1,000 training, 1,000 test points, X = round(3 z) with z ~ N(0, I_d), y smooth + noise 0.1."""
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(2000, d, generator=g, dtype=F64)
    y = torch.sin(Z[:, 0]) + 0.5 * torch.cos(Z[:, 1:].sum(1)) + 0.1 * torch.randn(2000, generator=g, dtype=F64)
    X = torch.round(3 * Z)
    return X[:1000], y[:1000], X[1000:], y[1000:]


def _r2_test(pred, y):
    return 1.0 - float((pred - y).square().mean() / (y - y.mean()).square().mean())


def test_points_isolated_at_the_lengthscale_warn_with_the_measured_shortfall():
    """Rounded inputs in 5 dimensions at lengthscale 1: the points are isolated, exact KRR reaches test R^2
    0.35 and the default dsg fit -0.39 (the random-feature noise of its few dominant blocks, ~0.9 of the
    RMS target at new points). A ConvergenceWarning says so.
    With the remedy it names (shrink=0.2) the fit reaches R^2 0.25 and the check is quiet."""
    X, y, Xt, yt = _rounded_synthetic(5)
    kernel = _kernel("rbf", 1.0)
    r2_exact = _r2_test(_exact(kernel, X, y, Xt, 1e-2), yt)
    assert 0.3 < r2_exact < 0.4
    fit = lambda **opts: kgp.KernelRegressor(  # noqa: E731
        kernel, noise=1e-2, solver="dsg", random_state=0, solver_options=opts
    ).fit(X, y)
    with pytest.warns(kgp.ConvergenceWarning, match="away from the training data.*shrink"):
        model = fit()
    r2_default = _r2_test(model.predict(Xt), yt)
    assert r2_default < r2_exact - 0.5  # the shortfall the warning reports
    sched = model.predictor_.schedule
    assert sched["off_data_score"] > 0.6 and 0.6 < sched["isolated"] < 0.8
    # the noise estimate is what the model predicts far from every training point
    # seeded, and 2,000 points: 200 unseeded ones gave RMS 0.545-0.635 by draw (one CI run fell outside
    # 20 %); 2,000 give 0.585-0.608 over 8 seeds against the estimate 0.686
    g = torch.Generator().manual_seed(0)
    far = model.predict(torch.full((2000, 5), 1e3, dtype=F64) + torch.randn(2000, 5, generator=g, dtype=F64))
    assert float(far.square().mean().sqrt()) == pytest.approx(sched["off_data_noise"], rel=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shrunk = fit(shrink=0.2)
    assert not [w for w in caught if "away from the training data" in str(w.message)]
    assert _r2_test(shrunk.predict(Xt), yt) > r2_exact - 0.15


def test_off_data_check_is_quiet_where_dsg_matches_exact():
    """Rounded inputs in 3 dimensions at lengthscale 2 (many repeated rows, neighbours within a lengthscale):
    dsg's test R^2 equals exact's to 0.01 and the check stays quiet (score 0.05 < 0.3)."""
    X, y, Xt, yt = _rounded_synthetic(3)
    kernel = _kernel("rbf", 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.ConvergenceWarning)
        model = kgp.KernelRegressor(kernel, noise=1e-2, solver="dsg", random_state=0).fit(X, y)
    assert model.predictor_.schedule["off_data_score"] < 0.1
    assert _r2_test(model.predict(Xt), yt) == pytest.approx(_r2_test(_exact(kernel, X, y, Xt, 1e-2), yt), abs=0.01)


@pytest.mark.parametrize("opts", [{"passes": 50}, {"update": "gradient", "passes": 50}])
def test_more_passes_on_isolated_points_still_warn(opts):
    """The plain gradient step reaches R^2 -7.1 with 50 passes on rounded inputs. Measured on the d = 5 case above:
    R^2 -0.31 (least_squares, 50 passes) and -0.68 (gradient, 50 passes) against exact 0.35; both warn."""
    X, y, Xt, yt = _rounded_synthetic(5)
    model = kgp.KernelRegressor(_kernel("rbf", 1.0), noise=1e-2, solver="dsg", random_state=0, solver_options=opts)
    with pytest.warns(kgp.ConvergenceWarning, match="away from the training data"):
        model.fit(X, y)
    assert _r2_test(model.predict(Xt), yt) < 0.0
