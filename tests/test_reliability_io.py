"""A full disk during a save, and the messages of issue 44's item 9.

* A save to a full disk raised torch's ``RuntimeError: [enforce fail at inline_container.cc:672] unexpected
  pos 16128 vs 16080``: it now raises the ``OSError`` of the failure (``errno.ENOSPC``, "No space left on
  device") naming the path given, and the previous file stays as it was. The full disk is simulated below
  the serialiser (the file's raw writes), so torch sees the failure exactly as on a real disk.
* A FIFO given as a model file was "empty file"; Latin-1 and UTF-16 CSV files were "not a text CSV file";
  ``memory_budget(np.int64(2**30))`` was refused; a finite 1e300 given to a float32 model was "NaN or
  infinite".
"""

from __future__ import annotations

import errno
import io as pyio
import os
import threading

import numpy as np
import pytest

import kgp
from kgp import io
from kgp.cli import main

_rng = np.random.default_rng(0)
X = _rng.normal(size=(300, 2))
Y = np.sin(X[:, 0]) + X[:, 1]


@pytest.fixture(scope="module")
def models():
    small = kgp.KernelRegressor(noise=0.1, solver="falkon", n_centers=20, random_state=0).fit(X, Y)
    large = kgp.KernelRegressor(noise=1.0, solver="falkon", n_centers=250, random_state=0).fit(X, Y)
    return small, large


# ------------------------------------------------------------------ full disk
class _FullDisk(pyio.RawIOBase):
    """A file descriptor on a disk with ``room`` bytes left: a short write fills it, the next raises ENOSPC."""

    def __init__(self, fd: int, room: int):
        self._fd, self._room = fd, room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        if self._room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(self._fd, data[: self._room])
        self._room -= n
        return n

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


class _FullDiskRaising(_FullDisk):
    """As :class:`_FullDisk`, but the write that does not fit raises at once (no short write)."""

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(self._fd, data)
        self._room -= n
        return n


# what kgp.io's os.fdopen returns: a buffered file as on a real disk, or the raw file that torch's writer then
# talks to directly (a short write, or a write that raises: both reached the user as torch's "unexpected pos")
FILES = {
    "buffered": lambda fd, room: pyio.BufferedWriter(_FullDisk(fd, room)),
    "short_write": _FullDisk,
    "raising_write": _FullDiskRaising,
}


def _disk_with_room(monkeypatch, room: int, kind: str = "buffered") -> None:
    """Every file kgp.io opens for writing sits on a disk with ``room`` bytes left."""
    monkeypatch.setattr(io.os, "fdopen", lambda fd, mode="wb": FILES[kind](fd, room))


def _assert_named_enospc(exc: BaseException, path) -> None:
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, repr(exc)
    assert "No space left on device" in str(exc) and str(path) in str(exc), str(exc)
    assert "inline_container" not in str(exc) and "unexpected pos" not in str(exc)
    assert any("the previous file is unchanged" in note for note in getattr(exc, "__notes__", []))


# room: nothing at all; a few bytes into the archive; most of the file
@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("room", [0, 100, 6000])
def test_a_full_disk_during_a_resave_names_enospc_and_the_path_and_keeps_the_file(
    tmp_path, monkeypatch, models, room, kind
):
    small, large = models
    path = tmp_path / "model.pt"
    small.save(path)
    before = path.read_bytes()
    _disk_with_room(monkeypatch, room, kind)
    with pytest.raises(OSError) as info:
        large.save(path)
    monkeypatch.undo()
    _assert_named_enospc(info.value, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temporary file left behind
    assert path.read_bytes() == before
    np.testing.assert_array_equal(kgp.load(path).predict(X), small.predict(X))


def test_a_full_disk_found_at_fsync_is_named_too(tmp_path, monkeypatch, models):
    """Network and delayed-allocation file systems report ENOSPC when the data is flushed."""
    small, large = models
    path = tmp_path / "model.pt"
    small.save(path)

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io.os, "fsync", fsync)
    with pytest.raises(OSError) as info:
        large.save(path)
    monkeypatch.undo()
    _assert_named_enospc(info.value, path)
    np.testing.assert_array_equal(kgp.load(path).predict(X), small.predict(X))


