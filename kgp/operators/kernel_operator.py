"""The lazy kernel matrix K(X, Z) that every solver in kgp multiplies with.

Design (docs/backend.md):

* Every product is a loop over row blocks of ``x1`` (:meth:`KernelOperator.blocks`), the separable
  unit a sharded backend would split across ranks: K v writes disjoint output rows, K^T u and
  K^T (K v + w) sum per-block partial products.
* Block sizes come from :func:`~kgp.operators.blocks.plan_block_rows` (``kgp.settings.memory_budget``,
  ``kgp.settings.block_rows``).
* Without autograd, fast families fill one reused buffer in place (:meth:`KernelFormula.fill`).
  With autograd, ``op @ v`` goes through linear_operator's ``Matmul`` function, whose forward is the
  fast path and whose backward calls :meth:`KernelOperator._bilinear_derivative`, which recomputes one
  differentiable block at a time, so the autograd graph never holds more than one block.

The operator is composed of two objects it owns: a :class:`~.workspace.BlockWorkspace` (prepared inputs,
buffers, the stored K, the row blocks of ``K(x1, x2)``) and a :class:`~.products.StreamingProducts` engine
(the streamed products over those blocks, and the autograd function of ``fused_matmul``);
:func:`~.autograd.bilinear_derivative` differentiates block by block, and :func:`~.residual.residual_matmul` gives a
batch's residual and gradient from one formation of each block. This module keeps construction, the
orientation and batch views, and linear_operator's API, mapping each onto the untransposed ``K(x1, x2)`` the
other two describe. Imports run one way: this module -> residual -> products -> autograd -> workspace.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import gpytorch
import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from ..kernels.formulas import KernelFormula, formula_for
from .autograd import bilinear_derivative
from .products import StreamingProducts
from .residual import residual_matmul
from .workspace import BlockWorkspace, cache_key

if TYPE_CHECKING:
    from ..distributed import Shard

__all__ = ["KernelOperator", "kernel_operator"]

_SUPPORTED_DTYPES = (torch.float32, torch.float64)  # also in .products (accumulate)


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
        (docs/solvers/falkon.md, "float32"); float64 distances bring it back to ~1e-7.
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
    formula, hypers = formula_for(kernel)
    hypers = tuple(h.to(device=x1.device, dtype=x1.dtype) for h in hypers)
    return KernelOperator(x1, x2, *hypers, kernel=kernel, formula=formula, distance_dtype=distance_dtype, shard=shard)


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
        Hyperparameter tensors in the order the formula defines (see :func:`kgp.kernels.formula_for`).
    kernel:
        The GPyTorch kernel (used by the generic path, and kept for introspection).
    formula:
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

    Attributes
    ----------
    workspace:
        The :class:`~kgp.operators.workspace.BlockWorkspace` of ``K(x1, x2)`` (shared with every view of this
        operator through ``cache``): what the native passes of :mod:`kgp.operators.fused_cpu` and
        :mod:`kgp.operators.fused_gpu` read.
    """

    def __init__(
        self,
        x1: Tensor,
        x2: Tensor,
        *hypers: Tensor,
        kernel: gpytorch.kernels.Kernel,
        formula: KernelFormula,
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
        key = cache_key(x1, x2, hypers, distance_dtype)
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
            formula=formula,
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
        self.formula = formula
        self.transposed = transposed
        self.batch_shape_ = batch_shape
        self.distance_dtype = distance_dtype
        self.shard = shard
        self._cache: dict = cache
        self.workspace = BlockWorkspace(x1, x2, self.hypers, kernel, formula, distance_dtype, cache)
        self._products = StreamingProducts(self.workspace, shard)

    def _view(self, *, transposed: bool | None = None, batch_shape: tuple[int, ...] | None = None) -> KernelOperator:
        """Same matrix, other orientation / batch view; shares prepared inputs, buffers and stored K."""
        out = KernelOperator(
            self.x1,
            self.x2,
            *self.hypers,
            kernel=self.kernel,
            formula=self.formula,
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
        return self.workspace.shape_nm

    # ------------------------------------------------------------------ blocks and products
    def block_rows(self, differentiable: bool = False) -> int:
        """Rows per block under the current memory budget (and ``kgp.settings.block_rows``).

        Parameters
        ----------
        differentiable:
            Size blocks for the autograd path, which keeps several block-sized temporaries alive.
        """
        return self.workspace.block_rows(differentiable)

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
        return self.workspace.blocks(start, stop)

    def fill_dense(self, out: Tensor) -> Tensor:
        """Write the whole **unscaled** ``K(x1, x2)`` (n x m, not transposed) into ``out``; no autograd.

        Each row block is formed in ``out`` itself (no second pass over the matrix, no buffer of fresh memory).
        """
        return self.workspace.fill_dense(out)

    def outputscale(self) -> Tensor | None:
        """The ScaleKernel factor that :meth:`blocks` leaves out (``None`` if unscaled)."""
        return self.workspace.outputscale()

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
            summed in float32 over runs of 16 rows only, the runs in the wider dtype. ``v`` and ``w``
            may then be given in either dtype, and the result has dtype ``accumulate``. Why: a float32 sum
            over n rows errs by about ``eps32 sqrt(n)`` in directions where ``K_MM`` is nearly singular,
            and FALKON's preconditioner amplifies exactly those (docs/solvers/falkon.md, "float32"). No
            autograd.

        Returns
        -------
        Tensor
            ``m x k`` (``m`` for vector input), with K = K(x1, x2) regardless of ``transposed``
            or a batch view. Differentiable with respect to ``v``, ``w`` and the representation
            tensors when autograd is on (without ``accumulate``).
        """
        return self._products.fused_matmul(v, w, accumulate=accumulate)

    def residual_matmul(
        self, v: Tensor, w: Tensor | None = None, *, own_columns: Tensor | None = None, transpose: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        r"""``u = K v + w`` and ``K^\top u`` from one formation of each kernel block (a stochastic gradient step).

        The two halves of :meth:`fused_matmul`, both returned: an SGD or EigenPro step on a batch ``X_b`` needs
        the batch's residual ``g = K(X_b, Z) a - y_b`` and the gradient ``K(X_b, Z)^\top g`` (EigenPro 3,
        eq. 28), and forming the block once for both halves the cost of the kernel evaluations, which dominate
        the products. On a CPU with the native pass (RBF, Matern 3/2, 5/2) no block is in memory at all.

        Parameters
        ----------
        v:
            ``m x k`` (or ``m``) coefficients.
        w:
            Optional ``n x k`` (or ``n``) offset (e.g. ``-y_b``).
        own_columns:
            Optional ``n`` integers: the column of ``x2`` holding row ``i``'s own point (-1: none). That entry
            is set to the exact ``k(x_i, x_i)``, as on the diagonal of ``K(X, X)`` (the distance GEMM's
            cancellation leaves rounding there). ``K(X, X)`` itself gets its exact diagonal without it.
        transpose:
            False: ``u`` alone, with the same entries (``K v`` where ``K(X, X)`` needs its exact diagonal).

        Returns
        -------
        tuple
            ``u`` (``n x k``) and ``K^\top u`` (``m x k``, None without ``transpose``; summed over the ranks of
            a row-sharded operator), with K = K(x1, x2) regardless of ``transposed``; vectors for vector input.
            No autograd.
        """
        return residual_matmul(self._products, v, w, own_columns=own_columns, transpose=transpose)

    def transpose_matmul(self, u: Tensor, *, accumulate: torch.dtype | None = None) -> Tensor:
        """``K(x1, x2)^T u`` for ``u`` of shape ``n x k`` (or ``n``), optionally summed in a wider dtype.

        ``accumulate`` as in :meth:`fused_matmul` (e.g. FALKON's right-hand side ``K_nM^T y`` of a
        float32 problem, summed in float64).
        """
        if accumulate is not None and accumulate != self.x1.dtype:
            return self._products.accumulated(None, u, accumulate)
        return self._view(transposed=True, batch_shape=()) @ u

    def gram(self) -> Tensor:
        r"""``K^T K`` (``m x m``, exactly symmetric) in one pass over the rows of ``x1``; no autograd.

        The Gram matrix ``K_Mn K_nM`` of the SGPR / DTC variance (Titsias 2009, eq. 6) without the
        ``n x m`` matrix; a sharded operator sums the ranks' partial products.
        """
        return self._products.gram()

    # ------------------------------------------------------------------ LinearOperator API
    def _matmul(self, rhs: Tensor) -> Tensor:
        self._products.check_rhs(rhs)
        vector = rhs.dim() == 1
        mat = rhs.unsqueeze(-1) if vector else rhs
        batch = mat.shape[:-2]
        if batch:  # fold batch dimensions of the right-hand side into columns
            cols = mat.movedim(-2, 0).reshape(mat.shape[-2], -1)
        else:
            cols = mat
        out = self._products.k_t_matmul(cols) if self.transposed else self._products.k_matmul(cols)
        if batch:
            out = out.reshape(out.shape[0], *batch, mat.shape[-1]).movedim(0, -2)
        if self.batch_shape_:
            full = torch.broadcast_shapes(self.batch_shape_, batch)
            out = out.expand(*full, *out.shape[-2:])
        return out.squeeze(-1) if vector else out

    def _t_matmul(self, rhs: Tensor) -> Tensor:
        return self._transpose_nonbatch()._matmul(rhs)

    def _bilinear_derivative(self, left_vecs: Tensor, right_vecs: Tensor) -> tuple[Tensor | None, ...]:
        """linear_operator's gradient hook, one row block at a time (:func:`~.autograd.bilinear_derivative`)."""
        return bilinear_derivative(
            self.workspace,
            left_vecs,
            right_vecs,
            transposed=self.transposed,
            batch_shape=self.batch_shape_,
            shard=self.shard,
        )

    def _matrix(self) -> Tensor:
        """Dense K(x1, x2) (not transposed, no batch)."""
        work = self.workspace
        if work.fast():
            n, m = self.shape_nm
            out = torch.empty(n, m, dtype=self.x1.dtype, device=self.x1.device)
            work.fill_dense(out)
            scale = work.scale()
            if scale is not None:
                out.mul_(scale)
            return out
        return self.formula.dense(self.x1, self.x2, self.hypers, self.kernel, diag_offset=work.diag_offset(slice(0, 0)))

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
        out = self.formula.pairs(self.x1, self.x2, self.hypers, self.kernel)
        if self.batch_shape_:
            out = out.expand(*self.batch_shape_, n)
        return out

    def _get_indices(self, row_index, col_index, *batch_indices):
        if self.transposed:
            row_index, col_index = col_index, row_index
        shape = torch.broadcast_shapes(row_index.shape, col_index.shape, *(b.shape for b in batch_indices))
        xa = self.x1[row_index.expand(shape)]
        xb = self.x2[col_index.expand(shape)]
        return self.formula.pairs(xa, xb, self.hypers, self.kernel)

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
            formula=self.formula,
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
        return f"KernelOperator({' x '.join(map(str, self.shape))}, family={self.formula.family}, dtype={self.dtype})"
