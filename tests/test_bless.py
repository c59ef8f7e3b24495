"""BLESS / BLESS-R center selectors (plugins/kgp_builtins/bless/) against independent oracles.

Oracles: eigendecomposition formula for the exact ridge leverage scores (numpy), the identity eq. 4 of
the BLESS paper (J = [n], A = I gives the exact scores), exact d_eff = Tr(K (K + lam n I)^{-1}), dense
float64 Nystrom solves, and uniform sampling as the baseline of the paper's FALKON-BLESS claim.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from kgp_builtins.bless import (
    bless,
    bless_r,
    center_weights,
    estimate_leverage_scores,
)
from kgp_builtins.oracles import exact_leverage_scores

import kgp
from kgp.kernels import make_kernel
from kgp.linalg import NotPSDError
from kgp.options import InvalidOptionError
from kgp.plugin import SelectionRequest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
ALGOS = {"bless": bless, "bless-r": bless_r}


def _clustered(n: int, seed: int, d: int = 3) -> torch.Tensor:
    """Mostly a unit Gaussian blob, 10% spread four times wider: strongly varying leverage scores."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    X[: n // 10] *= 4.0
    return X


def _rbf(lengthscale: float, dtype=torch.float64):
    return make_kernel("rbf", lengthscale).to(dtype)


def _numpy_exact_scores(X: torch.Tensor, lengthscale: float, lam: float) -> np.ndarray:
    """l_i = sum_k U_ik^2 s_k / (s_k + lam n) from numpy's eigh of the Gaussian kernel matrix."""
    x = X.numpy()
    d2 = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    K = np.exp(-d2 / (2 * lengthscale**2))
    s, U = np.linalg.eigh(K)
    s = np.clip(s, 0, None)
    return (U**2) @ (s / (s + lam * x.shape[0]))


