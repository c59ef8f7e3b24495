"""Property-based sweeps (hypothesis) of model files, the ``kgp`` command and concurrent use.

- **Model files**: one entry of a saved model, chosen at random among every tensor and plain value the
  file holds, is replaced by a hostile value (NaN, inf, a negative or huge number, a wrong shape, a wrong
  type), and the checksum recomputed (a deliberate forgery). ``kgp.load`` either refuses the file with one
  :class:`kgp.ModelFileError` line, or loads a model whose predictions are finite and equal to the original
  model's where the file's probe rows pin them (the probe check): never another exception, never garbage.
- **The command**: CSV files with random headers, byte-order marks, blank, non-numeric or non-finite cells,
  and random ``kgp fit`` / ``kgp predict`` flags. ``main`` returns 0, or a non-zero status with a one-line
  ``kgp: error:`` message; it never raises.
- **Threads**: random interleavings of fits, predictions and ``kgp.settings`` blocks in four threads (a
  fresh registry lookup in each); every fit gives the single-thread result, and no setting outlives its
  block.
"""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest
import torch

import kgp
from kgp import io, settings
from kgp.cli import main

hypothesis = pytest.importorskip("hypothesis", reason="the property-based sweep needs hypothesis (test extra)")
from hypothesis import HealthCheck, event, given  # noqa: E402
from hypothesis import settings as hsettings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SWEEP = hsettings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_rng = np.random.default_rng(3)
X = _rng.normal(size=(50, 2))
Y = np.sin(X[:, 0]) + 0.5 * X[:, 1]


