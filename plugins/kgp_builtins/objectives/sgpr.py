"""Objective ``sgpr``: the negative collapsed variational bound of Titsias (2009) per data point.

With inducing points Z (the model's centers, held fixed), ``Q = K_nM K_MM^{-1} K_Mn`` and
``r = y - m``, Titsias' bound (AISTATS 2009, eq. 9) is::

    F = log N(r | 0, Q + sigma^2 I) - tr(K_nn - Q) / (2 sigma^2).

It is evaluated with two Gram products only, ``A = K_Mn K_nM`` and ``b = K_Mn r`` (:mod:`.gram`,
streamed in row blocks: O(n M^2) time, no n x M storage), then M x M algebra (O(M^3)). With
``L L^T = K_MM``, ``W = L^{-1} A L^{-T}``, ``L_B L_B^T = I + W / sigma^2`` and
``c = L_B^{-1} L^{-1} b / sigma^2`` (matrix determinant lemma and Woodbury identity)::

    log|Q + sigma^2 I|            = n log sigma^2 + 2 sum log diag L_B
    r^T (Q + sigma^2 I)^{-1} r    = r^T r / sigma^2 - c^T c
    tr(Q)                          = tr(W)

This equals GPyTorch's SGPR (``InducingPointKernel`` + ``ExactMarginalLogLikelihood``) with the
same inducing points, up to the sign and the division by n.

Option ``batch_rows`` (for n beyond ~1e6): each evaluation draws that many rows afresh from
``problem.generator`` and scales the row sums ``A``, ``b``, ``r^T r`` and ``tr K_nn`` by n / batch
(unbiased estimates); the bound is then a stochastic estimate, for Adam.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

import kgp
from kgp.learning import LearningProblem
from kgp.linalg import psd_cholesky

from .gram import distinct_centers, gram_products

# first jitter (relative to the mean diagonal) tried when the centers' kernel matrix fails to factor,
# growing tenfold up to 1e-5: at the rounding level (eps) six tries were not enough for K_ZZ on pol
# with long lengthscales (numerically singular, M = 500); added only on failure, with a NumericalWarning
_KZZ_JITTER = 1e-10


class SGPRObjective:
    """Titsias' collapsed SGPR bound on the model's centers (negated, per data point)."""

    option_defaults = {
        "batch_rows": kgp.Option.integer(
            None,
            minimum=1,
            allow_none=True,
            help="rows drawn afresh per evaluation (stochastic bound, for Adam at n >> 1e6); None: all rows",
        ),
    }
    uses_centers = True

    def prepare(self, problem: LearningProblem) -> Callable[[Tensor, Tensor], Tensor]:
        options = kgp.merge_options("objective 'sgpr'", self.option_defaults, problem.options)
        X_all, Y_all = problem.X, problem.y
        if problem.centers is None:
            raise ValueError("objective 'sgpr' needs centers (inducing points)")
        Z = distinct_centers(problem.centers.points.detach())
        n, k = Y_all.shape
        m = Z.shape[0]
        eye = torch.eye(m, dtype=X_all.dtype, device=X_all.device)
        batch = options["batch_rows"]
        batch = None if batch is None or batch >= n else batch

        def loss(noise: Tensor, mean: Tensor) -> Tensor:
            X, Y, scale = X_all, Y_all, 1.0
            if batch is not None:
                # the n-row sums (A, b, r^T r, tr K) estimated without bias from a fresh row sample;
                # the bound itself is then a (slightly biased) stochastic estimate: use Adam, not L-BFGS
                rows = torch.randperm(n, generator=problem.generator)[:batch].to(X_all.device)
                X, Y, scale = X_all[rows], Y_all[rows], n / batch
            R = Y - mean
            A, b = gram_products(problem.kernel, X, Z, R)
            A, b = A * scale, b * scale
            kmm = problem.kernel_operator(Z).to_dense()
            L = psd_cholesky(
                kmm,
                jitter=_KZZ_JITTER * float(kmm.detach().diagonal().mean()),
                what="objective 'sgpr': K_MM of the centers",
                remedy="use fewer or better-spread centers, or float64",
            )
            Linv_A = torch.linalg.solve_triangular(L, A, upper=False)
            W = torch.linalg.solve_triangular(L, Linv_A.T, upper=False)  # L^{-1} A L^{-T} (A symmetric)
            W = 0.5 * (W + W.T)
            LB = psd_cholesky(
                eye + W / noise,
                max_tries=0,
                what=f"objective 'sgpr': I + W / noise with noise={float(noise.detach()):.6g}",
                remedy="raise learn_options['min_noise'] or use float64",
            )
            c = torch.linalg.solve_triangular(LB, torch.linalg.solve_triangular(L, b, upper=False), upper=False) / noise
            diag_sum = problem.kernel_operator(X).diagonal().sum() * scale
            logdet = n * torch.log(noise) + 2.0 * torch.log(LB.diagonal()).sum()
            quad = R.square().sum() * scale / noise - c.square().sum()
            trace = (diag_sum - W.diagonal().sum()) / noise
            nll = 0.5 * (quad + k * (logdet + n * math.log(2 * math.pi) + trace))
            return nll / (n * k)

        return loss
