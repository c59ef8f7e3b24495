"""benchmarks/bench_model_file.py: one paired run on a small saved GP, this checkout against its own HEAD."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import benchmark_module

import kgp

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    shutil.which("git") is None
    or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0,
    reason="needs git and a repository with a commit (the benchmark extracts the base version with git archive)",
)
def test_a_paired_run_writes_both_versions_and_compares_their_std(tmp_path, capsys):
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (400, 2))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.standard_normal(400)
    model = kgp.KernelRegressor("rbf", lengthscale=0.6, noise=0.01, solver="falkon", n_centers=60, random_state=0)
    model.fit(X, y).predict(X[:1], return_std=True)
    model.save(tmp_path / "m.kgp")
    np.save(tmp_path / "q.npy", rng.uniform(-2, 2, (30, 2)))
    jsonl = tmp_path / "runs.jsonl"
    with benchmark_module("bench_model_file") as bench:
        rows = bench.main(
            [
                str(tmp_path / "m.kgp"),
                str(tmp_path / "q.npy"),
                "--base",
                "HEAD",
                "--repeats",
                "2",
                "--jsonl",
                str(jsonl),
            ]
        )
    table = capsys.readouterr().out
    assert "| base HEAD |" in table and "| this checkout |" in table
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["version"] for r in records] == ["base", "head"]
    for name in ("base", "head"):
        assert rows[name]["file_bytes"] > 0 and rows[name]["load_seconds"] > 0 and rows[name]["std_seconds"] > 0
    # both processes predicted the std of the same 30 rows from the same model: one relative rounding at most
    # where HEAD's layout differs from the checkout's, none where it is the same
    assert rows["head"]["std_max_rel_diff"] < 1e-12
