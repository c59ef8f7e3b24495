"""benchmarks/bench_ep2_epoch.py at a tiny size: both commits' epochs paired, the same iterate, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import benchmark_module

ROOT = Path(__file__).resolve().parents[1]


def test_paired_epochs_give_the_same_iterate(capsys):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("the benchmark reads the 'before' epoch from git: not a git checkout")
    with benchmark_module("bench_ep2_epoch") as bench:
        results = bench.main(["--before", "HEAD", "--centers", "300", "--d", "3", "--repeats", "2"])
    (r,) = results
    assert r["M"] == 300 and r["q"] > 0
    # the same arithmetic up to the order of the sums (float32)
    assert r["diff"] < 1e-4, r["diff"]
    out = capsys.readouterr().out
    assert "| 300 | 3 |" in out and "wall before / after" in out
    assert not [m for m in sys.modules if m.startswith("ep2_at_")]
