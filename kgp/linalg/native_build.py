"""Building kgp's C sources on first use and running them on torch's threads' worth of Python threads.

kgp keeps two loops in C where torch has no operation that does the work in one pass over memory: the fused
kernel pass (:mod:`kgp.operators.fused_cpu`) and the triangular solves that read a float32 factor and sum in
float64 (:mod:`kgp.linalg.lower_factor`). Each source is compiled by the system's C compiler (``gcc`` or ``$CC``,
``-O3 -march=native``, or ``-march=$KGP_NATIVE_ARCH``; well under a second) into ``$KGP_CACHE_DIR``
(default ``~/.cache/kgp``), under a name keyed by the source, the compiler and the CPU's feature flags, and
loaded with ctypes. A build is loaded once in a child process, sealed with its SHA-256 and renamed into place
after an fsync; a cached file whose seal does not hold (truncated, bit-flipped, left by a killed build) is
never loaded, but rebuilt, since a damaged library can kill the process inside the loader. ctypes releases
the GIL during a call, so one Python thread per torch thread runs a share of the work (:func:`executor`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

__all__ = ["build_library", "cache_dir", "executor", "run_parallel", "seal_intact"]


def compiler_flags() -> list[str]:
    """The compiler's flags; ``KGP_NATIVE_ARCH`` sets another ``-march`` than the host's own (CI builds the
    256-bit form on AVX-512 hosts too)."""
    arch = os.environ.get("KGP_NATIVE_ARCH") or "native"
    # -fno-math-errno: sqrt without errno is one vector instruction (the Matern families)
    return ["-O3", f"-march={arch}", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$KGP_CACHE_DIR``, else ``$XDG_CACHE_HOME/kgp`` or ``~/.cache/kgp``."""
    if os.environ.get("KGP_CACHE_DIR"):
        return Path(os.environ["KGP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kgp"


def cpu_flags() -> str:
    """The CPU's feature flags: a library built with ``-march=native`` on one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_build_lock = threading.Lock()

_SEAL = b"kgp-sealed-library-sha256:"
"""Marks the trailer appended to a built library: this text and the SHA-256 of the bytes before it. The dynamic
loader maps an ELF file's segments from its program headers and ignores bytes after them, so the sealed file
loads as the compiler wrote it, and one file (renamed into place whole) carries its own check."""
_SEAL_BYTES = len(_SEAL) + hashlib.sha256().digest_size
_STALE_SECONDS = 3600.0
"""A temporary build file older than this was left by a killed build (a build times out after 300 s)."""


def _sealed(library: bytes) -> bytes:
    return library + _SEAL + hashlib.sha256(library).digest()


def seal_intact(path: Path) -> bool:
    """Whether ``path`` is a library this module built and sealed, byte for byte as it was written.

    A truncated, bit-flipped, empty or foreign file fails: loading such a file can kill the process inside
    ``dlopen`` (SIGBUS, SIGSEGV) where no Python ``except`` reaches, so nothing is loaded before this holds.
    """
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if len(data) <= _SEAL_BYTES:
        return False
    body, trailer = data[:-_SEAL_BYTES], data[-_SEAL_BYTES:]
    return trailer == _SEAL + hashlib.sha256(body).digest()


def _remove_stale_builds(folder: Path, stem: str) -> None:
    """Delete temporary files of builds that were killed before they could clean up after themselves."""
    now = time.time()
    for leftover in folder.glob(f".{stem}-*.building"):
        try:
            if now - leftover.stat().st_mtime > _STALE_SECONDS:
                leftover.unlink()
        except OSError:
            pass  # another process removed it, or the folder is read-only: a later build tries again


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _loads_in_a_child(path: str) -> str | None:
    """Load the library in a separate interpreter: a library that crashes the loader kills the child, not the
    caller. Returns None when it loads, else what went wrong."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", path],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        return f"exit status {done.returncode}: {done.stderr.strip()[-1000:]}"
    return None


def _build(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    """Compile, self-test in a child process, seal, fsync and rename into place; nothing partial is left."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(target.parent, source.stem)
    # built under a temporary name in the same folder and renamed: another process never sees a partial file
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".building", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        library = Path(tmp).read_bytes()
        if not library:
            raise RuntimeError(f"{compiler} exited 0 but wrote no library ({' '.join(flags)} -o {tmp})")
        failure = _loads_in_a_child(tmp)
        if failure is not None:
            raise RuntimeError(f"the library {compiler} built does not load: {failure}")
        _write_durably(Path(tmp), _sealed(library))
        os.replace(tmp, target)
        _fsync_folder(target.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (a crash after it leaves the new name, not an empty entry)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the file's own data is synced already
    finally:
        os.close(fd)


def build_library(source: Path) -> ctypes.CDLL:
    """Compile ``source`` into the cache (once per source, compiler, CPU and flags) and load it.

    A cached library is loaded only when its seal holds (:func:`seal_intact`); a damaged one is rebuilt in its
    place. A new build is loaded once in a child process before it is sealed and renamed into the cache, so a
    compiler that writes nothing or a broken file leaves nothing behind.

    Raises
    ------
    RuntimeError
        Without a C compiler, or when the compiler fails or its library does not load (the reason is in the
        message).
    """
    with _build_lock:
        compiler = shutil.which(os.environ.get("CC", "gcc"))
        if compiler is None:
            raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'gcc')!r} not found on PATH)")
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        flags = compiler_flags()
        key = hashlib.sha256(
            source.read_bytes() + version.encode() + cpu_flags().encode() + " ".join(flags).encode()
        ).hexdigest()[:20]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if not seal_intact(target):
            _build(compiler, flags, source, target)
            if not seal_intact(target):  # replaced again by a damaged file in between: refuse rather than load
                raise RuntimeError(f"the cached library {target} changed while it was being built; delete it")
        return ctypes.CDLL(str(target))


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def executor(threads: int) -> ThreadPoolExecutor:
    """One pool per thread count, never shut down: a pool in use by another caller stays valid."""
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kgp-native")
        return _pools[threads]


T = TypeVar("T")


def run_parallel(work: Callable[[T], object], shares: Sequence[T]) -> None:
    """``work(share)`` for every share, one pool thread each (on the calling thread when there is one share)."""
    if len(shares) == 1:
        work(shares[0])
    elif shares:
        list(executor(len(shares)).map(work, shares))
