"""Repeated triangular solves with a few right-hand sides, at about the speed of reading the factor once.

An iterative solver that applies the same ``M x M`` triangular factor to one vector per iteration (FALKON's
CG: four solves an iteration, :mod:`kgp_builtins.falkon.preconditioner`) is bound by reading the factor's
triangle from memory. LAPACK's ``?trsv`` / ``?trsm`` (MKL in torch's CPU wheels) split the solve into many
small parallel steps; each ends with the threads waiting for one another, and with passive OpenMP threads
(``OMP_WAIT_POLICY=PASSIVE``, which the kgp command, the Makefile and CI set, see README "Threads") every
such wait is a sleep and a wake-up. On a 2-core Intel Xeon host (float64, one
right-hand side, ``benchmarks/bench_triangular_solve.py``) MKL took 11-13.5 / 34 / 90-116 ms at M = 5,000 /
10,000 / 20,000 with passive threads, against 2.4-2.9 / 13.5 / 51-53 ms with spinning ones, about the
memory bound.

:class:`LowerFactor` solves block row by block row instead: one matrix-vector product over the block row's
panel and one product with the inverse of its ``b x b`` diagonal block (inverted once, when the factor is
at the first block-row solve), so a solve is ``2 M / b`` large parallel operations rather than many small
ones. With inverted diagonal blocks the solve is still one fixed linear map (what a preconditioner needs),
within the block's condition number times a few ulps of ``L^{-1}``; the residuals ``||L X - B||`` measured
against LAPACK's were 0.5-3.3x its own (same benchmark).

A float32 factor solved with float64 right-hand sides (FALKON's float32 default, ``precond_dtype="mixed"``)
runs the same block rows in C (``triangular_mixed.c``, built on first use, :mod:`kgp.linalg.native_build`): each
float32 entry is widened in a register and every product and sum is float64, so the solve is the float64
solve with the widened factor, while it reads half the bytes and the factor is never widened in memory.
The panel products run on torch's thread count of Python threads, the diagonal blocks by substitution on
one. Without a C compiler the factor is widened once into a float64 copy instead (twice the memory).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch import Tensor

from .native_build import build_library, run_parallel
from .subnormal import flush_below_scale

__all__ = ["SOLVE_BLOCK", "LowerFactor", "mixed_solve_error", "threads_sleep_when_waiting"]

SOLVE_BLOCK = 1024
"""Rows per block of :class:`LowerFactor`. Measured with one right-hand side and passive threads (2-core
Intel Xeon, float64): 256 / 512 / 1024 rows took 91 / 71 / 63 ms at M = 20,000 (the lower
solve), 2048 rows 262 ms (the diagonal blocks' own products, ``b^2`` each, begin to dominate). The
inverted blocks add ``M b`` entries to the factor's ``M^2`` (5% at M = 20,000)."""


def threads_sleep_when_waiting() -> bool:
    """Whether OpenMP threads sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``), which libgomp reads once
    when the process starts; kgp reads the same variable, so a value changed later misleads both alike."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"


class LowerFactor:
    """A lower-triangular ``L`` (``M x M``) prepared for repeated solves ``L X = B`` and ``L^T X = B``.

    Parameters
    ----------
    L : Tensor
        Lower triangular, any strides; only its lower triangle is read. Kept by reference, not copied:
        change it in place only before the first solve.
    block : int
        Rows per block (:data:`SOLVE_BLOCK`).

    Notes
    -----
    Which solve runs (``benchmarks/bench_triangular_solve.py``, 2-core Intel Xeon, M = 2,000 to
    20,000, both dtypes, 1 / 2 / 8 columns): the block rows for one column with passive threads (0.19-0.66x
    LAPACK's time; with spinning threads they took 0.99-1.32x, so LAPACK's solve stays there), and for
    ``L^T X = B`` with two or more columns under either policy (0.34-0.93x with spinning threads, 0.46-0.89x
    with passive ones except at M <= 5,000 in float32, 1.06-1.36x there, under a millisecond); LAPACK's for
    ``L X = B`` with two or more columns, where the panel product with a few columns ran at 0.75-1.81x
    LAPACK's time, and for ``M <= block``. The diagonal blocks are inverted at the first block-row solve,
    ``O(M block^2)`` flops (0.014-0.24 s at M = 2,000-20,000).
    """

    def __init__(self, L: Tensor, *, block: int = SOLVE_BLOCK) -> None:
        if L.ndim != 2 or L.shape[0] != L.shape[1]:
            raise ValueError(f"LowerFactor: L must be a square matrix, got shape {tuple(L.shape)}")
        if block < 1:
            raise ValueError(f"LowerFactor: block must be a positive integer, got {block!r}")
        self.L = L
        self.block = block
        self._inverses: list[Tensor] | None = None
        self._wide: LowerFactor | None = None

    def uses_native(self, B: Tensor) -> bool:
        """Whether :meth:`solve` of ``B`` runs the native mixed-precision solve (float32 ``L``, float64 ``B``,
        on the CPU, ``L``'s rows contiguous, and the C source built here)."""
        L = self.L
        return (
            L.dtype == torch.float32
            and B.dtype == torch.float64
            and L.device.type == "cpu"
            and L.stride(1) == 1
            and _mixed_library() is not None
        )

    def uses_blocks(self, columns: int, *, transpose: bool) -> bool:
        """Whether :meth:`solve` of ``columns`` right-hand sides runs block rows (else LAPACK's solve)."""
        if self.L.shape[0] <= self.block or self.L.device.type != "cpu":
            return False
        return (columns == 1 and threads_sleep_when_waiting()) or (columns >= 2 and transpose)

    def solve(self, B: Tensor, *, transpose: bool = False) -> Tensor:
        """``L^{-1} B`` (or ``L^{-T} B`` with ``transpose``) for ``B`` of shape ``M x k``; a new tensor.

        ``B`` has the factor's dtype, or float64 with a float32 factor: then the solve runs in float64 on
        the factor's exactly widened entries (module docstring) and returns float64.
        """
        L = self.L
        if B.ndim != 2 or B.shape[0] != L.shape[0]:
            raise ValueError(f"LowerFactor.solve: B must have shape ({L.shape[0]}, k), got {tuple(B.shape)}")
        mixed = L.dtype == torch.float32 and B.dtype == torch.float64
        if (B.dtype != L.dtype and not mixed) or B.device != L.device:
            raise ValueError(
                f"LowerFactor.solve: B must have the factor's dtype and device ({L.dtype}, {L.device}), or "
                f"float64 with a float32 factor, got {B.dtype}, {B.device}"
            )
        if mixed:
            if self.uses_native(B):
                return self._solve_native(B, transpose)
            if self._wide is None:  # no compiler: a float64 copy of the factor
                self._wide = LowerFactor(L.to(torch.float64), block=self.block)
            return self._wide.solve(B, transpose=transpose)
        if not self.uses_blocks(B.shape[1], transpose=transpose):
            if transpose:
                return torch.linalg.solve_triangular(L.mT, B, upper=True)
            return torch.linalg.solve_triangular(L, B, upper=False)
        return self._solve_blocks(B, transpose)

    def _block_inverses(self) -> list[Tensor]:
        if self._inverses is None:
            L, M = self.L, self.L.shape[0]
            # float32 blocks are inverted in float64: float32 forward substitution builds chains of small
            # values that go subnormal (5 blocks of EigenPro's factor on UCI pumadyn32nm: 1.7 s), and the
            # inverses' own subnormal entries are flushed (kgp.linalg.solve_lower_wide)
            wide = torch.float64 if L.dtype == torch.float32 else L.dtype
            eye = torch.eye(min(self.block, M), dtype=wide, device=L.device)
            self._inverses = []
            for s, e in self._bounds():
                inv = torch.linalg.solve_triangular(L[s:e, s:e].to(wide), eye[: e - s, : e - s], upper=False)
                if wide != L.dtype:
                    inv = inv.to(L.dtype)
                    flush_below_scale(inv, float(inv.abs().max()))
                self._inverses.append(inv)
        return self._inverses

    def _bounds(self) -> list[tuple[int, int]]:
        M = self.L.shape[0]
        return [(s, min(s + self.block, M)) for s in range(0, M, self.block)]

    def _solve_blocks(self, B: Tensor, transpose: bool) -> Tensor:
        L, M = self.L, self.L.shape[0]
        X = torch.empty(B.shape, dtype=B.dtype, device=B.device)
        blocks = list(zip(self._bounds(), self._block_inverses()))
        if not transpose:  # forward substitution: X_j = inv_j (B_j - L[j, :s] X[:s])
            for (s, e), inv in blocks:
                r = B[s:e] if s == 0 else torch.addmm(B[s:e], L[s:e, :s], X[:s], alpha=-1)
                torch.mm(inv, r, out=X[s:e])
        else:  # back substitution on L^T: X_j = inv_j^T (B_j - L[e:, j]^T X[e:])
            for (s, e), inv in reversed(blocks):
                r = B[s:e] if e == M else torch.addmm(B[s:e], L[e:, s:e].mT, X[e:], alpha=-1)
                torch.mm(inv.mT, r, out=X[s:e])
        return X

    def _solve_native(self, B: Tensor, transpose: bool) -> Tensor:
        L, M = self.L, self.L.shape[0]
        lib = _mixed_library()
        k = B.shape[1]
        # k x M, each column contiguous, solved in place: always a copy (B.mT of one column is contiguous)
        X = B.mT.clone(memory_format=torch.contiguous_format)
        ptr_l, ldl, ptr_x = L.data_ptr(), L.stride(0), X.data_ptr()
        threads = max(1, torch.get_num_threads())

        def split(a: int, b: int) -> list[tuple[int, int, int]]:  # (thread, first, stop)
            per = -(-(b - a) // threads)
            return [(i, r, min(r + per, b)) for i, r in enumerate(range(a, b, per))]

        if not transpose:
            for s, e in self._bounds():
                if s > 0:
                    run_parallel(
                        lambda p, s=s: lib.kgp_solve_panel(ptr_l, ldl, ptr_x, M, k, p[1], p[2], s), split(s, e)
                    )
                lib.kgp_solve_diagonal(ptr_l, ldl, ptr_x, M, k, s, e, 0)
        else:
            for s, e in reversed(self._bounds()):
                if e < M:
                    parts = split(e, M)
                    sums = torch.empty(len(parts), k, e - s, dtype=torch.float64)
                    run_parallel(
                        lambda p, s=s, e=e, sums=sums: lib.kgp_solve_panel_t(
                            ptr_l, ldl, ptr_x, M, k, s, e, p[1], p[2], sums[p[0]].data_ptr()
                        ),
                        parts,
                    )
                    X[:, s:e] -= sums.sum(0)
                lib.kgp_solve_diagonal(ptr_l, ldl, ptr_x, M, k, s, e, 1)
        return X.mT


_MIXED_SOURCE = Path(__file__).with_name("triangular_mixed.c")
_mixed_error: list[str] = []


@functools.cache
def _mixed_library() -> ctypes.CDLL | None:
    """The compiled mixed-precision solve, or None where it cannot be built (:func:`mixed_solve_error`)."""
    try:
        lib = build_library(_MIXED_SOURCE)
    except Exception as exc:  # no compiler, a compile error, an unwritable cache: the widened copy is used
        _mixed_error.append(f"{type(exc).__name__}: {exc}")
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name, args in (
        ("kgp_solve_panel", [pointer, size, pointer] + [size] * 5),
        ("kgp_solve_panel_t", [pointer, size, pointer] + [size] * 6 + [pointer]),
        ("kgp_solve_diagonal", [pointer, size, pointer] + [size] * 5),
    ):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = args
    return lib


def mixed_solve_error() -> str | None:
    """Why the native mixed-precision solve cannot be built here, or None (builds it if not tried yet)."""
    return None if _mixed_library() is not None else (_mixed_error[-1] if _mixed_error else "unknown")
