"""Autograd of :class:`~kgp.operators.KernelOperator` that never holds more than one block in the graph.

:func:`bilinear_derivative` is the operator's ``_bilinear_derivative`` (linear_operator's hook for the
gradients of a product): each row block of ``K`` is recomputed with autograd and differentiated at once. The
autograd function of ``fused_matmul`` lives with the product it differentiates (:mod:`.products`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .blocks import row_slices
from .workspace import BlockWorkspace

__all__ = ["bilinear_derivative"]


def bilinear_derivative(
    work: BlockWorkspace,
    left_vecs: Tensor,
    right_vecs: Tensor,
    *,
    transposed: bool = False,
    batch_shape: tuple[int, ...] = (),
    shard=None,
) -> tuple[Tensor | None, ...]:
    r"""Gradients of :math:`\sum_i u_i^\top K v_i` w.r.t. ``(x1, x2, *hypers)``, one row block at a time.

    ``K`` is ``K(x1, x2)`` of ``work``, or its transpose with ``transposed``, broadcast over ``batch_shape``
    (the operator's view). Each block of K is recomputed with autograd and differentiated at once, so the memory
    stays at one block (the default would keep every block of the product in the graph). No autograd through a
    row-sharded operator (``shard``).
    """
    args = (work.x1, work.x2, *work.hypers)
    wants = [a.requires_grad and a.dtype.is_floating_point for a in args]
    if not any(wants):
        return (None,) * len(args)
    if shard is not None:
        raise NotImplementedError("KernelOperator: autograd through a row-sharded operator is not supported")
    # bring the product to the form sum(L * (K R)), K = K(x1, x2) with batches folded into columns
    left, right = (right_vecs, left_vecs) if transposed else (left_vecs, right_vecs)
    batch = torch.broadcast_shapes(left.shape[:-2], right.shape[:-2], batch_shape)
    left = left.expand(*batch, *left.shape[-2:])
    right = right.expand(*batch, *right.shape[-2:])
    left = left.movedim(-2, 0).reshape(left.shape[-2], -1)
    right = right.movedim(-2, 0).reshape(right.shape[-2], -1)

    x1 = work.x1.detach()
    x2 = work.x2.detach().requires_grad_(wants[1])
    hypers = tuple(h.detach().requires_grad_(w) for h, w in zip(work.hypers, wants[2:]))
    grad_x1 = torch.zeros_like(x1) if wants[0] else None
    grad_rest = [None] * (1 + len(hypers))
    targets = [x2, *hypers]
    with torch.enable_grad():
        for rows in row_slices(0, x1.shape[0], work.block_rows(True)):
            xr = x1[rows].detach().requires_grad_(wants[0])
            block = work.formula.dense(xr, x2, hypers, work.kernel, diag_offset=work.diag_offset(rows))
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