def _load_uci(name: str):
    import gzip

    path = SHARED_DATA / "uci" / f"{name}.csv.gz"
    if not path.is_file():
        pytest.skip(f"real-data test: {path} is absent (shared/data ships beside the repository)")
    with gzip.open(path, "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    X = raw[:, :-1]
    X = (X - X.mean(0)) / X.std(0)
    return torch.tensor(X), torch.tensor(raw[:, -1])


# ---------------------------------------------------------------------------------------------- exact scores
def test_exact_leverage_scores_match_eigendecomposition():
    X = _clustered(400, 0)
    lam = 1e-2 / 400
    ours = exact_leverage_scores(X, _rbf(1.0), lam).numpy()
    ref = _numpy_exact_scores(X, 1.0, lam)
    np.testing.assert_allclose(ours, ref, rtol=1e-7, atol=1e-10)
    assert ours.max() <= 1.0 + 1e-12 and ours.min() > 0


def test_exact_leverage_scores_refuse_large_n():
    X = _clustered(300, 0)
    with kgp.settings.max_exact_size(200), pytest.raises(ValueError, match="max_exact_size"):
        exact_leverage_scores(X, _rbf(1.0), 1e-3)


def test_estimator_with_all_columns_and_identity_weights_is_exact():
    # BLESS eq. 4: J = [n], A = I gives l~ = l exactly.
    X = _clustered(300, 1)
    lam = 1e-3 / 300
    exact = exact_leverage_scores(X, _rbf(1.0), lam)
    est = estimate_leverage_scores(X, _rbf(1.0), lam, torch.arange(300), torch.ones(300, dtype=torch.float64))
    torch.testing.assert_close(est, exact, rtol=1e-6, atol=1e-9)


def test_estimator_uniform_columns_with_A_equal_M_over_n_is_unbiased_in_the_median():
    # The A normalisation for uniform J without replacement is (M/n) I (digest sec. 2.1).
    n, m = 1500, 400
    X = _clustered(n, 2)
    lam = 1e-1 / n
    g = torch.Generator().manual_seed(0)
    J = torch.randperm(n, generator=g)[:m]
    est = estimate_leverage_scores(X, _rbf(1.0), lam, J, torch.full((m,), m / n, dtype=torch.float64))
    ratio = (est / exact_leverage_scores(X, _rbf(1.0), lam)).numpy()
    assert 0.85 < np.median(ratio) < 1.25
    # A = I instead (unnormalised) over-regularises K_JJ by n/M and biases the scores up
    est_bad = estimate_leverage_scores(X, _rbf(1.0), lam, J, torch.ones(m, dtype=torch.float64))
    assert np.median((est_bad / exact_leverage_scores(X, _rbf(1.0), lam)).numpy()) > 1.5


# ---------------------------------------------------------------------------------------------- accuracy
def _accuracy(fn, X, kernel, lam, seed, **kw):
    res = fn(X, kernel, lam, generator=seed, **kw)
    exact = exact_leverage_scores(X, kernel, lam)
    est = estimate_leverage_scores(X, kernel, lam, res.indices, res.a)
    ratio = (est / exact).numpy()
    return res, exact, ratio


@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_scores_and_deff_accurate_on_synthetic(name):
    n, t = 2000, 1.0
    X = _clustered(n, 3)
    kernel = _rbf(1.0)
    lam = 1e-2 / n
    res, exact, ratio = _accuracy(ALGOS[name], X, kernel, lam, seed=0, t=t)
    inside = ((ratio >= 1 / (1 + t)) & (ratio <= 1 + t)).mean()
    # Thm. 1 (a) bounds all points with the theoretical q2 (~hundreds); with the practical default the
    # paper's Fig. 1 shows 5th / 95th percentiles of 0.57 / 2.03 (BLESS) and 0.73 / 1.50 (BLESS-R).
    assert inside >= 0.85, f"only {inside:.3f} of the scores are within [1/(1+t), 1+t]"
    q10, q50, q90 = np.quantile(ratio, [0.1, 0.5, 0.9])
    # BLESS (with replacement) overestimates slightly more: its Fig. 1 95th percentile is 2.03
    upper = 1 + t if name == "bless-r" else 2.25
    assert 1 / (1 + t) <= q10 and q90 <= upper and 0.85 <= q50 <= 1.3, (q10, q50, q90)
    d_eff = float(exact.sum())
    assert 0.5 <= res.d_eff / d_eff <= 2.0, (res.d_eff, d_eff)
    # the scores reported for the selected centers (the ones they were sampled with)
    sel = (res.leverage_scores / exact[res.indices]).numpy()
    assert 1 / (1 + t) <= np.median(sel) <= 1 + t


def test_more_oversampling_tightens_accuracy():
    n = 1500
    X = _clustered(n, 4)
    kernel = _rbf(1.0)
    lam = 1e-2 / n
    _, _, loose = _accuracy(bless_r, X, kernel, lam, seed=1, q2=2.0)
    _, _, tight = _accuracy(bless_r, X, kernel, lam, seed=1, q2=8.0)
    out = lambda r: ((r < 0.5) | (r > 2.0)).mean()  # noqa: E731
    assert out(tight) < out(loose)
    assert out(tight) <= 0.02


@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_scores_and_deff_accurate_on_real_data(name):
    X, _ = _load_uci("airfoil")  # n = 1503, d = 5
    kernel = _rbf(math.sqrt(X.shape[1]) / 2)
    n = X.shape[0]
    lam = 1e-1 / n
    res, exact, ratio = _accuracy(ALGOS[name], X, kernel, lam, seed=0)
    q10, q50, q90 = np.quantile(ratio, [0.1, 0.5, 0.9])
    upper = 2.0 if name == "bless-r" else 2.25  # as in the synthetic test
    assert 0.5 <= q10 and q90 <= upper and 0.85 <= q50 <= 1.3, (q10, q50, q90)
    assert 0.5 <= res.d_eff / float(exact.sum()) <= 2.0


@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_number_of_centers_scales_like_deff(name):
    n = 1500
    X = _clustered(n, 5, d=3)
    kernel = _rbf(1.0)
    q2 = 3.0
    d_effs, ms = [], []
    for noise in (10.0, 1.0, 1e-1, 1e-2):
        lam = noise / n
        d_eff = float(exact_leverage_scores(X, kernel, lam).sum())
        res = ALGOS[name](X, kernel, lam, generator=0, q2=q2)
        d_effs.append(d_eff)
        ms.append(res.indices.numel())
        # Thm. 1 (b): |J_H| <= q2 d_eff; duplicates (BLESS) make it smaller, not larger
        assert 0.3 * q2 * d_eff <= ms[-1] <= 1.5 * q2 * d_eff, (noise, ms[-1], d_eff)
    assert d_effs[-1] / d_effs[0] > 4  # the sweep really moves d_eff
    slope = np.polyfit(np.log(d_effs), np.log(ms), 1)[0]
    assert 0.7 <= slope <= 1.3, slope


# ---------------------------------------------------------------------------------------------- selector API
@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_selector_plugin_output_and_reproducibility(name):
    assert name in kgp.registry.registry.names("selector")
    selector = kgp.get_selector(name)
    X = _clustered(800, 6).to(torch.float32)
    options = kgp.resolve_options(f"selector {name!r}", selector)

    def run(seed, n_centers=None):
        req = SelectionRequest(
            X=X,
            n_centers=n_centers,
            kernel=_rbf(1.0, torch.float32),
            noise=1e-2,
            generator=torch.Generator().manual_seed(seed),
            options=options,
        )
        return selector.select(req)

    c = run(0)
    m = c.points.shape[0]
    assert c.points.dtype == torch.float32 and c.weights.dtype == torch.float32
    torch.testing.assert_close(c.points, X[c.indices])
    assert c.indices.unique().numel() == m
    assert torch.isfinite(c.weights).all() and (c.weights > 0).all()
    assert set(c.info) >= {"leverage_scores", "d_eff", "lambda_path"}
    assert c.info["leverage_scores"].shape == (m,)
    assert math.isclose(c.info["lambda_path"][-1], 1e-2 / 800, rel_tol=1e-12)
    assert all(a > b for a, b in zip(c.info["lambda_path"], c.info["lambda_path"][1:]))
    # D = sqrt((M/n) / A) (FALKON App. A Def. 2 with our duplicate rule)
    torch.testing.assert_close(c.weights, torch.sqrt((m / 800) / c.info["a"]))
    again = run(0)
    assert torch.equal(again.indices, c.indices) and torch.equal(again.weights, c.weights)
    assert not torch.equal(run(1).indices, c.indices)
    for k in (37, 200):
        fixed = run(0, n_centers=k)
        assert fixed.points.shape[0] == k and fixed.indices.unique().numel() == k


@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_early_stop_returns_requested_centers_at_a_larger_lambda(name):
    X = _clustered(1000, 7)
    lam = 1e-3 / 1000
    res = ALGOS[name](X, _rbf(1.0), lam, n_centers=60, early_stop=True, generator=0)
    assert res.indices.numel() == 60
    assert res.lambda_path[-1] > lam  # stopped where q2 d_eff(lambda_h) reached 60
    full = ALGOS[name](X, _rbf(1.0), lam, n_centers=60, early_stop=False, generator=0)
    assert full.indices.numel() == 60 and math.isclose(full.lambda_path[-1], lam)


def test_center_weights_reduce_to_identity_for_uniform_sampling():
    n, m = 1000, 50
    torch.testing.assert_close(
        center_weights(torch.full((m,), m / n, dtype=torch.float64), n), torch.ones(m, dtype=torch.float64)
    )


def test_weights_give_unbiased_estimate_of_KnM_T_KnM():
    # (n/M) K_{:,J} D^2 K_{J,:} estimates K^T K = sum_i k_i k_i^T (FALKON App. A: why D appears).
    n = 400
    X = _clustered(n, 8)
    kernel = _rbf(1.0)
    K = kernel(X).to_dense().detach()
    v = torch.randn(n, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    target = torch.linalg.matrix_norm(K @ v) ** 2
    for fn in (bless, bless_r):
        est = []
        for seed in range(20):
            r = fn(X, kernel, 1e-2 / n, generator=seed)
            kj = K[r.indices] @ v  # M x 4
            est.append(((n / r.indices.numel()) * (r.weights[:, None] ** 2 * kj**2).sum()).item())
        assert abs(np.mean(est) / target.item() - 1) < 0.15, (fn.__name__, np.mean(est) / target.item())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"q": 1.0}, r"bless\(\) option 'q': expected a finite number > 1, got 1.0"),
        ({"q2": -1.0}, r"bless\(\) option 'q2': expected a finite number > 0, got -1.0"),
        ({"t": 0}, r"bless\(\) option 't': expected a finite number > 0, got 0"),
        ({"linalg_dtype": "half"}, r"bless\(\) option 'linalg_dtype': expected one of 'float64', 'input', got 'half'"),
        ({"early_stop": "no"}, r"bless\(\) option 'early_stop': expected True or False, got 'no'"),
        ({"n_centers": 0}, "n_centers"),
        ({"n_centers": 10_000}, "n_centers"),
    ],
)
def test_bad_options_raise_naming_the_argument(kwargs, match):
    X = _clustered(100, 0)
    with pytest.raises(ValueError, match=match):
        bless(X, _rbf(1.0), 1e-3, **kwargs)


