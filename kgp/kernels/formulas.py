"""Recognise GPyTorch kernels and evaluate their blocks fast.

A :class:`KernelFormula` describes *how* to evaluate one kernel (its family and which
hyperparameter tensors it needs); the hyperparameter tensors themselves travel separately,
as arguments of the :class:`~kgp.operators.KernelOperator`, so that linear_operator's
autograd machinery sees them.

Fast families (one GEMM on augmented inputs, nonlinearity in place, reused buffer):

===============  =====================================================  =================
family           k(x, z) (u = x / lengthscale, v = z / lengthscale)     GPyTorch class
===============  =====================================================  =================
``rbf``          exp(-||u - v||^2 / 2)                                  RBFKernel
``matern12``     exp(-r),  r = ||u - v||                                MaternKernel(0.5)
``matern32``     (1 + sqrt3 r) exp(-sqrt3 r)                            MaternKernel(1.5)
``matern52``     (1 + sqrt5 r + 5 r^2 / 3) exp(-sqrt5 r)                MaternKernel(2.5)
``linear``       variance * x . z                                       LinearKernel
``polynomial``   (x . z + offset)^power                                 PolynomialKernel
===============  =====================================================  =================

Each may be wrapped in one ``ScaleKernel`` (outputscale multiplies the result). Anything else
(other kernels, ``active_dims``, batch shapes, sums and products) uses the ``generic`` family,
which calls the kernel's own ``forward`` on blocks: correct, slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gpytorch
import torch
from torch import Tensor

from .exp_floor import EXP_FLOOR
from .rbf_block import rbf_block

__all__ = ["EXP_FLOOR", "LOG2E", "KernelFormula", "KernelParameters", "formula_for", "kernel_parameters"]

_SQRT3 = math.sqrt(3.0)
_SQRT5 = math.sqrt(5.0)
_DISTANCE_FAMILIES = ("rbf", "matern12", "matern32", "matern52")
LOG2E = math.log2(math.e)
# factor c folded into the augmented inputs, so the GEMM yields (c r)^2 and exp(-c r) needs no extra
# pass. Matern 1/2 and the RBF fold in log2(e) as well and call exp2: 1.6x faster than exp in float32
# on the development CPU (docs/backend.md), at a relative error of the order the GEMM already makes.
_DISTANCE_FACTOR = {"matern12": LOG2E, "matern32": _SQRT3, "matern52": _SQRT5}


@dataclass(frozen=True)
class KernelFormula:
    """How to evaluate one kernel from its hyperparameter tensors.

    Attributes
    ----------
    family:
        One of ``rbf``, ``matern12``, ``matern32``, ``matern52``, ``linear``, ``polynomial``
        or ``generic``.
    scaled:
        Whether an outputscale tensor is present (a ``ScaleKernel`` wrapper).
    power:
        Exponent of the polynomial family.
    param_names:
        For ``generic``: the kernel module's parameter names, in the order of the
        hyperparameter tensors.
    """

    family: str
    scaled: bool = False
    power: int = 0
    param_names: tuple[str, ...] = ()

    @property
    def is_stationary(self) -> bool:
        return self.family in _DISTANCE_FAMILIES

    @property
    def buffers_needed(self) -> int:
        """Kernel-block-sized buffers the fast path needs at once."""
        return 2 if self.family in ("matern32", "matern52") else 1

    # ------------------------------------------------------------------ hyperparameters
    def split(self, hypers: tuple[Tensor, ...]) -> tuple[Tensor | None, Tensor | None]:
        """Return (shape parameter, scale) from the hyperparameter tuple.

        The shape parameter is the lengthscale (distance families), the variance (linear) or the
        offset (polynomial). The scale is the outputscale times, for ``linear``, nothing else.
        """
        if self.family == "generic":
            return None, None
        shape = hypers[0]
        scale = hypers[1] if self.scaled else None
        return shape, scale

    # ------------------------------------------------------------------ fast, no-grad path
    def prepare_cols(self, z: Tensor, hypers: tuple[Tensor, ...], center: Tensor | None = None) -> Tensor:
        """Augmented column inputs, computed once per operator (M x (d + 2)).

        ``center`` (1 x d) is subtracted from both sides of a stationary kernel: the value is
        unchanged, and the norms in the augmented GEMM stay small, which keeps float32 accurate.
        """
        shape, _ = self.split(hypers)
        if self.is_stationary:
            v = (z if center is None else z - center) / shape.reshape(1, -1)
            if self.family != "rbf":
                v = v * _DISTANCE_FACTOR[self.family]
            sq = (v * v).sum(dim=1, keepdim=True)
            ones = torch.ones_like(sq)
            if self.family == "rbf":
                # exp(u.v - |u|^2/2 - |v|^2/2) = exp2(log2(e) (...)): the GEMM yields the base-2 exponent
                return torch.cat([v, ones, -0.5 * sq], dim=1).mul_(LOG2E)
            return torch.cat([-2.0 * v, ones, sq], dim=1)
        if self.family == "linear":
            return z * shape.reshape(1, 1)
        if self.family == "polynomial":
            return torch.cat([z, shape.reshape(1, 1).expand(z.shape[0], 1)], dim=1)
        raise RuntimeError(f"family {self.family!r} has no fast path")

    def prepare_rows(self, x: Tensor, hypers: tuple[Tensor, ...], center: Tensor | None = None) -> Tensor:
        """Augmented row inputs (n x (d + 2)); cheap, O(n d). ``center`` as in :meth:`prepare_cols`."""
        shape, _ = self.split(hypers)
        if self.is_stationary:
            u = (x if center is None else x - center) / shape.reshape(1, -1)
            if self.family != "rbf":
                u = u * _DISTANCE_FACTOR[self.family]
            sq = (u * u).sum(dim=1, keepdim=True)
            ones = torch.ones_like(sq)
            if self.family == "rbf":
                return torch.cat([u, -0.5 * sq, ones], dim=1)
            return torch.cat([u, sq, ones], dim=1)
        if self.family == "linear":
            return x
        if self.family == "polynomial":
            return torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        raise RuntimeError(f"family {self.family!r} has no fast path")

    def fill(
        self, rows: Tensor, cols: Tensor, out: Tensor, spare: Tensor | None = None, exponent: Tensor | None = None
    ) -> Tensor:
        """Write the *unscaled* kernel block k(rows, cols) into ``out`` (in place).

        ``rows`` and ``cols`` come from :meth:`prepare_rows` / :meth:`prepare_cols`; ``spare`` is a
        second buffer of ``out``'s shape for the Matern 3/2 and 5/2 families. When ``rows`` / ``cols``
        are wider than ``out`` (float64 distances for a float32 block), the GEMM runs in their dtype
        into ``exponent`` (a buffer of ``out``'s shape in that dtype) and is rounded into ``out``
        once, before the nonlinearity.

        The exponent is floored at :data:`EXP_FLOOR` (in the same pass as the clamp that removes
        rounding noise): ``exp`` of arguments whose result is denormal or underflows ran 20-70x
        slower on the development CPU, and flush-to-zero did not help (docs/backend.md). Entries
        below ``exp(EXP_FLOOR)`` (2.1e-19 in float32, 1e-304 in float64) become that value.
        """
        if rows.dtype != out.dtype:
            torch.mm(rows, cols.T, out=exponent)
            if self.family == "matern12":
                _exact_near_zero(rows, cols, exponent)
            out.copy_(exponent)
        else:
            torch.mm(rows, cols.T, out=out)
            if self.family == "matern12":
                _exact_near_zero(rows, cols, out)
        family = self.family
        if family == "linear":
            return out
        if family == "polynomial":
            return out.pow_(self.power)
        floor = EXP_FLOOR.get(out.dtype, EXP_FLOOR[torch.float32])
        if family == "rbf":
            return out.clamp_(min=floor * LOG2E, max=0.0).exp2_()
        # distance families: the GEMM gives a^2 with a = c r (c = log2 e, sqrt 3, sqrt 5 folded into the inputs)
        if family == "matern12":
            limit = floor * LOG2E
            return out.clamp_(min=0.0, max=limit * limit).sqrt_().neg_().exp2_()
        a = out.clamp_(min=0.0, max=floor * floor).sqrt_()
        assert spare is not None
        # exp(-a) as exp2(-a log2 e): torch's exp2 ran 2-3x faster than exp here (float32 3.5 against
        # 1.2 G elements/s, one thread: benchmarks/bench_roofline.py); the product rounds by ~a eps
        torch.mul(a, -LOG2E, out=spare).exp2_()
        if family == "matern32":
            return a.add_(1.0).mul_(spare)
        return a.addcmul_(a, a, value=1.0 / 3.0).add_(1.0).mul_(spare)  # matern52

    # ------------------------------------------------------------------ differentiable path
    def dense(self, x: Tensor, z: Tensor, hypers: tuple[Tensor, ...], kernel, diag_offset: int | None = None) -> Tensor:
        """Differentiable, allocating evaluation of the scaled kernel block k(x, z).

        ``diag_offset`` (stationary families, rows of K(X, X)): column of the block's first diagonal
        entry, where the squared distance is set to exactly 0 (the expanded form leaves rounding noise
        there, which the square root of the Matern 1/2 kernel amplifies to ~sqrt(eps)).
        """
        if self.family == "generic":
            return _generic_block(kernel, self.param_names, hypers, x, z, diag=False)
        shape, scale = self.split(hypers)
        if self.family == "rbf":
            u = x / shape.reshape(1, -1)
            v = z / shape.reshape(1, -1)
            center = v.mean(dim=0, keepdim=True).detach()
            return rbf_block(u - center, v - center, scale, diag_offset)  # a closed-form backward
        if self.is_stationary:
            u = x / shape.reshape(1, -1)
            v = z / shape.reshape(1, -1)
            center = v.mean(dim=0, keepdim=True).detach()
            u, v = u - center, v - center
            su, sv = u.pow(2).sum(1, keepdim=True), v.pow(2).sum(1).unsqueeze(0)
            d2 = (su + sv - 2.0 * u @ v.T).clamp_min(0.0)
            if self.family == "matern12":  # near-zero distances from the differences (see _exact_near_zero)
                i, j = (d2.detach() < _NEAR * (su + sv).detach()).nonzero(as_tuple=True)
                if i.numel():
                    d2 = d2.index_put((i, j), (u[i] - v[j]).pow(2).sum(1))
            if diag_offset is not None:
                i = torch.arange(d2.shape[0], device=d2.device)
                keep = (i + diag_offset) < d2.shape[1]
                mask = torch.zeros(d2.shape, dtype=torch.bool, device=d2.device)
                mask[i[keep], i[keep] + diag_offset] = True
                d2 = d2.masked_fill(mask, 0.0)
            block = self._from_sq_dist(d2)
        elif self.family == "linear":
            block = (x * shape.reshape(1, 1)) @ z.T
        else:
            block = (x @ z.T + shape.reshape(1, 1)).pow(self.power)
        return block if scale is None else block * scale.reshape(1, 1)

    def pairs(self, x: Tensor, z: Tensor, hypers: tuple[Tensor, ...], kernel) -> Tensor:
        """Elementwise values k(x_i, z_i) for equally shaped ``x``, ``z`` (... x d)."""
        if self.family == "generic":
            flat_x, flat_z = x.reshape(-1, x.shape[-1]), z.reshape(-1, z.shape[-1])
            vals = _generic_block(kernel, self.param_names, hypers, flat_x, flat_z, diag=True)
            return vals.reshape(x.shape[:-1])
        shape, scale = self.split(hypers)
        if self.is_stationary:
            diff = (x - z) / shape
            vals = self._from_sq_dist(diff.pow(2).sum(-1))
        elif self.family == "linear":
            vals = (x * z).sum(-1) * shape.reshape(())
        else:
            vals = ((x * z).sum(-1) + shape.reshape(())).pow(self.power)
        return vals if scale is None else vals * scale.reshape(())

    def _from_sq_dist(self, d2: Tensor) -> Tensor:
        if self.family == "rbf":
            return torch.exp(-0.5 * d2)
        # clamp_min keeps the gradient of sqrt finite at r = 0 (as GPyTorch does)
        r = d2.clamp_min(1e-30).sqrt()
        if self.family == "matern12":
            return torch.exp(-r)
        if self.family == "matern32":
            a = _SQRT3 * r
            return (1.0 + a) * torch.exp(-a)
        a = _SQRT5 * r
        return (1.0 + a + a * a / 3.0) * torch.exp(-a)


def _generic_block(kernel, names, hypers, x, z, *, diag: bool) -> Tensor:
    params = dict(zip(names, hypers))
    # Evaluate inside functional_call: a lazily evaluated kernel tensor would run forward later,
    # with the module's own parameters instead of ``hypers`` (and autograd would miss them).
    with gpytorch.settings.lazily_evaluate_kernels(False):
        out = torch.func.functional_call(kernel, params, (x, z), {"diag": diag})
    if not torch.is_tensor(out):
        out = out.diagonal(dim1=-1, dim2=-2) if diag and out.dim() > 1 else out.to_dense()
    if diag:
        return out.reshape(x.shape[0])
    return out


def _plain(kernel) -> bool:
    """A kernel whose forward uses every input column and has no batch shape."""
    return kernel.active_dims is None and len(kernel.batch_shape) == 0


def formula_for(kernel: gpytorch.kernels.Kernel) -> tuple[KernelFormula, tuple[Tensor, ...]]:
    """Return the formula and the current hyperparameter tensors of a GPyTorch kernel.

    The tensors keep their autograd history (they are ``kernel.lengthscale`` etc.), so products
    of the operator are differentiable with respect to the kernel's raw parameters.
    """
    if not isinstance(kernel, gpytorch.kernels.Kernel):
        raise TypeError(f"kernel: expected a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
    scale = None
    base = kernel
    if type(kernel) is gpytorch.kernels.ScaleKernel and _plain(kernel):
        scale = kernel.outputscale.reshape(1)
        base = kernel.base_kernel
    fast = _fast_formula(base)
    if fast is not None:
        formula, shape = fast
        if scale is None:
            return formula, (shape,)
        return KernelFormula(formula.family, True, formula.power), (shape, scale)
    names = tuple(name for name, _ in kernel.named_parameters())
    params = tuple(p for _, p in kernel.named_parameters())
    return KernelFormula("generic", param_names=names), params


def _fast_formula(kernel) -> tuple[KernelFormula, Tensor] | None:
    if not _plain(kernel):
        return None
    kind = type(kernel)
    if kind is gpytorch.kernels.RBFKernel:
        return KernelFormula("rbf"), kernel.lengthscale.reshape(-1)
    if kind is gpytorch.kernels.MaternKernel:
        family = {0.5: "matern12", 1.5: "matern32", 2.5: "matern52"}.get(float(kernel.nu))
        if family is None:
            return None
        return KernelFormula(family), kernel.lengthscale.reshape(-1)
    if kind is gpytorch.kernels.LinearKernel:
        return KernelFormula("linear"), kernel.variance.reshape(1)
    if kind is gpytorch.kernels.PolynomialKernel:
        return KernelFormula("polynomial", power=int(kernel.power)), kernel.offset.reshape(1)
    return None


@dataclass(frozen=True)
class KernelParameters:
    """What :func:`kernel_parameters` recognised in a kernel.

    Attributes
    ----------
    family:
        ``rbf``, ``matern12``, ``matern32``, ``matern52``, ``linear``, ``polynomial`` or ``generic``
        (anything else: other kernels, ``active_dims``, batch shapes, sums and products).
    shape:
        Detached lengthscale (length 1, or d for ARD) of the distance families; the variance of
        ``linear``; the offset of ``polynomial``; None for ``generic``.
    outputscale:
        The outputscale of one wrapping ``ScaleKernel`` (1.0 without one; None for ``generic``),
        so that ``k(x, x) = outputscale`` for the distance families.
    power:
        Exponent of ``polynomial`` (0 otherwise).
    """

    family: str
    shape: Tensor | None
    outputscale: float | None
    power: int = 0

    @property
    def is_stationary(self) -> bool:
        return self.family in _DISTANCE_FAMILIES


def kernel_parameters(kernel: gpytorch.kernels.Kernel) -> KernelParameters:
    """Recognise a GPyTorch kernel and read its hyperparameters (public: for plugins).

    Plugins that need the kernel's form rather than its values (e.g. random Fourier features
    sample the spectral density of a stationary kernel) use this instead of inspecting
    GPyTorch classes themselves, so that they recognise exactly what the backend does.

    Raises
    ------
    TypeError
        If ``kernel`` is not a GPyTorch kernel.
    """
    formula, hypers = formula_for(kernel)
    if formula.family == "generic":
        return KernelParameters("generic", None, None)
    shape, scale = formula.split(hypers)
    outputscale = 1.0 if scale is None else float(scale.detach().reshape(()))
    return KernelParameters(formula.family, shape.detach().reshape(-1), outputscale, formula.power)


# Matern 1/2 reads the distance through a square root, so the expanded form's absolute error in the
# squared distance, about (d + 2) eps (|u|^2 + |v|^2), becomes sqrt of that near 0: 5e-4 in float32 on the
# diagonal of K[i, j] blocks. Pairs closer than this fraction of |u|^2 + |v|^2 are recomputed
# from their differences; the rest keep a relative error of at most (d + 2) eps / _NEAR in a^2, i.e. an
# absolute error of about 5 (d + 2) eps sqrt(|u|^2 + |v|^2) in the kernel value.
_NEAR = 1e-2

WIDE_ROWS_MAX_FEATURES = 100
"""From this many features on, a float32 block's candidate rows get the pair test (:func:`_exact_pairs`)
instead of a float64 GEMM of the whole rows (:func:`_wide_rows`).

