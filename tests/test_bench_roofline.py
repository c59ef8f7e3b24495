"""benchmarks/bench_roofline.py at tiny sizes: every operation gets a row with a finite positive ratio."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from benchmark_scripts import benchmark_module


@pytest.fixture(scope="module")
def roofline():
    with benchmark_module("bench_roofline") as module:
        yield module


def test_quick_run_has_every_operation(roofline, tmp_path, capsys):
    log = tmp_path / "runs.jsonl"
    threads = torch.get_num_threads()
    try:
        # one thread: the test must not load a shared machine that may be running timings
        result = roofline.main(["--quick", "--m", "64,128", "--n", "600", "--threads", "1", "--jsonl", str(log)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = result["rows"]
    for dtype in ("float32", "float64"):
        for m in (64, 128):
            names = {r["operation"] for r in rows if r["dtype"] == dtype and r["M"] == m}
            assert set(roofline.OPERATIONS) <= names, (dtype, m, set(roofline.OPERATIONS) - names)
            for name in roofline.OPERATIONS:
                assert f"| {name} | {m} |" in out
    assert {r["operation"] for r in rows if r["dtype"] == "float32"} >= {roofline.STORED_WIDE, roofline.PRECOND_MIXED}
    for r in rows:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert r["seconds"] > 0 and r["bound_s"] > 0 and r["threads"] == 1
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert logged == rows
    assert "## float32 / float64 time ratio" in out
    machine = result["machine"]
    assert all(rate > 0 for rate in (*machine.gemm.values(), *machine.exp.values(), machine.dram, machine.cache_read))


def test_peers_run_each_peer_benchmark_as_its_own_command(roofline, monkeypatch, capfd):
    """``--peers`` names the two peer scripts (which exist) with the run's centers and dtypes, and runs each in
    the given interpreter; here the FALKON library is not installed, so its script reports that and exits 0."""
    commands = roofline.peer_commands("python-x", [2000, 5000], ["float32"])
    assert [Path(c[1]).name for c in commands] == ["bench_falkon_library.py", "bench_eigenpro_reference.py"]
    assert all(Path(c[1]).is_file() and c[0] == "python-x" for c in commands)
    assert commands[0][2:] == ["--m", "2000", "5000", "--dtype", "float32"]
    if importlib.util.find_spec("falkon") is not None:
        pytest.skip("the FALKON library is installed here: its benchmark would run in full")
    both = roofline.peer_commands
    monkeypatch.setattr(roofline, "peer_commands", lambda python, ms, dtypes: both(python, ms, dtypes)[:1])
    args = roofline.build_parser().parse_args(["--peers", "--peer-python", sys.executable, "--peer-m", "2000"])
    roofline.run_peers(args)
    out = capfd.readouterr().out
    assert "## Peers: bench_falkon_library.py" in out and "skipped: the FALKON library is not importable" in out
    assert "exited with status" not in out
