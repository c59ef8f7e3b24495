"""The residual product of :class:`~kgp.operators.KernelOperator`: ``u = K v + w`` and ``K^T u`` from one formation
of each kernel block (``KernelOperator.residual_matmul``).

A stochastic-gradient step on a batch's rows needs both halves of ``fused_matmul``'s ``K^T (K v + w)``: the
residual ``u`` itself (the batch's errors, ``g = K(X_b, Z) a - y_b``) and the gradient ``K^T u`` (EigenPro 3,
eq. 28). The kernel evaluations dominate both products, so forming each block once for the two halves the
cost. Natively on a CPU (RBF, Matern 3/2, 5/2: :func:`~kgp.operators.fused_cpu.native_residual`) each tile of
rows is formed once and both products are taken while it is in the cache; on a GPU the fused kernels of
:mod:`.fused_gpu` form it twice (``K v + w``, then ``K^T u``); otherwise each row block of the workspace is formed
once and multiplied twice. No path reads or stores a whole ``K``, nor counts towards storing one: the callers
build one operator per batch and use it once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fused_cpu import native_applies, native_residual
from .fused_gpu import cols_product, rows_product, use_fused
from .products import StreamingProducts

__all__ = ["residual_matmul"]


def residual_matmul(
    products: StreamingProducts,
    v: Tensor,
    w: Tensor | None = None,
    *,
    own_columns: Tensor | None = None,
    transpose: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``u = K v + w`` and ``K^T u`` (``KernelOperator.residual_matmul`` documents the arguments) on the
    workspace of ``products``; ``K^T u`` is summed over the ranks of a sharded operator."""
    work = products.work
    vector = v.dim() == 1
    v2 = v.unsqueeze(-1) if vector else v
    w2 = None if w is None else (w.unsqueeze(-1) if w.dim() == 1 else w)
    n, m = work.shape_nm
    if v2.dim() != 2 or v2.shape[0] != m or (w2 is not None and w2.shape != (n, v2.shape[1])):
        raise ValueError(
            f"residual_matmul: expected v of shape ({m}, k) and w of shape ({n}, k), got "
            f"{tuple(v.shape)} and {None if w is None else tuple(w.shape)}"
        )
    if own_columns is not None and (own_columns.shape != (n,) or own_columns.dtype.is_floating_point):
        raise ValueError(
            f"residual_matmul: expected {n} integer own_columns, got {own_columns.dtype} {tuple(own_columns.shape)}"
        )
    for t in (v2, w2):
        if t is not None:
            products.check_rhs(t)
    if torch.is_grad_enabled() and (work.needs_grad() or any(t is not None and t.requires_grad for t in (v2, w2))):
        raise NotImplementedError("residual_matmul: no autograd; call it under torch.no_grad()")
    k = v2.shape[1]
    scale = work.scale()
    with torch.no_grad():
        # the outputscale folded into v (u = s K v + w), and K^T u scaled at the end
        vs = v2 if scale is None else v2 * scale
        plain = work.x1.device.type == "cpu" and not {"stored", "stored_head"} & work.cache.keys()
        if plain and native_applies(work, k, vs, w2, own_columns=True):
            own = own_columns
            if own is None and work.same_inputs():
                own = torch.arange(n)  # K(X, X): its diagonal is k(x, x), as the blocked pass sets it
            u, out = native_residual(work, vs, w2, own, transpose, v2.dtype)
        elif own_columns is None and k == 1 and use_fused(work, k, vs, w2):
            u = rows_product(work, vs, w2).unsqueeze(1)
            out = cols_product(work, u, v2.dtype).unsqueeze(1) if transpose else None
        else:
            u, out = _blocked(work, vs, w2, own_columns, transpose)
        if out is not None:
            products.reduce(out)
            if scale is not None:
                out.mul_(scale)
    if vector:
        return u.squeeze(-1), None if out is None else out.squeeze(-1)
    return u, out


def _blocked(
    work, vs: Tensor, w: Tensor | None, own_columns: Tensor | None, transpose: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`residual_matmul` over the workspace's row blocks (unscaled ``K``; ``vs`` already scaled)."""
    n, m = work.shape_nm
    k = vs.shape[1]
    u = torch.empty(n, k, dtype=vs.dtype, device=vs.device)
    out = torch.zeros(m, k, dtype=vs.dtype, device=vs.device) if transpose else None
    exact = None
    if own_columns is not None:
        own_columns = own_columns.to(device=vs.device, dtype=torch.int64)
        exact = work.own_entries()
    # a block is written into only where own columns are set: then never the stored matrix itself
    for rows, block in work.block_views(0, n, copy=own_columns is not None):
        if own_columns is not None:
            cols = own_columns[rows]
            r = (cols >= 0).nonzero(as_tuple=True)[0]
            if r.numel():
                block[r, cols[r]] = exact[rows][r]
        ur = u[rows]
        torch.mm(block, vs, out=ur)
        if w is not None:
            ur.add_(w[rows])
        if out is not None:
            out.addmm_(block.mT, ur)
    return u, out
