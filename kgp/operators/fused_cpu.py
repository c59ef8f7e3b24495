"""The fused kernel pass on a CPU: ``K^T (K v + w)`` for RBF and Matern 3/2, 5/2 kernels without kernel blocks
in memory.

The blocked pass writes each block of ``K`` (the augmented distance GEMM), rewrites it (``clamp_``,
``exp2_``) and reads it twice (``K v``, ``K^T u``). With blocks larger than the cache (64 MiB, the fastest
size on the 2-core development host because every torch operation on a block is a parallel region whose
passive threads pay a wake-up, docs/benchmarks/kernel-pass.md) that memory traffic took the pass to 2.2x
(float32) and 2.4x (float64) its distance-GEMM-plus-``exp`` bound at n = 32,000, M = 10,000, d = 8.
``fused_cpu.c`` forms eight rows at a time in registers and a row-sized cache buffer, multiplies
them by ``v`` and back while they are there, and runs each thread's share of the rows in one call. It is
compiled on first use by the system's C compiler (``gcc`` or ``$CC``, ``-O3 -march=native``, or
``-march=$KGP_NATIVE_ARCH``; about 0.5 s)
into ``$KGP_CACHE_DIR`` (default ``~/.cache/kgp``), keyed by the source, the compiler and the CPU's feature
flags, and loaded with ctypes; the calls release the GIL, so one Python thread per torch thread runs it.

Used by :class:`~kgp.operators.products.StreamingProducts` (``fused_matmul``, also with
``accumulate=float64``, ``K v``, and ``K^T u`` as ``K^T (K 0 + u)``: ``op.T @ u``, ``transpose_matmul``) when all
of these hold, else the blocked path runs with identical
semantics:

- :data:`kgp.settings.fused_kernels` is ``"auto"`` (the default) or ``"always"``; ``"never"`` turns it off.
  Without a working compiler ``"auto"`` falls back silently, ``"always"`` with a warning;
- the operator is on the CPU, float32 or float64, with distances in its own dtype, family ``rbf``,
  ``matern32`` or ``matern52`` (Matern 1/2 needs the blocked pass's recomputation of near-zero distances);
- at most :data:`MAX_COLUMNS` right-hand-side columns;
- ``x1`` and ``x2`` differ (on ``K(X, X)`` the blocked path sets the diagonal to exactly 1), no autograd;
- no stored ``K`` yet. Under ``kernel_cache="auto"`` the operator's second product stores ``K`` as the
  native pass forms it (when ``K`` fits the memory budget), and from then on :func:`stored_pass` reads it:
  one pass over memory for ``K^T (K v + w)``, where torch's two products read it twice (on airline,
  n = 219,082, M = 2,000 float32 with float64 sums: about 0.05 s against 0.133 s for forming ``K`` natively
  and 0.19 s for torch's two products; docs/benchmarks/native-cpu-pass.md). Where the whole ``K``
  does not fit, the second product stores its leading rows that do (a head), and later products read
  those and form the rest (docs/backend.md, "The native CPU pass"); a head is never grown or dropped while the
  operator's inputs stay the same.

The exponential is ``2^-(q/N) 2^f`` with ``q = round(-x N)``, ``|f| <= 1/(2N)``: ``2^-(q/N)`` a table entry
``2^-(j/N)`` (``N = 16``, or 8 for float64 in 256-bit vectors: one or two vectors, picked by a register
permute) with ``floor(q/N)`` taken from its exponent bits, and ``2^f - 1`` a Taylor polynomial (degree 3 in
float32, 7 or 8 in float64: remainder below 1/12 of the dtype's rounding), added as ``s + s (2^f - 1)`` in one
fused rounding. Within one ``eps`` of ``2^x`` (the test measures 0.87 / 0.96 ``eps`` in float64 / float32),
against a reduction to ``|f| <= 1/2`` with degrees 14 / 7 it saves 7 / 4 of an entry's ~30
multiply-adds. The GEMM's result is clamped as the blocked pass clamps it (``[EXP_FLOOR log2(e), 0]`` for
RBF, ``a^2`` in ``[0, EXP_FLOOR^2]`` for Matern).
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .. import settings
from ..kernels.formulas import EXP_FLOOR, LOG2E
from ..linalg.native_build import build_library, run_parallel
from .workspace import BlockWorkspace

__all__ = [
    "native_applies",
    "native_error",
    "native_pass",
    "native_residual",
    "native_rows_product",
    "stored_pass",
    "transpose_pass",
    "use_native",
    "use_stored",
]

SOURCE = Path(__file__).with_name("fused_cpu.c")
TILE = 8
"""Rows formed at a time (``TILE`` in the C source)."""
MAX_COLUMNS = 16
"""Most right-hand-side columns a call takes (``MAX_K`` in the C source); more run the blocked pass."""
_PAD = 64
"""Centers are padded to a multiple of this many entries: two vectors of the widest (512-bit) float32 form."""
_DTYPES = (torch.float32, torch.float64)
_FAMILIES = {"rbf": 0, "matern32": 1, "matern52": 2}
"""The families the C source forms (its ``RBF``, ``MATERN32``, ``MATERN52``); Matern 1/2 needs the blocked
pass's recomputation of near-zero distances."""


