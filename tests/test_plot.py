"""kgp.plot: each figure is rendered (Agg) and its plotted data checked against numbers computed here
independently (scipy's normal quantiles, the model's own attributes, separately fitted models)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib", reason="kgp.plot needs matplotlib (the plot extra)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy.stats import norm  # noqa: E402

import kgp  # noqa: E402
import kgp.plot  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _render(ax) -> None:
    ax.figure.canvas.draw()  # the whole figure is drawn, not only built


def test_calibration_curve_matches_the_normal_quantiles():
    """Standardized errors on a grid: the coverage of each interval is the count of |z| below scipy's quantile."""
    z = np.linspace(-3.0, 3.0, 601)
    mean, std = np.full_like(z, 2.0), np.full_like(z, 0.5)
    y = mean + std * z
    levels = [0.1, 0.5, 0.9, 0.95]
    nominal, empirical = kgp.plot.calibration_curve(y, mean, std, levels)
    expected = [np.mean(np.abs(z) <= norm.ppf((1 + p) / 2)) for p in levels]
    np.testing.assert_array_equal(nominal, levels)
    np.testing.assert_allclose(empirical, expected, rtol=0, atol=1e-15)


def test_gaussian_draws_are_calibrated_and_a_halved_std_is_not():
    rng = np.random.default_rng(0)
    mean, std = rng.normal(size=20_000), rng.uniform(0.5, 2.0, size=20_000)
    y = mean + std * rng.standard_normal(20_000)
    nominal, empirical = kgp.plot.calibration_curve(y, mean, std)
    se = np.sqrt(nominal * (1 - nominal) / y.size)
    assert np.all(np.abs(empirical - nominal) < 4 * se)
    _, over_confident = kgp.plot.calibration_curve(y, mean, std / 2)
    assert np.all(over_confident < nominal - 4 * se)  # below the diagonal: the std is too small


def test_calibration_plot_of_an_exact_gp_with_its_true_hyperparameters():
    """Data drawn from the GP that is fitted: its intervals hold their nominal coverage."""
    rng = np.random.default_rng(1)
    n, noise = 700, 0.05
    X = rng.uniform(-3, 3, size=(n, 1))
    K = np.exp(-0.5 * (X - X.T) ** 2 / 0.8**2)
    f = np.linalg.cholesky(K + 1e-8 * np.eye(n)) @ rng.standard_normal(n)
    y = f + np.sqrt(noise) * rng.standard_normal(n)
    model = kgp.KernelRegressor("rbf", lengthscale=0.8, noise=noise, solver="exact").fit(X[:400], y[:400])
    ax = kgp.plot.calibration(model, X[400:], y[400:], levels=[0.5, 0.8, 0.9, 0.95])
    _render(ax)
    diagonal, curve = ax.lines[0].get_xydata(), ax.lines[1].get_xydata()
    np.testing.assert_array_equal(diagonal, [[0, 0], [1, 1]])
    mean, std = model.predict(X[400:], return_std=True, include_noise=True)
    expected = kgp.plot.calibration_curve(y[400:], mean, std, [0.5, 0.8, 0.9, 0.95])
    np.testing.assert_array_equal(curve, np.column_stack(expected))
    assert np.all(np.abs(curve[:, 1] - curve[:, 0]) < 0.1)  # 300 points: binomial sd below 0.03
    # the same figure from arrays
    ax2 = kgp.plot.calibration(y=y[400:], mean=mean, std=std, levels=[0.5, 0.8, 0.9, 0.95])
    np.testing.assert_array_equal(ax2.lines[1].get_xydata(), curve)


