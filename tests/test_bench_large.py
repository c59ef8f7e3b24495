"""benchmarks/bench_large.py at tiny sizes: cached memory-mapped data, both fits, a table with the ratios."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from benchmark_scripts import benchmark_module

from kgp.datasets import PriorDraw


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("bench_large") as module:
        yield module


def test_cached_data_are_the_generator_rows_read_from_disk(bench, tmp_path):
    data = bench.cached_data(tmp_path, 700, 3, 50, seed=2, noise=0.2)
    assert isinstance(data["X"], np.memmap) and not data["X"].flags.writeable
    X, y = PriorDraw(3, seed=2, noise_std=0.2).sample(700)
    np.testing.assert_array_equal(data["X"], X)
    np.testing.assert_array_equal(data["y"], y)
    X_test, _ = PriorDraw(3, seed=2, noise_std=0.2).sample(50, split="test")
    np.testing.assert_array_equal(data["X_test"], X_test)
    files = sorted(tmp_path.glob("*.npy"))
    assert len(files) == 4 and not list(tmp_path.glob("*.tmp.npy"))
    stamps = [f.stat().st_mtime_ns for f in files]
    bench.cached_data(tmp_path, 700, 3, 50, seed=2, noise=0.2)  # read back, not written again
    assert [f.stat().st_mtime_ns for f in files] == stamps


def test_scores_against_closed_forms(bench):
    y = np.array([0.0, 1.0, 2.0, 3.0])
    mean = y + np.array([0.3, -0.3, 0.3, -0.3])
    s = bench.scores(mean, np.full(4, 0.5), y, noise=0.1)
    assert s["rmse"] == pytest.approx(0.3)
    assert s["excess"] == pytest.approx(math.sqrt(0.09 - 0.01))
    assert s["nlpd"] == pytest.approx(0.5 * math.log(2 * math.pi * 0.25) + 0.09 / 0.5)
    assert s["coverage"] == 1.0
    assert bench.scores(mean, np.full(4, 0.1), y, noise=0.1)["coverage"] == 0.0  # |error| 0.3 > 1.96 * 0.1


def test_quick_run_prints_the_table(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_N", 300)
    log = tmp_path / "runs.jsonl"
    threads = torch.get_num_threads()
    try:
        # one thread: the test must not load a shared machine that may be running timings
        argv = ["--quick", "--n-test", "100", "--svgp-seconds", "1", "--threads", "1"]
        paths = ["--cache", str(tmp_path / "cache"), "--jsonl", str(log), "--save", str(tmp_path / "models")]
        result = bench.main([*argv, *paths])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    (row,) = result["rows"]
    assert (row["n"], row["d"], row["n_test"]) == (300, 8, 100)
    for run in ("kgp", "svgp"):
        r = row[run]
        assert r["excess"] == pytest.approx(math.sqrt(max(r["rmse"] ** 2 - 0.01, 0.0)))
        assert 0.0 <= r["coverage"] <= 1.0 and math.isfinite(r["nlpd"])
        assert r["peak_rss"] > 0 and r["fit_seconds"] > 0
    assert row["kgp"]["M"] >= 1 and row["svgp"]["M"] == 300  # SVGP's inducing points: at most n
    assert row["svgp"]["steps"] >= 1
    served = row["kgp"]["served"]  # the saved model, loaded and queried in a fresh process
    model_file = tmp_path / "models" / "kgp_n300_d8_s0.kgp"
    assert served["query_rows"] == 100 and served["file_bytes"] == model_file.stat().st_size
    assert served["load_seconds"] > 0 and served["std_seconds"] > 0
    lines = [line for line in out.splitlines() if line.startswith("| 300 | 8 |")]
    assert len(lines) == 2 and "| kgp |" in lines[0] and "| svgp |" in lines[1]
    cells = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert float(cells[5]) == pytest.approx(row["kgp"]["fit_cpu_seconds"], abs=0.06)
    assert float(cells[11]) == pytest.approx(row["kgp"]["excess"] / row["svgp"]["excess"], abs=0.006)
    assert float(cells[15]) == pytest.approx(served["file_bytes"] / 1e9, abs=0.006)
    assert float(cells[16]) == pytest.approx(served["load_seconds"] + served["std_seconds"], abs=0.006)
    assert [c.strip() for c in lines[1].split("|")[1:-1]][15:] == ["", ""]  # SVGP saves no model
    assert json.loads(log.read_text().splitlines()[-1])["kgp"]["rmse"] == pytest.approx(row["kgp"]["rmse"])


def test_svgp_alone_on_the_cpu_clock_with_checkpoints(bench, tmp_path):
    threads = torch.get_num_threads()
    try:
        argv = ["--n", "400", "--n-test", "50", "--no-kgp", "--svgp-seconds", "0.6", "--svgp-clock", "cpu"]
        argv += ["--svgp-checkpoints", "0.1", "0.3", "5", "--threads", "1"]
        result = bench.main([*argv, "--cache", str(tmp_path / "cache"), "--jsonl", str(tmp_path / "runs.jsonl")])
    finally:
        torch.set_num_threads(threads)
    (row,) = result["rows"]
    assert "kgp" not in row
    svgp = row["svgp"]
    assert svgp["clock"] == "cpu" and svgp["train_clock_seconds"] >= 0.6
    # checkpoints past the budget are not reached; the others are, in order, each scored
    assert [c["clock_seconds"] >= t for c, t in zip(svgp["curve"], (0.1, 0.3))] == [True, True]
    assert len(svgp["curve"]) == 2 and svgp["curve"][0]["clock_seconds"] < svgp["curve"][1]["clock_seconds"]
    assert all(math.isfinite(c["nlpd"]) and c["excess"] >= 0 for c in svgp["curve"])
    assert "| 400 | 8 | svgp |" in result["table"]


def test_bad_arguments_are_refused(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--n", "0", "--cache", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--n-test", "0", "--cache", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--no-kgp", "--cache", str(tmp_path)])  # SVGP alone needs its time
