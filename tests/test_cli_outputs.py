"""The `kgp` command never replaces its own inputs, and a Ctrl-C leaves --out as it was: an --out that is the
--data or --model file (by any name: the same path, a hard link, a symbolic link) is refused before any work,
and a Ctrl-C during learning stops the command with exit status 130 unless --keep-best-on-interrupt asks to
keep the best point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kgp
import kgp.cli
from kgp.cli import main

ROOT = Path(__file__).resolve().parents[1]
_rng = np.random.default_rng(3)
X = _rng.normal(size=(60, 2))
Y = np.sin(X[:, 0]) + 0.5 * X[:, 1] + 0.05 * _rng.normal(size=60)


def _csv(path: Path) -> Path:
    rows = np.column_stack([X, Y])
    path.write_text("a,b,target\n" + "".join(",".join(repr(float(v)) for v in row) + "\n" for row in rows))
    return path


def _alias(original: Path, how: str) -> Path:
    """Another name for ``original``: itself, a hard link, a symbolic link, or a path through '..'."""
    if how == "same":
        return original
    if how == "relative":
        return original.parent / "sub" / ".." / original.name
    other = original.with_name(f"alias-{how}{original.suffix}")
    (os.link if how == "hardlink" else os.symlink)(original, other)
    return other


@pytest.fixture
def fitted(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "sub").mkdir()
    data = _csv(tmp_path / "d.csv")
    model = tmp_path / "m.pt"
    assert main(["fit", "--data", str(data), "--noise", "0.05", "--out", str(model)]) == 0
    return data, model


@pytest.mark.parametrize("how", ["same", "relative", "hardlink", "symlink"])
def test_fit_refuses_an_out_that_is_its_data(fitted, capsys, how):
    data, _ = fitted
    before = data.read_bytes()
    capsys.readouterr()
    out = _alias(data, how)
    assert main(["fit", "--data", str(data), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "--out" in err and "is the --data file" in err and "give another --out" in err, err
    assert data.read_bytes() == before


@pytest.mark.parametrize("how", ["same", "hardlink", "symlink"])
@pytest.mark.parametrize("which", ["--data", "--model"])
def test_predict_refuses_an_out_that_is_one_of_its_inputs(fitted, capsys, how, which):
    data, model = fitted
    target = data if which == "--data" else model
    before = {p: p.read_bytes() for p in (data, model)}
    capsys.readouterr()
    out = _alias(target, how)
    assert main(["predict", "--model", str(model), "--data", str(data), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"is the {which} file" in err, err
    assert {p: p.read_bytes() for p in (data, model)} == before
    # an --out of its own is written as before
    assert main(["predict", "--model", str(model), "--data", str(data), "--out", str(data.with_name("p.csv"))]) == 0
    np.testing.assert_allclose(
        np.loadtxt(data.with_name("p.csv"), delimiter=",", skiprows=1), kgp.load(model).predict(X), rtol=1e-12
    )


def test_predict_refuses_a_calibration_plot_over_an_input(fitted, capsys):
    data, model = fitted
    before = model.read_bytes()
    capsys.readouterr()
    args = ["predict", "--model", str(model), "--data", str(data), "--target", "target"]
    assert main([*args, "--calibration-plot", str(model)]) == 1
    assert "--calibration-plot" in capsys.readouterr().err
    assert model.read_bytes() == before


def _interrupting_estimator(monkeypatch, at: int) -> None:
    """The CLI's estimator with a learning callback that raises KeyboardInterrupt at evaluation ``at``."""
    build = kgp.cli._estimator_from_args
    seen: list[int] = []

    def callback(info):
        seen.append(info.iteration)
        if len(seen) == at:
            raise KeyboardInterrupt

    monkeypatch.setattr(kgp.cli, "_estimator_from_args", lambda args: build(args).set_params(callback=callback))


def test_ctrl_c_while_learning_exits_130_and_leaves_out_untouched(fitted, capsys, monkeypatch):
    data, model = fitted
    before = model.read_bytes()
    capsys.readouterr()
    _interrupting_estimator(monkeypatch, at=4)
    assert main(["fit", "--data", str(data), "--learn", "exact", "--out", str(model)]) == 130
    assert capsys.readouterr().err == "kgp fit: interrupted; nothing was written\n"
    assert model.read_bytes() == before
    assert sorted(p.name for p in model.parent.iterdir()) == ["d.csv", "m.pt", "sub"]


def test_keep_best_on_interrupt_saves_the_best_point(fitted, capsys, monkeypatch):
    data, model = fitted
    _interrupting_estimator(monkeypatch, at=4)
    with pytest.warns(kgp.ConvergenceWarning, match="interrupted"):
        status = main(["fit", "--data", str(data), "--learn", "exact", "--keep-best-on-interrupt", "--out", str(model)])
    assert status == 0
    saved = kgp.load(model)
    assert saved.learn_summary_["stopped"] == "interrupted" and saved.learn_summary_["evaluations"] == 4


def test_the_python_api_still_keeps_the_best_point_by_default():
    seen: list[int] = []

    def callback(info):
        seen.append(info.iteration)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.warns(kgp.ConvergenceWarning, match="interrupted"):
        model = kgp.KernelRegressor("rbf", learn="exact", callback=callback).fit(X, Y)
    assert model.learn_summary_["stopped"] == "interrupted"
    seen.clear()
    with kgp.settings.interrupted_learning("stop_fit"), pytest.raises(KeyboardInterrupt):
        kgp.KernelRegressor("rbf", learn="exact", callback=callback).fit(X, Y)
    with pytest.raises(ValueError, match="interrupted_learning"):
        kgp.settings.interrupted_learning("ignore")


_LATE_SIGINT = """
import os, signal, sys, time
import _kgp_launcher
status = _kgp_launcher.console(["plugins"])
os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the command's work, while the process exits
time.sleep(0.5)
sys.exit(status)
"""


def test_a_ctrl_c_after_the_command_finished_keeps_its_exit_status():
    env = dict(os.environ, KGP_DISABLE_ENTRYPOINTS="1")
    done = subprocess.run(
        [sys.executable, "-c", _LATE_SIGINT], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.returncode != -signal.SIGINT
