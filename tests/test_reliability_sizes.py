"""Sizes checked before allocation (docs/guarantees.md, "Sizes"): a step that cannot fit is refused before
it allocates or works, with the option to change and the numbers, not the allocator's message later."""

from __future__ import annotations

import time
import zipfile

import numpy as np
import pytest
import torch

import kgp
from kgp.safeguards import available_memory
from kgp.testing.memory import LargestTensor


def _data(n, d=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, d))
    return X, np.sin(4 * X[:, 0]) + X[:, 1]


def test_available_memory_reads_physical_memory_not_swap():
    available = available_memory()
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert 0 < available <= info["MemTotal"]  # RAM only: swap and virtual memory do not count
    assert abs(available - info["MemAvailable"]) < 0.5 * info["MemTotal"]


@pytest.mark.parametrize(
    ("dtype", "m", "needed"),
    [("float64", 1100, 2 * 1100**2 * 8), ("float32", 1500, 2 * 1500**2 * 4)],
)
@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")
def test_falkon_refuses_centers_whose_factors_exceed_available_memory(monkeypatch, dtype, m, needed):
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(8 * 2**20))  # a machine with 8 MiB free
    X, y = _data(1600)
    model = kgp.KernelRegressor("rbf", solver="falkon", n_centers=m, dtype=dtype)
    with LargestTensor() as probe, pytest.raises(kgp.InsufficientMemoryError) as info:
        model.fit(X, y)
    message = str(info.value)
    assert f"n_centers={m:,}" in message and f"{needed:,} bytes" in message and "8,388,608 bytes" in message
    assert "lower n_centers" in message
    assert isinstance(info.value, MemoryError) and isinstance(info.value, ValueError)
    assert probe.largest < m * m  # refused before any M x M array
    assert not hasattr(model, "posterior_")
    # what the message says fits does fit: at most sqrt(8 MiB / bytes per entry) centers
    fits = int(message.split("at most about ")[1].split(" ")[0].replace(",", ""))
    assert fits * fits * needed / m**2 <= 8 * 2**20 < (fits + 1) ** 2 * needed / m**2
    model.set_params(n_centers=fits).fit(X, y)


def test_falkon_at_sixty_thousand_centers_is_refused_before_work(monkeypatch):
    # the reproducer's size: 57.6 GB of float64 factors, refused on a 32 GiB machine in well under a second
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(32 * 2**30))
    X = np.random.default_rng(0).random((60_000, 2))
    with pytest.raises(kgp.InsufficientMemoryError, match=r"n_centers=60,000.*57,600,000,000 bytes"):
        kgp.KernelRegressor("rbf", solver="falkon", n_centers=60_000).fit(X, X[:, 0])


def test_learn_auto_under_a_tiny_budget_fails_before_learning():
    # kernel rows of the 3,000-row subset cannot be held in 1,024 bytes: the first evaluation without autograd
    # must fail before the optimisation, not after it (110 s)
    X, y = _data(4000, d=4)
    evaluations = []
    model = kgp.KernelRegressor("rbf", learn="auto", callback=lambda info: evaluations.append(info))
    start = time.process_time()
    with kgp.settings.memory_budget(1024), pytest.raises(kgp.InsufficientMemoryError) as info:
        model.fit(X, y)
    message = str(info.value)
    assert "memory_budget=1024" in message and "learn_options['subset']=3000" in message
    assert "nothing was evaluated" in message
    assert evaluations == []
    assert time.process_time() - start < 60  # generous: the point is no learning ran (110 s of CPU before)


def test_exact_objective_refuses_a_subset_beyond_available_memory(monkeypatch):
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(2**20))
    X, y = _data(400)
    with pytest.raises(kgp.InsufficientMemoryError, match=r"5 dense 400 x 400 arrays.*6,400,000 bytes"):
        kgp.KernelRegressor("rbf", learn="exact", solver="exact").fit(X, y)


