"""Objective ``sgpr``: the negative collapsed variational bound of Titsias (2009) per data point.

With inducing points Z (the model's centers, held fixed), ``Q = K_nM K_MM^{-1} K_Mn`` and
``r = y - m``, Titsias' bound (AISTATS 2009, eq. 9) is::

    F = log N(r | 0, Q + sigma^2 I) - tr(K_nn - Q) / (2 sigma^2).

It is evaluated with two Gram products only, ``A = K_Mn K_nM`` and ``b = K_Mn r`` (:mod:`.gram`,
streamed in row blocks: O(n M^2) time, no n x M storage), then M x M algebra (O(M^3)). With
``L L^T = K_MM`` and ``L_S L_S^T = S = A + sigma^2 K_MM`` (matrix determinant lemma and Woodbury
identity)::

    log|Q + sigma^2 I|            = (n - M) log sigma^2 + log|S| - log|K_MM|
    r^T (Q + sigma^2 I)^{-1} r    = (r^T r - ||L_S^{-1} b||^2) / sigma^2
    tr(Q)                          = tr(K_MM^{-1} A)

S is factored as it is rather than whitened by L (``I + L^{-1} A L^{-T} / sigma^2``): with long
lengthscales K_MM is ill-conditioned and the whitened form lost positive definiteness to rounding.

This equals GPyTorch's SGPR (``InducingPointKernel`` + ``ExactMarginalLogLikelihood``) with the
same inducing points, up to the sign and the division by n.

Option ``batch_rows`` (for n beyond ~1e6): each evaluation draws that many rows afresh from
``problem.generator`` and scales the row sums ``A``, ``b``, ``r^T r`` and ``tr K_nn`` by n / batch
(unbiased estimates); the bound is then a stochastic estimate, for Adam.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import kgp
from kgp.distributed import differentiable_sum
from kgp.learning import LearningProblem, ObjectiveLoss
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
    # likelihood: the collapsed bound on -log p(y) per point and output; distributed: the four row sums
    # are summed over the ranks (differentiable_sum)
    capabilities = kgp.Capabilities(uses_centers=True, distributed=True, likelihood=True)

    def prepare(self, problem: LearningProblem) -> ObjectiveLoss:
        options = problem.options  # resolved once by the model (kgp.options.resolve_options)
        X_all, Y_all = problem.X, problem.y
        if problem.centers is None:
            raise ValueError("objective 'sgpr' needs centers (inducing points)")
        Z = distinct_centers(problem.centers.points.detach())
        n, k = problem.n, Y_all.shape[1]  # n: all ranks' rows in a distributed fit
        m = Z.shape[0]
        batch = options["batch_rows"]
        batch = None if batch is None or batch >= n else batch

        def loss(noise: Tensor, mean: Tensor) -> Tensor:
            X, Y, scale = X_all, Y_all, 1.0
            if batch is not None:
                # the n-row sums (A, b, r^T r, tr K) estimated without bias from a fresh row sample;
                # the bound itself is then a (slightly biased) stochastic estimate: use Adam, not L-BFGS
                rows = torch.randperm(n, generator=problem.generator)[:batch].to(X_all.device)
                if problem.shard is not None:  # global row numbers: this rank's share of the sample
                    rows = problem.shard.local_rows(rows)[1]
                X, Y, scale = X_all[rows], Y_all[rows], n / batch

            def row_sums() -> tuple[Tensor, Tensor, Tensor, Tensor]:
                R = Y - mean
                A, b = gram_products(problem.kernel, X, Z, R)
                return A, b, R.square().sum(), problem.kernel_operator(X).diagonal().sum()

            if problem.shard is None:
                A, b, r_sq, diag_sum = row_sums()
            else:  # summed over the ranks, with every rank's part of the gradient
                params = list(problem.kernel.parameters())
                A, b, r_sq, diag_sum = differentiable_sum(problem.shard, row_sums, [*params, mean])
            A, b, r_sq, diag_sum = A * scale, b * scale, r_sq * scale, diag_sum * scale
            kmm = problem.kernel_operator(Z).to_dense()
            L = psd_cholesky(
                kmm,
                jitter=_KZZ_JITTER * float(kmm.detach().diagonal().mean()),
                what="objective 'sgpr': K_MM of the centers",
                remedy="use fewer or better-spread centers, or float64",
            )
            # S = A + noise K_MM is factored as it is, not through W = L^{-1} A L^{-T}: on elevators
            # (M = 500, lengthscales ~20) K_MM's condition number was 7e10 and the rounding that L^{-1}
            # amplified made I + W / noise indefinite; S stays well within positive definiteness
            LS = psd_cholesky(
                A + noise * kmm,
                what=f"objective 'sgpr': K_Mn K_nM + noise*K_MM with noise={float(noise.detach()):.6g}",
                remedy="raise learn_options['min_noise'] or use float64",
            )
            c = torch.linalg.solve_triangular(LS, b, upper=False)
            trace_q = torch.cholesky_solve(A, L).diagonal().sum()  # tr(K_MM^{-1} A) = tr Q
            logdet = (n - m) * torch.log(noise) + 2.0 * (torch.log(LS.diagonal()).sum() - torch.log(L.diagonal()).sum())
            quad = (r_sq - c.square().sum()) / noise
            trace = (diag_sum - trace_q) / noise
            nll = 0.5 * (quad + k * (logdet + n * math.log(2 * math.pi) + trace))
            return nll / (n * k)

        # -value * terms is the collapsed bound on the log marginal likelihood (Titsias 2009, eq. 9)
        return ObjectiveLoss(loss, terms=n * k)
