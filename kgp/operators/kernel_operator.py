"""The lazy kernel matrix K(X, Z) that every solver in kgp multiplies with."""

from __future__ import annotations

import gpytorch
import torch
from linear_operator.operators import BatchRepeatLinearOperator, LinearOperator
from torch import Tensor

from .. import settings
from ..kernels.recipes import KernelRecipe, recipe_for
from .blocks import plan_block_rows, row_slices

__all__ = ["KernelOperator", "kernel_operator"]


def kernel_operator(kernel: gpytorch.kernels.Kernel, x1: Tensor, x2: Tensor | None = None) -> KernelOperator:
    """Build the lazy kernel matrix ``K(x1, x2)`` for any GPyTorch kernel.

    Parameters
    ----------
    kernel:
        A GPyTorch kernel. RBF (incl. ARD), Matern 1/2, 3/2, 5/2, Linear, Polynomial and a
        ScaleKernel around any of them use the fast in-place path; others fall back to the
        kernel's own ``forward`` on blocks.
    x1:
        Row inputs, ``n x d``.
    x2:
        Column inputs, ``m x d``; ``None`` means ``x1`` (a square, symmetric operator).

    Returns
    -------
    KernelOperator
        An ``n x m`` :class:`linear_operator.LinearOperator`; nothing n x m is allocated.
    """
    x2 = x1 if x2 is None else x2
    recipe, hypers = recipe_for(kernel)
    hypers = tuple(h.to(device=x1.device, dtype=x1.dtype) for h in hypers)
    return KernelOperator(x1, x2, *hypers, kernel=kernel, recipe=recipe)


