"""The product engine of :class:`~kgp.operators.KernelOperator`: ``K v``, ``K^T u``, FALKON's fused
``K^T (K v + w)``, sums in a wider dtype and the Gram matrix ``K^T K``, each one pass over row blocks.

The operator owns one :class:`StreamingProducts` for ``K(x1, x2)``; it streams the blocks of the operator's
:class:`~kgp.operators.workspace.BlockWorkspace` and sums a row-sharded operator's partial products over the
ranks. The operator maps its own orientation (``K`` or ``K^T``) and batch views onto these products.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linalg.triangular import mirror_upper
from .autograd import bilinear_derivative
from .blocks import row_slices
from .fused_cpu import native_pass, native_rows_product, stored_pass, transpose_pass, use_native, use_stored
from .fused_gpu import cols_product, rows_product, use_fused
from .workspace import BlockWorkspace

__all__ = ["StreamingProducts"]

_SUPPORTED_DTYPES = (torch.float32, torch.float64)
# fused_matmul(accumulate=float64): rows summed in the block's dtype before the wider sum. FALKON's CG on
# UCI keggdirected (float32, M = 2,000, 30 iterations) reached a true relative residual of 3.35e-3 with
# exact sums, 3.31e-3 with runs of 8 rows, 3.7e-3 with 16, 5.8e-3 with 32 and 3.7e-2 with 128
# (docs/solvers/falkon.md, "float32"). At M = 5,000 with the batched run sums (_run_sums) 16 rows gave
# the same test RMSE as 8 (keggdirected, kin40k, within 0.1%) at 0.8x the per-iteration time.
_ACCUMULATE_ROWS = 16


def _run_sums(block: Tensor, inner: Tensor, rows: int, wide: torch.dtype) -> Tensor:
    """``block^T inner`` (``m x k``) with sums of ``rows`` terms in the block's dtype, the rest in ``wide``.

    One batched product gives every run's partial sum, ``(b / rows) x k x m`` in the block's dtype
    (1/rows of the block's memory for one column), which is then summed in ``wide``. One thread,
    n = 32,000, m = 5,000, k = 1, CPU time: plain float32 0.043 s, float64 0.079-0.084 s, this at 16
    rows 0.073 s, at 8 rows 0.121 s; a Python loop over runs of 8 took 0.188 s.
    """
    b, m = block.shape
    k = inner.shape[1]
    r = b // rows
    out = torch.zeros(k, m, dtype=wide, device=block.device)
    if r:
        full = r * rows
        parts = torch.bmm(inner[:full].reshape(r, rows, k).transpose(1, 2), block[:full].reshape(r, rows, m))
        out += parts.sum(0, dtype=wide)
    if r * rows < b:
        out += (inner[r * rows :].T @ block[r * rows :]).to(wide)
    return out.T


class _FusedMatmul(torch.autograd.Function):
    r"""Autograd for :meth:`kgp.operators.KernelOperator.fused_matmul`: a single fast forward pass, streamed backward.

    With :math:`y = K^\top (K v + w)` and incoming gradient :math:`g`:
    :math:`\partial v = K^\top K g`, :math:`\partial w = K g`, and the representation tensors get the
    bilinear derivative of :math:`(K v + w)^\top K g + (K g)^\top K v`, i.e. left vectors
    ``[K v + w, K g]`` against right vectors ``[g, v]`` (one block-streamed pass).
    """

    @staticmethod
    def forward(ctx, op: StreamingProducts, v: Tensor, w: Tensor | None, *args: Tensor) -> Tensor:
        out = op.fused_pass(v, w)
        ctx.op = op
        ctx.has_w = w is not None
        # K v + w (n x k) is recomputed in backward: keeping it would cost n x M for v = I_M
        ctx.save_for_backward(v, w if w is not None else v.new_empty(0))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        op: StreamingProducts = ctx.op
        v, w = ctx.saved_tensors
        needs_v, needs_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        needs_args = any(ctx.needs_input_grad[3:])
        grad = grad.contiguous()
        kg = op.k_matmul(grad) if (needs_v or needs_w or needs_args) else None
        grad_v = op.k_t_matmul(kg) if needs_v else None
        grad_w = kg if (needs_w and ctx.has_w) else None
        if needs_args:
            inner = op.k_matmul(v)
            if ctx.has_w:
                inner = inner + w
            arg_grads = bilinear_derivative(
                op.work, torch.cat([inner, kg], dim=1), torch.cat([grad, v], dim=1), shard=op.shard
            )
        else:
            arg_grads = (None,) * (len(ctx.needs_input_grad) - 3)
        return (None, grad_v, grad_w, *arg_grads)


class StreamingProducts:
    """Products with ``K(x1, x2)``, streamed over the row blocks of ``x1`` that ``work`` forms.

    Parameters
    ----------
    work:
        The operator's workspace (inputs, formula, buffers, the stored K).
    shard:
        A :class:`kgp.distributed.Shard` when ``x1`` is this rank's rows of a row-sharded data set: the
        products summed over rows are then summed over the ranks too. None: one process.
    """

    def __init__(self, work: BlockWorkspace, shard) -> None:
        self.work = work
        self.shard = shard

    def check_rhs(self, rhs: Tensor) -> None:
        """TypeError / ValueError unless ``rhs`` has the operator's dtype and device."""
        if rhs.dtype != self.work.x1.dtype:
            raise TypeError(f"KernelOperator: right-hand side has dtype {rhs.dtype}, operator has {self.work.x1.dtype}")
        if rhs.device != self.work.x1.device:
            raise ValueError(f"KernelOperator: right-hand side is on {rhs.device}, operator on {self.work.x1.device}")

    def k_matmul(self, v: Tensor) -> Tensor:
        """K(x1, x2) v for ``v`` of shape ``m x k``."""
        n, _ = self.work.shape_nm
        if not self.work.fast():
            parts = [self.work.dense_rows(rows) @ v for rows in row_slices(0, n, self.work.block_rows(True))]
            return torch.cat(parts, dim=0)
        scale = self.work.scale()
        k = v.shape[1]
        if use_fused(self.work, k, v):
            with torch.no_grad():
                out = rows_product(self.work, v).unsqueeze(1)
        elif use_native(self.work, k, v):
            with torch.no_grad():
                out = native_rows_product(self.work, v)
        elif k == 1:
            out = torch.empty(n, 1, dtype=v.dtype, device=v.device)
            for rows, block in self.work.block_views(0, n, copy=False):
                torch.mm(block, v, out=out[rows])
        else:
            # (K v)^T = v^T K^T: the faster orientation for k > 1 columns (_fused_pass_columns)
            v_t = v.mT.contiguous()
            out_t = torch.empty(k, n, dtype=v.dtype, device=v.device)
            for rows, block in self.work.block_views(0, n, copy=False):
                torch.mm(v_t, block.mT, out=out_t[:, rows])
            out = out_t.mT.contiguous()  # callers may view() it, as before
        return out if scale is None else out.mul_(scale)

    def k_t_matmul(self, u: Tensor) -> Tensor:
        """K(x1, x2)^T u for ``u`` of shape ``n x k``."""
        n, m = self.work.shape_nm
        if not self.work.fast():
            self._no_sharded_grad()
            acc = None
            for rows in row_slices(0, n, self.work.block_rows(True)):
                part = self.work.dense_rows(rows).T @ u[rows]
                acc = part if acc is None else acc + part
            return self.reduce(acc if acc is not None else u.new_zeros(m, u.shape[1]))
        scale = self.work.scale()
        k = u.shape[1]
        if use_fused(self.work, k, u):
            with torch.no_grad():
                out = self.reduce(cols_product(self.work, u, u.dtype).unsqueeze(1))
            return out if scale is None else out.mul_(scale)
        if use_stored(self.work, k, u) or use_native(self.work, k, u):
            # as K^T (K 0 + u) (FALKON's right-hand side K^T y in float64): 0.85 s natively against 2.2 s for
            # the blocks on airline (n = 219,082, M = 5,000 float64)
            with torch.no_grad():
                out = self.reduce(transpose_pass(self.work, None, u, u.dtype))
            return out if scale is None else out.mul_(scale)
        # k > 1: accumulate the transpose u^T K, which reads each row-major block far faster (_fused_pass_columns)
        out_t = torch.zeros(k, m, dtype=u.dtype, device=u.device) if k > 1 else None
        out = torch.zeros(m, k, dtype=u.dtype, device=u.device) if k == 1 else None
        for rows, block in self.work.block_views(0, n, copy=False):
            if out_t is not None:
                out_t.addmm_(u[rows].mT, block)
            else:
                out.addmm_(block.T, u[rows])
        if out_t is not None:
            out = out_t.mT.contiguous()
        self.reduce(out)
        return out if scale is None else out.mul_(scale)

    def reduce(self, partial: Tensor) -> Tensor:
        """Sum a partial ``m x k`` result over the ranks of a sharded operator (in place; identity otherwise)."""
        if self.shard is None:
            return partial
        return self.shard.all_reduce_(partial)

    def _no_sharded_grad(self) -> None:
        if self.shard is not None and self.work.needs_grad():
            raise NotImplementedError(
                "KernelOperator: autograd through a row-sharded operator is not supported (gradients would "
                "need their own reduction); run distributed fits under torch.no_grad()"
            )

    def fused_matmul(self, v: Tensor, w: Tensor | None = None, *, accumulate: torch.dtype | None = None) -> Tensor:
        r""":math:`K^\top (K v + w)` in one pass over the rows of ``x1`` (``KernelOperator.fused_matmul``).

        ``accumulate``: a wider dtype for the sum over rows, in runs of :data:`_ACCUMULATE_ROWS` rows
        (:meth:`accumulated`). Differentiable with respect to ``v``, ``w`` and the representation tensors when
        autograd is on (without ``accumulate``).
        """
        if accumulate is not None and accumulate != self.work.x1.dtype:
            return self.accumulated(v, w, accumulate)
        vector = v.dim() == 1
        v2 = v.unsqueeze(-1) if vector else v
        w2 = None if w is None else (w.unsqueeze(-1) if w.dim() == 1 else w)
        n, m = self.work.shape_nm
        if v2.dim() != 2 or v2.shape[0] != m or (w2 is not None and w2.shape != (n, v2.shape[1])):
            raise ValueError(
                f"fused_matmul: expected v of shape ({m}, k) and w of shape ({n}, k), got "
                f"{tuple(v.shape)} and {None if w is None else tuple(w.shape)}"
            )
        self.check_rhs(v2)
        if w2 is not None:
            self.check_rhs(w2)
        args = (self.work.x1, self.work.x2, *self.work.hypers)
        tracked = (v2, *args) if w2 is None else (v2, w2, *args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
            if self.shard is not None:
                raise NotImplementedError(
                    "fused_matmul: autograd through a row-sharded operator is not supported; use torch.no_grad()"
                )
            out = _FusedMatmul.apply(self, v2, w2, *args)
        else:
            out = self.fused_pass(v2, w2)
        return out.squeeze(-1) if vector else out

    def accumulated(self, v: Tensor | None, w: Tensor | None, accumulate: torch.dtype) -> Tensor:
        """``K^T (K v + w)`` (``v`` may be None: ``K^T w``) summed in ``accumulate``: runs of
        :data:`_ACCUMULATE_ROWS` rows in the block's dtype, the runs in the wider one."""
        if accumulate not in _SUPPORTED_DTYPES or accumulate.itemsize < self.work.x1.element_size():
            raise TypeError(f"accumulate: expected a dtype at least as wide as {self.work.x1.dtype}, got {accumulate}")
        ref = v if v is not None else w
        vector = ref.dim() == 1
        v2 = None if v is None else (v.unsqueeze(-1) if vector else v)
        w2 = None if w is None else (w.unsqueeze(-1) if w.dim() == 1 else w)
        n, m = self.work.shape_nm
        k = (v2 if v2 is not None else w2).shape[1]
        if (v2 is not None and (v2.dim() != 2 or v2.shape[0] != m)) or (w2 is not None and w2.shape != (n, k)):
            raise ValueError(
                f"fused_matmul: expected v of shape ({m}, k) and w of shape ({n}, k), got "
                f"{None if v is None else tuple(v.shape)} and {None if w is None else tuple(w.shape)}"
            )
        for t in (v2, w2):
            if t is not None and t.device != self.work.x1.device:
                raise ValueError(f"KernelOperator: right-hand side is on {t.device}, operator on {self.work.x1.device}")
        scale = self.work.scale()
        dtype = self.work.x1.dtype
        rows_per_sum = _ACCUMULATE_ROWS
        with torch.no_grad():
            vs = None
            if v2 is not None:
                vs = (v2 if scale is None else v2 * scale.to(v2.dtype)).to(dtype)
            out = None
            if use_fused(self.work, k):
                u = w2 if vs is None else rows_product(self.work, vs, w2)
                out = self.reduce(cols_product(self.work, u, accumulate).unsqueeze(1))
            elif use_stored(self.work, k, vs, w2) or use_native(self.work, k, vs, w2):
                # K^T w alone (FALKON's right-hand side K^T y) as K^T (K 0 + w): the native pass forms each
                # tile once either way, 0.13 against 0.42 s for the blocks on airline (n = 219,082, M = 2,000)
                out = self.reduce(transpose_pass(self.work, vs, w2, accumulate))
            if out is not None:
                if scale is not None:
                    out.mul_(scale.to(accumulate))
                return out.squeeze(-1) if vector else out
            out = torch.zeros(m, k, dtype=accumulate, device=self.work.x1.device)
            scratch = self.work.scratch(self.work.block_rows(), k)
            # k > 1: K v as (v^T K^T)^T, the faster orientation (_fused_pass_columns)
            vs_t = vs.mT.contiguous() if vs is not None and k > 1 else None
            scratch_t = (
                self.work.wide_buffer("scratch_t", k, self.work.block_rows(), dtype) if vs_t is not None else None
            )
            for rows, block in self.work.block_views(0, n, copy=False):
                b = block.shape[0]
                inner = scratch[:b]
                if vs_t is not None:
                    torch.mm(vs_t, block.mT, out=scratch_t[:, :b])
                    inner.copy_(scratch_t[:, :b].mT)
                    if w2 is not None:
                        inner.add_(w2[rows].to(dtype))
                elif vs is not None:
                    torch.mm(block, vs, out=inner)
                    if w2 is not None:
                        inner.add_(w2[rows].to(dtype))
                else:
                    inner.copy_(w2[rows])
                out.add_(_run_sums(block, inner, rows_per_sum, accumulate))
            self.reduce(out)  # partial sums added across ranks in the accumulation dtype
            if scale is not None:
                out.mul_(scale.to(accumulate))
        return out.squeeze(-1) if vector else out

    def gram(self) -> Tensor:
        r"""``K^T K`` (``m x m``, exactly symmetric) in one pass over the rows of ``x1``; no autograd.

        The Gram matrix ``K_Mn K_nM`` of the SGPR / DTC variance (Titsias 2009, eq. 6) without the
        ``n x m`` matrix. Only the upper triangle of column panels is multiplied (about half of the
        ``n m^2`` flops of ``fused_matmul(eye(m))``, which also spends ``n m^2`` on the identity) and
        mirrored onto the lower one at the end, in place (:func:`kgp.linalg.mirror_upper`). A sharded operator
        sums the ranks' partial products.
        """
        n, m = self.work.shape_nm
        scale = self.work.scale()
        # panels narrow enough for the triangle to save work, wide enough for efficient GEMMs
        panel = max(256, -(-m // 8))
        with torch.no_grad():
            out = torch.zeros(m, m, dtype=self.work.x1.dtype, device=self.work.x1.device)
            for _, block in self.work.block_views(0, n, copy=False):
                for c in range(0, m, panel):
                    e = min(c + panel, m)
                    out[c:e, c:].addmm_(block[:, c:e].T, block[:, c:])
            self.reduce(out)
            mirror_upper(out)  # in place: the variance's M x M budget holds the Gram once, not three times
            if scale is not None:
                out.mul_(scale * scale)
        return out

    def fused_pass(self, v: Tensor, w: Tensor | None) -> Tensor:
        """One pass of K^T (K v + w) without autograd (the per-block K v lands in a reused buffer)."""
        _, m = self.work.shape_nm
        k = v.shape[1]
        scale = self.work.scale()
        with torch.no_grad():
            # fold the outputscale into v: one m x k product instead of one per block
            vs = v if scale is None else v * scale
            out = None
            if use_fused(self.work, k):
                out = self.reduce(cols_product(self.work, rows_product(self.work, vs, w), v.dtype).unsqueeze(1))
            elif use_stored(self.work, k, vs, w):
                out = self.reduce(stored_pass(self.work, vs, w, v.dtype))
            elif use_native(self.work, k, vs, w):
                out = self.reduce(native_pass(self.work, vs, w, v.dtype))
            if out is not None:
                return out if scale is None else out.mul_(scale)
            if k > 1:
                return self._fused_pass_columns(vs, w, scale)
            out = torch.zeros(m, k, dtype=v.dtype, device=v.device)
            scratch = self.work.scratch(self.work.block_rows(), k)
            for rows, block in self.work.block_views(0, self.work.shape_nm[0], copy=False):
                inner = scratch[: block.shape[0]]
                torch.mm(block, vs, out=inner)
                if w is not None:
                    inner.add_(w[rows])
                out.addmm_(block.T, inner)
            self.reduce(out)
            if scale is not None:
                out.mul_(scale)
        return out

    def _fused_pass_columns(self, vs: Tensor, w: Tensor | None, scale: Tensor | None) -> Tensor:
        """:meth:`fused_pass` for ``k > 1`` columns, in the transposed orientation.

        ``(K v)^T = v^T K^T`` and ``(K^T u)^T = u^T K`` read each row-major block as one wide GEMM
        operand, where ``block.T @ inner`` with ``k > 1`` ran at a fifth of the memory rate with MKL: one
        pass over a stored 219,082 x 2,000 float32 ``K_nM`` took 0.26 s instead of 0.61 s with two or
        eight columns (0.15 s with one; two threads, docs/benchmarks/kernel-pass.md). FALKON's residual
        refresh and every multi-output fit pass several columns.
        """
        m, k = vs.shape
        vs_t = vs.mT.contiguous()
        out_t = torch.zeros(k, m, dtype=vs.dtype, device=vs.device)
        scratch = self.work.wide_buffer("scratch_t", k, self.work.block_rows(), vs.dtype)
        for rows, block in self.work.block_views(0, self.work.shape_nm[0], copy=False):
            inner_t = scratch[:, : block.shape[0]]
            torch.mm(vs_t, block.mT, out=inner_t)
            if w is not None:
                inner_t.add_(w[rows].mT)
            out_t.addmm_(inner_t, block)
        out = out_t.mT.contiguous()
        self.reduce(out)
        if scale is not None:
            out.mul_(scale)
        return out