def test_bad_inputs_raise():
    X = _clustered(100, 0)
    with pytest.raises(TypeError, match="X"):
        bless(X.numpy(), _rbf(1.0), 1e-3)
    with pytest.raises(TypeError, match="kernel"):
        bless_r(X, "rbf", 1e-3)
    with pytest.raises(ValueError, match="lam"):
        bless_r(X, _rbf(1.0), -1.0)
    with pytest.raises(ValueError, match=r"bless_r\(\) option 'score_lambda': expected one of 'current', 'previous'"):
        bless_r(X, _rbf(1.0), 1e-3, score_lambda="next")
    with pytest.raises(ValueError, match=r"estimate_leverage_scores\(\) option 'linalg_dtype'"):
        estimate_leverage_scores(X, _rbf(1.0), 1e-3, torch.arange(3), torch.ones(3), linalg_dtype="half")
    with pytest.raises(ValueError, match="unknown option"):
        kgp.KernelRegressor(solver="falkon", centers="bless", selector_options={"q3": 1}).fit(X, X[:, 0])


@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_selector_options_are_the_functions_keyword_defaults(name):
    # the selector declares the function's keyword arguments with the function's defaults (plain
    # Option tables in options.py; this keeps them from drifting apart)
    import inspect

    fn = ALGOS[name]
    defaults = kgp.get_selector(name).option_defaults
    params = inspect.signature(fn).parameters
    expected = {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY} | {"lam": None}
    del expected["n_centers"], expected["generator"], expected["shard"]  # from the request, not options
    assert {k: opt.default for k, opt in defaults.items()} == expected
    assert all(isinstance(opt, kgp.Option) and opt.help for opt in defaults.values())
    assert params["early_stop"].default is True  # "stop the lambda path at the requested n_centers by default"
    assert set(expected) == {"lam", "q", "t", "q2", "early_stop", "linalg_dtype"} | (
        {"q1"} if name == "bless" else {"score_lambda"}
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"q": 1}, "option 'q': expected a finite number > 1, got 1"),
        ({"lam": 0.0}, "option 'lam': expected a finite number > 0 or None, got 0.0"),
        ({"early_stop": 1}, "option 'early_stop': expected True or False, got 1"),
        ({"linalg_dtype": "float32"}, "option 'linalg_dtype': expected one of 'float64', 'input', got 'float32'"),
    ],
)
@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_selector_options_are_checked_in_kgps_format(name, options, message):
    X = _clustered(60, 0)
    with pytest.raises(InvalidOptionError, match=f"selector '{name}' {message}"):
        kgp.KernelRegressor(solver="falkon", centers=name, selector_options=options).fit(X, X[:, 0])
    # resolved for a direct select() the same way
    with pytest.raises(InvalidOptionError, match=f"selector '{name}' {message}"):
        kgp.resolve_options(f"selector '{name}'", kgp.get_selector(name), options)


