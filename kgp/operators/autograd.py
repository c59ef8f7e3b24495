"""Autograd of :class:`~kgp.operators.KernelOperator` that never holds more than one block in the graph.

- :class:`BlockAutograd` (a mixin of the operator) overrides linear_operator's
  ``_bilinear_derivative``: each row block of ``K`` is recomputed with autograd and differentiated at
  once;
- :class:`_FusedMatmul` is the autograd function of ``fused_matmul``: one fast forward pass and a
  streamed backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .blocks import row_slices

if TYPE_CHECKING:
    from .kernel_operator import KernelOperator

__all__ = ["BlockAutograd"]


class BlockAutograd:
    """linear_operator's bilinear derivative, one row block at a time (a mixin of the operator)."""

    def _bilinear_derivative(self, left_vecs: Tensor, right_vecs: Tensor) -> tuple[Tensor | None, ...]:
        r"""Gradients of :math:`\sum_i u_i^\top K v_i` w.r.t. ``(x1, x2, *hypers)``, one row block at a time.

        Each block of K is recomputed with autograd and differentiated at once, so the memory
        stays at one block (the default would keep every block of the product in the graph).
        """
        args = (self.x1, self.x2, *self.hypers)
        wants = [a.requires_grad and a.dtype.is_floating_point for a in args]
        if not any(wants):
            return (None,) * len(args)
        if self.shard is not None:
            raise NotImplementedError("KernelOperator: autograd through a row-sharded operator is not supported")
        # bring the product to the form sum(L * (K R)), K = K(x1, x2) with batches folded into columns
        left, right = (right_vecs, left_vecs) if self.transposed else (left_vecs, right_vecs)
        batch = torch.broadcast_shapes(left.shape[:-2], right.shape[:-2], self.batch_shape_)
        left = left.expand(*batch, *left.shape[-2:])
        right = right.expand(*batch, *right.shape[-2:])
        left = left.movedim(-2, 0).reshape(left.shape[-2], -1)
        right = right.movedim(-2, 0).reshape(right.shape[-2], -1)

        x1 = self.x1.detach()
        x2 = self.x2.detach().requires_grad_(wants[1])
        hypers = tuple(h.detach().requires_grad_(w) for h, w in zip(self.hypers, wants[2:]))
        grad_x1 = torch.zeros_like(x1) if wants[0] else None
        grad_rest = [None] * (1 + len(hypers))
        targets = [x2, *hypers]
        with torch.enable_grad():
            for rows in row_slices(0, x1.shape[0], self.block_rows(True)):
                xr = x1[rows].detach().requires_grad_(wants[0])
                block = self.recipe.dense(xr, x2, hypers, self.kernel, diag_offset=self._diag_offset(rows))
                loss = (left[rows] * (block @ right)).sum()
                inputs = [t for t in (xr, *targets) if t.requires_grad]
                got = iter(torch.autograd.grad(loss, inputs, allow_unused=True))
                if wants[0]:
                    g = next(got)
                    if g is not None:
                        grad_x1[rows] = g
                for i, t in enumerate(targets):
                    if t.requires_grad:
                        g = next(got)
                        if g is not None:
                            grad_rest[i] = g if grad_rest[i] is None else grad_rest[i] + g
        return (grad_x1, *grad_rest)


class _FusedMatmul(torch.autograd.Function):
    r"""Autograd for :meth:`KernelOperator.fused_matmul`: a single fast forward pass, streamed backward.

    With :math:`y = K^\top (K v + w)` and incoming gradient :math:`g`:
    :math:`\partial v = K^\top K g`, :math:`\partial w = K g`, and the representation tensors get the
    bilinear derivative of :math:`(K v + w)^\top K g + (K g)^\top K v`, i.e. left vectors
    ``[K v + w, K g]`` against right vectors ``[g, v]`` (one block-streamed pass).
    """

    @staticmethod
    def forward(ctx, op: KernelOperator, v: Tensor, w: Tensor | None, *args: Tensor) -> Tensor:
        out = op._fused_pass(v, w)
        ctx.op = op
        ctx.has_w = w is not None
        # K v + w (n x k) is recomputed in backward: keeping it would cost n x M for v = I_M
        ctx.save_for_backward(v, w if w is not None else v.new_empty(0))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        op: KernelOperator = ctx.op
        v, w = ctx.saved_tensors
        needs_v, needs_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        needs_args = any(ctx.needs_input_grad[3:])
        grad = grad.contiguous()
        kg = op._k_matmul(grad) if (needs_v or needs_w or needs_args) else None
        grad_v = op._k_t_matmul(kg) if needs_v else None
        grad_w = kg if (needs_w and ctx.has_w) else None
        if needs_args:
            inner = op._k_matmul(v)
            if ctx.has_w:
                inner = inner + w
            arg_grads = op._bilinear_derivative(torch.cat([inner, kg], dim=1), torch.cat([grad, v], dim=1))
        else:
            arg_grads = (None,) * (len(ctx.needs_input_grad) - 3)
        return (None, grad_v, grad_w, *arg_grads)
