"""Building kgp's C sources on first use and running them on torch's threads' worth of Python threads.

kgp keeps two loops in C where torch has no operation that does the work in one pass over memory: the fused
kernel pass (:mod:`kgp.operators.fused_cpu`) and the triangular solves that read a float32 factor and sum in
float64 (:mod:`kgp.triangular`). Each source is compiled by the system's C compiler (``gcc`` or ``$CC``,
``-O3 -march=native``, or ``-march=$KGP_NATIVE_ARCH``; well under a second) into ``$KGP_CACHE_DIR``
(default ``~/.cache/kgp``), under a name keyed by the source, the compiler and the CPU's feature flags, and
loaded with ctypes. ctypes releases the GIL during a call, so one Python thread per torch thread runs a
share of the work (:func:`executor`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

__all__ = ["build_library", "cache_dir", "executor", "run_parallel"]


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


def build_library(source: Path) -> ctypes.CDLL:
    """Compile ``source`` into the cache (once per source, compiler, CPU and flags) and load it.

    Raises
    ------
    RuntimeError
        Without a C compiler, or when the compiler fails (its error output is in the message).
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
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # built under a temporary name and renamed: processes building at once never load a partial file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                done = subprocess.run(
                    [compiler, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300
                )
                if done.returncode != 0:
                    raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
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
