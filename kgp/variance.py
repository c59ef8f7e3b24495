"""Predictive variances of the fitted GP, computed block-wise (``predict(X, return_std=True)``).

Two forms, chosen by what the solver fitted:

- **exact** (solvers declaring ``Capabilities(target="exact")``, e.g. ``exact``): the GP posterior variance
  of the latent function (Rasmussen & Williams 2006, Algorithm 2.1, lines 5-6)::

      var f(x) = k(x, x) - k_x^T (K + sigma^2 I)^{-1} k_x,     k_x = K(X, x);

- **nystrom** (every solver with centers Z; the target of all of them is the Nystrom estimator):
  the DTC / SGPR predictive variance of Titsias (2009, eq. 6; Quinonero-Candela & Rasmussen 2005,
  eq. 20b), with ``Q(x, x) = k_Mx^T K_MM^{-1} k_Mx``::

      var f(x) = k(x, x) - Q(x, x) + sigma^2 k_Mx^T (sigma^2 K_MM + K_Mn K_nM)^{-1} k_Mx.

Both are variances of the latent f; the observation noise sigma^2 is added on request. The factors
are Cholesky factors: ``n x n`` for exact (only below ``kgp.settings.max_exact_size``), two ``M x M``
for Nystrom (``K_Mn K_nM`` is accumulated in row blocks, never n x M). Query points are processed in
row blocks under ``kgp.settings.memory_budget``.

The Nystrom factors of a float32 model are built and used in float64 (the inputs and the kernel are cast,
the result is rounded back): the difference of two nearly equal quadratic forms in float32 put the std
up to 13% off the float64 value (pol, 6,000 rows, M = 1,500; median 0.01%), 15-57% on other UCI sets.
The cost is the Gram pass ``K_Mn K_nM`` at the float64 rate (about 2x the float32 one) and 2 M^2 float64
numbers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .linalg import cholesky_in_place, flush_below_scale, psd_cholesky
from .operators import kernel_operator, plan_block_rows, row_slices

__all__ = ["VarianceFactors", "check_dense_size", "exact_factors", "nystrom_factors", "latent_variance"]


def check_dense_size(n: int, itemsize: int, what: str, device: torch.device | None = None) -> None:
    """Refuse a dense ``n x n`` matrix (on ``device``) above ``kgp.settings.max_exact_size`` or ``memory_budget``,
    naming both."""
    from . import settings

    limit = settings.max_exact_size.value()
    budget = settings.memory_budget.value(device)
    if n > limit or n * n * itemsize > budget:
        raise ValueError(
            f"{what} needs a dense {n:,} x {n:,} matrix ({n * n * itemsize / 2**20:,.0f} MiB); "
            f"kgp.settings.max_exact_size={limit:,}, kgp.settings.memory_budget={budget:,} bytes. Raise them "
            f"(kgp.settings.max_exact_size({n}), kgp.settings.memory_budget(bytes); environment KGP_MAX_EXACT_SIZE, "
            "KGP_MEMORY_BUDGET) or use fewer rows"
        )


@dataclass
class VarianceFactors:
    """What the latent variance needs besides the kernel.

    Attributes
    ----------
    kind:
        ``"exact"`` or ``"nystrom"``.
    points:
        Training inputs (exact) or centers (Nystrom), ``p x d``.
    chol:
        Lower Cholesky factor of ``K + sigma^2 I`` (exact) or of ``K_MM`` (Nystrom).
    chol_s:
        Nystrom only: lower Cholesky factor of ``sigma^2 K_MM + K_Mn K_nM``.
    noise:
        sigma^2.
    """

    kind: str
    points: Tensor
    chol: Tensor
    chol_s: Tensor | None
    noise: float

    def state_dict(self) -> dict:
        state = {"kind": self.kind, "points": self.points, "chol": self.chol, "noise": float(self.noise)}
        if self.chol_s is not None:
            state["chol_s"] = self.chol_s
        return state

    @classmethod
    def from_state(cls, state: dict) -> VarianceFactors:
        return cls(state["kind"], state["points"], state["chol"], state.get("chol_s"), float(state["noise"]))


def exact_factors(kernel: gpytorch.kernels.Kernel, X: Tensor, noise: float) -> VarianceFactors:
    """Cholesky factor of ``K(X, X) + noise I`` (dense: n below ``kgp.settings.max_exact_size``).

    Raises
    ------
    ValueError
        If the dense ``n x n`` matrix exceeds ``kgp.settings.max_exact_size`` or ``memory_budget``
        (``return_std`` on an exact model holds both, as its fit does).
    """
    check_dense_size(X.shape[0], X.element_size(), "return_std=True on an exact model", X.device)
    with torch.no_grad():
        K = kernel_operator(kernel, X).to_dense()
        K.diagonal().add_(noise)
        # written over K: one n x n array at the peak (kgp.linalg)
        L = cholesky_in_place(K, what=f"K + noise*I with noise={noise:g}", remedy="use float64")
    return VarianceFactors("exact", X, L, None, noise)


def _working(kernel: gpytorch.kernels.Kernel, dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    """The kernel in ``dtype`` (a copy when it differs; GPyTorch kernels are small modules)."""
    current = next((p.dtype for p in kernel.parameters()), dtype)
    return kernel if current == dtype else copy.deepcopy(kernel).to(dtype)


def nystrom_factors(
    kernel: gpytorch.kernels.Kernel, X: Tensor, Z: Tensor, noise: float, shard: Any = None
) -> VarianceFactors:
    """Cholesky factors of ``K_MM`` and ``noise K_MM + K_Mn K_nM`` (one streamed pass over X), in float64.

    ``shard``: in a distributed fit, ``X`` is this rank's rows and ``K_Mn K_nM`` is summed over all
    ranks' rows (one all-reduce of ``M x M``); every rank then holds the same factors.
    """
    if X.dtype == torch.float32:
        kernel, X, Z = _working(kernel, torch.float64), X.double(), Z.double()
    with torch.no_grad():
        kmm = kernel_operator(kernel, Z).to_dense()
        S = kernel_operator(kernel, X, Z, shard=shard).gram().add_(kmm, alpha=noise)
        S = 0.5 * (S + S.T)  # kmm is symmetric only to rounding
        # up to 12 tenfold jitters, from eps to ~1e-5 of the mean diagonal: keggdirected's learned GP
        # (M = 11,241, float64) still fails at the sixth; a jitter that size moves the std of
        # directions the centers cannot tell apart, which rounding already blurs
        remedy = "use fewer or better-spread centers (n_centers) or a larger noise"
        L = psd_cholesky(kmm, max_tries=12, what="K_MM of the centers", remedy=remedy)
        L_s = psd_cholesky(S, max_tries=12, what="noise*K_MM + K_Mn K_nM", remedy=remedy)
    return VarianceFactors("nystrom", Z, L, L_s, noise)


def cross_kernel(kernel: gpytorch.kernels.Kernel, Xq: Tensor, points: Tensor, prior: Tensor) -> Tensor:
    """``K(points, Xq)`` (``p x q``, a transposed view) for the variance's triangular solves.

    Entries below :func:`kgp.linalg.tiny_fraction` of the kernel's scale (the largest of ``prior``, the
    query rows' ``k(x, x)``, and of the block) are set to 0: with short lengthscales most query-to-data
    values are far below it, and the solves' products of them are subnormal, which Intel CPUs process
    10-100x slower (UCI parkinsons, the learned default GP's 1,175 test rows against 4,700 training rows:
    6.3 s -> 0.19 s for ``L^{-1} K``). A dropped entry moves the variance by less than ``1e-150`` of the
    kernel's scale (float64).
    """
    dense = kernel_operator(kernel, Xq, points).to_dense()
    flush_below_scale(dense, max(_largest(prior), _largest(dense)))
    return dense.mT


def _largest(X: Tensor) -> float:
    return float(X.abs().max()) if X.numel() else 0.0


def latent_variance(kernel: gpytorch.kernels.Kernel, Xq: Tensor, factors: VarianceFactors) -> Tensor:
    """Variance of the latent f at the rows of ``Xq`` (length ``q``), clamped at 0 with no other change.

    Rounding can make a variance slightly negative where the data pin f down; those entries are set
    to 0 (as scikit-learn's ``GaussianProcessRegressor`` does, which warns; here the clamp is
    documented instead, since it only removes rounding noise below ``eps * k(x, x)``).
    """
    p = factors.points.shape[0]
    out = torch.empty(Xq.shape[0], dtype=Xq.dtype, device=Xq.device)
    work = factors.chol.dtype  # float64 Nystrom factors of a float32 model: the query side follows them
    kernel = _working(kernel, work)
    # p x b cross-kernel block plus two solves of the same size per query block
    rows = plan_block_rows(Xq.shape[0], p, work.itemsize, 3, device=Xq.device)
    with torch.no_grad():
        for sl in row_slices(0, Xq.shape[0], rows):
            xq = Xq[sl].to(work)
            prior = kernel_operator(kernel, xq, xq).diagonal()
            # the stored points as the operator's columns: a stationary kernel centres distances on the
            # columns' mean, which must not depend on the query batch (a far query row would shift it and
            # cancel every other row's variance to 0)
            kx = cross_kernel(kernel, xq, factors.points, prior)  # p x b
            v = torch.linalg.solve_triangular(factors.chol, kx, upper=False)
            var = prior - v.square().sum(0)
            if factors.kind == "nystrom":
                w = torch.linalg.solve_triangular(factors.chol_s, kx, upper=False)
                var = var + factors.noise * w.square().sum(0)
            out[sl] = var.clamp_min(0.0)
    return out
