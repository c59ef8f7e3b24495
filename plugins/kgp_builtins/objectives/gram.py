"""The two Gram products of the SGPR bound, streamed over row blocks in both directions.

``A = K_nM^T K_nM`` (M x M) and ``B = K_nM^T R`` (M x k) are all the bound needs of the n x M
matrix. A plain autograd graph would keep every row block of K_nM for the backward pass (n x M in
total); :class:`GramProducts` keeps only its inputs and recomputes one block at a time in backward,
as activation checkpointing does, so the peak memory is a few blocks under
``kgp.settings.memory_budget`` in both passes.
"""

from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

import kgp
from kgp.operators import plan_block_rows, row_slices

# block-sized temporaries alive at once in the backward pass (the differentiable block, its graph and U)
_BACKWARD_BUFFERS = 10


def distinct_centers(Z: Tensor) -> Tensor:
    """The rows of Z without exact repeats (first occurrence kept, order kept).

    Uniform centers drawn from data with repeated rows (discrete features) can repeat points; a
    repeated center adds nothing to the Nystrom space (same ``Q = K_nM K_MM^+ K_Mn``, same
    predictor) but makes K_MM exactly singular. Dropping repeats leaves the bound and the held-out
    score unchanged. (It did not cure the factorisation failures of the benchmark on pol and
    elevators, whose cause is open: docs/gp-workflow.md, section 8.3.)
    """
    _, inverse = torch.unique(Z, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), Z.shape[0], dtype=torch.long, device=Z.device)
    first.scatter_reduce_(0, inverse, torch.arange(Z.shape[0], device=Z.device), reduce="amin")
    return Z[first.sort().values]


def gram_products(kernel: gpytorch.kernels.Kernel, X: Tensor, Z: Tensor, R: Tensor) -> tuple[Tensor, Tensor]:
    """``(K_nM^T K_nM, K_nM^T R)`` with ``K_nM = K(X, Z)``, differentiable w.r.t. the kernel's parameters and R.

    Parameters
    ----------
    kernel:
        GPyTorch kernel (its trainable parameters receive gradients).
    X, Z:
        ``n x d`` inputs and ``M x d`` centers (held fixed: no gradient).
    R:
        ``n x k`` right-hand side (e.g. targets minus a trainable mean).
    """
    params = tuple(p for p in kernel.parameters() if p.requires_grad)
    return GramProducts.apply(kernel, X, Z, R, *params)


class GramProducts(torch.autograd.Function):
    r"""Forward through the fast block backend; backward recomputes each block with autograd.

    With incoming gradients :math:`G_A` (M x M) and :math:`G_B` (M x k), the scalar to differentiate
    is :math:`\langle G_A, K^\top K\rangle + \langle G_B, K^\top R\rangle = \langle K, U\rangle`
    with :math:`U = K (G_A + G_A^\top) + R G_B^\top`, summed block by block: per block, U is formed
    from the block's value and ``sum(K_block * U)`` is differentiated through the block's
    recomputation. :math:`\partial R = K G_B` is written block by block.
    """

    @staticmethod
    def forward(ctx, kernel, X: Tensor, Z: Tensor, R: Tensor, *params: Tensor):
        op = kgp.kernel_operator(kernel, X, Z)  # autograd is off here: the in-place fast path
        m = Z.shape[0]
        A = torch.zeros(m, m, dtype=X.dtype, device=X.device)
        B = torch.zeros(m, R.shape[1], dtype=X.dtype, device=X.device)
        for rows, block in op.blocks():
            A.addmm_(block.T, block)
            B.addmm_(block.T, R[rows])
        scale = op.outputscale()
        if scale is not None:  # blocks() leaves the ScaleKernel factor out
            A.mul_(scale * scale)
            B.mul_(scale)
        ctx.kernel = kernel
        ctx.save_for_backward(X, Z, R)
        ctx.n_params = len(params)
        return A, B

    @staticmethod
    def backward(ctx, grad_A: Tensor, grad_B: Tensor):
        X, Z, R = ctx.saved_tensors
        kernel = ctx.kernel
        params = tuple(p for p in kernel.parameters() if p.requires_grad)
        sym = grad_A + grad_A.T
        grads: list[Tensor | None] = [None] * len(params)
        grad_R = torch.empty_like(R) if ctx.needs_input_grad[3] else None
        rows_per_block = plan_block_rows(X.shape[0], Z.shape[0], X.element_size(), _BACKWARD_BUFFERS, device=X.device)
        for rows in row_slices(0, X.shape[0], rows_per_block):
            with torch.enable_grad():
                block = kgp.kernel_operator(kernel, X[rows], Z).to_dense()  # differentiable, one block
                value = block.detach()
                U = value @ sym + R[rows] @ grad_B.T
                if grad_R is not None:
                    grad_R[rows] = value @ grad_B
                if params:
                    got = torch.autograd.grad((block * U).sum(), params, allow_unused=True)
                    for i, g in enumerate(got):
                        if g is not None:
                            grads[i] = g if grads[i] is None else grads[i] + g
        return (None, None, None, grad_R, *grads)
