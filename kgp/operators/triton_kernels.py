"""Triton kernels of the fused GPU pass (imported only where Triton is installed; see :mod:`.fused_gpu`).

Both kernels evaluate kernel tiles in registers from the augmented inputs of
:meth:`kgp.kernels.formulas.KernelFormula.prepare_rows` / ``prepare_cols``, stored transposed (``DIM x n``
and ``DIM x m``) so that each of the ``DIM`` outer-product steps reads contiguous rows. The kernel
matrix never reaches memory: a tile is formed, used once and dropped, so the two products
``u = K v + w`` and ``K^T u`` each form every tile once (KeOps-style recomputation), where the blocked
path writes every block, reads it for the exponential and twice more for the products.

Two forms of the distance part, the same nonlinearity and products after it:

- ``DOT=False``: an explicit ``DIM``-step FMA loop on the CUDA cores, the exact float32 arithmetic of the
  blocked path's GEMM; any card.
- ``DOT=True``: ``tl.dot`` on the tensor cores with ``input_precision="tf32x3"``
  (each float32 operand split into a TF32 high part and a TF32 remainder, three products accumulated in
  float32), ``DIM`` padded with zeros to ``DPAD``, a power of two of at least 16. Plain TF32 would err by
  1e-3 to 1 in the kernel values of the UCI sets with learned ARD lengthscales; the split form erred by
  1.0-1.6x the float32 GEMM's error on all 15 sets (emulated on the CPU, docs/backend.md "Tensor cores
  for the fused pass"), so it keeps the blocked path's accuracy. Compute capability 8.0 and up.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

# families (constexpr codes): 0 rbf (exponent in base 2), 1 Matern 3/2, 2 Matern 5/2 (squared scaled distance)
RBF, MATERN32, MATERN52 = 0, 1, 2
UNROLL_DIM = tl.constexpr(16)
"""Largest ``DIM`` whose outer-product steps are unrolled (measured: ``DIM = 10``)."""


@triton.jit
def _tile(
    rows_t,
    cols_t,
    n,
    m,
    offs_n,
    offs_m,
    mask_n,
    mask_m,
    out_dtype: tl.constexpr,
    DIM: tl.constexpr,
    FAMILY: tl.constexpr,
    LOW: tl.constexpr,
    HIGH: tl.constexpr,
):
    """The unscaled kernel tile k(rows[offs_n], cols[offs_m]), as :meth:`KernelFormula.fill` computes it."""
    a = tl.load(rows_t + offs_n, mask=mask_n, other=0.0)
    b = tl.load(cols_t + offs_m, mask=mask_m, other=0.0)
    t = a[:, None] * b[None, :]
    if DIM <= UNROLL_DIM:
        for k in tl.static_range(1, DIM):
            a = tl.load(rows_t + k * n + offs_n, mask=mask_n, other=0.0)
            b = tl.load(cols_t + k * m + offs_m, mask=mask_m, other=0.0)
            t += a[:, None] * b[None, :]
    else:
        # a loop, not DIM unrolled steps: fewer registers live at once and a shorter compile (the d = 28
        # run of the unrolled form did not finish within 80 s, docs/backend.md; not yet measured)
        for k in range(1, DIM):
            a = tl.load(rows_t + k * n + offs_n, mask=mask_n, other=0.0)
            b = tl.load(cols_t + k * m + offs_m, mask=mask_m, other=0.0)
            t += a[:, None] * b[None, :]
    # wider distances (float64 for a float32 operator) are rounded once, before the nonlinearity
    return _nonlinear(t.to(out_dtype), FAMILY, LOW, HIGH)


@triton.jit
def _nonlinear(t, FAMILY: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr):
    """The kernel values from the augmented product ``t``, as :meth:`KernelFormula.fill` computes them."""
    if FAMILY == 0:
        # the inputs fold in log2(e): t is the base-2 exponent, floored so that results stay normal
        e = tl.exp2(tl.minimum(tl.maximum(t, LOW), HIGH))
    else:
        a = tl.sqrt(tl.minimum(tl.maximum(t, LOW), HIGH))
        ex = tl.exp2(a * -1.4426950408889634)
        if FAMILY == 1:
            e = (1.0 + a) * ex
        else:
            e = (1.0 + a + a * a * 0.3333333333333333) * ex
    return e


@triton.jit
def rows_pass(
    rows_t,
    cols_t,
    v,
    w,
    u,
    n,
    m,
    DIM: tl.constexpr,
    DPAD: tl.constexpr,
    DOT: tl.constexpr,
    FAMILY: tl.constexpr,
    LOW: tl.constexpr,
    HIGH: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``u = K v (+ w)`` for one column: a program owns ``BLOCK_N`` rows and sweeps all ``m`` columns.

    ``DOT``: the distance part on the tensor cores (3xTF32, the row tile loaded once, zero-padded to
    ``DPAD``), else the FMA loop of :func:`_tile`.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    if DOT:
        a = _row_tile(rows_t, n, offs_n, mask_n, DIM, DPAD)
    acc = tl.zeros((BLOCK_N,), dtype=u.dtype.element_ty)
    for start in range(0, m, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < m
        if DOT:
            b = _col_tile(cols_t, m, offs_m, mask_m, DIM, DPAD)
            e = _nonlinear(tl.dot(a, b, input_precision="tf32x3"), FAMILY, LOW, HIGH)
        else:
            e = _tile(rows_t, cols_t, n, m, offs_n, offs_m, mask_n, mask_m, u.dtype.element_ty, DIM, FAMILY, LOW, HIGH)
        vv = tl.load(v + offs_m, mask=mask_m, other=0.0)
        acc += tl.sum(e * vv[None, :], axis=1)
    if HAS_W:
        acc += tl.load(w + offs_n, mask=mask_n, other=0.0)
    tl.store(u + offs_n, acc, mask=mask_n)


@triton.jit
def cols_pass(
    rows_t,
    cols_t,
    u,
    part,
    n,
    m,
    rows_per_split,
    out_dtype: tl.constexpr,
    DIM: tl.constexpr,
    DPAD: tl.constexpr,
    DOT: tl.constexpr,
    FAMILY: tl.constexpr,
    LOW: tl.constexpr,
    HIGH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Partial sums of ``K^T u``: program ``(j, s)`` sums rows ``[s r, (s + 1) r)`` into ``part[s, j-tile]``.

    A tile's column sums are taken in the kernel's dtype (a tree over ``BLOCK_N`` = 32-256 rows, whose
    rounding grows with log2 of that), the running sum over tiles in ``part``'s dtype (float64), and the
    host sums the splits in float64: as accurate as the blocked path's 16-row runs of ``accumulate``.
    ``DOT`` as in :func:`rows_pass` (the column tile loaded once).
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < m
    if DOT:
        b = _col_tile(cols_t, m, offs_m, mask_m, DIM, DPAD)
    acc = tl.zeros((BLOCK_M,), dtype=part.dtype.element_ty)
    first = pid_s * rows_per_split
    last = tl.minimum(first + rows_per_split, n)
    for start in range(first, last, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < last
        if DOT:
            a = _row_tile(rows_t, n, offs_n, mask_n, DIM, DPAD)
            e = _nonlinear(tl.dot(a, b, input_precision="tf32x3"), FAMILY, LOW, HIGH)
        else:
            e = _tile(rows_t, cols_t, n, m, offs_n, offs_m, mask_n, mask_m, out_dtype, DIM, FAMILY, LOW, HIGH)
        uu = tl.load(u + offs_n, mask=mask_n, other=0.0)
        acc += tl.sum(e * uu[:, None], axis=0).to(part.dtype.element_ty)
    tl.store(part + pid_s * m + offs_m, acc, mask=mask_m)


@triton.jit
def _row_tile(rows_t, n, offs_n, mask_n, DIM: tl.constexpr, DPAD: tl.constexpr):
    """Rows ``offs_n`` of the augmented inputs as a ``BLOCK_N x DPAD`` tile, zero beyond ``DIM``."""
    kk = tl.arange(0, DPAD)
    mask = mask_n[:, None] & (kk < DIM)[None, :]
    return tl.load(rows_t + kk[None, :] * n + offs_n[:, None], mask=mask, other=0.0)


@triton.jit
def _col_tile(cols_t, m, offs_m, mask_m, DIM: tl.constexpr, DPAD: tl.constexpr):
    """Columns ``offs_m`` of the augmented inputs as a ``DPAD x BLOCK_M`` tile, zero beyond ``DIM``."""
    kk = tl.arange(0, DPAD)
    mask = (kk < DIM)[:, None] & mask_m[None, :]
    return tl.load(cols_t + kk[:, None] * m + offs_m[None, :], mask=mask, other=0.0)


# (BLOCK_N, BLOCK_M, warps): the FMA loop's shapes, and the tensor cores' (at least 16 a side, larger tiles)
FMA_SHAPES = ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4), (128, 32, 4))
DOT_SHAPES = ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (256, 64, 8), (64, 256, 8))


def autotuned(kernel, key: list[str], shapes=FMA_SHAPES):
    """``kernel`` tuned over tile shapes on first use per key (a few configs: each costs a compile)."""
    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_M": bm}, num_warps=warps) for bn, bm, warps in shapes]
    options = {}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        # the chosen shape goes to Triton's on-disk cache, so a later process compiles one config instead
        # of compiling and timing six (12.9 s of a 15.7 s fit at n = 1e6, d = 28 on an H100)
        options["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **options)(kernel)
