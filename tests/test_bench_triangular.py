"""benchmarks/bench_triangular_solve.py at a tiny size, under both thread policies: every row is filled in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_triangular_solve.py"


def test_both_policies_print_a_full_table():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: the host may be running timings
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "1500", "--columns", "1,3", "--dtypes", "float64", "--reps", "1"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "OMP_WAIT_POLICY=PASSIVE" in out and "OMP_WAIT_POLICY=unset" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1500 |")]
    assert len(rows) == 4
    picks = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        times = [float(cells[i]) for i in (3, 4, 6, 7)]
        assert all(t > 0 for t in times)
        # the block rows agree with LAPACK's solve: residuals within a small factor of its own
        residuals = [float(x) for x in re.findall(r"[0-9.]+", cells[9])]
        assert len(residuals) == 2 and all(r < 20 for r in residuals)
        picks.append(cells[10])
    # the measured rule: one column -> block rows only with passive threads; 3 columns -> block rows for L^T X = B
    assert picks == ["blocks / blocks", "torch / blocks", "torch / torch", "torch / blocks"]