def _bomb(path, good, inflated: int):
    """``good``'s entries, its first tensor storage replaced by ``inflated`` zero bytes, deflated."""
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as out:
        for entry in source.infolist():
            if entry.filename.endswith("/data/0"):
                with out.open(entry.filename, "w", force_zip64=True) as fh:
                    chunk = bytes(2**22)
                    for _ in range(inflated // len(chunk)):
                        fh.write(chunk)
            else:
                out.writestr(entry.filename, source.read(entry))


def test_zip_bomb_model_file_is_refused_from_its_declared_sizes(tmp_path, monkeypatch):
    X, y = _data(60)
    good = tmp_path / "good.pt"
    kgp.KernelRegressor("rbf").fit(X, y).save(good)
    bomb = tmp_path / "bomb.pt"
    _bomb(bomb, good, 2**28)  # 256 MiB of zeros in a file of a few hundred kB
    assert bomb.stat().st_size < 2**21

    def no_read(*args, **kwargs):
        raise AssertionError("torch.load was called on a decompression bomb")

    monkeypatch.setattr(torch, "load", no_read)
    with pytest.raises(kgp.ModelFileError, match=r"declares 256\.0 MiB \(268,435,456 bytes\).*nothing was read"):
        kgp.load(bomb)
    monkeypatch.undo()
    np.testing.assert_array_equal(kgp.load(good).predict(X), kgp.KernelRegressor("rbf").fit(X, y).predict(X))


def test_model_file_declaring_more_than_available_memory_is_refused(tmp_path, monkeypatch):
    X, y = _data(300)
    path = tmp_path / "m.pt"
    kgp.KernelRegressor("rbf").fit(X, y).save(path)
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", "1000")
    with pytest.raises(kgp.ModelFileError, match="more than the available memory"):
        kgp.load(path)


def test_eigenpro_refuses_a_cholesky_projection_beyond_available_memory(monkeypatch):
    monkeypatch.setenv("KGP_AVAILABLE_MEMORY", str(16 * 2**20))
    X, y = _data(1500)
    model = kgp.KernelRegressor(
        "rbf", solver="eigenpro", n_centers=1000, solver_options={"projection": "cholesky"}, random_state=0
    )
    with LargestTensor() as probe, pytest.raises(kgp.InsufficientMemoryError) as info:
        model.fit(X, y)
    message = str(info.value)
    # three float64 1,000 x 1,000 arrays (24 MB) and the model-size arrays, above 16 MiB
    assert "n_centers=1,000 and projection='cholesky'" in message and "'projection': 'eigenpro2'" in message
    assert probe.largest < 1000 * 1000


def test_eigenpro_announces_a_long_run_with_its_size(monkeypatch):
    from kgp_builtins.eigenpro import budget

    X, y = _data(1200)
    # a run of 10 epochs x 1,200 rows x 300 centers = 3.6e6 entries, announced under a threshold of 1e6
    monkeypatch.setattr(budget, "LONG_RUN_ENTRIES", {"cpu": 1e6, "accelerator": 1e6})
    with pytest.warns(kgp.CostWarning) as record:
        kgp.KernelRegressor("rbf", solver="eigenpro", n_centers=300, random_state=0).fit(X, y)
    message = str(record[0].message)
    assert "solver 'eigenpro': 10 epochs over n=1,200 rows with n_centers=300 form 3.6e+06 kernel entries" in message
    assert "n_centers" in message and "'epochs'" in message
    monkeypatch.undo()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", kgp.CostWarning)  # the real threshold: an ordinary fit is not announced
        kgp.KernelRegressor("rbf", solver="eigenpro", n_centers=300, random_state=0).fit(X, y)


def test_eigenpro2_announces_a_long_run_over_its_training_rows(monkeypatch):
    from kgp_builtins.eigenpro import budget

    X, y = _data(800)
    monkeypatch.setattr(budget, "LONG_RUN_ENTRIES", {"cpu": 1e6, "accelerator": 1e6})
    with pytest.warns(kgp.CostWarning) as record:
        kgp.KernelRegressor("rbf", solver="eigenpro2", random_state=0).fit(X, y)
    message = str(record[0].message)
    assert "solver 'eigenpro2': 10 epochs over n=800 rows with its 800 training rows as centers form 6.4e+06" in message
    assert "solver='eigenpro' with fewer centers" in message
