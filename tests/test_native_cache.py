"""The compiled-library cache (:mod:`kgp.linalg.native_build`): a damaged, empty or foreign file in the cache is never
loaded (loading one can kill the process inside the dynamic loader), but rebuilt; a failed build leaves nothing.

Every load of a damaged cache runs in a child process, so that a regression crashes the child and fails the
test instead of killing the test run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kgp.linalg import native_build

SOURCE = "int kgp_answer(void) { return 42; }\n"


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "answer.c"
    path.parent.mkdir()
    path.write_text(SOURCE)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("KGP_CACHE_DIR", str(folder))
    return folder


def _fake_compiler(tmp_path: Path, body: str) -> str:
    """A 'compiler' script: answers --version, and on a build runs ``body`` with $OUT the -o argument."""
    script = tmp_path / "fakecc"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            if [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi
            OUT=""
            while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then OUT="$2"; fi; shift; done
            """
        )
        + body
        + "\n"
    )
    script.chmod(0o755)
    return str(script)


def _load_in_child(source: Path, cache: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys; from pathlib import Path; from kgp.linalg import native_build; "
        "print(native_build.build_library(Path(sys.argv[1])).kgp_answer())"
    )
    env = dict(os.environ, KGP_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", code, str(source)], capture_output=True, text=True, env=env)


def _only_library(cache: Path) -> Path:
    files = sorted(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".so", files
    return files[0]


def test_a_built_library_is_sealed_and_loads(source: Path, cache: Path) -> None:
    assert native_build.build_library(source).kgp_answer() == 42
    library = _only_library(cache)
    assert native_build.seal_intact(library)
    stamp = library.stat().st_mtime_ns
    assert native_build.build_library(source).kgp_answer() == 42
    assert library.stat().st_mtime_ns == stamp  # an intact library is loaded, not rebuilt


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "unsealed"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(source: Path, cache: Path, damage: str) -> None:
    first = _load_in_child(source, cache)
    assert first.returncode == 0 and first.stdout.strip() == "42", first.stderr
    library = _only_library(cache)
    data = bytearray(library.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 3] ^= 0x10
    elif damage == "empty":
        data = bytearray()
    else:  # a library written without the seal (a build by another tool or an older kgp)
        data = data[: -native_build._SEAL_BYTES]
    library.write_bytes(bytes(data))
    assert not native_build.seal_intact(library)
    again = _load_in_child(source, cache)
    assert again.returncode == 0 and again.stdout.strip() == "42", (again.returncode, again.stderr)
    assert _only_library(cache) == library and native_build.seal_intact(library)


@pytest.mark.parametrize(
    "body, reason",
    [
        ("exit 0", "wrote no library"),
        ('echo "this is not a shared library" > "$OUT"; exit 0', "does not load"),
        ('echo "error: bad source" >&2; exit 1', "bad source"),
    ],
)
def test_a_failed_build_raises_and_leaves_nothing(
    source: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, reason: str
) -> None:
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, body))
    with pytest.raises(RuntimeError, match=reason):
        native_build.build_library(source)
    assert list(cache.iterdir()) == []


def test_files_of_a_killed_build_are_removed_by_the_next_build(source: Path, cache: Path) -> None:
    cache.mkdir()
    stale = cache / ".answer-killed.building"
    stale.write_bytes(b"half a library")
    old = time.time() - 2 * native_build._STALE_SECONDS
    os.utime(stale, (old, old))
    running = cache / ".answer-running.building"  # a build in progress in another process: left alone
    running.write_bytes(b"")
    assert native_build.build_library(source).kgp_answer() == 42
    assert not stale.exists() and running.exists()


def test_the_native_pass_survives_a_truncated_cache(tmp_path: Path) -> None:
    """The reproducer from the reliability sweep: a truncated fused-pass library, then a fit in a new process."""
    env = dict(os.environ, KGP_CACHE_DIR=str(tmp_path))
    code = textwrap.dedent(
        """\
        import numpy as np, kgp
        from kgp.operators import fused_cpu
        assert fused_cpu.native_error() is None, fused_cpu.native_error()
        X = np.random.default_rng(0).random((300, 3))
        print(kgp.KernelRegressor("rbf", noise=1e-2).fit(X, X[:, 0]).predict(X[:2]).shape)
        """
    )
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0
    (library,) = tmp_path.glob("fused_cpu-*.so")
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "(2,)"
    assert native_build.seal_intact(library)
