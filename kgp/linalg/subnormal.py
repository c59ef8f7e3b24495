"""Subnormal numbers kept out of dense factorizations: entries flushed in software, and the CPU's flush-to-zero mode.

Some CPUs process subnormal operands and results 10-100x slower than normal ones. Kernel matrices with short
lengthscales hold entries near the smallest normal number, and the GEMMs of a factorization multiply them into
subnormal range. Two remedies, used together:

- In software: entries below :func:`tiny_fraction` of a matrix's scale are set to 0 (:func:`zero_small_entries`,
  :func:`flush_below_scale`, :func:`flush_for_cholesky`), so that no product of two kept entries is subnormal.
- In the CPU: :func:`flush_denormals` runs a block with the flush-to-zero and denormals-are-zero modes on in
  every thread torch computes on. LAPACK's ``potrf`` on UCI pumadyn32nm's float32 ``K_MM`` (M = 5,000) took
  17.3 s against 1.2 s with the input and each panel flushed by kgp's own blocked loop (2-core Intel Xeon host);
  the mode does the same inside LAPACK. It is a per-thread register and torch only sets the calling thread's:
  :func:`flush_denormals` also sets it in the OpenMP threads that torch and MKL run on, by entering one parallel
  region of torch's own ``libgomp`` whose body (a ctypes callback) sets the mode in each thread and checks there
  that a subnormal number multiplies to 0. Values below the dtype's smallest normal number (1.2e-38 in float32,
  2.2e-308 in float64) then become 0, less than the software flush already changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import struct
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = [
    "flush_below_scale",
    "flush_denormals",
    "flush_for_cholesky",
    "tiny_fraction",
    "zero_small_entries",
]

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


def tiny_fraction(dtype: torch.dtype) -> float:
    """The square root of ``dtype``'s smallest normal number (2^-63 in float32, 2^-511 in float64).

    Entries of a matrix below this fraction of its scale can be set to 0 before a factorization
    (:func:`zero_small_entries`, ``cholesky_in_place(flush_below=...)``) so that no product of two kept
    entries is subnormal: some CPUs process subnormal operands 10-100x slower. kgp's kernels floor ``exp``
    near the dtype's smallest normal number, but the GEMMs of a factorization multiply such entries. On the
    2-core Intel Xeon host (UCI parkinsons, short lengthscales) FALKON's float64
    setup at M = 4,700 took 78 s and the exact solver's float64 Cholesky at n = 4,700 took 22 s; flushed,
    2.3 s and 0.5 s. The change to the matrix is below 1e-150 of its scale in float64 (1e-19 in float32).
    """
    return math.sqrt(torch.finfo(dtype).tiny)


def flush_for_cholesky(A: Tensor) -> float | None:
    """Set the entries of a symmetric positive definite ``A`` below :func:`tiny_fraction` of its mean diagonal
    to 0, in place; return the ``flush_below`` for its factor (the same fraction of the factor's scale, the
    root of the mean diagonal) to pass to :func:`cholesky_in_place`, or None (nothing changed) if the mean
    diagonal is not positive and finite.
    """
    scale = float(A.diagonal().mean())
    if not flush_below_scale(A, scale):
        return None
    return tiny_fraction(A.dtype) * math.sqrt(scale)


def flush_below_scale(X: Tensor, scale: float) -> bool:
    """Set the entries of ``X`` below :func:`tiny_fraction` of ``scale`` in magnitude to 0, in place.

    Their products with anything of the size of ``scale`` are subnormal (slow on some CPUs) and far below
    what a sum of such products resolves. Returns False, changing nothing, where ``scale`` is not positive
    and finite.
    """
    if not (math.isfinite(scale) and scale > 0):
        return False
    zero_small_entries(X, tiny_fraction(X.dtype) * scale)
    return True


def zero_small_entries(X: Tensor, threshold: float, *, rows: int | None = None) -> Tensor:
    """Set the entries of ``X`` smaller than ``threshold`` in magnitude to 0, in place (NaN and inf are kept).

    Keeps subnormal numbers out of float32 factorizations (see ``cholesky_in_place``'s ``flush_below``).
    ``threshold`` is rounded to ``X``'s dtype, as a comparison of ``X`` with it would be. One pass of
    ``torch.hardshrink`` written over ``X``, which zeroes ``|x| <= lambd``: ``lambd`` is the largest value
    of the dtype below the threshold. One pass instead of a magnitude, a mask and a masked fill (three passes
    and two temporaries): 0.19 s against 2.04 s for a 20,000 x 20,000 float32 matrix (2-core Intel Xeon host,
    two passive threads). ``rows``: rows per call (None: all of ``X`` at once). No autograd:
    ``X`` must not require grad (a flush is a numerical device, not part of a model).
    """
    lambd = float(torch.nextafter(torch.tensor(threshold, dtype=X.dtype), torch.tensor(0.0, dtype=X.dtype)))
    rows = X.shape[0] if rows is None else rows
    for r in range(0, X.shape[0], max(1, rows)):
        part = X[r : r + rows]
        torch.hardshrink(part, lambd, out=part)
    return X