_error: list[str] = []


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled pass (built on first use), or None where it cannot be built (:func:`native_error` says why)."""
    try:
        return _load()
    except Exception as exc:  # no compiler, a compile error, an unwritable cache: the blocked pass runs
        _error.append(f"{type(exc).__name__}: {exc}")
        return None


def _load() -> ctypes.CDLL:
    lib = build_library(SOURCE)
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name, scalar in (
        ("kgp_pass_f32", ctypes.c_float),
        ("kgp_pass_f32_f64", ctypes.c_float),
        ("kgp_pass_f64", ctypes.c_double),
    ):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [pointer] * 9 + [size] * 6 + [scalar] * 3 + [size]
    for name in ("kgp_stored_pass_f32", "kgp_stored_pass_f32_f64", "kgp_stored_pass_f64"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [pointer, size, pointer, pointer, pointer, size, size, size, size]
    for name in ("kgp_pass_f32_exp2_values", "kgp_pass_f64_exp2_values"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [pointer, pointer, size]
    if lib.kgp_max_columns() != MAX_COLUMNS or 2 * lib.kgp_vector_bytes() > _PAD * 4:
        raise RuntimeError("fused_cpu.c and fused_cpu.py disagree on the column cap or the padding")
    return lib


def _exp2_values(x: Tensor) -> Tensor:
    """The pass's ``2^x`` (``EXP_FLOOR log2(e) <= x <= 0``) on a float32 or float64 CPU tensor, for the tests."""
    flat = x.reshape(-1)
    padded = torch.zeros(-(-flat.numel() // _PAD) * _PAD, dtype=x.dtype)
    padded[: flat.numel()] = flat
    out = torch.empty_like(padded)
    name = "kgp_pass_f32_exp2_values" if x.dtype == torch.float32 else "kgp_pass_f64_exp2_values"
    getattr(_library(), name)(padded.data_ptr(), out.data_ptr(), padded.numel())
    return out[: flat.numel()].reshape(x.shape)


def native_error() -> str | None:
    """Why the native pass cannot be built here, or None (builds it if that was not tried yet)."""
    return None if _library() is not None else (_error[-1] if _error else "unknown")


def native_applies(work: BlockWorkspace, k: int, *rhs: Tensor, own_columns: bool = False) -> bool:
    """Whether ``work``'s fused product (``k`` columns, right-hand sides ``rhs``) can run natively (module
    docstring); a stored ``K`` is only seen once it exists, :func:`use_native` is what the products call.
    ``own_columns``: the caller names each row's own column (:func:`native_residual`), so ``K(X, X)`` is
    accepted too, its diagonal set exactly by the pass."""
    mode = settings.fused_kernels.value()
    x1 = work.x1
    if mode == "never" or work.formula.family not in _FAMILIES or x1.device.type != "cpu" or not 1 <= k <= MAX_COLUMNS:
        return False
    if x1.dtype not in _DTYPES or work.distance_dtype is not None or work.needs_grad():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in rhs):
        return False
    n, m = work.shape_nm
    if 2 * n * (x1.shape[1] + 2) * x1.element_size() > settings.memory_budget.value(x1.device):
        return False  # the augmented rows, kept whole
    if _library() is None:
        if mode == "always":
            warnings.warn(
                f"kgp.settings.fused_kernels('always'): the native CPU pass cannot be built ({native_error()}); "
                "products run the blocked pass",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    work.check_cache()
    return (own_columns or not work.same_inputs()) and work.cache.get("stored") is None


def use_native(work: BlockWorkspace, k: int, *rhs: Tensor) -> bool:
    """:func:`native_applies`, counted as one use of the operator towards storing ``K``: where ``K`` is due
    to be stored at this use (``kernel_cache="auto"``, :meth:`~kgp.operators.workspace.BlockWorkspace.rows_due`),
    the native pass that follows writes it as it forms it, and :func:`use_stored` takes over from then on.
    Where only a head of ``K``'s rows fits the memory budget, the pass stores that head and from then on
    reads it (the stored pass's loop) and forms the remaining rows."""
    if not native_applies(work, k, *rhs):
        return False
    if "stored_head" in work.cache or "storing" in work.cache:
        return True
    rows = work.rows_due()
    if rows:
        n, m = work.shape_nm
        if rows < n:
            rows = rows // TILE * TILE
        if rows:
            work.cache["storing"] = torch.empty(rows, m, dtype=work.x1.dtype, device=work.x1.device)
    return True


def use_stored(work: BlockWorkspace, k: int, *rhs: Tensor) -> bool:
    """Whether a product with ``k`` columns reads ``work``'s stored ``K`` with :func:`stored_pass`: a stored
    float32 or float64 ``K`` on the CPU, at most :data:`MAX_COLUMNS` columns, no autograd, and the native
    library built (``kgp.settings.fused_kernels`` not ``"never"``)."""
    if settings.fused_kernels.value() == "never" or not 1 <= k <= MAX_COLUMNS:
        return False
    work.check_cache()
    stored = work.cache.get("stored")
    if stored is None or stored.device.type != "cpu" or stored.dtype not in _DTYPES or not stored.is_contiguous():
        return False
    if work.needs_grad() or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in rhs)):
        return False
    return _library() is not None


