"""benchmarks/bench_large_limits.py: its "true" model is the generator's GP (scikit-learn oracle)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF

from kgp.datasets import PriorDraw

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_large_limits.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_large_limits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_the_true_model_with_every_row_as_a_center_is_the_generators_gp(bench, tmp_path):
    draw = PriorDraw(3, seed=1, noise_std=0.1)
    data = bench.bench_large.cached_data(tmp_path, 400, 3, 60, seed=1, noise=0.1)
    got = bench.fit_one(data, draw, 400, "true")
    oracle = GaussianProcessRegressor(RBF(draw.lengthscale), alpha=0.01, optimizer=None).fit(data["X"], data["y"])
    mean, std = oracle.predict(data["X_test"], return_std=True)
    want = bench.bench_large.scores(mean, np.sqrt(std**2 + 0.01), data["y_test"], 0.1)
    # FALKON on all 400 rows is the exact posterior mean up to its CG tolerance; its DTC std equals the
    # exact one in exact arithmetic, here up to the jitter the Cholesky of K_MM (400 close rows) needs
    assert got["rmse"] == pytest.approx(want["rmse"], rel=1e-4)
    assert got["nlpd"] == pytest.approx(want["nlpd"], abs=2e-3)
    assert got["noise_learned"] == pytest.approx(0.01, rel=1e-12)