# ---------------------------------------------------------------------------------------------- files
def _leaves(value, path=()):
    """Every (path, leaf) of a nested dict / list state: tensors and plain values."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, (list, tuple)) and value and not all(isinstance(v, (int, float)) for v in value):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _set(state, path, value):
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("forged")
    models = {
        "exact_learned": kgp.KernelRegressor(
            "rbf", learn="exact", solver="exact", learn_options={"iterations": 5}, random_state=0
        ),
        "falkon_learned": kgp.KernelRegressor(
            "rbf", learn="sgpr", n_centers=12, learn_options={"iterations": 5}, random_state=0
        ),
    }
    files = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, model in models.items():
            model.fit(X, Y)
            model.predict(X[:3], return_std=True)
            path = root / f"{name}.kgp"
            model.save(path)
            files[name] = (path, model)
    return files


def _hostile(value, draw):
    """A replacement for ``value`` that a careless or malicious writer could put in its place."""
    if torch.is_tensor(value):
        kind = draw(st.sampled_from(["nan", "inf", "negative", "huge", "shape", "dtype", "type"]))
        if kind == "shape":
            return torch.zeros(value.numel() + 1, dtype=value.dtype)
        if kind == "dtype":
            return value.to(torch.int64) if value.is_floating_point() else value.double()
        if kind == "type":
            return draw(st.sampled_from([None, "text", 3, [1.0, 2.0]]))
        if not value.is_floating_point() or value.numel() == 0:
            return torch.full((max(1, value.numel()),), -1, dtype=torch.int64)
        out = value.clone().reshape(-1)
        i = draw(st.integers(0, out.numel() - 1))
        out[i] = {"nan": math.nan, "inf": math.inf, "negative": -abs(float(out[i])) - 1.0, "huge": 1e300}[kind]
        return out.reshape(value.shape)
    return draw(
        st.sampled_from([None, -5, 0, 10**12, -1e300, math.nan, "bogus", True, [], {}, [[[[1]]]], "0" * 10_000])
    )


@SWEEP
@given(data=st.data(), which=st.sampled_from(["exact_learned", "falkon_learned"]))
def test_a_forged_entry_is_refused_or_harmless(saved, tmp_path_factory, data, which):
    path, model = saved[which]
    state = torch.load(path, weights_only=True)
    body = {k: v for k, v in state.items() if k not in ("format", "format_version", "checksum")}
    leaves = [(p, v) for p, v in _leaves(body) if p]
    where, old = data.draw(st.sampled_from(leaves), label="entry")
    _set(body, where, _hostile(old, data.draw))
    forged = tmp_path_factory.mktemp("f") / "forged.kgp"
    io.write_model(body, forged)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = kgp.load(forged)
            mean, std = loaded.predict(X[:5], return_std=True)
    except kgp.ModelFileError as exc:
        assert "\n" not in str(exc) and str(forged) in str(exc)
        event("refused at load")
        return
    except ValueError as exc:  # a model that loads but says it has no variance: a clear, named refusal
        assert str(exc).startswith("return_std=True"), exc
        event("no variance")
        return
    event("harmless")
    assert np.isfinite(mean).all() and np.isfinite(std).all() and (std >= 0).all(), where
    # what the entry changed did not move the predictions (else the probe check must have refused it)
    np.testing.assert_allclose(mean, model.predict(X[:5]), rtol=1e-6, atol=1e-9, err_msg=str(where))


# ---------------------------------------------------------------------------------------------- the command
def _run(argv: list[str]) -> int:
    """``main``'s status; argparse's usage errors exit with status 2 after their one-line message."""
    try:
        return main(argv)
    except SystemExit as exc:
        assert exc.code == 2, exc
        return 2


CELLS = st.sampled_from(["1.5", "-2", "0", "", "nan", "inf", "x", " 3 ", "1e400", '"4"', "1,5"])


@SWEEP
@given(
    header=st.lists(st.sampled_from(["a", "b", "y", "", "\ufeffa", "a", "target", "é"]), min_size=1, max_size=4),
    bom=st.booleans(),
    cells=st.lists(st.lists(CELLS, min_size=1, max_size=4), min_size=0, max_size=6),
    numeric_rows=st.integers(0, 30),
    flags=st.lists(
        st.sampled_from(
            [
                ["--target", "y"],
                ["--target", "a"],
                ["--target", "nope"],
                ["--solver", "falkon"],
                ["--solver", "exact"],
                ["--learn", "exact"],
                ["--learn", "holdout"],
                ["--normalize-y"],
                ["--n-centers", "5"],
                ["--n-centers", "0"],
                ["--dtype", "float32"],
                ["--header", "no"],
                ["--header", "none"],  # not a choice: argparse's usage error (exit status 2)
                ["--option", "maxiter=3"],
            ]
        ),
        max_size=4,
    ),
)
def test_the_command_never_raises_and_errors_are_one_line(
    tmp_path_factory, capsys, header, bom, cells, numeric_rows, flags
):
    root = tmp_path_factory.mktemp("cli")
    lines = [",".join(header)] + [",".join(row) for row in cells]
    lines += [",".join(f"{v:.4f}" for v in row) for row in _rng.normal(size=(numeric_rows, len(header)))]
    (root / "d.csv").write_text(("\ufeff" if bom else "") + "\n".join(lines) + "\n", encoding="utf-8")
    argv = ["fit", "--data", str(root / "d.csv"), "--out", str(root / "m.kgp")] + [f for pair in flags for f in pair]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        status = _run(argv)
        if status == 0:
            status = _run(["predict", "--model", str(root / "m.kgp"), "--data", str(root / "d.csv"), "--std"])
    err = capsys.readouterr().err
    assert isinstance(status, int)
    event(f"status {status}")
    if status != 0:
        errors = [line for line in err.splitlines() if "error" in line]
        assert errors, err
        assert all(len(line) < 2_000 for line in errors) and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- threads
@SWEEP
@given(
    plan=st.lists(
        st.tuples(
            st.sampled_from(["exact", "falkon", "eigenpro"]),
            st.sampled_from([None, ("max_exact_size", 10), ("block_rows", 7), ("memory_budget", 2**20)]),
        ),
        min_size=4,
        max_size=4,
    )
)
def test_threads_fit_as_one_thread_does_and_settings_stay_in_their_block(plan):
    before = {name: getattr(settings, name).value() for name in ("max_exact_size", "block_rows", "memory_budget")}
    expected, results, errors = {}, {}, []
    options = {"exact": {}, "falkon": {"n_centers": 10}, "eigenpro": {"n_centers": 10}}
    for solver in {s for s, _ in plan}:
        expected[solver] = kgp.KernelRegressor(solver=solver, noise=0.1, random_state=0, **options[solver]).fit(X, Y)
    barrier = threading.Barrier(len(plan))

    def work(i, solver, setting):
        try:
            barrier.wait(timeout=60)
            model = kgp.KernelRegressor(solver=kgp.get_solver(solver) and solver, noise=0.1, random_state=0)
            model.set_params(**options[solver])
            if setting is None:
                results[i] = model.fit(X, Y).predict(X[:7])
                return
            name, value = setting
            with getattr(settings, name)(value):
                try:
                    results[i] = model.fit(X, Y).predict(X[:7])
                except ValueError as exc:  # max_exact_size 10 refuses the exact solve: in this thread only
                    results[i] = exc
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, s, c)) for i, (s, c) in enumerate(plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    for i, (solver, setting) in enumerate(plan):
        if isinstance(results[i], ValueError):
            assert setting == ("max_exact_size", 10) and solver == "exact", results[i]
            continue
        # block_rows and memory_budget change the blocks, not the result (summation order only)
        np.testing.assert_allclose(results[i], expected[solver].predict(X[:7]), rtol=1e-6, atol=1e-9)
    assert {name: getattr(settings, name).value() for name in before} == before
