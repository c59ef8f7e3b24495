"""benchmarks/bench_eigenpro4_large.py at tiny sizes: the data it reads, every fit, the table and the JSON lines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import benchmark_module

from kgp.datasets import PriorDraw

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_eigenpro4_large.py"


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("bench_eigenpro4_large") as module:
        yield module


def test_cached_rows_are_the_first_rows_of_the_smallest_set_that_holds_them(bench, tmp_path):
    draw = PriorDraw(3, seed=1, noise_std=0.2)
    stem = "prior_d3_s1_noise0.2"
    for rows in (300, 500):
        X, y = draw.sample(rows)
        np.save(tmp_path / f"{stem}_train{rows}_X.npy", X)
        np.save(tmp_path / f"{stem}_train{rows}_y.npy", y)
    X, y = bench._cached(tmp_path, stem, "train", 400)
    assert isinstance(X, np.memmap) and X.shape == (400, 3)
    np.testing.assert_array_equal(X, draw.sample(400)[0])
    assert bench._cached(tmp_path, stem, "train", 600) is None
    assert bench._cached(tmp_path, stem, "test", 10) is None
    data = bench.load_data(200, 50, 3, 1, 0.2, tmp_path, np.float32)
    assert data["source"] == f"train: {tmp_path}, test: generated"
    np.testing.assert_allclose(data["X"].numpy(), draw.sample(200)[0] / draw.lengthscale, rtol=1e-6)
    np.testing.assert_allclose(data["y_test"].numpy(), draw.sample(50, split="test")[1], rtol=1e-6)


def test_reach_seconds_is_the_first_epoch_at_the_target(bench):
    curve = [{"elapsed": 1.0, "val_rmse": 0.5}, {"elapsed": 2.0, "val_rmse": 0.3}, {"elapsed": 3.0, "val_rmse": 0.2}]
    assert bench.reach_seconds(curve, 0.3) == 2.0
    assert bench.reach_seconds(curve, 0.1) is None


def test_one_command_runs_every_fit_and_prints_one_table(bench, tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    argv = ["--n", "600", "--n-test", "200", "--n-val", "100", "--d", "3", "--centers", "120", "--epochs", "2"]
    argv += ["--falkon-centers", "40", "120", "--eigenpro-budget", "50", "--eigenpro-epochs", "3"]
    argv += ["--cache", "", "--jsonl", str(runs)]
    results = bench.main(argv)
    out = capsys.readouterr().out
    assert [r["solver"] for r in results] == ["eigenpro4", "falkon", "falkon", "eigenpro"]
    assert [r["M"] for r in results] == [120, 40, 120, 120]
    assert out.count("| eigenpro4 | 120 |") == 1 and "| run | M |" in out
    assert "excess / eigenpro4" in out and "eigenpro at the same M" in out
    lines = [json.loads(line) for line in runs.read_text().splitlines()]
    assert len(lines) == 4
    for line in lines:
        assert line["host"]["threads"] >= 1 and "load_end" in line and line["n"] == 600
        assert 0.2 / 2 < line["rmse"] < 2.0 and line["excess"] <= line["rmse"]
    ep4 = lines[0]
    assert ep4["iterations"] == 2 and len(ep4["curve"]) == 2 and ep4["extras"]["memory_estimate"] > 0
    # eigenpro stops at the first epoch that reaches eigenpro4's validation RMSE, else after its epochs
    target = ep4["curve"][-1]["val_rmse"]
    curve = lines[-1]["curve"]
    assert all(c["val_rmse"] > target for c in curve[:-1])
    assert curve[-1]["val_rmse"] <= target or len(curve) == 3


def test_bench_eigenpro4_periods_table(capsys):
    """benchmarks/bench_eigenpro4.py --periods: the default period first, ``Nx`` scaled from its batch."""
    path = SCRIPT.with_name("bench_eigenpro4.py")
    spec = importlib.util.spec_from_file_location("bench_eigenpro4_periods", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not (module.DATA / "letter.npz").is_file():
        pytest.skip("letter.npz not found")
    module.period_table(["letter"], [100], 1, ["16", "2x"], 1)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| letter |")]
    assert [row.split(" | ")[2] for row in rows] == ["default", "16", "2x"]
    batch, period = (int(v) for v in rows[0].split(" | ")[3].split(" / "))
    assert period == max(1, 100 // batch)
    assert rows[2].split(" | ")[3] == f"{batch} / {max(1, 200 // batch)}"
    assert rows[1].split(" | ")[3].endswith(" / 16")