def test_the_cli_says_no_space_left_on_device(tmp_path, monkeypatch, capsys):
    data = tmp_path / "d.csv"
    np.savetxt(data, np.column_stack([X, Y]), delimiter=",", header="a,b,y", comments="")
    out = tmp_path / "m.pt"
    _disk_with_room(monkeypatch, 100, "raising_write")  # was "kgp fit: error: [enforce fail at inline_container..."
    assert main(["fit", "--data", str(data), "--solver", "falkon", "--n-centers", "50", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and str(out) in err, err
    assert "unexpected pos" not in err and not out.exists()


# ------------------------------------------------------------------ a FIFO as a model file
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_given_as_a_model_is_not_a_regular_file_and_is_never_opened(tmp_path, capsys):
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    result: dict = {}

    def load():  # opening a FIFO for reading would block until a writer comes: a thread with a deadline
        try:
            kgp.load(fifo)
        except Exception as exc:
            result["exc"] = exc

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # release the blocked reader, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("kgp.load blocked on a FIFO")
    exc = result["exc"]
    assert isinstance(exc, kgp.ModelFileError), repr(exc)
    assert "not a regular file but a FIFO (named pipe)" in str(exc) and str(fifo) in str(exc)
    assert "empty" not in str(exc)
    assert main(["predict", "--model", str(fifo), "--data", str(tmp_path / "none.csv")]) == 1
    assert "not a regular file but a FIFO" in capsys.readouterr().err


# ------------------------------------------------------------------ CSV encodings
_TEXT = "a,b,y\n" + "".join(f"{i},{i + 1},{i * 0.5}\n" for i in range(50))


@pytest.mark.parametrize(
    "name, content, words",
    [
        (
            "latin1.csv",
            _TEXT.encode() + "9,caf\u00e9,1\n".encode("latin-1"),
            f"is not UTF-8 text: byte 0xe9 at offset {len(_TEXT) + 5} (line 52) is not valid UTF-8",
        ),
        ("cp1252.csv", "a,b,y\n1,2,\u20ac\n".encode("cp1252"), "byte 0x80 at offset 10 (line 2)"),
        ("utf16.csv", _TEXT.encode("utf-16"), "is UTF-16 text (byte-order mark FF FE), not UTF-8"),
        ("utf16be.csv", _TEXT.encode("utf-16-be"), "looks like UTF-16BE text (no byte-order mark"),
        ("utf16le.csv", _TEXT.encode("utf-16-le"), "looks like UTF-16LE text (no byte-order mark"),
    ],
)
def test_a_csv_in_another_encoding_says_which_and_how_to_fix_it(tmp_path, capsys, name, content, words):
    data = tmp_path / name
    data.write_bytes(content)
    assert main(["fit", "--data", str(data), "--out", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kgp fit: error: --data: {data} ") and err.count("\n") == 1, err
    assert words in err and "re-save the file as UTF-8" in err, err


def test_a_gzipped_latin1_csv_names_the_offset_in_the_decompressed_text(tmp_path, capsys):
    import gzip

    data = tmp_path / "big.csv.gz"
    with gzip.open(data, "wb") as fh:  # the bad byte past the first megabyte: found block by block
        fh.write(_TEXT.encode() * 30_000 + "1,\u00e9,2\n".encode("latin-1"))
    assert main(["fit", "--data", str(data), "--out", str(tmp_path / "m.pt")]) == 1
    err = capsys.readouterr().err
    assert f"byte 0xe9 at offset {len(_TEXT) * 30_000 + 2:,} of the decompressed text (line {51 * 30_000 + 1:,})" in err


# ------------------------------------------------------------------ settings take numpy integers
def test_memory_budget_takes_a_numpy_integer():
    with kgp.settings.memory_budget(np.int64(2**30)):
        assert kgp.settings.memory_budget.value() == 2**30
        assert type(kgp.settings.memory_budget.value()) is int
    with kgp.settings.max_exact_size(np.int32(500)), kgp.settings.block_rows(np.uint16(64)):
        assert kgp.settings.max_exact_size.value() == 500 and kgp.settings.block_rows.value() == 64
    with kgp.settings.distributed_timeout(np.int64(5)):
        assert kgp.settings.distributed_timeout.value() == 5.0
    for bad in (True, np.bool_(True), np.float64(2.0**30), 0, np.int64(-1)):
        with pytest.raises(ValueError, match="memory_budget: expected a positive integer"):
            kgp.settings.memory_budget(bad)


# ------------------------------------------------------------------ float32 overflow
@pytest.mark.parametrize("value", [1e300, -1e39])
def test_a_finite_value_beyond_float32_says_it_overflows(value):
    model = kgp.KernelRegressor(solver="exact", dtype="float32").fit(X[:100], Y[:100])
    query = np.array([[value, 0.0], [0.1, 0.2]])
    with pytest.raises(ValueError) as info:
        model.predict(query)
    message = str(info.value)
    assert message.startswith("X: 1 finite value(s) overflow float32"), message
    assert f"{abs(value):.3g}" in message and "3.403e+38" in message and "dtype='float64'" in message
    assert "NaN" not in message
    # the same at fit; a real NaN or infinity is still called so
    with pytest.raises(ValueError, match="overflow float32"):
        kgp.KernelRegressor(solver="exact", dtype="float32").fit(np.vstack([X[:50], query]), Y[:52])
    with pytest.raises(ValueError, match="contains 1 NaN or infinite"):
        model.predict(np.array([[np.inf, 0.0]]))