def test_selector_defaults_stop_early_like_the_function_defaults():
    X = _clustered(600, 7).float()
    selector = kgp.get_selector("bless")
    req = SelectionRequest(
        X=X,
        n_centers=40,
        kernel=_rbf(1.0, torch.float32),
        noise=1e-3,
        generator=torch.Generator().manual_seed(3),
        options=kgp.resolve_options("selector 'bless'", selector),  # the defaults, as the model passes them
    )
    c = selector.select(req)
    res = bless(X, _rbf(1.0, torch.float32), 1e-3 / 600, n_centers=40, generator=3)
    assert torch.equal(c.indices, res.indices) and torch.equal(c.weights, res.weights)
    assert res.lambda_path[-1] > 1e-3 / 600


def test_estimator_reports_a_nan_dictionary_as_not_psd():
    # W = A^-1/2 K_JJ A^-1/2 + lam n I is factorised by kgp.linalg.psd_cholesky: NaN raises NotPSDError
    # naming the matrix (the hand-written jitter loop it replaced never ended on NaN)
    X = _clustered(50, 0)
    a = torch.ones(5, dtype=torch.float64)
    a[2] = float("nan")
    with pytest.raises(NotPSDError, match=r"BLESS's W = A\^-1/2 K_JJ A\^-1/2 \+ lambda n I contains NaN"):
        estimate_leverage_scores(X, _rbf(1.0), 1e-3, torch.arange(5), a)