The float64 row GEMM costs ``2 d`` flops per entry, the pair test a few whatever d. With every row a
candidate (the centers are training rows), EigenPro 4 on UCI letter (d = 16) took 1.05x the time with the pair
test, on mnist_5k (d = 784) 0.76-0.84x, the same test accuracy to every digit; one streamed 4,000 x 4,000
pass took 0.83x at d = 16, 0.70x at 64, 0.63x at 256, 0.58x at 784 (docs/benchmarks/matern12-pass.md,
"Many features"). The wide rows' extra accuracy (float64 distances on the rows they recompute) matters
where the float32 expanded form's own error, about ``(d + 2) eps32`` of the norms, is small; at this many
features every row without a near pair keeps that error anyway, and the pair test gives the near pairs
from their differences as in float64 blocks."""

_NEAR_CHUNK = 2**20
"""Entries per chunk of rows in which :func:`_exact_near_zero` compares each pair with its own threshold (its
temporaries stay a few MB whatever the block's size)."""


def _exact_near_zero(rows: Tensor, cols: Tensor, sq_dist: Tensor) -> None:
    """Recompute the squared distances of ``sq_dist`` that cancellation spoiled.

    ``rows`` = ``[u, |u|^2, 1]`` and ``cols`` = ``[-2 v, 1, |v|^2]`` (the Matern augmented inputs). A pair
    needs it when ``sq_dist < _NEAR (|u|^2 + |v|^2)``. First a row-minimum pass over the block finds the rows
    whose minimum can pass (``< _NEAR (|u|^2 + max |v|^2)``). Then, in chunks of :data:`_NEAR_CHUNK` entries:

    - a float32 block of fewer than :data:`WIDE_ROWS_MAX_FEATURES` features (:func:`_wide_rows`): those rows'
      distances again, from the same rounded ``u``, ``v`` but with a float64 GEMM and float64 norms;
    - otherwise (:func:`_exact_pairs`): the pair test, and the pairs that pass from their differences.

    Why the row minima first, not one threshold for the whole block (``_NEAR (max |u|^2 + max |v|^2)``, then
    the pair test on what passed it), as before: with a few points of large norm that threshold lets most of
    the block through (58% of the pairs on UCI protein's standardised inputs, where the pair test keeps
    0.1%), and the follow-up on those pairs made a float32 Laplacian pass 27x the time of the same pass
    without the test (the benchmark's "far" shape; protein: 3.4 s against 0.9 s with this test). Even where
    the threshold is tight, comparing the whole block and its ``nonzero`` cost 3-4x the rest of the pass,
    while ``amin`` reads the block at the memory rate (benchmarks/bench_matern12_pass.py, docs/backend.md
    "Matern 1/2 (Laplacian) blocks").
    """
    if not (rows.shape[0] and cols.shape[0]):
        return
    d = rows.shape[1] - 2
    sq_u, sq_v = rows[:, d], cols[:, d + 1]
    # a row can hold a pair only if its minimum is below its largest threshold (1% margin for rounding);
    # a NaN (a NaN input) hides the minimum, so such rows are recomputed too
    mins = sq_dist.amin(dim=1)
    candidates = ((mins < 1.01 * _NEAR * (sq_u + sq_v.max())) | mins.isnan()).nonzero().squeeze(1)
    if candidates.numel() == 0:
        return
    if sq_dist.dtype == torch.float64 or d >= WIDE_ROWS_MAX_FEATURES:
        _exact_pairs(rows, cols, sq_dist, candidates)
    else:
        _wide_rows(rows, cols, sq_dist, candidates)


def _wide_rows(rows: Tensor, cols: Tensor, sq_dist: Tensor, candidates: Tensor) -> None:
    """The candidate rows' squared distances from a float64 GEMM of the same float32 ``u`` and ``v``.

    In float64 the expanded form's absolute error, at most about ``2 (d + 2) eps64 (|u|^2 + |v|^2)``, is
    far below what float32 resolves; subtracting that bound before the nonlinearity's clamp at 0 gives a
    duplicate exactly ``k = 1`` (a shift of 1e-14 of the norms, within the same bound). Where at least half
    the rows are candidates every row is recomputed, in slices: cheaper than gathering and scattering rows.
    On UCI letter (EigenPro 3, 459 x 4,000 float32 blocks, near pairs in 58-79% of the rows) a whole block
    took 4.3-5.4 ms against 5.1-8.9 ms with the pair test and the recomputation of the pairs from their
    differences, and the block's largest error against float64 differences went from 1.4e-6 to 9e-8
    (2-core Intel Xeon host).
    """
    d = rows.shape[1] - 2
    wide = torch.float64
    cols_wide = cols.to(wide)
    cols_wide[:, d + 1] = cols_wide[:, :d].square().sum(dim=1).mul_(0.25)  # |v|^2 from -2 v, in float64
    slack = 2 * (d + 2) * torch.finfo(wide).eps
    shift = slack * float(cols_wide[:, d + 1].max())
    n, step = sq_dist.shape[0], max(1, _NEAR_CHUNK // sq_dist.shape[1])
    every_row = 2 * candidates.numel() >= n
    for start in range(0, n if every_row else candidates.numel(), step):
        if every_row:
            part = slice(start, min(start + step, n))
        else:
            part = candidates[start : start + step]
        u = rows[part].to(wide)
        u[:, d] = u[:, :d].square().sum(dim=1).mul_(1.0 - slack).sub_(shift)
        block = u @ cols_wide.T
        if every_row:
            sq_dist[part].copy_(block)
        else:
            sq_dist.index_copy_(0, part, block.to(sq_dist.dtype))


def _exact_pairs(rows: Tensor, cols: Tensor, sq_dist: Tensor, candidates: Tensor) -> None:
    """On the candidate rows, the pairs with ``sq_dist < _NEAR (|u|^2 + |v|^2)`` from their differences."""
    d = rows.shape[1] - 2
    sq_u, sq_v = rows[:, d], cols[:, d + 1]
    step = max(1, _NEAR_CHUNK // cols.shape[0])
    every_row = candidates.numel() == rows.shape[0]
    found_i, found_j = [], []
    for start in range(0, candidates.numel(), step):
        picked = candidates[start : start + step]
        # the rows themselves (a view) when every row is a candidate, else a gathered copy of the chunk
        part = sq_dist[start : start + picked.numel()] if every_row else sq_dist[picked]
        pi, pj = (part < _NEAR * (sq_u[picked, None] + sq_v)).nonzero(as_tuple=True)
        found_i.append(picked[pi])
        found_j.append(pj)
    i, j = torch.cat(found_i), torch.cat(found_j)
    if i.numel():
        diff = rows[i, :d] + 0.5 * cols[j, :d]  # u - v, cols holding -2 v
        sq_dist[i, j] = diff.square().sum(dim=1).to(sq_dist.dtype)
