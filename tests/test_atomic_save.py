"""Saving is atomic: an interrupted or failed re-save leaves the previous model file intact and no
temporary file behind, and a process loading while another re-saves never sees a part of a file.

Before the fix (``torch.save`` straight into the destination) the interruption tests left a truncated
file that ``kgp.load`` refused, and the concurrent reader failed on part of its loads.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import kgp
from kgp import io

_rng = np.random.default_rng(0)
X = _rng.normal(size=(300, 2))
Y = np.sin(X[:, 0]) + X[:, 1]


def _model(noise: float):
    return kgp.KernelRegressor(noise=noise, solver="falkon", n_centers=200, random_state=0).fit(X, Y)


@pytest.fixture(scope="module")
def models():
    return _model(0.1), _model(1.0)


def _interrupt_mid_write(exc: BaseException):
    """A torch.save that writes the first half of the real file, then raises ``exc`` (Ctrl-C, a full disk)."""
    real = torch.save

    def partial(obj, fh):
        import io as _io

        buffer = _io.BytesIO()
        real(obj, buffer)
        fh.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise exc

    return partial


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(("torch.save", KeyboardInterrupt()), id="ctrl-c-mid-write"),
        pytest.param(("torch.save", OSError(errno.ENOSPC, "No space left on device")), id="disk-full-mid-write"),
        pytest.param(("fsync", OSError(errno.EIO, "Input/output error")), id="fsync-fails"),
        pytest.param(("replace", KeyboardInterrupt()), id="ctrl-c-before-rename"),
    ],
)
def test_an_interrupted_resave_keeps_the_previous_file(tmp_path, monkeypatch, models, failure):
    good, other = models
    path = tmp_path / "model.pt"
    good.save(path)
    where, exc = failure
    if where == "torch.save":
        monkeypatch.setattr(io.torch, "save", _interrupt_mid_write(exc))
    else:

        def fail(*args, **kwargs):
            raise exc

        monkeypatch.setattr(io.os, where, fail)
    with pytest.raises(type(exc)):
        other.save(path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temporary file left behind
    np.testing.assert_array_equal(kgp.load(path).predict(X), good.predict(X))


def test_a_first_save_interrupted_leaves_no_file(tmp_path, monkeypatch, models):
    monkeypatch.setattr(io.torch, "save", _interrupt_mid_write(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        models[0].save(tmp_path / "new.pt")
    assert list(tmp_path.iterdir()) == []


_READER = textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np
    import kgp
    path, loads = sys.argv[1], int(sys.argv[2])
    X = np.load(sys.argv[3])
    seen, failures = {}, []
    print("ready", flush=True)
    for _ in range(loads):
        try:
            key = f"{float(kgp.load(path).predict(X[:1])[0]):.12g}"
            seen[key] = seen.get(key, 0) + 1
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
    print(json.dumps({"seen": seen, "failures": failures}))
    """
)


def test_a_reader_never_sees_a_part_of_a_file_being_resaved(tmp_path, models):
    """One process loads 150 times while this one re-saves two different models without pause."""
    a, b = models
    path = tmp_path / "model.pt"
    a.save(path)
    np.save(tmp_path / "X.npy", X)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(path), "150", str(tmp_path / "X.npy")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert reader.stdout.readline().strip() == "ready"
    saves = 0
    while reader.poll() is None:
        (a if saves % 2 else b).save(path)
        saves += 1
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["failures"] == [], result["failures"][:3]
    expected = {f"{float(m.predict(X[:1])[0]):.12g}" for m in models}
    assert set(result["seen"]) <= expected and sum(result["seen"].values()) == 150
    assert saves > 10  # the writer was busy while the reader read
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.npy", "model.pt"]


def test_permissions_follow_the_umask_or_the_replaced_file(tmp_path, models):
    umask = os.umask(0)
    os.umask(umask)
    fresh = tmp_path / "fresh.pt"
    models[0].save(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask  # as any new file (mkstemp would give 0o600)
    kept = tmp_path / "kept.pt"
    models[0].save(kept)
    os.chmod(kept, 0o640)
    models[1].save(kept)
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640


def test_saving_through_a_symlink_replaces_its_target(tmp_path, models):
    target = tmp_path / "real.pt"
    link = tmp_path / "link.pt"
    models[0].save(target)
    link.symlink_to(target)
    models[1].save(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    np.testing.assert_array_equal(kgp.load(target).predict(X), models[1].predict(X))


def test_a_directory_or_a_missing_folder_is_refused_by_name(tmp_path, models):
    with pytest.raises(IsADirectoryError, match=f"{tmp_path}: is a directory; give a file name"):
        models[0].save(tmp_path)
    with pytest.raises(FileNotFoundError, match="the folder .*missing does not exist"):
        models[0].save(tmp_path / "missing" / "m.pt")
    assert list(tmp_path.iterdir()) == []
