"""The fused kernel pass on a GPU: ``K v``, ``K^T u`` and ``K^T (K v + w)`` without kernel blocks in memory.

On a GPU the blocked pass is bound by memory traffic, not arithmetic: each block is written by the
distance GEMM, read and written by the exponential, and read by both products, while the GEMM itself
is a small part of the time (0.66 ms of 16.9 ms at n = 200,000, M = 10,000, d = 8 on an H200,
docs/backend.md "On a GPU"). The Triton kernels of :mod:`._triton_kernels` form each kernel tile in
registers instead (the approach of KeOps, which the FALKON library uses on GPUs), so the pass costs
two tile evaluations and no block memory at all.

Used by :class:`~kgp.operators.products.StreamingProducts` when all of these hold (else the blocked
path runs, with identical semantics):

- :data:`kgp.settings.fused_kernels` is ``"auto"`` (opt-in: the default is ``"never"``, see below);
- the operator lives on a CUDA device and Triton is importable;
- float32, with float32 distances: in float64 the FMA loop runs on the card's float64 units (half
  the float32 rate) and ``exp2`` is a software routine, so the fused RBF pass took 1.7x the blocked
  one, whose distance GEMM runs on float64 tensor cores (H200, docs/backend.md);
- a memory budget of at least :data:`TUNING_BUDGET` (the automatic budget is a fifth of the card's memory at
  most, so on a card below about 5 GiB only a budget the user sets lets the fused kernels run);
- the family is ``rbf``, ``matern32`` or ``matern52`` (Matern 1/2 needs the blocked path's exact
  small-distance correction, the other families are GEMMs already);
- one right-hand-side column (FALKON's conjugate-gradient loop, predictions);
- ``x1`` and ``x2`` differ (on ``K(X, X)`` the blocked path sets the diagonal to exactly 1);
- no stored ``K`` (``kernel_cache="auto"`` under the budget reads the stored matrix instead);
- no autograd.

Why opt-in: on an H200 (2026-11-27, float32, n = 200,000, d = 8, M = 2,000-20,000) the fused pass took
0.36-0.40x the blocked pass's time with an RBF kernel and 0.18-0.20x with Matern 5/2, but the one run
at d = 28 (n = 1e6, M = 10,000, inside a FALKON fit) did not finish within 80 s where the blocked fit
took 2.9 s, and no card was left to find out why (tile-size tuning or register spills at ``DIM = 30``
are the suspects; above ``DIM = 16`` the kernels now loop instead of unrolling). It becomes the default
once that is measured.

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
from ..kernels.recipes import _LOG2E, EXP_FLOOR

__all__ = ["cols_product", "fused_applies", "rows_product", "use_fused"]

_FAMILIES = {"rbf": 0, "matern32": 1, "matern52": 2}
TUNING_BUDGET = 2**30
"""Smallest memory budget under which the fused kernels run: their first call per shape tunes the tile
size with Triton's timer, which allocates a 256 MB buffer (to flush the L2 cache between timings)."""
_INT32_LIMIT = 2**31 - 1


@functools.cache
def _kernels():
    """The compiled-on-demand kernels, or ``None`` without Triton (checked once per process)."""
    try:
        from . import _triton_kernels as tk
    except Exception as exc:  # not installed, or an install that fails to import: the blocked pass runs
        warnings.warn(
            f"kgp.settings.fused_kernels('auto'): Triton is not usable ({type(exc).__name__}: {exc}); "
            "products run the blocked pass",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    if _interpreting():
        # the interpreter has no CUDA events to time configurations with: one fixed tile shape
        def fixed(kernel):
            return lambda grid, **kw: kernel[grid](BLOCK_N=32, BLOCK_M=32, **kw)

        return tk, fixed(tk.rows_pass), fixed(tk.cols_pass)
    # tuned once per compiled variant: a new M or n does not time the configurations again (each timing
    # runs full passes, seconds at n = 1e6)
    rows = tk.autotuned(tk.rows_pass, ["DIM", "FAMILY", "HAS_W"])
    cols = tk.autotuned(tk.cols_pass, ["DIM", "FAMILY"])
    return tk, (lambda grid, **kw: rows[grid](**kw)), (lambda grid, **kw: cols[grid](**kw))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fused_applies(op, k: int, *rhs: Tensor) -> bool:
    """Whether ``op``'s product with ``k`` columns (right-hand sides ``rhs``) can run in the fused kernels.

    A pure query (the conditions in the module docstring), except that a stored ``K`` is only seen once
    it exists; :func:`use_fused` is what the products call.
    """
    if settings.fused_kernels.value() != "auto" or k != 1 or op.recipe.family not in _FAMILIES:
        return False
    x1 = op.x1
    if x1.dtype != torch.float32 or op.distance_dtype is not None:
        return False
    n, m = op.shape_nm
    dim = x1.shape[1] + 2
    budget = settings.memory_budget.value(x1.device)
    # the tuner's 256 MB buffer, and the transposed rows (n x DIM) the kernels read
    if budget < TUNING_BUDGET or 4 * n * dim * x1.element_size() > budget:
        return False
    if not (x1.device.type == "cuda" or (_interpreting() and x1.device.type == "cpu")):
        return False
    if dim * max(n, m) > _INT32_LIMIT or op._needs_grad():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in rhs):
        return False  # the kernels record no gradient; the blocked path's products do (or refuse)
    if _kernels() is None:
        return False
    op._check_cache()
    return not op._same_inputs() and op._cache.get("stored") is None