def test_docs_options_table_matches_declarations():
    from kgp.options import describe_options

    page = (Path(__file__).resolve().parents[1] / "docs" / "selectors" / "bless.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2])
    declared = {}
    for name in ("bless", "bless-r"):
        for option, default, expected, _ in describe_options(kgp.get_selector(name).option_defaults):
            declared[option] = (default.replace("'", '"'), expected)
    assert rows == declared


def test_previous_lambda_variant_of_bless_r_is_accurate():
    n = 1500
    X = _clustered(n, 9)
    lam = 1e-2 / n
    res, exact, ratio = _accuracy(bless_r, X, _rbf(1.0), lam, seed=0, score_lambda="previous")
    assert 0.5 <= np.quantile(ratio, 0.1) and np.quantile(ratio, 0.9) <= 2.0
    assert 0.5 <= res.d_eff / float(exact.sum()) <= 2.0


@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_float32_input_gives_float32_output_and_accurate_scores(name):
    n = 1000
    X = _clustered(n, 14)
    lam = 1e-2 / n
    res32 = ALGOS[name](X.float(), _rbf(1.0, torch.float32), lam, generator=0)
    assert res32.weights.dtype == torch.float32 and res32.leverage_scores.dtype == torch.float32
    exact = exact_leverage_scores(X, _rbf(1.0), lam)
    est = estimate_leverage_scores(X, _rbf(1.0), lam, res32.indices, res32.a.double())
    ratio = (est / exact).numpy()
    assert ((ratio >= 0.5) & (ratio <= 2.0)).mean() >= 0.8
    assert 0.85 <= np.median(ratio) <= 1.3


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["bless", "bless-r"])
def test_cuda_inputs_stay_on_device_and_match_cpu_accuracy(name):
    n = 1500
    X = _clustered(n, 15)
    lam = 1e-2 / n
    res = ALGOS[name](X.cuda(), _rbf(1.0).cuda(), lam, generator=0)
    assert res.indices.is_cuda and res.weights.is_cuda and res.leverage_scores.is_cuda
    exact = exact_leverage_scores(X, _rbf(1.0), lam)
    est = estimate_leverage_scores(X, _rbf(1.0), lam, res.indices.cpu(), res.a.cpu())
    assert 0.5 <= np.quantile((est / exact).numpy(), 0.1)
    assert 0.5 <= res.d_eff / float(exact.sum()) <= 2.0


# ---------------------------------------------------------------------------------------------- weighted Nystrom
def _dense_nystrom(X, y, Z, kernel, noise, weights=None):
    """float64 oracle: alpha = D beta with (D K_nM^T K_nM D + noise D K_MM D) beta = D K_nM^T y."""
    X, y, Z = X.double(), y.double().reshape(-1, 1), Z.double()
    knm = kernel(X, Z).to_dense().detach()
    kmm = kernel(Z, Z).to_dense().detach()
    d = torch.ones(Z.shape[0], dtype=torch.float64) if weights is None else weights.double()
    H = d[:, None] * (knm.T @ knm + noise * kmm) * d[None, :]
    rhs = d[:, None] * (knm.T @ y)
    beta = torch.linalg.lstsq(H, rhs, driver="gelsd").solution
    return d[:, None] * beta


