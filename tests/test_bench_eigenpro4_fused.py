"""benchmarks/bench_eigenpro4_fused.py at a tiny size: both commits' fits, the parts it meters, the table, and the
solver left as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import benchmark_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("the benchmark reads the 'before' solver from git: not a git checkout")
    with benchmark_module("bench_eigenpro4_fused") as module:
        yield module


def test_paired_fits_meter_their_parts_and_leave_the_solver_as_it_was(bench, capsys):
    from kgp_builtins.eigenpro4.projection import DelayedProjection
    from kgp_builtins.eigenpro4.solver import EigenPro4Solver
    from kgp_builtins.eigenpro4.state import DelayedState

    originals = (EigenPro4Solver.fit, DelayedState.step, DelayedState.absorb, DelayedProjection.solve)
    args = ["--n", "1200", "--centers", "120", "--n-test", "200", "--cache", "", "--before", "HEAD", "--repeats", "2"]
    results = bench.main(args)
    assert [r["variant"] for r in results] == ["before", "after", "after", "before"]
    for r in results:
        assert set(r["parts"]) == {"steps", "projections", "absorb"}
        steps = r["parts"]["steps"]
        assert steps[1] >= 1200 * 120  # every row met every center at least once
    out = capsys.readouterr().out
    assert "| steps |" in out and "| **fit, CPU s** |" in out and "FALKON's pass" in out
    assert (EigenPro4Solver.fit, DelayedState.step, DelayedState.absorb, DelayedProjection.solve) == originals
    assert not [m for m in sys.modules if m.startswith("eigenpro4_at_")]
