"""Flush-to-zero for a factorization: subnormal numbers read and written as 0 in every thread torch computes on.

Some CPUs process subnormal operands and results 10-100x slower than normal ones. Kernel matrices with short
lengthscales hold entries near the smallest normal number, and a Cholesky multiplies them into subnormal
range: LAPACK's ``potrf`` on UCI pumadyn32nm's float32 ``K_MM`` (M = 5,000) took 17.3 s against 1.2 s with
the input and each panel flushed by kgp's own blocked loop (2-core Intel Xeon host). The CPU's
flush-to-zero and denormals-are-zero modes (``torch.set_flush_denormal``) do the same inside LAPACK, but the
mode is a per-thread register and torch only sets the calling thread's. :func:`flush_denormals` also sets it
in the OpenMP threads that torch and MKL run on, by entering one parallel region of torch's own ``libgomp``
whose body (a ctypes callback) sets the mode in each thread and checks there that a subnormal number
multiplies to 0.

Values below the dtype's smallest normal number (1.2e-38 in float32, 2.2e-308 in float64) become 0. kgp's
factorizations already set entries below ``sqrt(tiny)`` of the matrix's scale to 0 (:func:`kgp.linalg.tiny_fraction`):
the mode changes results by less than that.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import threading
from collections.abc import Iterator

import torch

__all__ = ["flush_denormals"]

_LOCK = threading.RLock()  # re-entrant: a nested block sees the mode on and leaves it
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
SUBNORMAL_BITS = 0x00200000  # a float32 subnormal number (2^-129), as its bit pattern (tests)
# a float64 subnormal number, made from its bits: computed in a flushing thread it would be 0
_SUBNORMAL = struct.unpack("<d", struct.pack("<Q", 1 << 40))[0]
_ZERO_BYTES = bytes(8)


@functools.cache
def _gomp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime (the one MKL's threads belong to), or None where torch carries none."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.isfile(path) or not torch.backends.openmp.is_available():
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.GOMP_parallel.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
    except (OSError, AttributeError):
        return None
    return lib


def _flushes_here() -> bool:
    """Whether the calling thread reads a subnormal number as 0 (the mode is per thread; Python's float
    arithmetic runs on the same SSE unit). Compared as bits: a float comparison would itself read it as 0."""
    return struct.pack("<d", _SUBNORMAL * 1.0) == _ZERO_BYTES


def _in_every_thread(on: bool | None) -> list[bool]:
    """Set the mode (unless ``on`` is None) in each of torch's OpenMP threads; whether each then flushes.

    One parallel region of torch's ``libgomp`` with torch's thread count: the threads that MKL and torch's own
    parallel loops run on. No tensor is allocated (memory-budget checks watch every allocation).
    """
    states: list[bool] = []

    @_CALLBACK
    def body(_):
        if on is not None:
            torch.set_flush_denormal(on)
        states.append(_flushes_here())

    _gomp().GOMP_parallel(body, None, max(1, torch.get_num_threads()), 0)
    return states


@contextlib.contextmanager
def flush_denormals() -> Iterator[bool]:
    """Run the block with flush-to-zero in every thread torch computes on (CPU); yields whether that holds.

    Yields False, changing nothing, where the mode cannot be set in every thread (no ``libgomp`` in torch's
    build, a CPU without the mode, or a check that fails); then the caller keeps its own flushing. On exit the
    threads go back to normal arithmetic, unless the mode was already on in all of them when the block began;
    the calling thread keeps a mode it had set itself (``torch.set_flush_denormal``).
    """
    if _gomp() is None:
        yield False
        return
    with _LOCK:
        threads = max(1, torch.get_num_threads())
        before = _in_every_thread(None)
        if len(before) == threads and all(before):  # already on (an enclosing block): leave it
            yield True
            return
        caller_had_it = _flushes_here()
        active = False
        try:  # set_flush_denormal is False where the CPU has no such mode
            if torch.set_flush_denormal(True):
                states = _in_every_thread(True)
                active = len(states) == threads and all(states) and _flushes_here()
        except Exception:  # noqa: BLE001 - a foreign runtime that misbehaves means: flush in software
            active = False
        try:
            yield active
        finally:
            _in_every_thread(False)
            torch.set_flush_denormal(caller_had_it)
