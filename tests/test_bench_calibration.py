"""benchmarks/bench_calibration.py: the scores against closed forms, and one run on a small saved GP."""

from __future__ import annotations

import math

import numpy as np
import pytest
from benchmark_scripts import benchmark_module

import kgp
from kgp.datasets import PriorDraw


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("bench_calibration") as module:
        yield module


def test_scores_of_a_calibrated_and_a_doubled_std(bench):
    """Residuals drawn with the predicted std: each coverage within 4 standard errors of its level and E[z^2] near 1;
    the same residuals scored against twice that std: E[z^2] near 1/4, and the rescaled 95% coverage back at 0.95."""
    rng = np.random.default_rng(0)
    n = 200_000
    mean, std = rng.standard_normal(n), np.exp(rng.uniform(-2, 0, n))
    y = mean + std * rng.standard_normal(n)
    calibrated = bench.scores(y, mean, std)
    for name, level in (("68%", 0.68), ("95%", 0.95), ("99%", 0.99)):
        assert abs(calibrated[name] - level) < 4 * math.sqrt(level * (1 - level) / n), (name, calibrated[name])
    assert abs(calibrated["E[z^2]"] - 1) < 4 * math.sqrt(2 / n)
    expected_nlpd = np.mean(0.5 * np.log(2 * math.pi * std**2)) + 0.5  # E[z^2] = 1
    assert abs(calibrated["nlpd"] - expected_nlpd) < 4 * math.sqrt(0.5 / n)
    wide = bench.scores(y, mean, 2 * std)
    assert abs(wide["E[z^2]"] - 0.25) < 4 * 0.25 * math.sqrt(2 / n)
    assert wide["95%"] > 0.999  # the 95% interval of a doubled std holds |z| < 3.92
    assert abs(wide["95% rescaled"] - 0.95) < 4 * math.sqrt(0.95 * 0.05 / n)


def test_a_saved_model_scored_on_fresh_test_rows(bench, tmp_path, capsys):
    X, y = PriorDraw(2, seed=0, noise_std=0.1).sample(400)
    model = kgp.KernelRegressor("rbf", lengthscale=1.0, noise=0.01, solver="exact").fit(X, y)
    path = tmp_path / "gp.kgp"
    model.save(path)
    results = bench.main([str(path), "--d", "2", "--rows", "12000"])
    assert set(results) == {"all 12,000 rows", "first 10,000 rows"}
    full = results["all 12,000 rows"]
    # the same rows predicted here, independently of the script
    Xt, yt = PriorDraw(2, seed=0, noise_std=0.1).sample(12_000, split="test")
    mean, std = model.predict(Xt, return_std=True, include_noise=True)
    z = (yt - np.asarray(mean)) / np.asarray(std)
    assert full["95%"] == pytest.approx(float(np.mean(np.abs(z) <= 1.959964)), abs=1e-12)
    assert full["E[z^2]"] == pytest.approx(float(np.mean(z**2)), rel=1e-9)
    assert "| all 12,000 rows |" in capsys.readouterr().out


def test_the_factor_measured_on_a_saved_model_is_the_one_its_fit_measured(bench, tmp_path, capsys):
    """``--train``: the factor the script measures on a model saved without it equals the fit's own step on the
    same rows (same draw of rows, same residuals up to the order of the sums), and both stds are scored."""
    from test_variance_calibration import learned_prior_fit

    model, (X, y), _ = learned_prior_fit(20_000, 100)
    fitted = model.posterior_.variance.calibration
    assert 0 < fitted < 1  # the step ran and measured something (the test's data: 200 rows per center)
    model.posterior_.variance.calibration = 1.0  # as saved before the step existed
    path = tmp_path / "gp.kgp"
    model.save(path)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    results = bench.main(
        [str(path), "--d", "3", "--rows", "3000", "--train", str(tmp_path / "X.npy"), str(tmp_path / "y.npy")]
    )
    (measured_label,) = [k for k in results if k.startswith("factor")]
    measured = float(measured_label.split()[1].rstrip(","))
    assert measured == pytest.approx(fitted, abs=1e-4)  # printed to 4 digits
    formula = results["formula, all 3,000 rows"]
    assert formula["95%"] > results[measured_label]["95%"]  # the factor narrows the intervals
    assert "| formula, all 3,000 rows |" in capsys.readouterr().out
