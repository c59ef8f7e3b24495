"""The lazy kernel matrix K(X, Z) that every solver in kgp multiplies with.

Design (docs/backend.md):

* Every product is a loop over row blocks of ``x1`` (:meth:`KernelOperator.blocks`), the separable
  unit a sharded backend would split across ranks: K v writes disjoint output rows, K^T u and
  K^T (K v + w) sum per-block partial products.
* Block sizes come from :func:`~kgp.operators.blocks.plan_block_rows` (``kgp.settings.memory_budget``,
  ``kgp.settings.block_rows``).
* Without autograd, fast families fill one reused buffer in place (:meth:`KernelRecipe.fill`).
  With autograd, ``op @ v`` goes through linear_operator's ``Matmul`` function, whose forward is the
  fast path and whose backward calls :meth:`KernelOperator._bilinear_derivative`, which recomputes one
  differentiable block at a time, so the autograd graph never holds more than one block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import gpytorch
import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from .. import settings
from ..kernels.recipes import KernelRecipe, recipe_for
from .blocks import plan_block_rows, row_slices

if TYPE_CHECKING:
    from ..distributed import Shard

__all__ = ["KernelOperator", "kernel_operator"]

_SUPPORTED_DTYPES = (torch.float32, torch.float64)
# Block-sized temporaries alive at once in the differentiable path (kept by autograd per block).
_GRAD_BUFFERS = 8
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


def kernel_operator(
    kernel: gpytorch.kernels.Kernel,
    x1: Tensor,
    x2: Tensor | None = None,
    *,
    distance_dtype: torch.dtype | None = None,
    shard: Shard | None = None,
) -> KernelOperator:
    """Build the lazy kernel matrix ``K(x1, x2)`` for any GPyTorch kernel.

    Parameters
    ----------
    kernel:
        A GPyTorch kernel. RBF (incl. ARD), Matern 1/2, 3/2, 5/2, Linear, Polynomial and a
        ScaleKernel around any of them use the fast in-place path; others fall back to the
        kernel's own ``forward`` on blocks.
    x1:
        Row inputs, ``n x d`` (float32 or float64, any device).
    x2:
        Column inputs, ``m x d``; ``None`` means ``x1`` (a square, symmetric operator).
    distance_dtype:
        Precision of the one GEMM of the fast path (the squared distances, i.e. the exponent of
        RBF / Matern kernels, or the inner products of Linear / Polynomial ones). None: the input
        dtype. ``torch.float64`` with float32 inputs keeps the blocks, the nonlinearity and all
        products in float32 but computes the exponent from float64 inputs: with small (ARD)
        lengthscales the float32 exponent ``u.v - |u|^2/2 - |v|^2/2`` cancels terms of size
        ``|x / lengthscale|^2`` and loses up to 1e-3 relative accuracy in the kernel values
        (docs/backend.md, "Precision"); float64 distances bring it back to ~1e-7.
    shard:
        A :class:`kgp.distributed.Shard` when ``x1`` is this rank's rows of a row-sharded data set
        (``problem.kernel_operator(problem.X, Z)`` passes it): products summed over the rows
        (``K^T u``, ``fused_matmul``, ``transpose_matmul``) are then summed over all ranks too, so
        every rank gets the global result; ``K v`` stays local (this rank's rows). ``x2`` must be
        the same on every rank. No autograd through a sharded operator.

    Returns
    -------
    KernelOperator
        An ``n x m`` :class:`linear_operator.LinearOperator`; nothing n x m is allocated.

    Raises
    ------
    TypeError
        If ``kernel`` is not a GPyTorch kernel or an input is not a float32/float64 tensor.
    ValueError
        If the inputs are not 2-D, differ in feature count, dtype or device.
    """
    for name, x in (("x1", x1), ("x2", x2)):
        if x is None and name == "x2":
            continue
        if not torch.is_tensor(x):
            raise TypeError(f"kernel_operator: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"kernel_operator: {name} must be float32 or float64, got {x.dtype}")
    x2 = x1 if x2 is None else x2
    if distance_dtype is not None and distance_dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"kernel_operator: distance_dtype must be None, float32 or float64, got {distance_dtype}")
    recipe, hypers = recipe_for(kernel)
    hypers = tuple(h.to(device=x1.device, dtype=x1.dtype) for h in hypers)
    return KernelOperator(x1, x2, *hypers, kernel=kernel, recipe=recipe, distance_dtype=distance_dtype, shard=shard)


def _signature(*tensors: Tensor) -> tuple:
    """Identity of the tensors' current contents (storage, in-place version, layout)."""
    return tuple((t.data_ptr(), _version(t), t.dtype, t.device, tuple(t.shape), t.stride()) for t in tensors)


def _version(t: Tensor) -> int:
    # inference-mode tensors have no version counter (and cannot be modified in place outside it)
    return -1 if t.is_inference() else t._version


class KernelOperator(LinearOperator):
    r"""Lazy ``K(x1, x2)`` (or its transpose), evaluated in row blocks of ``x1``.

    Products stream over row blocks of ``x1`` sized by :func:`~kgp.operators.blocks.plan_block_rows`
    (the memory budget in :mod:`kgp.settings`), reusing one block buffer across blocks and across
    calls. Without autograd the block is computed in place (one GEMM on augmented inputs, then the
    nonlinearity). Gradients with respect to the representation tensors (``x1``, ``x2``, the
    hyperparameters) are computed block by block in :meth:`_bilinear_derivative`.

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
    batch_shape:
        Leading batch dimensions of a broadcast view (every batch entry is the same matrix). Only
        linear_operator's own batch algebra creates these; solvers use 2-D operators.
    cache:
        Prepared inputs, buffers and the stored K of another operator on the same tensors (used
        when linear_operator rebuilds the operator; ignored if the tensors differ).
    distance_dtype:
        Precision of the fast path's GEMM (see :func:`kernel_operator`); None: the input dtype.
    """

    def __init__(
        self,
        x1: Tensor,
        x2: Tensor,
        *hypers: Tensor,
        kernel: gpytorch.kernels.Kernel,
        recipe: KernelRecipe,
        transposed: bool = False,
        batch_shape: tuple[int, ...] = (),
        cache: dict | None = None,
        distance_dtype: torch.dtype | None = None,
        shard: Shard | None = None,
    ):
        if x1.dim() != 2 or x2.dim() != 2:
            raise ValueError(
                "KernelOperator: expected 2-D inputs (n x d, m x d), got shapes "
                f"{tuple(x1.shape)} and {tuple(x2.shape)}"
            )
        if x1.shape[1] != x2.shape[1]:
            raise ValueError(f"KernelOperator: x1 has {x1.shape[1]} features but x2 has {x2.shape[1]}")
        if x1.dtype != x2.dtype or x1.device != x2.device:
            raise ValueError(
                f"KernelOperator: x1 and x2 must share dtype and device, got {x1.dtype}/{x1.device} "
                f"and {x2.dtype}/{x2.device}"
            )
        batch_shape = tuple(int(s) for s in batch_shape)
        if distance_dtype == x1.dtype:
            distance_dtype = None
        key = (_signature(x1, x2, *hypers), distance_dtype)
        if cache is None or cache.get("key") != key:
            cache = {"key": key}
        # The cache travels as a kwarg: linear_operator rebuilds the operator from its representation
        # inside every product (Matmul), and the rebuilt one must find the prepared inputs, buffers
        # and stored K. The key (storage, version, dtype, shape) keeps it from outliving its tensors.
        super().__init__(
            x1,
            x2,
            *hypers,
            kernel=kernel,
            recipe=recipe,
            transposed=transposed,
            batch_shape=batch_shape,
            cache=cache,
            distance_dtype=distance_dtype,
            shard=shard,
        )
        self.x1 = x1
        self.x2 = x2
        self.hypers = tuple(hypers)
        self.kernel = kernel
        self.recipe = recipe
        self.transposed = transposed
        self.batch_shape_ = batch_shape
        self.distance_dtype = distance_dtype
        self.shard = shard
        self._cache: dict = cache

    def _view(self, *, transposed: bool | None = None, batch_shape: tuple[int, ...] | None = None) -> KernelOperator:
        """Same matrix, other orientation / batch view; shares prepared inputs, buffers and stored K."""
        out = KernelOperator(
            self.x1,
            self.x2,
            *self.hypers,
            kernel=self.kernel,
            recipe=self.recipe,
            transposed=self.transposed if transposed is None else transposed,
            batch_shape=self.batch_shape_ if batch_shape is None else batch_shape,
            cache=self._cache,
            distance_dtype=self.distance_dtype,
            shard=self.shard,
        )
        return out

    # ------------------------------------------------------------------ structure
    def _size(self) -> torch.Size:
        n, m = self.x1.shape[0], self.x2.shape[0]
        return torch.Size((*self.batch_shape_, *((m, n) if self.transposed else (n, m))))

    def _transpose_nonbatch(self) -> KernelOperator:
        return self._view(transposed=not self.transposed)

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

    def _same_inputs(self) -> bool:
        """Whether x1 and x2 hold the same points (K(X, X)); then the diagonal is k(x, x) exactly."""
        if "same" not in self._cache:
            x1, x2 = self.x1, self.x2
            self._cache["same"] = x1 is x2 or (x1.shape == x2.shape and bool(torch.equal(x1, x2)))
        return self._cache["same"]

    # ------------------------------------------------------------------ fast path pieces
    def _fast(self) -> bool:
        return self.recipe.family != "generic" and not self._needs_grad()

    def _center(self) -> Tensor | None:
        if not self.recipe.is_stationary:
            return None
        if "center" not in self._cache:
            self._cache["center"] = self._in_distance_dtype(self.x2.detach()).mean(dim=0, keepdim=True)
        return self._cache["center"]

    def _in_distance_dtype(self, t: Tensor) -> Tensor:
        return t if self.distance_dtype is None else t.to(self.distance_dtype)

    def _distance_hypers(self) -> tuple[Tensor, ...]:
        if self.distance_dtype is None:
            return self.hypers
        return tuple(h.detach().to(self.distance_dtype) for h in self.hypers)

    def _cols(self) -> Tensor:
        if "cols" not in self._cache:
            with torch.no_grad():
                x2 = self._in_distance_dtype(self.x2)
                cols = self.recipe.prepare_cols(x2, self._distance_hypers(), self._center())
                self._cache["cols"] = cols.contiguous()
        return self._cache["cols"]

    def _rows(self, rows: slice) -> Tensor:
        # Augmented rows cost O(n d): keep them when they are small next to the budget.
        full = self._cache.get("rows")
        if full is not None:
            return full[rows]
        n, d = self.x1.shape
        itemsize = self.x1.element_size() if self.distance_dtype is None else self.distance_dtype.itemsize
        hypers = self._distance_hypers()
        with torch.no_grad():
            if (n * (d + 2) * itemsize) * 8 <= settings.memory_budget.value():
                full = self.recipe.prepare_rows(self._in_distance_dtype(self.x1), hypers, self._center())
                full = full.contiguous()
                self._cache["rows"] = full
                return full[rows]
            return self.recipe.prepare_rows(self._in_distance_dtype(self.x1[rows]), hypers, self._center())

    def _buffers_per_row(self, differentiable: bool = False) -> int:
        if self.recipe.family == "generic":
            # a generic forward may build b x m x d temporaries (e.g. PeriodicKernel's differences)
            return 4 + self.x1.shape[1]
        if differentiable:
            return _GRAD_BUFFERS
        extra = 0
        if self.distance_dtype is not None:  # the exponent block in the wider dtype
            extra = -(-self.distance_dtype.itemsize // self.x1.element_size())
        return self.recipe.buffers_needed + extra

    def block_rows(self, differentiable: bool = False) -> int:
        """Rows per block under the current memory budget (and ``kgp.settings.block_rows``).

        Parameters
        ----------
        differentiable:
            Size blocks for the autograd path, which keeps several block-sized temporaries alive.
        """
        n, m = self.shape_nm
        return plan_block_rows(n, m, self.x1.element_size(), self._buffers_per_row(differentiable))

    def _buffers(self, rows: int) -> tuple[Tensor, Tensor | None]:
        m = self.x2.shape[0]
        key = ("buffers", rows, m, self.x1.dtype, self.x1.device)
        if key not in self._cache:
            # drop buffers of another block size first, so at most one set is alive
            for k in [k for k in self._cache if isinstance(k, tuple) and k[0] == "buffers"]:
                del self._cache[k]
            main = torch.empty(rows, m, dtype=self.x1.dtype, device=self.x1.device)
            spare = torch.empty_like(main) if self.recipe.buffers_needed > 1 else None
            self._cache[key] = (main, spare)
        return self._cache[key]

    def _scratch(self, rows: int, k: int) -> Tensor:
        """A reused ``rows x k`` buffer for the per-block inner product of :meth:`fused_matmul`."""
        buf = self._cache.get("scratch")
        if buf is None or buf.shape[0] < rows or buf.shape[1] != k or buf.dtype != self.x1.dtype:
            buf = torch.empty(rows, k, dtype=self.x1.dtype, device=self.x1.device)
            self._cache["scratch"] = buf
        return buf

    def _wide_buffer(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """A reused ``rows x cols`` buffer of another dtype (the exponent, or a block cast for accumulation)."""
        buf = self._cache.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype:
            buf = torch.empty(rows, cols, dtype=dtype, device=self.x1.device)
            self._cache[name] = buf
        return buf[:rows]

    def _stored(self) -> Tensor | None:
        """The whole unscaled K(x1, x2) when ``kernel_cache="auto"`` allows it, else ``None``.

        Stored from the operator's second product on (a single product, e.g. a prediction, never
        pays for the n x M write), and only if the matrix plus one block of scratch fits
        ``kgp.settings.memory_budget``. Products read it directly; :meth:`blocks` copies from it.
        """
        if "stored" in self._cache:
            return self._cache["stored"]
        if settings.kernel_cache.value() != "auto" or self.recipe.family == "generic":
            return None
        uses = self._cache.get("uses", 0) + 1
        self._cache["uses"] = uses
        if uses < 2:
            return None
        n, m = self.shape_nm
        itemsize = self.x1.element_size()
        spare_rows = self.block_rows() if self.recipe.buffers_needed > 1 else 0
        if (n + spare_rows) * m * itemsize > settings.memory_budget.value():
            return None
        stored = torch.empty(n, m, dtype=self.x1.dtype, device=self.x1.device)
        spare = torch.empty(spare_rows, m, dtype=stored.dtype, device=stored.device) if spare_rows else None
        with torch.no_grad():
            for rows in row_slices(0, n, max(1, spare_rows or self.block_rows())):
                b = rows.stop - rows.start
                self._fill(rows, stored[rows], None if spare is None else spare[:b])
        self._cache["stored"] = stored
        return stored

    def _fill(self, rows: slice, out: Tensor, spare: Tensor | None) -> None:
        exponent = None
        if self.distance_dtype is not None:
            exponent = self._wide_buffer("exponent", out.shape[0], out.shape[1], self.distance_dtype)
        self.recipe.fill(self._rows(rows), self._cols(), out, spare, exponent=exponent)
        if self.recipe.is_stationary and self._same_inputs():
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
        yield from self._block_views(start, stop, copy=True)

    def _block_views(self, start: int, stop: int, copy: bool) -> Iterator[tuple[slice, Tensor]]:
        """Unscaled blocks; from the stored matrix when there is one (copied into the buffer if ``copy``)."""
        key = (_signature(self.x1, self.x2, *self.hypers), self.distance_dtype)
        if self._cache.get("key") != key:
            # an input was modified in place: prepared inputs and stored K are stale
            self._cache.clear()
            self._cache["key"] = key
        if self.recipe.family == "generic":
            yield from self._generic_blocks(start, stop)
            return
        rows_per_block = self.block_rows()
        stored = self._stored()
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

    def _generic_blocks(self, start: int, stop: int) -> Iterator[tuple[slice, Tensor]]:
        scale = self._scale()
        with torch.no_grad():
            for rows in row_slices(start, stop, self.block_rows()):
                block = self._dense_rows(rows)
                yield rows, (block if scale is None else block.div_(scale))

    def outputscale(self) -> Tensor | None:
        """The ScaleKernel factor that :meth:`blocks` leaves out (``None`` if unscaled)."""
        scale = self._scale()
        return None if scale is None else scale.detach()

    # ------------------------------------------------------------------ streaming products
    def _product_dtype_check(self, rhs: Tensor) -> None:
        if rhs.dtype != self.x1.dtype:
            raise TypeError(f"KernelOperator: right-hand side has dtype {rhs.dtype}, operator has {self.x1.dtype}")
        if rhs.device != self.x1.device:
            raise ValueError(f"KernelOperator: right-hand side is on {rhs.device}, operator on {self.x1.device}")

    def _k_matmul(self, v: Tensor) -> Tensor:
        """K(x1, x2) v for ``v`` of shape ``m x k``."""
        n, _ = self.shape_nm
        if not self._fast():
            parts = [self._dense_rows(rows) @ v for rows in row_slices(0, n, self.block_rows(True))]
            return torch.cat(parts, dim=0)
        scale = self._scale()
        out = torch.empty(n, v.shape[1], dtype=v.dtype, device=v.device)
        for rows, block in self._block_views(0, n, copy=False):
            torch.mm(block, v, out=out[rows])
        return out if scale is None else out.mul_(scale)

    def _k_t_matmul(self, u: Tensor) -> Tensor:
        """K(x1, x2)^T u for ``u`` of shape ``n x k``."""
        n, m = self.shape_nm
        if not self._fast():
            self._no_sharded_grad()
            acc = None
            for rows in row_slices(0, n, self.block_rows(True)):
                part = self._dense_rows(rows).T @ u[rows]
                acc = part if acc is None else acc + part
            return self._reduce(acc if acc is not None else u.new_zeros(m, u.shape[1]))
        scale = self._scale()
        out = torch.zeros(m, u.shape[1], dtype=u.dtype, device=u.device)
        for rows, block in self._block_views(0, n, copy=False):
            out.addmm_(block.T, u[rows])
        self._reduce(out)
        return out if scale is None else out.mul_(scale)

    def _reduce(self, partial: Tensor) -> Tensor:
        """Sum a partial ``m x k`` result over the ranks of a sharded operator (in place; identity otherwise)."""
        if self.shard is None:
            return partial
        return self.shard.all_reduce_(partial)

    def _no_sharded_grad(self) -> None:
        if self.shard is not None and self._needs_grad():
            raise NotImplementedError(
                "KernelOperator: autograd through a row-sharded operator is not supported (gradients would "
                "need their own reduction); run distributed fits under torch.no_grad()"
            )

    def fused_matmul(self, v: Tensor, w: Tensor | None = None, *, accumulate: torch.dtype | None = None) -> Tensor:
        r"""Compute :math:`K^\top (K v + w)` in one pass over the rows of ``x1`` (FALKON's hot loop).

        This is the product ``K_nM^T (K_nM u + v)`` of FALKON's Algorithm 1 (``KnM_times_vector``,
        Rudi et al. 2017): each row block of K is formed once and used for both products.

        Parameters
        ----------
        v:
            ``m x k`` (or ``m``) coefficients.
        w:
            Optional ``n x k`` (or ``n``) offset added before the transposed product.
        accumulate:
            Optional wider dtype (float64 for a float32 operator) for the sum over rows of the
            transposed product: ``K v + w`` stays in the operator's dtype, and ``K^T (K v + w)`` is
            summed in float32 over runs of :data:`_ACCUMULATE_ROWS` rows only, the runs in the wider
            dtype. ``v`` and ``w`` may then be given in either dtype, and the result has dtype
            ``accumulate``. Why: a float32 sum over n rows errs by about
            ``eps32 sqrt(n)`` in directions where ``K_MM`` is nearly singular, and FALKON's
            preconditioner amplifies exactly those (docs/solvers/falkon.md, "float32"). No autograd.

        Returns
        -------
        Tensor
            ``m x k`` (``m`` for vector input), with K = K(x1, x2) regardless of ``transposed``
            or a batch view. Differentiable with respect to ``v``, ``w`` and the representation
            tensors when autograd is on (without ``accumulate``).
        """
        if accumulate is not None and accumulate != self.x1.dtype:
            return self._accumulated(v, w, accumulate)
        vector = v.dim() == 1
        v2 = v.unsqueeze(-1) if vector else v
        w2 = None if w is None else (w.unsqueeze(-1) if w.dim() == 1 else w)
        n, m = self.shape_nm
        if v2.dim() != 2 or v2.shape[0] != m or (w2 is not None and w2.shape != (n, v2.shape[1])):
            raise ValueError(
                f"fused_matmul: expected v of shape ({m}, k) and w of shape ({n}, k), got "
                f"{tuple(v.shape)} and {None if w is None else tuple(w.shape)}"
            )
        self._product_dtype_check(v2)
        if w2 is not None:
            self._product_dtype_check(w2)
        base = self._view(transposed=False, batch_shape=())
        args = (base.x1, base.x2, *base.hypers)
        tracked = (v2, *args) if w2 is None else (v2, w2, *args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
            if self.shard is not None:
                raise NotImplementedError(
                    "fused_matmul: autograd through a row-sharded operator is not supported; use torch.no_grad()"
                )
            out = _FusedMatmul.apply(base, v2, w2, *args)
        else:
            out = base._fused_pass(v2, w2)
        return out.squeeze(-1) if vector else out

    def transpose_matmul(self, u: Tensor, *, accumulate: torch.dtype | None = None) -> Tensor:
        """``K(x1, x2)^T u`` for ``u`` of shape ``n x k`` (or ``n``), optionally summed in a wider dtype.

        ``accumulate`` as in :meth:`fused_matmul` (e.g. FALKON's right-hand side ``K_nM^T y`` of a
        float32 problem, summed in float64).
        """
        if accumulate is not None and accumulate != self.x1.dtype:
            return self._accumulated(None, u, accumulate)
        base = self._view(transposed=True, batch_shape=())
        return base @ u

    def _accumulated(self, v: Tensor | None, w: Tensor | None, accumulate: torch.dtype) -> Tensor:
        """``K^T (K v + w)`` (``v`` may be None: ``K^T w``) with blocks cast to ``accumulate`` for the sum."""
        if accumulate not in _SUPPORTED_DTYPES or accumulate.itemsize < self.x1.element_size():
            raise TypeError(f"accumulate: expected a dtype at least as wide as {self.x1.dtype}, got {accumulate}")
        ref = v if v is not None else w
        vector = ref.dim() == 1
        v2 = None if v is None else (v.unsqueeze(-1) if vector else v)
        w2 = None if w is None else (w.unsqueeze(-1) if w.dim() == 1 else w)
        n, m = self.shape_nm
        k = (v2 if v2 is not None else w2).shape[1]
        if (v2 is not None and (v2.dim() != 2 or v2.shape[0] != m)) or (w2 is not None and w2.shape != (n, k)):
            raise ValueError(
                f"fused_matmul: expected v of shape ({m}, k) and w of shape ({n}, k), got "
                f"{None if v is None else tuple(v.shape)} and {None if w is None else tuple(w.shape)}"
            )
        for t in (v2, w2):
            if t is not None and t.device != self.x1.device:
                raise ValueError(f"KernelOperator: right-hand side is on {t.device}, operator on {self.x1.device}")
        base = self._view(transposed=False, batch_shape=())
        scale = base._scale()
        dtype = self.x1.dtype
        rows_per_sum = _ACCUMULATE_ROWS
        with torch.no_grad():
            vs = None
            if v2 is not None:
                vs = (v2 if scale is None else v2 * scale.to(v2.dtype)).to(dtype)
            out = torch.zeros(m, k, dtype=accumulate, device=self.x1.device)
            scratch = base._scratch(base.block_rows(), k)
            for rows, block in base._block_views(0, n, copy=False):
                b = block.shape[0]
                inner = scratch[:b]
                if vs is not None:
                    torch.mm(block, vs, out=inner)
                    if w2 is not None:
                        inner.add_(w2[rows].to(dtype))
                else:
                    inner.copy_(w2[rows])
                out.add_(_run_sums(block, inner, rows_per_sum, accumulate))
            base._reduce(out)  # partial sums added across ranks in the accumulation dtype
            if scale is not None:
                out.mul_(scale.to(accumulate))
        return out.squeeze(-1) if vector else out

    def gram(self) -> Tensor:
        r"""``K^T K`` (``m x m``, exactly symmetric) in one pass over the rows of ``x1``; no autograd.

        The Gram matrix ``K_Mn K_nM`` of the SGPR / DTC variance (Titsias 2009, eq. 6) without the
        ``n x m`` matrix. Only the upper triangle of column panels is multiplied (about half of the
        ``n m^2`` flops of ``fused_matmul(eye(m))``, which also spends ``n m^2`` on the identity) and
        mirrored at the end. A sharded operator sums the ranks' partial products.
        """
        n, m = self.shape_nm
        base = self._view(transposed=False, batch_shape=())
        scale = base._scale()
        # panels narrow enough for the triangle to save work, wide enough for efficient GEMMs
        panel = max(256, -(-m // 8))
        with torch.no_grad():
            out = torch.zeros(m, m, dtype=self.x1.dtype, device=self.x1.device)
            for _, block in base._block_views(0, n, copy=False):
                for c in range(0, m, panel):
                    e = min(c + panel, m)
                    out[c:e, c:].addmm_(block[:, c:e].T, block[:, c:])
            base._reduce(out)
            upper = out.triu()
            out = upper + upper.triu(1).mT
            if scale is not None:
                out.mul_(scale * scale)
        return out

    def _fused_pass(self, v: Tensor, w: Tensor | None) -> Tensor:
        """One pass of K^T (K v + w) without autograd (the per-block K v lands in a reused buffer)."""
        _, m = self.shape_nm
        scale = self._scale()
        with torch.no_grad():
            # fold the outputscale into v: one m x k product instead of one per block
            vs = v if scale is None else v * scale
            out = torch.zeros(m, v.shape[1], dtype=v.dtype, device=v.device)
            scratch = self._scratch(self.block_rows(), v.shape[1])
            for rows, block in self._block_views(0, self.shape_nm[0], copy=False):
                inner = scratch[: block.shape[0]]
                torch.mm(block, vs, out=inner)
                if w is not None:
                    inner.add_(w[rows])
                out.addmm_(block.T, inner)
            self._reduce(out)
            if scale is not None:
                out.mul_(scale)
        return out

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
        if self.batch_shape_:
            full = torch.broadcast_shapes(self.batch_shape_, batch)
            out = out.expand(*full, *out.shape[-2:])
        return out.squeeze(-1) if vector else out

    def _t_matmul(self, rhs: Tensor) -> Tensor:
        return self._transpose_nonbatch()._matmul(rhs)

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

    def _diag_offset(self, rows: slice) -> int | None:
        """Column of the block's first diagonal entry for K(X, X) with a stationary kernel, else None."""
        if self.recipe.is_stationary and self._same_inputs():
            return rows.start
        return None

    def _dense_rows(self, rows: slice) -> Tensor:
        """Differentiable scaled block K(x1[rows], x2)."""
        return self.recipe.dense(self.x1[rows], self.x2, self.hypers, self.kernel, diag_offset=self._diag_offset(rows))

    def _matrix(self) -> Tensor:
        """Dense K(x1, x2) (not transposed, no batch)."""
        if self._fast():
            n, m = self.shape_nm
            out = torch.empty(n, m, dtype=self.x1.dtype, device=self.x1.device)
            for rows, block in self.blocks():
                out[rows] = block
            scale = self._scale()
            if scale is not None:
                out.mul_(scale)
            return out
        return self.recipe.dense(self.x1, self.x2, self.hypers, self.kernel, diag_offset=self._diag_offset(slice(0, 0)))

    def to_dense(self) -> Tensor:
        """The dense matrix (n x m): only for small operators, it allocates the whole matrix."""
        out = self._matrix()
        out = out.T.contiguous() if self.transposed else out
        if self.batch_shape_:
            out = out.expand(*self.batch_shape_, *out.shape)
        return out

    def _diagonal(self) -> Tensor:
        n, m = self.shape_nm
        if n != m:
            raise RuntimeError(f"diagonal of a non-square {n} x {m} kernel operator")
        out = self.recipe.pairs(self.x1, self.x2, self.hypers, self.kernel)
        if self.batch_shape_:
            out = out.expand(*self.batch_shape_, n)
        return out

    def _get_indices(self, row_index, col_index, *batch_indices):
        if self.transposed:
            row_index, col_index = col_index, row_index
        shape = torch.broadcast_shapes(row_index.shape, col_index.shape, *(b.shape for b in batch_indices))
        xa = self.x1[row_index.expand(shape)]
        xb = self.x2[col_index.expand(shape)]
        return self.recipe.pairs(xa, xb, self.hypers, self.kernel)

    def _getitem(self, row_index, col_index, *batch_indices):
        simple = all(isinstance(i, slice) or (torch.is_tensor(i) and i.dim() == 1) for i in (row_index, col_index))
        plain_batch = all(isinstance(i, (int, slice)) for i in batch_indices)
        if not simple or not plain_batch:
            return super()._getitem(row_index, col_index, *batch_indices)
        # batch entries are identical: integer/slice batch indices only change the batch shape
        batch_shape = tuple(torch.empty(self.batch_shape_, device="meta")[tuple(batch_indices)].shape)
        if self.shard is not None:
            return super()._getitem(row_index, col_index, *batch_indices)  # rows of one rank are not all rows
        if self.transposed:
            row_index, col_index = col_index, row_index
        return KernelOperator(
            self.x1[row_index],
            self.x2[col_index],
            *self.hypers,
            kernel=self.kernel,
            recipe=self.recipe,
            transposed=self.transposed,
            batch_shape=batch_shape,
            distance_dtype=self.distance_dtype,  # the block keeps the precision the operator was built with
        )

    # batch views: every batch entry is the same matrix, so they only change the reported shape
    def _unsqueeze_batch(self, dim: int) -> KernelOperator:
        shape = list(self.batch_shape_)
        shape.insert(dim, 1)
        return self._view(batch_shape=tuple(shape))

    def _expand_batch(self, batch_shape) -> KernelOperator:
        return self._view(batch_shape=tuple(batch_shape))

    def _permute_batch(self, *dims: int) -> KernelOperator:
        return self._view(batch_shape=tuple(self.batch_shape_[d] for d in dims))

    def __repr__(self) -> str:
        return f"KernelOperator({' x '.join(map(str, self.shape))}, family={self.recipe.family}, dtype={self.dtype})"


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
