"""Where a :class:`~kgp.operators.KernelOperator` keeps its work: prepared inputs, reused block buffers, the
stored ``K`` and the row blocks every product streams over (docs/backend.md).

A :class:`BlockWorkspace` describes ``K(x1, x2)`` itself, never its transpose or a batch view: the operator and
its views share one, through the cache dict that travels with the operator when linear_operator rebuilds it
(see :class:`~kgp.operators.KernelOperator`). The product engine (:mod:`.products`), the native passes
(:mod:`.fused_cpu`, :mod:`.fused_gpu`) and the block-wise derivative (:mod:`.autograd`) work on it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from .. import settings
from ..kernels.formulas import KernelFormula
from .blocks import plan_block_rows, row_slices

__all__ = ["BlockWorkspace", "cache_key"]

# Block-sized temporaries alive at once in the differentiable path (kept by autograd per block).
_GRAD_BUFFERS = 8


def _signature(*tensors: Tensor) -> tuple:
    """Identity of the tensors' current contents (storage, in-place version, layout)."""
    return tuple((t.data_ptr(), _version(t), t.dtype, t.device, tuple(t.shape), t.stride()) for t in tensors)


def _version(t: Tensor) -> int:
    # inference-mode tensors have no version counter (and cannot be modified in place outside it)
    return -1 if t.is_inference() else t._version


def cache_key(x1: Tensor, x2: Tensor, hypers: tuple[Tensor, ...], distance_dtype: torch.dtype | None) -> tuple:
    """The key under which an operator's cache holds prepared inputs, buffers and the stored K: the inputs'
    current contents (:func:`_signature`) and the distance dtype; a cache under another key is stale."""
    return (_signature(x1, x2, *hypers), distance_dtype)


