"""What float32 kernel passes can resolve, and the choices FALKON makes from it.

FALKON on float32 inputs keeps its kernel blocks in float32 (half the memory traffic and the fast
``exp2``), but three things must not stay in float32 (docs/solvers/falkon.md, "float32"):

1. **The transposed products.** ``K_nM^T u`` summed in float32 over n rows errs by about
   ``eps32 sqrt(n) |K||u|`` in every direction, including those where ``K_MM`` is nearly singular;
   the preconditioner ``B = T^{-1} A^{-1}`` amplifies exactly those directions (by up to
   ``1 / sqrt(mu (mu / M + lambda))`` for an eigenvalue mu of ``K_MM``), so ``W = B^T H B`` is
   perturbed by more than its smallest eigenvalues and CG diverges (UCI keggdirected: test RMSE
   12.4 instead of 0.128). Summing each block's ``K^T u`` in float64 (``accumulate``) removes it;
   ``K v`` may stay in float32.
2. **The exponent of the kernel.** The augmented GEMM computes ``u.v - |u|^2/2 - |v|^2/2`` with
   ``u = x / lengthscale``: with small ARD lengthscales ``|u|^2`` reaches hundreds and float32
   cancellation leaves kernel values wrong by up to 1e-3 relative (UCI bike, parkinsons), which
   costs 2-5% test RMSE even with an exact solve (most of it at prediction time).
   :func:`kernel_resolution` measures the error on the centers; above :data:`DISTANCE_SWITCH` the
   passes and the predictor compute distances in float64 (``kernel_operator(...,
   distance_dtype=torch.float64)``), which brings it to ~1e-7.
3. **The factorization.** ``K_MM`` (evaluated in float64) is factored with a jitter above the float32
   resolution of the passes (:func:`float32_jitter`), not by a truncated ``eigh``
   (3-4x the fit time at M = 5,000); the jitter changes the preconditioner only, not the
   solution (``Preconditioner.regulariser`` removes it from the problem). The factorizations may run
   in float32 (``precond_dtype="mixed"``, the float32 default) as long as the factors are applied in
   float64: float32 triangular solves are not one fixed linear map and CG on them diverges (UCI kin40k
   test RMSE 2.23 instead of 0.124).
"""

from __future__ import annotations

import torch

import kgp
from kgp.plugin import Problem

from .preconditioner import DEFAULT_JITTER

__all__ = ["DISTANCE_SWITCH", "JITTER_FACTOR", "JITTER_FLOOR", "float32_jitter", "kernel_resolution"]

PROBE_ROWS = 256
"""Centers whose kernel row is evaluated in both precisions by :func:`kernel_resolution`."""

DISTANCE_SWITCH = 1e-4
"""Largest relative kernel-value error of float32 distances that FALKON keeps, in the passes and in
the predictor. Measured on the centers of the 15 UCI sets with learned ARD lengthscales: 1.5e-7
(tamielectric) to 3.3e-5 (protein) on twelve sets, where float32 distances lose nothing; 3.4e-4
(airfoil), 3.7e-4 (bike) and 3.5e-3 (parkinsons), where they cost 2-5% test RMSE
(docs/solvers/falkon.md, "float32")."""

JITTER_FLOOR = DEFAULT_JITTER
"""Smallest float32 jitter, relative to the mean diagonal of ``D K_MM D``: the float64 default."""

JITTER_FACTOR = 100.0
"""The float32 jitter is at least this many times the measured relative kernel-value error."""


def kernel_resolution(problem: Problem, distance_dtype: torch.dtype | None) -> float:
    """Largest error of the input-dtype kernel values on the centers, relative to the largest value.

    Evaluates ``K(Z[:p], Z)`` (p = :data:`PROBE_ROWS`) through the backend in the input dtype (with
    ``distance_dtype``) and in float64 from the same hyperparameter values: ``O(p M d)``.
    """
    Z = problem.centers.points
    rows = Z[:PROBE_ROWS]
    with torch.no_grad():
        low = kgp.kernel_operator(problem.kernel, rows, Z, distance_dtype=distance_dtype).to_dense()
        ref = kgp.kernel_operator(problem.kernel, rows.double(), Z.double()).to_dense()
    scale = float(ref.abs().max())
    if scale == 0.0:
        return 0.0
    return float((low.double() - ref).abs().max()) / scale


def float32_jitter(resolution: float) -> float:
    """Jitter of the float32 Cholesky of ``K_MM`` relative to its mean diagonal: ``max(floor, factor * res)``."""
    return max(JITTER_FLOOR, JITTER_FACTOR * resolution)
