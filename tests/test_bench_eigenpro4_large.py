"""benchmarks/bench_eigenpro4_large.py at tiny sizes: the data it reads, every fit, the table and the JSON lines."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
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
    argv += ["--falkon-centers", "40", "120", "--falkon-budget-mib", "0.5", "--eigenpro-budget", "50"]
    argv += ["--eigenpro-epochs", "3"]
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
    # the falkon fits ran under --falkon-budget-mib, the others under the default budget
    assert [line["memory_budget"] == 2**19 for line in lines] == [False, True, True, False]
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


# A stand-in for the reference package (github.com/EigenPro/EigenPro's eigenpro/, not in this repository): the
# entry points the benchmark calls, recording what they were given; its model predicts 0.
_FAKE_REFERENCE = {
    "__init__.py": "",
    "kernels.py": ("def gaussian(a, b, bandwidth):\n    return (a @ b.T) * 0 + bandwidth\nlaplacian = gaussian\n"),
    "models/__init__.py": "",
    "models/sharded_kernel_machine.py": (
        "import torch\n"
        "CALLS = []\n"
        "class Machine:\n"
        "    def __init__(self, centers, k):\n"
        "        self.centers, self.k = centers, k\n"
        "    def __call__(self, x):\n"
        "        return torch.zeros(x.shape[0], self.k)\n"
        "def create_sharded_kernel_machine(centers, n_outputs, kernel_fn, device, dtype, tmp_centers_coeff):\n"
        "    CALLS.append({'centers': centers.shape, 'coeff': tmp_centers_coeff, 'dtype': dtype})\n"
        "    return Machine(centers, n_outputs)\n"
    ),
    "solver.py": (
        "CALLS = []\n"
        "def fit(model, X, Y, x, y, device, dtype, kernel, **options):\n"
        "    CALLS.append({'X': X.shape, 'Y': Y.shape, 'x': x.shape, 'dtype': dtype, **options})\n"
        "    print('its own output, discarded')\n"
        "    return model\n"
    ),
    "utils/__init__.py": "",
    "utils/device.py": (
        "class Device:\n    @staticmethod\n    def create(use_gpu_if_available):\n        return 'cpu'\n"
    ),
}


@pytest.fixture
def fake_reference(tmp_path, monkeypatch):
    root = tmp_path / "ref"
    for name, text in _FAKE_REFERENCE.items():
        path = root / "eigenpro" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for name in [m for m in sys.modules if m == "eigenpro" or m.startswith("eigenpro.")]:
        monkeypatch.delitem(sys.modules, name)
    shims_before = {m for m in ("tabulate", "termcolor") if m in sys.modules}
    yield root
    for name in [m for m in sys.modules if m == "eigenpro" or m.startswith("eigenpro.")]:
        del sys.modules[name]
    for name in {"tabulate", "termcolor"} - shims_before:
        sys.modules.pop(name, None)
    if str(root) in sys.path:
        sys.path.remove(str(root))


def test_the_reference_row_gets_the_same_rows_centers_and_its_own_epochs(bench, fake_reference, capsys):
    argv = ["--n", "300", "--n-test", "80", "--n-val", "50", "--d", "2", "--centers", "60", "--epochs", "1"]
    argv += ["--cache", "", "--jsonl", "", "--reference", str(fake_reference), "--reference-epochs", "3"]
    results = bench.main(argv)
    out = capsys.readouterr().out
    assert [r["solver"] for r in results] == ["eigenpro4", "reference"]
    import eigenpro.models.sharded_kernel_machine as machine
    import eigenpro.solver as solver

    # below M = 4,000 its temporary-center buffer gets room for one of its batches: 1 + ceil(4000 / 60) = 68
    assert machine.CALLS == [{"centers": (60, 2), "coeff": 68, "dtype": torch.float32}]
    (call,) = solver.CALLS
    assert call["X"] == (300, 2) and call["Y"] == (300, 1) and call["x"] == (50, 2) and call["epochs"] == 3
    assert call["n_data_pcd_nyst_samples"] == 2000 and call["n_model_pcd_nyst_samples"] == 60
    assert call["n_data_pcd_eigenvals"] == 100 and call["n_model_pcd_eigenvals"] == 30
    # the stand-in predicts 0, so its test RMSE is the root mean square of the test targets
    draw = PriorDraw(2, seed=0, noise_std=0.1)
    y_test = draw.sample(80, split="test")[1].astype(np.float32).astype(np.float64)
    assert results[1]["rmse"] == pytest.approx(float(np.sqrt(np.mean(y_test**2))), rel=1e-6)
    assert results[1]["iterations"] == 3 and "| reference | 60 | 3 |" in out
    assert "against the reference (3 epoch(s))" in out and "its own output" not in out


def test_a_reference_path_without_the_package_is_skipped_with_a_reason(bench, tmp_path, capsys):
    assert bench.ep4_reference.available(tmp_path) is None
    assert f"SKIP reference: no eigenpro/solver.py under {tmp_path}" in capsys.readouterr().out
    assert bench.ep4_reference.available(None) is None


def test_the_classification_benchmark_scores_the_reference_on_the_test_rows(fake_reference):
    """bench_eigenpro4.py's reference column: one-hot targets in, argmax of its outputs scored on the test rows."""
    with benchmark_module("bench_eigenpro4") as module:
        rng = np.random.default_rng(0)
        Xtr, Xte = rng.standard_normal((90, 4)).astype(np.float32), rng.standard_normal((40, 4)).astype(np.float32)
        ytr, yte = rng.integers(3, 6, 90), rng.integers(3, 6, 40)
        accuracy, seconds = module.run_reference(
            fake_reference, "letter", torch.as_tensor(Xtr[:30]), Xtr, ytr, Xte, yte, 2
        )
    import eigenpro.solver as solver

    (call,) = solver.CALLS
    assert call["Y"] == (90, 3) and call["x"] == (40, 4) and call["epochs"] == 2
    # the stand-in's outputs are all 0: argmax picks the first class, 3
    assert accuracy == pytest.approx(float(np.mean(yte == 3))) and seconds >= 0