class BlockWorkspace:
    """Prepared inputs, buffers, the stored matrix and the row blocks of ``K(x1, x2)``.

    Parameters
    ----------
    x1, x2:
        ``n x d`` and ``m x d`` inputs.
    hypers:
        Hyperparameter tensors in the order the formula defines (:func:`kgp.kernels.formula_for`).
    kernel:
        The GPyTorch kernel (the generic path calls its ``forward``).
    formula:
        How to evaluate the kernel's blocks.
    distance_dtype:
        Precision of the fast path's GEMM; None: the input dtype.
    cache:
        The dict that holds everything computed from the inputs (under :func:`cache_key`); shared by every
        view of the operator.
    """

    def __init__(
        self,
        x1: Tensor,
        x2: Tensor,
        hypers: tuple[Tensor, ...],
        kernel,
        formula: KernelFormula,
        distance_dtype: torch.dtype | None,
        cache: dict,
    ):
        self.x1 = x1
        self.x2 = x2
        self.hypers = hypers
        self.kernel = kernel
        self.formula = formula
        self.distance_dtype = distance_dtype
        self.cache = cache

    @property
    def shape_nm(self) -> tuple[int, int]:
        """Shape of ``K(x1, x2)``."""
        return self.x1.shape[0], self.x2.shape[0]

    def needs_grad(self) -> bool:
        """Whether autograd records products with ``K`` (a representation tensor requires grad)."""
        if not torch.is_grad_enabled():
            return False
        return any(t.requires_grad for t in (self.x1, self.x2, *self.hypers))

    def scale(self) -> Tensor | None:
        """The outputscale as a 0-d tensor (differentiable), or None for an unscaled kernel."""
        _, scale = self.formula.split(self.hypers)
        return None if scale is None else scale.reshape(())

    def same_inputs(self) -> bool:
        """Whether x1 and x2 hold the same points (K(X, X)); then the diagonal is k(x, x) exactly."""
        if "same" not in self.cache:
            x1, x2 = self.x1, self.x2
            self.cache["same"] = x1 is x2 or (x1.shape == x2.shape and bool(torch.equal(x1, x2)))
        return self.cache["same"]

    def diag_offset(self, rows: slice) -> int | None:
        """Column of the block's first diagonal entry for K(X, X) with a stationary kernel, else None."""
        if self.formula.is_stationary and self.same_inputs():
            return rows.start
        return None

    def dense_rows(self, rows: slice) -> Tensor:
        """Differentiable scaled block K(x1[rows], x2)."""
        return self.formula.dense(self.x1[rows], self.x2, self.hypers, self.kernel, diag_offset=self.diag_offset(rows))

    def fast(self) -> bool:
        return self.formula.family != "generic" and not self.needs_grad()

    def _center(self) -> Tensor | None:
        if not self.formula.is_stationary:
            return None
        if "center" not in self.cache:
            self.cache["center"] = self._in_distance_dtype(self.x2.detach()).mean(dim=0, keepdim=True)
        return self.cache["center"]

    def _in_distance_dtype(self, t: Tensor) -> Tensor:
        return t if self.distance_dtype is None else t.to(self.distance_dtype)

    def _distance_hypers(self) -> tuple[Tensor, ...]:
        if self.distance_dtype is None:
            return self.hypers
        return tuple(h.detach().to(self.distance_dtype) for h in self.hypers)

    def prepared_cols(self) -> Tensor:
        if "cols" not in self.cache:
            with torch.no_grad():
                x2 = self._in_distance_dtype(self.x2)
                cols = self.formula.prepare_cols(x2, self._distance_hypers(), self._center())
                self.cache["cols"] = cols.contiguous()
        return self.cache["cols"]

    def prepared_rows(self, rows: slice) -> Tensor:
        # Augmented rows cost O(n d): keep them when they are small next to the budget.
        full = self.cache.get("rows")
        if full is not None:
            return full[rows]
        n, d = self.x1.shape
        itemsize = self.x1.element_size() if self.distance_dtype is None else self.distance_dtype.itemsize
        hypers = self._distance_hypers()
        with torch.no_grad():
            if (n * (d + 2) * itemsize) * 8 <= settings.memory_budget.value(self.x1.device):
                full = self.formula.prepare_rows(self._in_distance_dtype(self.x1), hypers, self._center())
                full = full.contiguous()
                self.cache["rows"] = full
                return full[rows]
            return self.formula.prepare_rows(self._in_distance_dtype(self.x1[rows]), hypers, self._center())

    def _buffers_per_row(self, differentiable: bool = False) -> int:
        if self.formula.family == "generic":
            # a generic forward may build b x m x d temporaries (e.g. PeriodicKernel's differences)
            return 4 + self.x1.shape[1]
        if differentiable:
            return _GRAD_BUFFERS
        extra = 0
        if self.distance_dtype is not None:  # the exponent block in the wider dtype
            extra = -(-self.distance_dtype.itemsize // self.x1.element_size())
        return self.formula.buffers_needed + extra

    def block_rows(self, differentiable: bool = False) -> int:
        """Rows per block under the current memory budget (and ``kgp.settings.block_rows``).

        Parameters
        ----------
        differentiable:
            Size blocks for the autograd path, which keeps several block-sized temporaries alive.
        """
        n, m = self.shape_nm
        return plan_block_rows(
            n, m, self.x1.element_size(), self._buffers_per_row(differentiable), device=self.x1.device
        )

    def _buffers(self, rows: int) -> tuple[Tensor, Tensor | None]:
        m = self.x2.shape[0]
        key = ("buffers", rows, m, self.x1.dtype, self.x1.device)
        if key not in self.cache:
            # drop buffers of another block size first, so at most one set is alive
            for k in [k for k in self.cache if isinstance(k, tuple) and k[0] == "buffers"]:
                del self.cache[k]
            main = torch.empty(rows, m, dtype=self.x1.dtype, device=self.x1.device)
            spare = torch.empty_like(main) if self.formula.buffers_needed > 1 else None
            self.cache[key] = (main, spare)
        return self.cache[key]

    def scratch(self, rows: int, k: int) -> Tensor:
        """A reused ``rows x k`` buffer for the per-block inner product of :meth:`fused_matmul`."""
        buf = self.cache.get("scratch")
        if buf is None or buf.shape[0] < rows or buf.shape[1] != k or buf.dtype != self.x1.dtype:
            buf = torch.empty(rows, k, dtype=self.x1.dtype, device=self.x1.device)
            self.cache["scratch"] = buf
        return buf

    def wide_buffer(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """A reused ``rows x cols`` buffer of another dtype (the exponent, or a block cast for accumulation)."""
        buf = self.cache.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype:
            buf = torch.empty(rows, cols, dtype=dtype, device=self.x1.device)
            self.cache[name] = buf
        return buf[:rows]

    def _store_due(self) -> bool:
        """Count one use of the operator towards storing ``K``; True when the whole ``K`` is to be stored from
        this use on (:meth:`rows_due` is ``n``)."""
        rows = self.rows_due()
        return rows is not None and rows == self.shape_nm[0]

    def rows_due(self) -> int | None:
        """Count one use of the operator towards storing ``K``; from the second use under
        ``kernel_cache="auto"``, the number of leading rows of ``K`` that fit ``kgp.settings.memory_budget``
        next to one block of scratch (``n`` when the whole matrix does: a single product, e.g. a prediction,
        never pays for the ``n x M`` write; 0 where no row fits); ``None`` under ``kernel_cache="never"``, for a
        generic kernel, or at the first use. Only the
        native CPU pass reads a stored head of fewer rows (:func:`kgp.operators.fused_cpu.use_native`)."""
        if settings.kernel_cache.value() != "auto" or self.formula.family == "generic":
            return None
        uses = self.cache.get("uses", 0) + 1
        self.cache["uses"] = uses
        if uses < 2:
            return None
        n, m = self.shape_nm
        spare_rows = self.block_rows() if self.formula.buffers_needed > 1 else 0
        row_bytes = max(1, m * self.x1.element_size())
        fits = settings.memory_budget.value(self.x1.device) // row_bytes - spare_rows
        return max(0, min(n, fits))

    def stored(self) -> Tensor | None:
        """The whole unscaled K(x1, x2) when ``kernel_cache="auto"`` allows it (:meth:`_store_due`), else
        ``None``. Products read it directly; :meth:`blocks` copies from it. The native CPU pass stores it
        as it forms it instead (:func:`kgp.operators.fused_cpu.use_native`)."""
        if "stored" in self.cache:
            return self.cache["stored"]
        if not self._store_due():
            return None
        n, m = self.shape_nm
        spare_rows = self.block_rows() if self.formula.buffers_needed > 1 else 0
        stored = torch.empty(n, m, dtype=self.x1.dtype, device=self.x1.device)
        spare = torch.empty(spare_rows, m, dtype=stored.dtype, device=stored.device) if spare_rows else None
        with torch.no_grad():
            for rows in row_slices(0, n, max(1, spare_rows or self.block_rows())):
                b = rows.stop - rows.start
                self._fill(rows, stored[rows], None if spare is None else spare[:b])
        self.cache["stored"] = stored
        self.cache.pop("stored_head", None)  # the budget grew since a native pass stored a head: not twice
        return stored

    def _fill(self, rows: slice, out: Tensor, spare: Tensor | None) -> None:
        exponent = None
        if self.distance_dtype is not None:
            exponent = self.wide_buffer("exponent", out.shape[0], out.shape[1], self.distance_dtype)
        self.formula.fill(self.prepared_rows(rows), self.prepared_cols(), out, spare, exponent=exponent)
        if self.formula.is_stationary and self.same_inputs():
            # k(x, x) = 1 exactly; the augmented GEMM leaves ~sqrt(eps) there for Matern 1/2
            out.diagonal(offset=rows.start).fill_(1.0)

    def blocks(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[slice, Tensor]]:
        """Yield ``(row_slice, block)`` with the **unscaled** kernel block for rows of ``x1``.

        The block is a view of a reused buffer: consume it before advancing the iterator (writing
        into it is allowed). This is the separable unit of the backend (a sharded version hands
        each rank its own range). Multiply by :meth:`outputscale` for the scaled kernel. No autograd.

        Parameters
        ----------
        start, stop:
            Row range of ``x1`` to cover (default: all rows).
        """
        n, _ = self.shape_nm
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"blocks: expected 0 <= start <= stop <= {n}, got start={start}, stop={stop}")
        yield from self.block_views(start, stop, copy=True)

    def fill_dense(self, out: Tensor) -> Tensor:
        """Write the whole **unscaled** ``K(x1, x2)`` (n x m, not transposed) into ``out``; no autograd.

        Each row block is formed in ``out`` itself: through :meth:`blocks` every block was written into a reused
        buffer and copied out, a second pass over the matrix and a buffer of fresh memory (at M = 2,000 the copy
        and the buffer's first touch were half of ``K_MM``'s 22 ms in float64; docs/backend.md, "The setup
        without copies").
        """
        self.check_cache()
        stored = self.stored() if self.formula.family != "generic" else None
        if self.formula.family == "generic" or stored is not None:
            for rows, block in self.block_views(0, self.shape_nm[0], copy=False):
                out[rows] = block
            return out
        rows_per_block = self.block_rows()
        spare = None
        if self.formula.buffers_needed > 1:
            spare = torch.empty(min(rows_per_block, out.shape[0]), out.shape[1], dtype=out.dtype, device=out.device)
        with torch.no_grad():
            for rows in row_slices(0, out.shape[0], rows_per_block):
                b = rows.stop - rows.start
                self._fill(rows, out[rows], None if spare is None else spare[:b])
        return out

    def block_views(self, start: int, stop: int, copy: bool) -> Iterator[tuple[slice, Tensor]]:
        """Unscaled blocks; from the stored matrix when there is one (copied into the buffer if ``copy``)."""
        self.check_cache()
        if self.formula.family == "generic":
            yield from self._generic_blocks(start, stop)
            return
        rows_per_block = self.block_rows()
        stored = self.stored()
        if stored is not None and not copy:
            for rows in row_slices(start, stop, rows_per_block):
                yield rows, stored[rows]
            return
        main, spare = self._buffers(rows_per_block)
        with torch.no_grad():
            for rows in row_slices(start, stop, rows_per_block):
                b = rows.stop - rows.start
                out = main[:b]
                if stored is not None:
                    # a copy, so that a caller writing into its block cannot corrupt the stored matrix
                    out.copy_(stored[rows])
                else:
                    self._fill(rows, out, None if spare is None else spare[:b])
                yield rows, out

    def check_cache(self) -> None:
        """Empty the cache when an input was modified in place (prepared inputs and stored K are stale)."""
        key = cache_key(self.x1, self.x2, self.hypers, self.distance_dtype)
        if self.cache.get("key") != key:
            self.cache.clear()
            self.cache["key"] = key

    def _generic_blocks(self, start: int, stop: int) -> Iterator[tuple[slice, Tensor]]:
        scale = self.scale()
        with torch.no_grad():
            for rows in row_slices(start, stop, self.block_rows()):
                block = self.dense_rows(rows)
                yield rows, (block if scale is None else block.div_(scale))

    def own_entries(self) -> Tensor:
        """The exact unscaled ``k(x_i, x_i)`` of every row of ``x1`` (``n``): 1 for the stationary families, else
        the kernel's own value on the pair over the outputscale; what a row's entry in its own column is set to
        (:meth:`~kgp.operators.products.StreamingProducts.residual_matmul`)."""
        n = self.x1.shape[0]
        if self.formula.is_stationary:
            return torch.ones(n, dtype=self.x1.dtype, device=self.x1.device)
        with torch.no_grad():
            values = self.formula.pairs(self.x1, self.x1, self.hypers, self.kernel)
            scale = self.scale()
            return values if scale is None else values / scale

    def outputscale(self) -> Tensor | None:
        """The ScaleKernel factor that :meth:`blocks` leaves out (``None`` if unscaled)."""
        scale = self.scale()
        return None if scale is None else scale.detach()