def _row_shares(start: int, stop: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` row ranges of whole :data:`TILE`-row tiles covering ``[start, stop)``, one
    per torch thread (at most one per tile); ``stop > start``. Fixed by the range and the thread count, so a
    pass's sums are reproducible."""
    tiles = -(-(stop - start) // TILE)
    threads = max(1, min(torch.get_num_threads(), tiles))
    per = -(-tiles // threads) * TILE
    return [(s, min(s + per, stop)) for s in range(start, stop, per)]


_STORED_PASSES = {
    (torch.float32, torch.float32): "kgp_stored_pass_f32",
    (torch.float32, torch.float64): "kgp_stored_pass_f32_f64",
    (torch.float64, torch.float64): "kgp_stored_pass_f64",
}


def stored_pass(work: BlockWorkspace, vs: Tensor, w: Tensor | None, accumulate: torch.dtype) -> Tensor:
    """This process's ``K^T (K vs + w)`` (``m x k``, unscaled ``K``) in dtype ``accumulate``, reading the
    stored ``K`` once (the C source's stored pass; the same sums as :func:`native_pass`: inner products and
    each :data:`TILE` rows' part of the transposed product in the operator's dtype, the rest in
    ``accumulate``). ``vs`` (``m x k``) and ``w`` (``n x k`` or None) are cast to the operator's dtype."""
    stored = work.cache["stored"]
    n, m = stored.shape
    if n == 0:  # a rank of a distributed fit holding no rows (K stored by the blocked pass): its part is 0
        return torch.zeros(m, vs.shape[1], dtype=accumulate)
    return _sum(_read_stored(stored, vs, w, accumulate)).T.contiguous()


def _read_stored(stored: Tensor, vs: Tensor, w: Tensor | None, accumulate: torch.dtype) -> list[Tensor]:
    """Each thread's ``k x m`` partial ``K^T (K vs + w)`` over the stored rows ``stored`` (the leading rows of
    ``K``; ``w`` covers all of ``K``'s rows, the pass reads its first ``len(stored)``)."""
    dtype = stored.dtype
    rows, m = stored.shape
    k = vs.shape[1]
    fn = getattr(_library(), _STORED_PASSES[(dtype, accumulate)])
    vt = vs.to(dtype).T.contiguous()
    wc = None if w is None else w.to(dtype).contiguous()
    shares = _row_shares(0, rows)
    outs = [torch.zeros(k, m, dtype=accumulate) for _ in shares]
    w_ptr = None if wc is None else wc.data_ptr()

    def run(i: int) -> None:
        start, stop = shares[i]
        fn(stored.data_ptr(), m, vt.data_ptr(), w_ptr, outs[i].data_ptr(), start, stop, m, k)

    run_parallel(run, range(len(shares)))
    return outs


def _sum(parts: list[Tensor]) -> Tensor:
    out = parts[0]
    for extra in parts[1:]:
        out += extra
    return out


def transpose_pass(work: BlockWorkspace, vs: Tensor | None, w: Tensor, accumulate: torch.dtype) -> Tensor:
    """``K^T (K vs + w)``, or ``K^T w`` as ``K^T (K 0 + w)`` where ``vs`` is None (FALKON's right-hand side
    ``K^T y``: the pass forms each tile once either way), reading the stored ``K`` where there is one
    (:func:`stored_pass`), else :func:`native_pass`; for a caller that checked :func:`use_stored` or
    :func:`use_native`."""
    if vs is None:
        vs = torch.zeros(work.shape_nm[1], w.shape[1], dtype=work.x1.dtype, device=work.x1.device)
    return (stored_pass if "stored" in work.cache else native_pass)(work, vs, w, accumulate)


def native_pass(work: BlockWorkspace, vs: Tensor, w: Tensor | None, accumulate: torch.dtype) -> Tensor:
    """This process's ``K^T (K vs + w)`` (``m x k``, unscaled ``K``) in dtype ``accumulate``.

    ``vs`` (``m x k``) and ``w`` (``n x k`` or None) in the operator's dtype; ``accumulate`` is that dtype or
    float64 (float32 sums of :data:`TILE` rows, then float64). The caller scales and reduces across ranks.
    With a stored head of ``K`` (:func:`use_native`) its rows are read, the rest formed.
    """
    n, m = work.shape_nm
    k = vs.shape[1]
    if n == 0:  # a rank of a distributed fit holding no rows: its part of the sum
        return torch.zeros(m, k, dtype=accumulate)
    head = work.cache.get("stored_head")
    if head is None:
        out = _sum(_run(work, vs, w, accumulate, None))[:, :m]
    else:
        out = _sum(_read_stored(head, vs, w, accumulate))
        if head.shape[0] < n:
            out += _sum(_run(work, vs, w, accumulate, None, start=head.shape[0]))[:, :m]
    return out.T.contiguous()


def native_rows_product(work: BlockWorkspace, vs: Tensor) -> Tensor:
    """``K vs`` (``n x k``, unscaled ``K``) in the operator's dtype: the pass's first half alone (a stored
    head's rows by a matrix product)."""
    n, k = work.shape_nm[0], vs.shape[1]
    out = torch.empty(n, k, dtype=work.x1.dtype)
    head = work.cache.get("stored_head")
    start = 0
    if head is not None:
        start = head.shape[0]
        torch.mm(head, vs.to(head.dtype), out=out[:start])
    if start < n:
        _run(work, vs, None, work.x1.dtype, out, start=start)
    return out


def native_residual(
    work: BlockWorkspace, vs: Tensor, w: Tensor | None, own: Tensor | None, transpose: bool, accumulate: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """``u = K vs + w`` (``n x k``, in the operator's dtype) and, with ``transpose``, ``K^T u`` (``m x k``, summed
    in ``accumulate``), unscaled ``K``, from one formation of each tile of rows (the C source's pass with both
    its outputs); no stored ``K`` is read or written. ``own``: each row's own column (int64, -1: none), whose
    entry is set to the exact ``k(x, x)``; for a caller that checked :func:`native_applies`."""
    n, m = work.shape_nm
    k = vs.shape[1]
    u = torch.empty(n, k, dtype=work.x1.dtype)
    if n == 0:
        return u, torch.zeros(m, k, dtype=accumulate) if transpose else None
    own = None if own is None else own.to(torch.int64).contiguous()
    parts = _run(work, vs, w, accumulate, u, transpose=transpose, own=own)
    return u, (_sum(parts)[:, :m].T.contiguous() if transpose else None)


def _run(
    work: BlockWorkspace,
    vs: Tensor,
    w: Tensor | None,
    accumulate: torch.dtype,
    kv: Tensor | None,
    start: int = 0,
    *,
    transpose: bool | None = None,
    own: Tensor | None = None,
) -> list[Tensor]:
    """One call per thread over contiguous shares of whole tiles of rows ``[start, n)``; each thread's
    ``k x padded`` partial sum of ``K^T (K vs + w)`` over them. Where ``kv`` is given, ``K vs + w`` is written
    there, and the transposed product is made only with ``transpose=True`` (default: only without ``kv``).
    ``own`` (int64, ``n``): each row's own column, -1 for none; those entries are set to the exact unscaled
    ``k(x, x) = 1`` of the stationary families the pass forms. Where :func:`use_native` left a buffer for ``K``
    (whole, or a head of its rows), the rows it covers are written into it as they are formed and it is kept
    once the pass is through."""
    lib = _library()
    dtype = work.x1.dtype
    n, m = work.shape_nm
    k = vs.shape[1]
    padded = -(-m // _PAD) * _PAD
    if "native_cols" not in work.cache:
        cols = work.prepared_cols()
        cols_t = torch.empty(cols.shape[1], padded, dtype=dtype)
        cols_t[:, :m] = cols.T
        # padding repeats the first center (its v entry is 0): a zero column would give 0 * inf = NaN in the
        # padding for a row whose augmented norm overflowed (a far row), and NaN * 0 stays NaN in the sums
        cols_t[:, m:] = cols_t[:, :1]
        work.cache["native_cols"] = cols_t
    cols_t = work.cache["native_cols"]
    rows = work.prepared_rows(slice(0, n)).contiguous()
    dim = rows.shape[1]
    vt = torch.zeros(k, padded, dtype=dtype)
    vt[:, :m] = vs.T
    wc = None if w is None else w.to(dtype).contiguous()
    fn = {
        (torch.float32, torch.float32): lib.kgp_pass_f32,
        (torch.float32, torch.float64): lib.kgp_pass_f32_f64,
        (torch.float64, torch.float64): lib.kgp_pass_f64,
    }[(dtype, accumulate)]
    family = work.formula.family
    floor = EXP_FLOOR[dtype]
    # the blocked pass's clamps (KernelFormula.fill): the base-2 exponent for RBF, a^2 for Matern
    lo, hi = (floor * LOG2E, 0.0) if family == "rbf" else (0.0, floor * floor)
    # K due to be stored at this use: its rows (all, or a head) in one parallel call, the rest in another
    store = work.cache.pop("storing", None) if start == 0 else None
    stored_rows = 0 if store is None else store.shape[0]
    groups = [(_row_shares(0, stored_rows), store)] if stored_rows else []
    if stored_rows < n:
        groups.append((_row_shares(max(start, stored_rows), n), None))
    w_ptr = None if wc is None else wc.data_ptr()
    kv_ptr = None if kv is None else kv.data_ptr()
    own_ptr = None if own is None else own.data_ptr()
    transpose = kv is None if transpose is None else transpose
    bufs = [torch.empty(TILE, padded, dtype=dtype) for _ in range(max(len(g) for g, _ in groups))]
    outs = []
    for shares, target in groups:
        parts = [torch.zeros(k, padded, dtype=accumulate) for _ in shares] if transpose else []
        store_ptr = None if target is None else target.data_ptr()

        def run(i: int, shares=shares, parts=parts, store_ptr=store_ptr) -> None:
            s, e = shares[i]
            out_ptr = parts[i].data_ptr() if parts else None
            fn(
                rows.data_ptr(), cols_t.data_ptr(), vt.data_ptr(), w_ptr, out_ptr, bufs[i].data_ptr(), kv_ptr,
                store_ptr, own_ptr, s, e, dim, padded, k, _FAMILIES[family], lo, hi, 1.0, m,
            )  # fmt: skip

        run_parallel(run, range(len(shares)))
        # each group summed on its own, so that a product that stores a head adds in the order of the
        # products that read it (head, then the rest): the same result where the stored pass is the native one
        outs += [_sum(parts)] if len(groups) > 1 and parts else parts
    if store is not None:
        work.cache["stored" if stored_rows == n else "stored_head"] = store
    return outs
