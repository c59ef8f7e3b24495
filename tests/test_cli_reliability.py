"""The `kgp` command on the inputs and interruptions of issues 25 and 27: a UTF-8 byte-order mark, an
unwritable --out (refused before the fit), advice that matches the fit's dtype, Ctrl-C at any time
(one line, exit 130), every installed plugin in --help, --threads, --progress and the default dtype."""

from __future__ import annotations

import ast
import gzip
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kgp
from kgp.cli import cli_words, main

ROOT = Path(__file__).resolve().parents[1]
_rng = np.random.default_rng(0)
X = _rng.normal(size=(60, 2))
Y = np.sin(X[:, 0]) + 0.5 * X[:, 1]


def _csv(path: Path, header=("a", "b", "target"), bom=False, rows=None) -> Path:
    rows = np.column_stack([X, Y]) if rows is None else rows
    text = ",".join(header) + "\n" + "".join(",".join(repr(float(v)) for v in row) + "\n" for row in rows)
    data = ("\ufeff" if bom else "") + text
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(data)
    else:
        path.write_text(data, encoding="utf-8")
    return path


# ------------------------------------------------------------------ byte-order mark
@pytest.mark.parametrize("name", ["bom.csv", "bom.csv.gz"])
def test_a_byte_order_mark_is_not_part_of_the_first_column_name(tmp_path, capsys, name):
    data = _csv(tmp_path / name, bom=True)
    out = tmp_path / "m.pt"
    assert main(["fit", "--data", str(data), "--target", "a", "--out", str(out)]) == 0, capsys.readouterr().err
    assert "(target a; features b, target)" in capsys.readouterr().out
    assert main(["fit", "--data", str(data), "--target", "target", "--out", str(out)]) == 0
    assert kgp.load(out).feature_names_in_.tolist() == ["a", "b"]
    # the model predicts from a file without the mark, by name
    assert main(["predict", "--model", str(out), "--data", str(_csv(tmp_path / "plain.csv"))]) == 0


