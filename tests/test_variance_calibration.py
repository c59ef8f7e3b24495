"""The factor on the Nystrom variance's conditional term (kgp.variance.calibration).

Checked: the estimator against its defining equation and against residuals drawn from a known variance; the
scaled variance and covariance against a dense oracle written here (``g d + t``, ``G^{1/2} D G^{1/2} + T``);
far rows keep the prior; a fit with many rows per center measures c < 1 and its test coverage moves towards
the nominal 95 %; few rows per center keep c = 1; the factor survives a model file, and a bad stored value is
refused naming the entry; two gloo ranks measure the one process's factor."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import kgp
from kgp.posterior_checks import PosteriorStateError
from kgp.variance import latent_covariance, latent_variance
from kgp.variance.base import variance_terms
from kgp.variance.calibration import (
    CALIBRATION_ROWS,
    Z_SE,
    calibration_subset,
    conditional_scale,
    estimate_calibration,
    split_terms,
)

NOISE = 0.01


def _draw(m: int, c_true: float, seed: int = 0):
    """Per-row terms a, b and squared residuals whose variance is ``NOISE + c_true a + b``."""
    g = torch.Generator().manual_seed(seed)
    a = 0.05 * torch.rand(m, generator=g, dtype=torch.float64) ** 2
    b = 1e-4 * torch.rand(m, generator=g, dtype=torch.float64)
    r = torch.randn(m, generator=g, dtype=torch.float64) * (NOISE + c_true * a + b).sqrt()
    return r.square(), a, b


def _mean_square_z(r2, a, b, c):
    return float((r2 / (NOISE + c * a + b)).mean())


def test_the_estimate_solves_its_equation():
    r2, a, b = _draw(20_000, 0.6)
    n, m_centers = 10**7, 10_000
    c = estimate_calibration(r2, a, b, NOISE, n, m_centers)
    z2 = r2 / (NOISE + a + b)
    target = 1 - 2 * m_centers / n - Z_SE * float(z2.std()) / math.sqrt(r2.numel())
    assert 0 < c < 1
    assert _mean_square_z(r2, a, b, c) == pytest.approx(target, abs=1e-7)


def test_the_estimate_recovers_a_known_factor_within_its_standard_error():
    # 200,000 rows: the standardised residuals' mean square has standard error sqrt(2 / m) = 0.0032; the
    # estimate aims Z_SE of them low, so c lands above the truth, by about Z_SE * 0.0032 / |d mean z^2 / dc|
    r2, a, b = _draw(200_000, 0.5, seed=1)
    c = estimate_calibration(r2, a, b, NOISE, 10**9, 1)
    slope = (_mean_square_z(r2, a, b, 0.45) - _mean_square_z(r2, a, b, 0.55)) / 0.1
    shift = 2 * Z_SE * math.sqrt(2 / r2.numel()) / slope
    assert 0.5 - shift < c < 0.5 + 2 * shift


def test_residuals_at_least_as_large_as_the_variance_keep_the_formula():
    r2, a, b = _draw(20_000, 1.5, seed=2)
    assert estimate_calibration(r2, a, b, NOISE, 10**7, 100) == 1.0


def test_residuals_the_noise_alone_covers_give_zero():
    _, a, b = _draw(1_000, 0.0, seed=3)
    assert estimate_calibration(torch.zeros(1_000, dtype=torch.float64), a, b, NOISE, 10**7, 100) == 0.0


def test_few_rows_per_center_keep_the_formula():
    # with n <= 2 M the optimism bound alone puts the target at or below 0: no residual can ask for less
    r2, a, b = _draw(5_000, 0.1, seed=4)
    assert estimate_calibration(r2, a, b, NOISE, 5_000, 2_500) == 1.0
    assert estimate_calibration(r2[:1], a[:1], b[:1], NOISE, 10**7, 1) == 1.0


def test_the_row_draw_is_fixed_and_uniform():
    assert torch.equal(calibration_subset(10), torch.arange(10))
    drawn = calibration_subset(10**6)
    assert drawn.numel() == CALIBRATION_ROWS and torch.equal(drawn, calibration_subset(10**6))
    assert bool((drawn[1:] > drawn[:-1]).all()) and int(drawn.max()) < 10**6


def test_the_scale_is_c_where_the_centers_represent_f_and_one_where_they_do_not():
    prior = torch.tensor([2.0, 2.0, 2.0, 2.0, 0.0], dtype=torch.float64)
    conditional = torch.tensor([0.0, 1.0, 2.0, -1e-17, 0.0], dtype=torch.float64)
    g = conditional_scale(prior, conditional, 0.3)
    torch.testing.assert_close(g, torch.tensor([0.3, 0.65, 1.0, 0.3, 1.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.equal(conditional_scale(prior, conditional, 1.0), torch.ones(5, dtype=torch.float64))
    a, b = split_terms(prior[:3], conditional[:3], torch.full((3,), 0.1, dtype=torch.float64))
    # a + b is the unscaled variance d + t, and c a + b the scaled one g d + t
    torch.testing.assert_close(a + b, conditional[:3] + 0.1)
    torch.testing.assert_close(0.3 * a + b, g[:3] * conditional[:3] + 0.1)


# ---------------------------------------------------------------------- the scaled variance against a dense oracle
def _nystrom_model(n=3_000, m=30, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    y = np.sin(2 * X[:, 0]) * np.cos(X[:, 1]) + 0.1 * rng.normal(size=n)
    return kgp.KernelRegressor("rbf", lengthscale=0.7, noise=NOISE, solver="falkon", n_centers=m, random_state=0).fit(
        X, y
    )


def _oracle_terms(model, xq):
    v = model.posterior_.variance
    v.build()
    kernel, Z, Xs = v.kernel, v.centers, v.train_X
    with torch.no_grad():
        Kmm = kernel(Z, Z).to_dense()
        Kmn = kernel(Z, Xs).to_dense()
        S = Kmn @ Kmn.T + v.noise * Kmm
        kq = kernel(Z, xq).to_dense()
        Kqq = kernel(xq, xq).to_dense()
        D = Kqq - kq.T @ torch.linalg.solve(Kmm, kq)
        T = v.noise * kq.T @ torch.linalg.solve(S, kq)
    return Kqq.diagonal(), D, T


def test_the_scaled_variance_and_covariance_equal_the_oracle():
    model = _nystrom_model()
    xq = torch.as_tensor(np.random.default_rng(5).normal(size=(40, 2)) * 1.5)
    xq[-3:] += 40.0  # far rows: the centers represent nothing there
    prior, D, T = _oracle_terms(model, xq)
    c = 0.35
    g = c + (1 - c) * (D.diagonal().clamp_min(0) / prior).clamp(0, 1)
    var = latent_variance(model.kernel_, xq, model.posterior_.variance.factors, calibration=c)
    cov = latent_covariance(model.kernel_, xq, model.posterior_.variance.factors, calibration=c)
    eps = torch.finfo(torch.float64).eps
    # K_MM's condition number here is below 1e7: a few 1e-9 of the prior at most
    tol = 1e7 * eps * float(prior.max())
    torch.testing.assert_close(var, (g * D.diagonal() + T.diagonal()).clamp_min(0), rtol=0, atol=tol)
    oracle = g.sqrt()[:, None] * D * g.sqrt()[None, :] + T
    torch.testing.assert_close(cov, oracle, rtol=0, atol=tol)
    torch.testing.assert_close(cov.diagonal(), var, rtol=0, atol=0)
    assert float(torch.linalg.eigvalsh(cov).min()) > -tol
    # far from the data the latent variance is the prior's, calibrated or not
    torch.testing.assert_close(var[-3:], prior[-3:], rtol=1e-12, atol=0)
    # and the factor lowers the variance where the centers represent f
    assert bool((var[:-3] < latent_variance(model.kernel_, xq, model.posterior_.variance.factors)[:-3]).all())


def test_the_calibration_terms_are_the_ones_the_variance_combines():
    model = _nystrom_model()
    xq = torch.as_tensor(np.random.default_rng(6).normal(size=(25, 2)))
    model.posterior_.variance.build()
    factors = model.posterior_.variance.factors
    prior, conditional, rest = variance_terms(model.kernel_, xq, factors)
    a, b = split_terms(prior, conditional, rest)
    for c in (1.0, 0.4):
        var = latent_variance(model.kernel_, xq, factors, calibration=c)
        torch.testing.assert_close(var, (c * a + b).clamp_min(0), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------- fits
def learned_prior_fit(n, m, seed=0):
    """A learned GP (FALKON on m centers) on n rows of a d = 3 prior draw, its training rows and 20,000 test rows."""
    from kgp.datasets import PriorDraw

    draw = PriorDraw(3, seed=seed, noise_std=0.1)
    X, y = draw.sample(n)
    Xq, yq = draw.sample(20_000, split="test")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = kgp.KernelRegressor(
            "rbf",
            learn="exact",
            learn_options={"iterations": 30, "subset": 1000},
            solver="falkon",
            n_centers=m,
            random_state=0,
        ).fit(X, y)
    return model, (X, y), (Xq, yq)


def _coverage(model, Xq, yq, calibration=None):
    v = model.posterior_.variance
    kept = v.calibration
    if calibration is not None:
        v.calibration = calibration
    try:
        mean, std = model.predict(Xq, return_std=True, include_noise=True)
    finally:
        v.calibration = kept
    return float(np.mean(np.abs(yq - mean) <= 1.959964 * std))


def test_many_rows_per_center_shrink_an_overstated_variance_towards_the_nominal_coverage():
    # d = 3 prior draw, 200 rows per center: the DTC interval covers 0.978 of 20,000 test rows (measured)
    model, _, (Xq, yq) = learned_prior_fit(20_000, 100)
    c = model.posterior_.variance.calibration
    formula, calibrated = _coverage(model, Xq, yq, calibration=1.0), _coverage(model, Xq, yq)
    assert 0 < c < 1
    # the standard error of a coverage on 20,000 rows is 0.0015
    assert formula > 0.97
    assert 0.94 < calibrated < formula - 0.01


def test_few_rows_per_center_keep_the_formula_in_a_fit():
    model, _, _ = learned_prior_fit(2_000, 1_000)
    assert model.posterior_.variance.calibration == 1.0


def test_the_factor_survives_a_model_file_and_a_bad_one_is_refused(tmp_path):
    model, _, (Xq, _) = learned_prior_fit(20_000, 100)
    assert model.posterior_.variance.calibration < 1
    path = tmp_path / "m.kgp"
    model.save(path)
    loaded = kgp.load(path)
    assert loaded.posterior_.variance.calibration == model.posterior_.variance.calibration
    np.testing.assert_array_equal(
        loaded.predict(Xq[:200], return_std=True)[1], model.predict(Xq[:200], return_std=True)[1]
    )
    for bad in (1.5, -0.1, float("nan"), "0.5", True):
        state = model.posterior_.state_dict()
        state["variance"]["calibration"] = bad
        with pytest.raises(
            PosteriorStateError, match=r"posterior\.variance\.calibration: expected a factor in \[0, 1\]"
        ):
            type(model.posterior_).from_state(
                state,
                model.kernel_,
                type(model.posterior_.predictor),
                n_features=Xq.shape[1],
                n_outputs=1,
                device=torch.device("cpu"),
                dtype=torch.float64,
            )


def test_a_fit_without_learning_keeps_the_formula():
    model = _nystrom_model()
    model.predict(np.zeros((2, 2)), return_std=True)
    assert model.posterior_.variance.calibration == 1.0
