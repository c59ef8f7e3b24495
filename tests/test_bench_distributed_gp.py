"""benchmarks/bench_distributed_gp.py at a tiny size: two gloo ranks against one process, one table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_distributed_gp.py"

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


def test_two_ranks_give_the_one_process_gp(tmp_path):
    log = tmp_path / "runs.jsonl"
    argv = ["--n", "400", "--ranks", "2", "--n-test", "30", "--threads", "1", "--memory-budget-gb", "0.25"]
    argv += ["--cache", str(tmp_path / "cache"), "--jsonl", str(log)]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| rank ")]
    assert len(rows) == 2 and "| 200 |" in rows[0]  # each rank held half of the rows
    (result,) = [json.loads(line) for line in log.read_text().splitlines()]
    one, *ranks = result["runs"]
    assert one["mean_rel_diff"] == 0.0 and len(ranks) == 2
    for rank in ranks:
        # the same learned GP: hyperparameters from the same gathered subset, the same Gram rows
        assert rank["noise"] == pytest.approx(one["noise"], rel=1e-6)
        assert rank["mean_rel_diff"] < 1e-5 and rank["std_rel_diff"] < 1e-5