def test_calibration_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="std: expected positive"):
        kgp.plot.calibration_curve([1.0], [1.0], [0.0])
    with pytest.raises(ValueError, match="levels: expected coverages strictly between 0 and 1"):
        kgp.plot.calibration_curve([1.0], [1.0], [1.0], levels=[0.5, 1.0])
    with pytest.raises(ValueError, match="y, mean, std: expected one non-empty shape"):
        kgp.plot.calibration_curve([1.0, 2.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="mean: expected finite numbers"):
        kgp.plot.calibration_curve([1.0], [np.nan], [1.0])
    with pytest.raises(ValueError, match="give a fitted model with X and y, or y, mean and std"):
        kgp.plot.calibration(y=[1.0])


def test_learning_curve_plots_the_objective_of_every_step():
    rng = np.random.default_rng(2)
    X = rng.uniform(-2, 2, size=(150, 2))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.standard_normal(150)
    model = kgp.KernelRegressor("rbf", learn="exact", learn_options={"iterations": 12}).fit(X, y)
    ax = kgp.plot.learning_curve(model)
    _render(ax)
    xy = ax.lines[0].get_xydata()
    np.testing.assert_array_equal(xy[:, 0], np.arange(1, 13))
    np.testing.assert_array_equal(xy[:, 1], model.learn_history_)
    assert xy[-1, 1] < xy[0, 1]  # the learning went downhill
    with pytest.raises(ValueError, match="no learning history; fit it with learn="):
        kgp.plot.learning_curve(kgp.KernelRegressor().fit(X, y))


def test_sweep_centers_and_the_fit_vs_centers_figure():
    rng = np.random.default_rng(3)
    X = rng.uniform(-2, 2, size=(600, 2))
    y = np.sin(2 * X[:, 0]) * np.cos(X[:, 1]) + 0.05 * rng.standard_normal(600)
    base = kgp.KernelRegressor(
        "rbf", lengthscale=0.7, noise=1e-2, solver="falkon", random_state=4, solver_options={"maxiter": 50}
    )
    sizes = [80, 5, 20]
    results = kgp.plot.sweep_centers(base, X[:500], y[:500], X[500:], y[500:], sizes)
    assert not hasattr(base, "predictor_")  # the template itself is not fitted
    assert [r["n_centers"] for r in results] == sizes
    for r in results:  # each entry is the fit of that M, redone here independently
        model = kgp.KernelRegressor(
            "rbf", lengthscale=0.7, noise=1e-2, solver="falkon", random_state=4, solver_options={"maxiter": 50}
        )
        model.set_params(n_centers=r["n_centers"]).fit(X[:500], y[:500])
        rmse = float(np.sqrt(np.mean((model.predict(X[500:]) - y[500:]) ** 2)))
        assert r["rmse"] == pytest.approx(rmse, rel=1e-12) and r["fit_time"] > 0
    by_m = {r["n_centers"]: r["rmse"] for r in results}
    assert by_m[80] < by_m[20] < by_m[5]  # more centers, smaller error on this smooth function

    left, right = kgp.plot.fit_vs_centers(results)
    _render(left)
    ordered = sorted(results, key=lambda r: r["n_centers"])
    np.testing.assert_array_equal(left.lines[0].get_xydata(), [[r["n_centers"], r["rmse"]] for r in ordered])
    np.testing.assert_array_equal(right.lines[0].get_xydata(), [[r["n_centers"], r["fit_time"]] for r in ordered])
    assert left.get_xscale() == "log" and right.get_ylabel() == "fit time (s)"
    with pytest.raises(ValueError, match="results: every entry needs 'fit_time'"):
        kgp.plot.fit_vs_centers([{"n_centers": 5, "rmse": 1.0}])


def test_without_matplotlib_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # an import of it now fails
    with pytest.raises(
        ImportError, match=r'kgp\.plot needs matplotlib: install the extra with pip install "kgp\[plot\]"'
    ):
        kgp.plot.calibration(y=[1.0, 2.0], mean=[1.0, 2.0], std=[1.0, 1.0])
    # the numbers need no matplotlib
    assert kgp.plot.calibration_curve([0.0, 3.0], [0.0, 0.0], [1.0, 1.0], levels=[0.5])[1].tolist() == [0.5]