def test_weighted_nystrom_solution_does_not_depend_on_D():
    # FALKON App. A: D only rescales the basis; the weighted estimator equals plain Nystrom.
    n = 600
    X = _clustered(n, 10)
    y = torch.sin(X[:, 0]) + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kernel = _rbf(1.0)
    # M = 150 keeps cond(H) ~ 1e8, so that the float64 oracle itself is accurate to ~1e-10
    res = bless(X, kernel, 1e-2 / n, n_centers=150, early_stop=False, generator=0)
    Z = X[res.indices]
    a_w = _dense_nystrom(X, y, Z, kernel, 1e-2, res.weights)
    a_0 = _dense_nystrom(X, y, Z, kernel, 1e-2)
    Xt = _clustered(200, 11)
    kt = kernel(Xt, Z).to_dense().detach()
    torch.testing.assert_close(kt @ a_w, kt @ a_0, rtol=1e-6, atol=1e-8)
    assert not torch.allclose(res.weights, torch.ones_like(res.weights))  # the weights are not trivial


def _falkon_available() -> bool:
    return "falkon" in kgp.registry.registry.names("solver")


@pytest.mark.parametrize("centers", ["bless", "bless-r"])
def test_falkon_with_bless_centers_equals_dense_weighted_nystrom(centers):
    if not _falkon_available():
        pytest.skip("solver 'falkon' is not registered yet (plugin written separately)")
    n = 1000
    X = _clustered(n, 12)
    y = torch.sin(2 * X[:, 0]) * torch.cos(X[:, 1]) + 0.05 * torch.randn(
        n, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    noise = 1e-2
    model = kgp.KernelRegressor(
        kernel="rbf",
        lengthscale=1.0,
        noise=noise,
        solver="falkon",
        centers=centers,
        n_centers=150,  # cond(H) ~ 1e8: the dense float64 oracle is accurate to ~1e-10 (not at M ~ 500)
        random_state=0,
        solver_options={"maxiter": 100, "tol": 1e-12},
    ).fit(X, y)
    assert model.center_weights_ is not None and not torch.allclose(
        model.center_weights_, torch.ones(1, dtype=torch.float64)
    )
    alpha = _dense_nystrom(X, y, model.centers_, model.kernel_, noise, model.center_weights_)
    Xt = _clustered(300, 13)
    ref = (model.kernel_(Xt, model.centers_).to_dense().detach() @ alpha).squeeze(1)
    pred = model.predict(Xt)
    err = torch.linalg.norm(pred - ref) / torch.linalg.norm(ref)
    assert err < 1e-6, float(err)


# ---------------------------------------------------------------------------------------------- paper claim
def _nonuniform_problem(seed: int, n: int = 3000, n_test: int = 2000):
    """95% of the inputs in a tight blob where f is flat; 5% spread over [-4, 4]^2 where f varies.

    The test distribution weighs both parts equally, so the sparse region (where uniform sampling
    puts ~5% of its centers) carries the error.
    """
    g = torch.Generator().manual_seed(seed)

    def f(x):
        return torch.sin(1.5 * x[:, 0]) * torch.cos(1.5 * x[:, 1])

    dense = int(0.95 * n)
    X = torch.cat([0.1 * torch.randn(dense, 2, generator=g), 8 * torch.rand(n - dense, 2, generator=g) - 4]).double()
    y = f(X) + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    half = n_test // 2
    Xt = torch.cat(
        [0.1 * torch.randn(half, 2, generator=g), 8 * torch.rand(n_test - half, 2, generator=g) - 4]
    ).double()
    return X, y, Xt, f(Xt)


def _test_mse(solver: str, centers: str, seed: int, m: int) -> float:
    X, y, Xt, yt = _nonuniform_problem(seed)
    opts = {"maxiter": 30} if solver == "falkon" else None
    if solver == "dense":
        sel = kgp.get_selector(centers)
        req = SelectionRequest(
            X=X,
            n_centers=m,
            kernel=_rbf(0.7),
            noise=1e-3,
            generator=torch.Generator().manual_seed(seed),
            options=kgp.resolve_options(f"selector {centers!r}", sel),
        )
        c = sel.select(req)
        alpha = _dense_nystrom(X, y, c.points, _rbf(0.7), 1e-3)
        pred = (_rbf(0.7)(Xt, c.points).to_dense().detach() @ alpha).squeeze(1)
    else:
        model = kgp.KernelRegressor(
            kernel="rbf",
            lengthscale=0.7,
            noise=1e-3,
            solver=solver,
            centers=centers,
            n_centers=m,
            random_state=seed,
            solver_options=opts,
        ).fit(X, y)
        pred = model.predict(Xt)
    return float(((pred - yt) ** 2).mean())


@pytest.mark.parametrize("centers", ["bless", "bless-r"])
def test_bless_beats_uniform_on_nonuniform_density_dense_nystrom(centers):
    # The Nystrom estimator FALKON converges to, solved densely: isolates the effect of the centers.
    m, seeds = 60, range(5)
    lev = np.mean([_test_mse("dense", centers, s, m) for s in seeds])
    uni = np.mean([_test_mse("dense", "uniform", s, m) for s in seeds])
    assert lev < 0.5 * uni, (lev, uni)


@pytest.mark.parametrize("centers", ["bless", "bless-r"])
def test_falkon_bless_beats_falkon_uniform_on_nonuniform_density(centers):
    if not _falkon_available():
        pytest.skip("solver 'falkon' is not registered yet (plugin written separately)")
    m, seeds = 60, range(5)
    lev = np.mean([_test_mse("falkon", centers, s, m) for s in seeds])
    uni = np.mean([_test_mse("falkon", "uniform", s, m) for s in seeds])
    assert lev < 0.5 * uni, (lev, uni)


def test_scores_with_tiny_kernel_values_match_the_unflushed_formula():
    # short lengthscales: most kernel values lie far below 1e-150 and their products in BLESS's Cholesky and
    # solves are subnormal (30-50x slower on Intel hosts: UCI parkinsons, 75 s -> 5.5 s). They are set to 0
    # (kgp.linalg.tiny_fraction); the scores must stay those of eq. 3 computed densely without it.
    g = torch.Generator().manual_seed(7)
    X = torch.randn(400, 4, generator=g, dtype=torch.float64)
    kernel = _rbf(0.1)
    K = kgp.kernel_operator(kernel, X).to_dense().detach()
    tiny = kgp.linalg.tiny_fraction(torch.float64)
    assert ((K > 0) & (K < tiny)).double().mean() > 0.25  # the case the flush is for (34% here)
    lam = 1e-3
    J = torch.arange(0, 400, 2)
    a = torch.full((200,), 0.5, dtype=torch.float64)
    est = estimate_leverage_scores(X, kernel, lam, J, a)
    # eq. 3, dense float64: (lam n)^-1 (K_ii - K_Ji^T (K_JJ + lam n A)^-1 K_Ji), clipped as the estimator
    lam_n = lam * 400
    quad = (K[J] * torch.linalg.solve(K[J][:, J] + lam_n * torch.diag(a), K[J])).sum(0)
    expected = ((K.diagonal() - quad).clamp_min(0) / lam_n).clamp_max(1.0)
    # W = A^-1/2 K_JJ A^-1/2 + lam n I has eigenvalues in [lam n, lam n + 2 max K]: cond <= 1 + 2 / 0.4
    torch.testing.assert_close(est, expected, rtol=1e-10, atol=1e-12)
    from kgp_builtins.bless.scores import ScoreEstimator

    with torch.no_grad():  # as bless() and estimate_leverage_scores() call it
        factor = ScoreEstimator(X, kernel, J, a, lam, torch.float64).chol
    assert not bool(((factor != 0) & (factor.abs() < tiny)).any())  # no operand of a subnormal product