class KernelOperator(LinearOperator):
    r"""Lazy ``K(x1, x2)`` (or its transpose), evaluated in row blocks of ``x1``.

    Products stream over row blocks of ``x1`` sized by :func:`~kgp.operators.blocks.plan_block_rows`
    (the memory budget in :mod:`kgp.settings`), reusing one block buffer across blocks and across
    calls. Without autograd the block is computed in place (one GEMM on augmented inputs, then the
    nonlinearity); with autograd (any representation tensor requiring grad) a differentiable,
    allocating formula is used instead.

    Parameters
    ----------
    x1, x2:
        ``n x d`` and ``m x d`` inputs.
    *hypers:
        Hyperparameter tensors in the order the recipe defines (see :func:`kgp.kernels.recipe_for`).
    kernel:
        The GPyTorch kernel (used by the generic path, and kept for introspection).
    recipe:
        How to evaluate the kernel.
    transposed:
        Represent ``K(x1, x2)^T`` (``m x n``) while still streaming over ``x1``.
    """

    def __init__(
        self,
        x1: Tensor,
        x2: Tensor,
        *hypers: Tensor,
        kernel: gpytorch.kernels.Kernel,
        recipe: KernelRecipe,
        transposed: bool = False,
    ):
        if x1.dim() != 2 or x2.dim() != 2:
            raise ValueError(
                f"KernelOperator: expected 2-D inputs (n x d, m x d), got shapes {tuple(x1.shape)} and {tuple(x2.shape)}"
            )
        if x1.shape[1] != x2.shape[1]:
            raise ValueError(f"KernelOperator: x1 has {x1.shape[1]} features but x2 has {x2.shape[1]}")
        if x1.dtype != x2.dtype or x1.device != x2.device:
            raise ValueError("KernelOperator: x1 and x2 must share dtype and device")
        super().__init__(x1, x2, *hypers, kernel=kernel, recipe=recipe, transposed=transposed)
        self.x1 = x1
        self.x2 = x2
        self.hypers = tuple(hypers)
        self.kernel = kernel
        self.recipe = recipe
        self.transposed = transposed
        self._cache: dict = {}

    # ------------------------------------------------------------------ structure
    def _size(self) -> torch.Size:
        n, m = self.x1.shape[0], self.x2.shape[0]
        return torch.Size((m, n) if self.transposed else (n, m))

    def _transpose_nonbatch(self) -> KernelOperator:
        out = KernelOperator(
            self.x1, self.x2, *self.hypers, kernel=self.kernel, recipe=self.recipe, transposed=not self.transposed
        )
        out._cache = self._cache  # same matrix: share prepared inputs, buffers and any stored K
        return out

    @property
    def shape_nm(self) -> tuple[int, int]:
        """Shape of the streamed (untransposed) matrix ``K(x1, x2)``."""
        return self.x1.shape[0], self.x2.shape[0]

    def _needs_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        return any(t.requires_grad for t in (self.x1, self.x2, *self.hypers))

    def _scale(self) -> Tensor | None:
        _, scale = self.recipe.split(self.hypers)
        return None if scale is None else scale.reshape(())

    # ------------------------------------------------------------------ fast path pieces
    def _fast(self) -> bool:
        return self.recipe.family != "generic" and not self._needs_grad()

    def _center(self) -> Tensor | None:
        if not self.recipe.is_stationary:
            return None
        if "center" not in self._cache:
            self._cache["center"] = self.x2.detach().mean(dim=0, keepdim=True)
        return self._cache["center"]

    def _cols(self) -> Tensor:
        if "cols" not in self._cache:
            with torch.no_grad():
                self._cache["cols"] = self.recipe.prepare_cols(self.x2, self.hypers, self._center()).contiguous()
        return self._cache["cols"]

    def _rows(self, rows: slice) -> Tensor:
        # Augmented rows cost O(n d): keep them when they are small next to the budget.
        full = self._cache.get("rows")
        if full is not None:
            return full[rows]
        n, d = self.x1.shape
        with torch.no_grad():
            if (n * (d + 2) * self.x1.element_size()) * 8 <= settings.memory_budget.value():
                full = self.recipe.prepare_rows(self.x1, self.hypers, self._center()).contiguous()
                self._cache["rows"] = full
                return full[rows]
            return self.recipe.prepare_rows(self.x1[rows], self.hypers, self._center())

    def block_rows(self) -> int:
        """Rows per block under the current memory budget."""
        n, m = self.shape_nm
        return plan_block_rows(n, m, self.x1.element_size(), self.recipe.buffers_needed)

    def _buffers(self, rows: int) -> tuple[Tensor, Tensor | None]:
        m = self.x2.shape[0]
        key = ("buffers", rows, m, self.x1.dtype, self.x1.device)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if not (isinstance(k, tuple) and k[0] == "buffers")}
            main = torch.empty(rows, m, dtype=self.x1.dtype, device=self.x1.device)
            spare = torch.empty_like(main) if self.recipe.buffers_needed > 1 else None
            self._cache[key] = (main, spare)
        return self._cache[key]

    def _stored(self) -> Tensor | None:
        """The whole unscaled K(x1, x2), if the cache setting allows and it fits the budget."""
        if "stored" in self._cache:
            return self._cache["stored"]
        if settings.kernel_cache.value() != "auto":
            return None
        n, m = self.shape_nm
        if n * m * self.x1.element_size() > settings.memory_budget.value():
            return None
        stored = torch.empty(n, m, dtype=self.x1.dtype, device=self.x1.device)
        for rows, block in self.blocks():
            stored[rows] = block
        self._cache["stored"] = stored
        return stored

    def blocks(self, start: int = 0, stop: int | None = None):
        """Yield ``(row_slice, block)`` with the **unscaled** kernel block for rows of ``x1``.

        The block is a view of a reused buffer: consume it before advancing the iterator. This is
        the separable unit of the backend (a sharded version hands each rank its own range).
        """
        n, _ = self.shape_nm
        stop = n if stop is None else stop
        rows_per_block = self.block_rows()
        main, spare = self._buffers(rows_per_block)
        cols = self._cols()
        with torch.no_grad():
            for rows in row_slices(start, stop, rows_per_block):
                b = rows.stop - rows.start
                out = main[:b]
                self.recipe.fill(self._rows(rows), cols, out, None if spare is None else spare[:b])
                yield rows, out

    # ------------------------------------------------------------------ streaming products
    def _product_dtype_check(self, rhs: Tensor) -> None:
        if rhs.dtype != self.x1.dtype:
            raise TypeError(f"KernelOperator: right-hand side has dtype {rhs.dtype}, operator has {self.x1.dtype}")

    def _k_matmul(self, v: Tensor) -> Tensor:
        """K(x1, x2) v for ``v`` of shape ``m x k``."""
        n, _ = self.shape_nm
        scale = self._scale()
        if not self._fast():
            parts = [self._dense_rows(rows) @ v for rows in row_slices(0, n, self.block_rows())]
            return torch.cat(parts, dim=0)
        stored = self._stored()
        if stored is not None:
            out = stored @ v
        else:
            out = torch.empty(n, v.shape[1], dtype=v.dtype, device=v.device)
            for rows, block in self.blocks():
                torch.mm(block, v, out=out[rows])
        return out if scale is None else out.mul_(scale)

    def _k_t_matmul(self, u: Tensor) -> Tensor:
        """K(x1, x2)^T u for ``u`` of shape ``n x k``."""
        n, m = self.shape_nm
        scale = self._scale()
        if not self._fast():
            acc = None
            for rows in row_slices(0, n, self.block_rows()):
                part = self._dense_rows(rows).T @ u[rows]
                acc = part if acc is None else acc + part
            return acc
        stored = self._stored()
        if stored is not None:
            out = stored.T @ u
        else:
            out = torch.zeros(m, u.shape[1], dtype=u.dtype, device=u.device)
            for rows, block in self.blocks():
                out.addmm_(block.T, u[rows])
        return out if scale is None else out.mul_(scale)

    def fused_matmul(self, v: Tensor, w: Tensor | None = None) -> Tensor:
        r"""Compute :math:`K^\top (K v + w)` in one pass over the rows of ``x1`` (FALKON's hot loop).

        Parameters
        ----------
        v:
            ``m x k`` (or ``m``) coefficients.
        w:
            Optional ``n x k`` (or ``n``) offset added before the transposed product.

        Returns
        -------
        Tensor
            ``m x k`` (``m`` for vector input), with K = K(x1, x2) regardless of ``transposed``.
        """
        vector = v.dim() == 1
        v2 = v.unsqueeze(-1) if vector else v
        w2 = None if w is None else (w.unsqueeze(-1) if w.dim() == 1 else w)
        n, m = self.shape_nm
        if v2.shape[0] != m or (w2 is not None and w2.shape != (n, v2.shape[1])):
            raise ValueError(
                f"fused_matmul: expected v of shape ({m}, k) and w of shape ({n}, k), got "
                f"{tuple(v.shape)} and {None if w is None else tuple(w.shape)}"
            )
        self._product_dtype_check(v2)
        if not self._fast():
            kv = self._k_matmul(v2)
            out = self._k_t_matmul(kv if w2 is None else kv + w2)
        else:
            scale = self._scale()
            stored = self._stored()
            if stored is not None:
                inner = stored @ v2
                if scale is not None:
                    inner.mul_(scale)
                if w2 is not None:
                    inner.add_(w2)
                out = stored.T @ inner
            else:
                out = torch.zeros(m, v2.shape[1], dtype=v2.dtype, device=v2.device)
                for rows, block in self.blocks():
                    inner = block @ v2
                    if scale is not None:
                        inner.mul_(scale)
                    if w2 is not None:
                        inner.add_(w2[rows])
                    out.addmm_(block.T, inner)
            if scale is not None:
                out.mul_(scale)
        return out.squeeze(-1) if vector else out

    # ------------------------------------------------------------------ LinearOperator API
    def _matmul(self, rhs: Tensor) -> Tensor:
        self._product_dtype_check(rhs)
        vector = rhs.dim() == 1
        mat = rhs.unsqueeze(-1) if vector else rhs
        batch = mat.shape[:-2]
        if batch:  # fold batch dimensions of the right-hand side into columns
            cols = mat.movedim(-2, 0).reshape(mat.shape[-2], -1)
        else:
            cols = mat
        out = self._k_t_matmul(cols) if self.transposed else self._k_matmul(cols)
        if batch:
            out = out.reshape(out.shape[0], *batch, mat.shape[-1]).movedim(0, -2)
        return out.squeeze(-1) if vector else out

    def _t_matmul(self, rhs: Tensor) -> Tensor:
        return self._transpose_nonbatch()._matmul(rhs)

    def _dense_rows(self, rows: slice) -> Tensor:
        """Differentiable scaled block K(x1[rows], x2)."""
        return self.recipe.dense(self.x1[rows], self.x2, self.hypers, self.kernel)

    def to_dense(self) -> Tensor:
        if self._fast():
            n, m = self.shape_nm
            out = torch.empty(n, m, dtype=self.x1.dtype, device=self.x1.device)
            for rows, block in self.blocks():
                out[rows] = block
            scale = self._scale()
            if scale is not None:
                out.mul_(scale)
        else:
            out = self.recipe.dense(self.x1, self.x2, self.hypers, self.kernel)
        return out.T.contiguous() if self.transposed else out

    def _diagonal(self) -> Tensor:
        n, m = self.shape_nm
        if n != m:
            raise RuntimeError(f"diagonal of a non-square {n} x {m} kernel operator")
        return self.recipe.pairs(self.x1, self.x2, self.hypers, self.kernel)

    def _get_indices(self, row_index, col_index, *batch_indices):
        if batch_indices:
            return super()._get_indices(row_index, col_index, *batch_indices)
        if self.transposed:
            row_index, col_index = col_index, row_index
        shape = torch.broadcast_shapes(row_index.shape, col_index.shape)
        xa = self.x1[row_index.expand(shape)]
        xb = self.x2[col_index.expand(shape)]
        return self.recipe.pairs(xa, xb, self.hypers, self.kernel)

    def _getitem(self, row_index, col_index, *batch_indices):
        simple = all(isinstance(i, slice) or (torch.is_tensor(i) and i.dim() == 1) for i in (row_index, col_index))
        if batch_indices or not simple:
            return super()._getitem(row_index, col_index, *batch_indices)
        if self.transposed:
            row_index, col_index = col_index, row_index
        out = KernelOperator(
            self.x1[row_index],
            self.x2[col_index],
            *self.hypers,
            kernel=self.kernel,
            recipe=self.recipe,
            transposed=self.transposed,
        )
        return out

    def _unsqueeze_batch(self, dim: int) -> LinearOperator:
        return BatchRepeatLinearOperator(self, batch_repeat=torch.Size((1,)))

    def _expand_batch(self, batch_shape):
        return BatchRepeatLinearOperator(self, batch_repeat=torch.Size(batch_shape))

    def __repr__(self) -> str:
        n, m = self.shape
        return f"KernelOperator({n} x {m}, family={self.recipe.family}, dtype={self.dtype})"
