"""The fused kernel pass on a GPU: ``K v``, ``K^T u`` and ``K^T (K v + w)`` without kernel blocks in memory.

On a GPU the blocked pass is bound by memory traffic, not arithmetic: each block is written by the
distance GEMM, read and written by the exponential, and read by both products, while the GEMM itself
is a small part of the time (0.66 ms of 16.9 ms at n = 200,000, M = 10,000, d = 8 on an H200,
docs/backend.md "On a GPU"). The Triton kernels of :mod:`.triton_kernels` form each kernel tile in
registers instead (the approach of KeOps, which the FALKON library uses on GPUs), so the pass costs
two tile evaluations and no block memory at all.

Used by :class:`~kgp.operators.products.StreamingProducts` when all of these hold (else the blocked
path runs, with identical semantics):

- :data:`kgp.settings.fused_kernels` is ``"auto"`` (the default) and the card has TF32 tensor cores
  (compute capability 8.0 and up: A100, H100, H200, L4, RTX 30xx on), or it is ``"always"`` (older cards
  too, with the FMA loop);
- the operator lives on a CUDA device and Triton is importable (without it ``"auto"`` falls back to the
  blocked pass silently, ``"always"`` with a warning);
- float32, with float32 distances: in float64 the FMA loop runs on the card's float64 units (half
  the float32 rate) and ``exp2`` is a software routine, so the fused RBF pass took 1.7x the blocked
  one, whose distance GEMM runs on float64 tensor cores (H200, docs/backend.md);
- for the FMA loop only, a memory budget of at least :data:`TUNING_BUDGET` (its tile shape is tuned on
  first use; the tensor-core form runs fixed tile shapes, :data:`DOT_TILES`);
- the family is ``rbf``, ``matern32`` or ``matern52`` (Matern 1/2 needs the blocked path's exact
  small-distance correction, the other families are GEMMs already);
- for the tensor-core form, ``d + 2`` at most :data:`DOT_MAX_DIM`;
- one right-hand-side column (FALKON's conjugate-gradient loop, predictions);
- ``x1`` and ``x2`` differ (on ``K(X, X)`` the blocked path sets the diagonal to exactly 1);
- no stored ``K``. With the FMA loop, ``kernel_cache="auto"`` stores ``K`` under the budget and reads it
  instead; the tensor-core form was faster than reading a stored ``K`` (H200: 3.5 against
  4.8 ms at n = 200,000, M = 10,000, d = 8; 21.8 against 23.2 ms at n = 1e6, d = 28), so it never
  stores one, which also keeps the ``n x M`` matrix off the card;
- no autograd.

Why it is the default (H200, float32, docs/benchmarks/gpu.md): the
tensor-core form took 0.11-0.25x the blocked pass's time (RBF and Matern 5/2, d = 8 and 28, M = 2,000 to
20,000), 1.85x the card's float32 GEMM bound at n = 1e6, M = 10,000, d = 28, and a FALKON fit of that
problem 1.99 s against 3.00 s blocked, at the same test MSE. The FMA loop alone is not the default: 5.8x
the GEMM bound at d = 28 and 2-16 s of tile-shape tuning in a machine's first process.

``TRITON_INTERPRET=1`` runs the kernels on the CPU through Triton's interpreter (tests only).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch
from torch import Tensor

from .. import settings
from ..kernels.formulas import EXP_FLOOR, LOG2E
from .workspace import BlockWorkspace

__all__ = ["cols_product", "fused_applies", "rows_product", "use_fused"]

_FAMILIES = {"rbf": 0, "matern32": 1, "matern52": 2}
TUNING_BUDGET = 2**30
"""Smallest memory budget under which the FMA-loop kernels run: their first call per variant tunes the tile
size with Triton's timer, which allocates a 256 MB buffer (to flush the L2 cache between timings). The
tensor-core kernels run fixed tile shapes and need no such floor."""
_INT32_LIMIT = 2**31 - 1


DOT_TILES = {"rows": (256, 64, 8), "cols": (128, 64, 4)}
"""Tile shape ``(BLOCK_N, BLOCK_M, warps)`` of the tensor-core kernels, fixed so that a first use compiles
one variant and times none. ``benchmarks/bench_fused_tiles.py`` timed the six candidates on an H200
(RBF and Matern 5/2, d = 8, 20 and 28, M = 2,000 to 20,000): these two were within 1.05x
(rows) and 1.02x (columns) of the best shape on every problem; the next best were 1.24x and 1.16x."""

DOT_MAX_DIM = 32
"""Widest augmented input (``d + 2``) the tensor-core kernels take; wider operators run the blocked pass.
The rows kernel keeps a ``BLOCK_N x DPAD`` tile live across its loop, so the register use grows with
``DPAD``. Only ``DPAD = 16`` and ``32`` were measured on a card (``DIM`` 10 to 30); ``DPAD = 64``
is the next candidate to measure. At large ``d`` the distance GEMM dominates the pass anyway."""

TENSOR_CORES = True
"""Whether cards of compute capability 8.0 and up form the distance part on their tensor cores (3xTF32,
:mod:`.triton_kernels`); ``False`` keeps the FMA loop everywhere (a switch for benchmarks and tests)."""


@functools.cache
def _kernels():
    """The compiled-on-demand launchers ``{"fma": (rows, cols), "dot": (rows, cols)}``, or ``None`` without
    Triton (checked once per process; :func:`_triton_error` says why)."""
    if _triton_error() is not None:
        return None
    from . import triton_kernels as tk

    if _interpreting():
        # the interpreter has no CUDA events to time configurations with: one small fixed tile shape
        def fixed(kernel, shape=(32, 32, 4)):
            return lambda grid, **kw: kernel[grid](BLOCK_N=shape[0], BLOCK_M=shape[1], **kw)

        return {
            "fma": (fixed(tk.rows_pass), fixed(tk.cols_pass)),
            "dot": (fixed(tk.rows_pass), fixed(tk.cols_pass)),
        }

    def fixed_shape(kernel, shape):
        bn, bm, warps = shape
        return lambda grid, **kw: kernel[grid](BLOCK_N=bn, BLOCK_M=bm, num_warps=warps, **kw)

    # the FMA loop is tuned once per compiled variant: a new M or n does not time the configurations
    # again (each timing runs full passes, seconds at n = 1e6)
    def tuned(kernel, key):
        tuned_kernel = tk.autotuned(kernel, key)
        return lambda grid, **kw: tuned_kernel[grid](**kw)

    return {
        "fma": (tuned(tk.rows_pass, ["DIM", "FAMILY", "HAS_W"]), tuned(tk.cols_pass, ["DIM", "FAMILY"])),
        "dot": (fixed_shape(tk.rows_pass, DOT_TILES["rows"]), fixed_shape(tk.cols_pass, DOT_TILES["cols"])),
    }


@functools.cache
def _triton_error() -> str | None:
    """Why Triton's kernels cannot be imported here, or ``None`` (checked once per process)."""
    try:
        from . import triton_kernels  # noqa: F401
    except Exception as exc:  # not installed, or an install that fails to import: the blocked pass runs
        return f"{type(exc).__name__}: {exc}"
    return None


