"""Autograd of :class:`~kgp.operators.KernelOperator` that never holds more than one block in the graph.

:class:`BlockAutograd` (a mixin of the operator) overrides linear_operator's ``_bilinear_derivative``: each
row block of ``K`` is recomputed with autograd and differentiated at once. The autograd function of
``fused_matmul`` lives with the product it differentiates (:mod:`.products`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .blocks import row_slices

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
                block = self.formula.dense(xr, x2, hypers, self.kernel, diag_offset=self._diag_offset(rows))
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
