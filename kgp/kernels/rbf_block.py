"""The differentiable RBF block ``s exp(-|u_a - v_b|^2 / 2)`` with a hand-written backward.

Autograd through the expanded form (``|u|^2 + |v|^2 - 2 u v^T``, clamp, diagonal mask, ``exp``, the
outputscale) keeps one ``n x m`` temporary per operation and spends about twenty ``n x m`` passes on an
``exact`` learning step's kernel (2-core development host, n = 3,000, d = 17: the elementwise products
and copies were 31% of the step). The gradient has a closed form: with ``H = G o K`` (``G`` the incoming
gradient, ``K`` the block including ``s``), ``d2 = |u_a - v_b|^2`` and ``dK / d d2 = -K / 2``::

    grad u = H v - diag(H 1) u,     grad v = H^T u - diag(H^T 1) v,     grad s = sum(H) / s,

one elementwise product, two reductions and two ``n x m x d`` GEMMs. Entries whose expanded squared
distance rounded below zero (clamped) or that lie on the diagonal of ``K(X, X)`` (set to exactly zero)
have ``u_a = v_b`` up to rounding, so their terms in these sums vanish to rounding as autograd's zero
gradient there does. Squared distances above ``-2 EXP_FLOOR`` (:mod:`kgp.kernels.exp_floor`) give exactly
0 (their true values lie below 1e-304 in float64, 2.1e-19 in float32), with a zero gradient, as autograd
through an underflowing ``exp`` gives.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .exp_floor import EXP_FLOOR

__all__ = ["rbf_block"]


class _RBFBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u: Tensor, v: Tensor, scale: Tensor | None, diag_offset: int | None) -> Tensor:
        su = u.pow(2).sum(1, keepdim=True)
        sv = v.pow(2).sum(1).unsqueeze(0)
        # at most -2 EXP_FLOOR, so that exp's results stay normal numbers (subnormal ones made exp 7-10x slower
        # on the learned parkinsons kernel: 56 ms a 3,000 x 3,000 block against 4.5 ms); the capped entries
        # are then set to 0, what exp of their true exponent rounds to or nearly: left at the floor, their
        # products in the backward's GEMMs were subnormal (4x slower GEMMs)
        floor = EXP_FLOOR.get(u.dtype, EXP_FLOOR[torch.float64])
        block = torch.addmm(su + sv, u, v.mT, alpha=-2.0).clamp_(0.0, -2.0 * floor)
        if diag_offset is not None:
            i = torch.arange(block.shape[0], device=block.device)
            i = i[(i + diag_offset) < block.shape[1]]
            block[i, i + diag_offset] = 0.0
        block.mul_(-0.5).exp_()
        torch.hardshrink(block, math.exp(floor) * (1 + 16 * torch.finfo(block.dtype).eps), out=block)
        if scale is not None:
            block.mul_(scale.reshape(()))
        ctx.save_for_backward(u, v, block, scale)
        return block

    @staticmethod
    def backward(ctx, grad: Tensor):
        u, v, block, scale = ctx.saved_tensors
        h = grad * block
        grad_u = grad_v = grad_scale = None
        if ctx.needs_input_grad[0]:
            grad_u = torch.addmm(h.sum(1, keepdim=True).neg().mul(u), h, v)
        if ctx.needs_input_grad[1]:
            grad_v = torch.addmm(h.sum(0).unsqueeze(1).neg().mul(v), h.mT, u)
        if scale is not None and ctx.needs_input_grad[2]:
            grad_scale = (h.sum() / scale.reshape(())).reshape(scale.shape)
        return grad_u, grad_v, grad_scale, None


def rbf_block(u: Tensor, v: Tensor, scale: Tensor | None = None, diag_offset: int | None = None) -> Tensor:
    """``scale * exp(-|u_a - v_b|^2 / 2)`` for ``u`` (n x d), ``v`` (m x d), differentiable in all three.

    ``diag_offset``: rows of ``K(X, X)``, column of the block's first diagonal entry, where the squared
    distance is set to exactly zero (the expanded form leaves rounding noise there). No double backward.
    """
    return _RBFBlock.apply(u, v, scale, diag_offset)
