"""LAPACK's Cholesky (``?potrf``) called on a tensor's own memory, from the LAPACK that torch's CPU build carries.

``torch.linalg.cholesky_ex`` on a factor-sized matrix does two things besides LAPACK's work: a C-ordered input
is copied into LAPACK's order and back (1.6-1.9x the factorization at n = 2,000), and with ``out=`` on the
transposed view (no copy) it zeroes the other triangle with a strided ``triu_`` that walks the matrix against
its layout: 10 ms at n = 2,000, against 0.3-0.5 ms for a ``tril_`` in the matrix's own order (2-core Intel Xeon
host). Called directly, MKL's ``potrf`` factors in place and the caller zeroes the triangle in
order: 0.52-0.83x the time of kgp's blocked loop at n = 2,000 to 10,000 in both dtypes (283-303 GFLOP/s in
float32, 146-150 in float64, against a GEMM rate of 326 / 158; docs/benchmarks/roofline.md).

torch's Linux x86 wheels link MKL statically into ``libtorch_cpu`` and export its LAPACK symbols
(``spotrf_``, ``dpotrf_``; their integers are passed as 64-bit ones holding 32-bit values, which both LAPACK
integer widths read alike on a little-endian CPU). Where the symbols are missing (another platform or build)
or a one-time check on a 3 x 3 matrix disagrees with ``torch.linalg.cholesky``, :func:`potrf_applies` is False
and callers use torch's routine. The call releases the GIL and runs on the threads torch set for MKL.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch
from torch import Tensor

__all__ = ["potrf_applies", "potrf_lower"]

_SYMBOLS = {torch.float32: "spotrf_", torch.float64: "dpotrf_"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        for name in _SYMBOLS.values():
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [ctypes.c_char_p] + [ctypes.c_void_p] * 4
    except (OSError, AttributeError):
        return None
    return lib


def _call(A: Tensor) -> int:
    # 64-bit integers holding 32-bit values: on a little-endian CPU both LAPACK integer widths (LP64, which
    # torch's MKL uses, and ILP64) read the same n, and a 32-bit info lands in the low half of a zeroed 64
    n = ctypes.c_int64(A.shape[0])
    info = ctypes.c_int64(0)
    # A C-ordered matrix is, read in LAPACK's column order, its transpose: LAPACK's upper triangle there is
    # A's lower one, so the upper factor it writes is A's lower factor L (its strict upper triangle is left as it was)
    getattr(_library(), _SYMBOLS[A.dtype])(
        b"U", ctypes.byref(n), ctypes.c_void_p(A.data_ptr()), ctypes.byref(n), ctypes.byref(info)
    )
    return int(info.value)


@functools.cache
def _works(dtype: torch.dtype) -> bool:
    """The symbol exists and factors a known 3 x 3 matrix as torch does (checked once per dtype)."""
    if _library() is None or sys.byteorder != "little":
        return False
    A = torch.tensor([[4.0, 2.0, 0.4], [2.0, 5.0, 1.0], [0.4, 1.0, 3.0]], dtype=dtype)
    expected = torch.linalg.cholesky(A)
    W = A.clone()
    try:
        info = _call(W)
    except Exception:  # noqa: BLE001 - a foreign call that misbehaves means: use torch's routine
        return False
    return info == 0 and bool(torch.allclose(W.tril(), expected, rtol=1e-5, atol=1e-6))


def potrf_applies(A: Tensor) -> bool:
    """Whether :func:`potrf_lower` can factor ``A``: a contiguous square float32/float64 CPU matrix that does not
    require grad, with the LAPACK symbols available (see the module docstring)."""
    return (
        A.device.type == "cpu"
        and A.dtype in _SYMBOLS
        and A.ndim == 2
        and A.shape[0] == A.shape[1]
        and 0 < A.shape[0] < 2**31
        and A.is_contiguous()
        and not (torch.is_grad_enabled() and A.requires_grad)
        and _works(A.dtype)
    )


def potrf_lower(A: Tensor, *, zero_upper: bool = True) -> int:
    """Factor ``A = L L^T`` in place (``L`` over the lower triangle, the strict upper one set to 0); LAPACK's ``info``.

    Only the lower triangle of ``A`` is read. ``info > 0``: the leading minor of that order is not positive
    definite (the lower triangle is then partly overwritten). ``zero_upper=False`` leaves the strict upper
    triangle as it was, success or not: a symmetric matrix keeps a copy of itself there, from which a failed
    try can be restored (:func:`kgp.linalg.cholesky.psd_cholesky_in_place`). ``A`` must satisfy
    :func:`potrf_applies`.
    """
    if not potrf_applies(A):
        raise ValueError("potrf_lower: expected a contiguous square float32/float64 CPU matrix without grad")
    info = _call(A)
    if zero_upper:
        A.tril_()
    return info