def _tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` has TF32 tensor cores (compute capability 8.0 on; the CPU interpreter counts)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return _interpreting()


def _form(device: torch.device) -> str:
    """``"dot"`` (tensor cores, 3xTF32) where the card has TF32 tensor cores and :data:`TENSOR_CORES` is set."""
    return "dot" if TENSOR_CORES and _tensor_cores(device) else "fma"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fused_applies(work: BlockWorkspace, k: int, *rhs: Tensor) -> bool:
    """Whether ``work``'s product with ``k`` columns (right-hand sides ``rhs``) can run in the fused kernels.

    A pure query (the conditions in the module docstring), except that a stored ``K`` is only seen once
    it exists; :func:`use_fused` is what the products call.
    """
    mode = settings.fused_kernels.value()
    if mode == "never" or k != 1 or work.formula.family not in _FAMILIES:
        return False
    x1 = work.x1
    if x1.dtype != torch.float32 or work.distance_dtype is not None:
        return False
    if not (x1.device.type == "cuda" or (_interpreting() and x1.device.type == "cpu")):
        return False
    if mode == "auto" and not _tensor_cores(x1.device):
        return False  # the FMA loop alone was measured, on cards with tensor cores; "always" allows it
    n, m = work.shape_nm
    dim = x1.shape[1] + 2
    budget = settings.memory_budget.value(x1.device)
    form = _form(x1.device)
    if form == "fma" and budget < TUNING_BUDGET:
        return False  # the tuner's 256 MB buffer
    if form == "dot" and dim > DOT_MAX_DIM:
        return False
    if 4 * n * dim * x1.element_size() > budget:  # the transposed rows (n x DIM) the kernels read
        return False
    if dim * max(n, m) > _INT32_LIMIT or work.needs_grad():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in rhs):
        return False  # the kernels record no gradient; the blocked path's products do (or refuse)
    if _kernels() is None:
        if mode == "always":
            warnings.warn(
                f"kgp.settings.fused_kernels('always'): Triton is not usable ({_triton_error()}); "
                "products run the blocked pass",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    work.check_cache()
    return not work.same_inputs() and work.cache.get("stored") is None


def use_fused(work: BlockWorkspace, k: int, *rhs: Tensor) -> bool:
    """:func:`fused_applies`; with the FMA loop, then one use of the operator towards storing ``K``
    (``kernel_cache="auto"``), as a blocked product counts it: where ``K`` is stored from this use on, the
    products read it instead. The tensor-core form is faster than a stored ``K`` and never stores one."""
    if not fused_applies(work, k, *rhs):
        return False
    return _form(work.x1.device) == "dot" or work.stored() is None


def _prepared(work: BlockWorkspace) -> tuple[Tensor, Tensor]:
    """The augmented inputs, transposed (``DIM x n`` and ``DIM x m``), kept in the operator's cache.

    Called after :func:`use_fused`, whose gate has already emptied a stale cache.
    """
    if "rows_t" not in work.cache:
        n = work.shape_nm[0]
        work.cache["rows_t"] = work.prepared_rows(slice(0, n)).T.contiguous()
        work.cache.pop("rows", None)  # the blocked path rebuilds it if it needs it (O(n d))
    if "cols_t" not in work.cache:
        work.cache["cols_t"] = work.prepared_cols().T.contiguous()
    return work.cache["rows_t"], work.cache["cols_t"]


def _bounds(family: str, dtype: torch.dtype) -> tuple[float, float]:
    floor = EXP_FLOOR[dtype]
    if family == "rbf":
        return floor * LOG2E, 0.0
    return 0.0, floor * floor


def rows_product(work: BlockWorkspace, v: Tensor, w: Tensor | None = None) -> Tensor:
    """``K v + w`` (unscaled ``K``) for ``v`` of length ``m`` and ``w`` of length ``n``; length ``n``."""
    form = _form(work.x1.device)
    rows_kernel, _ = _kernels()[form]
    rows_t, cols_t = _prepared(work)
    n, m = work.shape_nm
    dtype = work.x1.dtype
    low, high = _bounds(work.formula.family, dtype)
    u = torch.empty(n, dtype=dtype, device=work.x1.device)
    v = v.reshape(-1).to(dtype).contiguous()
    w = None if w is None else w.reshape(-1).to(dtype).contiguous()
    with _on(work.x1.device):
        _launch_rows(rows_kernel, rows_t, cols_t, v, w, u, n, m, work.formula.family, low, high, form)
    return u


def _launch_rows(rows_kernel, rows_t, cols_t, v, w, u, n, m, family, low, high, form: str) -> None:
    rows_kernel(
        lambda meta: (_cdiv(n, meta["BLOCK_N"]),),
        rows_t=rows_t,
        cols_t=cols_t,
        v=v,
        w=u if w is None else w,
        u=u,
        n=n,
        m=m,
        FAMILY=_FAMILIES[family],
        LOW=low,
        HIGH=high,
        HAS_W=w is not None,
        **_dims(rows_t.shape[0], form),
    )


def _dims(dim: int, form: str) -> dict:
    """``DIM`` (the augmented width), ``DPAD`` (its zero-padded width, read by the tensor-core form) and
    ``DOT`` (the form) of the kernels' launch."""
    return {"DIM": dim, "DPAD": max(16, 1 << (dim - 1).bit_length()), "DOT": form == "dot"}


def cols_product(work: BlockWorkspace, u: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``K^T u`` (unscaled ``K``) for ``u`` of length ``n``, summed in float64 and returned in ``out_dtype``."""
    form = _form(work.x1.device)
    _, cols_kernel = _kernels()[form]
    rows_t, cols_t = _prepared(work)
    n, m = work.shape_nm
    dtype = work.x1.dtype
    low, high = _bounds(work.formula.family, dtype)
    rows_per_split = _rows_per_split(n, m, work.x1.device)
    splits = max(1, -(-n // rows_per_split))
    part = torch.empty(splits, m, dtype=torch.float64, device=work.x1.device)
    with _on(work.x1.device):
        cols_kernel(
            lambda meta: (_cdiv(m, meta["BLOCK_M"]), splits),
            rows_t=rows_t,
            cols_t=cols_t,
            u=u.reshape(-1).to(dtype).contiguous(),
            part=part,
            n=n,
            m=m,
            rows_per_split=rows_per_split,
            FAMILY=_FAMILIES[work.formula.family],
            LOW=low,
            HIGH=high,
            out_dtype=_triton_dtype(dtype),
            **_dims(rows_t.shape[0], form),
        )
    return part.sum(0).to(out_dtype)


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the operator's (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _rows_per_split(n: int, m: int, device: torch.device) -> int:
    """Rows one ``cols_pass`` program sums: enough programs to fill the card, at least 4,096 rows each.

    The splits' float64 partial sums (``splits x m``) stay within an eighth of the memory budget and their
    offsets within int32; there are at most twice as many splits as the card has multiprocessors.
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 2
    most = max(1, min(2 * sms, settings.memory_budget.value(device) // (64 * m), _INT32_LIMIT // m))
    per = max(4096, -(-n // most))
    return -(-per // 256) * 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton_dtype(dtype: torch.dtype):
    """Triton's scalar type for a torch float dtype (a constexpr argument of the kernels)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float64: tl.float64}[dtype]