def use_fused(op, k: int, *rhs: Tensor) -> bool:
    """:func:`fused_applies`, then one use of the operator towards storing ``K`` (``kernel_cache="auto"``),
    as a blocked product counts it: where ``K`` is stored from this use on, the products read it instead."""
    return fused_applies(op, k, *rhs) and op._stored() is None


def _prepared(op) -> tuple[Tensor, Tensor]:
    """The augmented inputs, transposed (``DIM x n`` and ``DIM x m``), kept in the operator's cache.

    Called after :func:`use_fused`, whose gate has already emptied a stale cache.
    """
    if "rows_t" not in op._cache:
        n = op.shape_nm[0]
        op._cache["rows_t"] = op._rows(slice(0, n)).T.contiguous()
        op._cache.pop("rows", None)  # the blocked path rebuilds it if it needs it (O(n d))
    if "cols_t" not in op._cache:
        op._cache["cols_t"] = op._cols().T.contiguous()
    return op._cache["rows_t"], op._cache["cols_t"]


def _bounds(family: str, dtype: torch.dtype) -> tuple[float, float]:
    floor = EXP_FLOOR[dtype]
    if family == "rbf":
        return floor * _LOG2E, 0.0
    return 0.0, floor * floor


def rows_product(op, v: Tensor, w: Tensor | None = None) -> Tensor:
    """``K v + w`` (unscaled ``K``) for ``v`` of length ``m`` and ``w`` of length ``n``; length ``n``."""
    tk, rows_kernel, _ = _kernels()
    rows_t, cols_t = _prepared(op)
    n, m = op.shape_nm
    dtype = op.x1.dtype
    low, high = _bounds(op.recipe.family, dtype)
    u = torch.empty(n, dtype=dtype, device=op.x1.device)
    v = v.reshape(-1).to(dtype).contiguous()
    w = None if w is None else w.reshape(-1).to(dtype).contiguous()
    with _on(op.x1.device):
        _launch_rows(rows_kernel, rows_t, cols_t, v, w, u, n, m, op.recipe.family, low, high)
    return u


def _launch_rows(rows_kernel, rows_t, cols_t, v, w, u, n, m, family, low, high) -> None:
    rows_kernel(
        lambda meta: (_cdiv(n, meta["BLOCK_N"]),),
        rows_t=rows_t,
        cols_t=cols_t,
        v=v,
        w=u if w is None else w,
        u=u,
        n=n,
        m=m,
        DIM=rows_t.shape[0],
        FAMILY=_FAMILIES[family],
        LOW=low,
        HIGH=high,
        HAS_W=w is not None,
    )


def cols_product(op, u: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``K^T u`` (unscaled ``K``) for ``u`` of length ``n``, summed in float64 and returned in ``out_dtype``."""
    _, _, cols_kernel = _kernels()
    rows_t, cols_t = _prepared(op)
    n, m = op.shape_nm
    dtype = op.x1.dtype
    low, high = _bounds(op.recipe.family, dtype)
    rows_per_split = _rows_per_split(n, m, op.x1.device)
    splits = max(1, -(-n // rows_per_split))
    part = torch.empty(splits, m, dtype=torch.float64, device=op.x1.device)
    with _on(op.x1.device):
        cols_kernel(
            lambda meta: (_cdiv(m, meta["BLOCK_M"]), splits),
            rows_t=rows_t,
            cols_t=cols_t,
            u=u.reshape(-1).to(dtype).contiguous(),
            part=part,
            n=n,
            m=m,
            rows_per_split=rows_per_split,
            out_dtype=_triton_dtype(dtype),
            DIM=rows_t.shape[0],
            FAMILY=_FAMILIES[op.recipe.family],
            LOW=low,
            HIGH=high,
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