# ------------------------------------------------------------------ --out checked before the fit
@pytest.fixture
def no_fit(monkeypatch):
    """Fail the test if a fit starts (the refusal must come first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the fit ran although --out cannot be written")

    monkeypatch.setattr(kgp.KernelRegressor, "fit", refuse)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (".", r"--out: \. is a directory; give a file name"),
        ("missing/m.pt", r"--out: the folder .*missing does not exist \(for missing/m.pt\); create it first"),
    ],
)
def test_an_unwritable_out_is_refused_before_the_fit(tmp_path, capsys, monkeypatch, no_fit, out, message):
    data = _csv(tmp_path / "d.csv")
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--data", str(data), "--out", out]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(f"kgp fit: error: {message}\n", err), err


def test_predict_refuses_an_unwritable_out_before_predicting(tmp_path, capsys):
    data = _csv(tmp_path / "d.csv")
    model = tmp_path / "m.pt"
    assert main(["fit", "--data", str(data), "--out", str(model)]) == 0
    capsys.readouterr()
    assert main(["predict", "--model", str(model), "--data", str(data), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"kgp predict: error: --out: {tmp_path} is a directory; give a file name\n"


# ------------------------------------------------------------------ advice that matches the dtype
class _NotPSDObjective:
    """An objective whose first evaluation fails as the built-in ones do on 3 rows."""

    option_defaults: dict = {}
    capabilities = kgp.Capabilities()

    def prepare(self, problem):
        def loss(noise, mean):
            bad = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=problem.X.dtype)
            kgp.linalg.psd_cholesky(bad, what="K_ZZ of the centers", remedy="use fewer centers, or float64")

        return loss


class _NotPSDPlugin:
    @staticmethod
    @kgp.hookimpl
    def register_objectives(register):
        register("test-not-psd", _NotPSDObjective())


@pytest.fixture
def not_psd_objective():
    kgp.register(_NotPSDPlugin(), name="test-not-psd-plugin")
    yield "test-not-psd"
    kgp.unregister("test-not-psd-plugin")


def test_a_float64_fit_is_not_advised_float64_and_a_float32_fit_gets_the_flag(tmp_path, capsys, not_psd_objective):
    data = _csv(tmp_path / "d.csv")
    args = ["fit", "--data", str(data), "--learn", not_psd_objective, "--out", str(tmp_path / "m.pt")]
    assert main(args) == 1  # a CSV fits in float64
    err = capsys.readouterr().err
    assert "torch.float64) is not positive definite" in err and "use fewer centers" in err
    assert "or float64" not in err and "use float64" not in err
    assert main([*args, "--dtype", "float32"]) == 1
    err = capsys.readouterr().err
    assert "torch.float32) is not positive definite" in err and "use fewer centers, or --dtype float64" in err


def _float64_remedies() -> list[str]:
    """Every string literal in kgp/ and plugins/ that advises float64 (the remedies of numerical errors)."""
    found = set()
    for path in [*ROOT.joinpath("kgp").rglob("*.py"), *ROOT.joinpath("plugins").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"\bfloat64$", node.value):
                if node.value.startswith(("use ", "raise ")) or ", or float64" in node.value:
                    found.add(node.value)
    return sorted(found)


def test_every_float64_remedy_in_the_code_is_rewritten():
    remedies = _float64_remedies()
    assert len(remedies) >= 3, remedies  # e.g. "use float64", "raise learn_options['min_noise'] or use float64"
    for remedy in remedies:
        message = f"learn 'x': step 3 failed: S (3 x 3, torch.float64) is not positive definite; {remedy}. Next"
        for_64 = cli_words(message, "float64")
        assert for_64.count("float64") == 1, for_64  # only the dtype it ran in is left
        assert "not positive definite" in for_64 and for_64.endswith(". Next")
        for_32 = cli_words(message.replace("torch.float64", "torch.float32"), "float32")
        assert "--dtype float64" in for_32, for_32
    assert cli_words("raise learn_options['min_noise'] or use float64", "float64") == (
        "raise --learn-option min_noise=VALUE"
    )


# ------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_during_the_fit_or_the_save_keeps_the_previous_file(tmp_path, capsys, monkeypatch):
    data = _csv(tmp_path / "d.csv")
    out = tmp_path / "m.pt"
    assert main(["fit", "--data", str(data), "--out", str(out)]) == 0
    before = kgp.load(out).predict(X)
    capsys.readouterr()

    def interrupted(obj, fh):
        fh.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(kgp.io.torch, "save", interrupted)
    assert main(["fit", "--data", str(data), "--noise", "0.5", "--out", str(out)]) == 130
    assert capsys.readouterr().err == "kgp fit: interrupted; nothing was written\n"
    monkeypatch.undo()
    np.testing.assert_array_equal(kgp.load(out).predict(X), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.csv", "m.pt"]


_IMPORT_INTERRUPTED = """
import sys
class Interrupt:  # Ctrl-C arrives while torch is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
import _kgp_launcher
sys.exit(_kgp_launcher.main(["plugins"]))
"""


def test_ctrl_c_while_importing_is_one_line_and_exit_130():
    done = subprocess.run([sys.executable, "-c", _IMPORT_INTERRUPTED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130
    assert done.stderr == "kgp: interrupted while starting; nothing was done\n"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="watches /proc/PID/maps for torch's library")
def test_a_real_sigint_while_the_console_script_imports_torch():
    """The installed `kgp` script, interrupted once torch's library is mapped (its import takes seconds)."""
    exe = Path(sys.executable).parent / "kgp"
    if not exe.exists():
        pytest.skip("no kgp console script beside this interpreter")
    proc = subprocess.Popen([str(exe), "plugins"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError):
            break
        if "libtorch" in maps:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the import finished before the signal arrived")
    assert proc.returncode == 130, err
    assert err == "kgp: interrupted while starting; nothing was done\n"


# ------------------------------------------------------------------ --help lists what is installed
def test_fit_help_lists_every_installed_plugin_including_new_ones(capsys, not_psd_objective):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    registry = kgp.registry.registry
    objectives = registry.names("objective")
    assert {"exact", "holdout", "sgpr", not_psd_objective} <= set(objectives)
    assert f"objective: {', '.join(objectives)}" in text  # a runtime registration too: nothing hard-coded
    assert f"solver plugin name: {', '.join(registry.names('solver'))}" in text
    assert f"center-selector plugin name: {', '.join(registry.names('selector'))}" in text


# ------------------------------------------------------------------ --threads, --progress, dtype
def test_threads_sets_torchs_thread_count(tmp_path, capsys):
    data = _csv(tmp_path / "d.csv")
    before = torch.get_num_threads()
    try:
        assert main(["fit", "--data", str(data), "--threads", "1", "--out", str(tmp_path / "m.pt")]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as info:
            main(["fit", "--data", str(data), "--threads", bad, "--out", str(tmp_path / "m.pt")])
        assert info.value.code == 2
        assert f"argument --threads: expected a positive integer, got '{bad}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "tty", "expected"),
    [([], True, True), ([], False, False), (["--no-progress"], True, False), (["--progress"], False, True)],
)
def test_progress_is_on_by_default_when_stderr_is_a_terminal(tmp_path, monkeypatch, flag, tty, expected):
    data = _csv(tmp_path / "d.csv")
    seen = []
    real_fit = kgp.KernelRegressor.fit

    def spy(self, *args, **kwargs):
        seen.append(self.progress)
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(kgp.KernelRegressor, "fit", spy)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    assert main(["fit", "--data", str(data), *flag, "--out", str(tmp_path / "m.pt")]) == 0
    assert seen == [expected]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_cli_and_the_api_choose_the_same_default_dtype(tmp_path, dtype):
    np.savez(tmp_path / "d.npz", X=X.astype(dtype), y=Y.astype(dtype))
    assert main(["fit", "--data", str(tmp_path / "d.npz"), "--out", str(tmp_path / "m.pt")]) == 0
    api = kgp.KernelRegressor().fit(X.astype(dtype), Y.astype(dtype))
    assert kgp.load(tmp_path / "m.pt").dtype_ == api.dtype_ == getattr(torch, np.dtype(dtype).name)
    _csv(tmp_path / "d.csv")  # text is read as float64, as numpy reads it
    assert main(["fit", "--data", str(tmp_path / "d.csv"), "--out", str(tmp_path / "c.pt")]) == 0
    assert kgp.load(tmp_path / "c.pt").dtype_ == torch.float64


def test_datasets_work_after_import_kgp_alone():
    code = "import kgp; X, y = kgp.datasets.load_demo(); print(kgp.datasets.standardized_split(X, y)[0].shape)"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(824, 8)"
