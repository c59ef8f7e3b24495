"""Objective ``holdout``: the held-out error of the Nystrom predictor itself (a validation objective).

The marginal-likelihood objectives score a GP that the solver never computes: with M centers the
solver's predictor is the Nystrom (subset-of-regressors) mean, and the ``sgpr`` bound with too few
inducing points explains the Nystrom error as noise (Titsias 2009; Bauer, van der Wilk & Rasmussen
2016), so the solver, handed that noise, underfits. ``holdout`` instead scores the Nystrom predictor
on rows it was not fitted on, as the hold-out criterion of Meanti et al. (AISTATS 2022, "Efficient
hyperparameter tuning for large scale kernel ridge regression", sec. 3): the centers and the
hyperparameters are then chosen for the predictor that is actually used.

Rows are split once (``problem.generator``) into a fitting part T and a held-out part V. On T, with
centers Z, ``r = y - m``, ``A = K_ZT K_TZ``, ``b = K_ZT r_T`` (streamed by :mod:`.gram`) and
``L_S L_S^T = S = A + sigma^2 K_ZZ`` (the system FALKON solves), the Nystrom mean at the held-out
rows is::

    mu_V = H^T L_S^{-1} b,      H = L_S^{-1} K_ZV.

``score="mse"`` minimises ``mean (r_V - mu_V)^2``. It depends on sigma^2 and the outputscale only
through their ratio (the solver's regularisation), so it leaves the overall scale where it started;
the scale matters only to ``return_std``. ``score="nlpd"`` minimises the held-out negative log
predictive density with the SGPR / DTC predictive variance of the same model (Titsias 2009, eq. 6;
Rasmussen & Williams 2006, eq. 8.27)::

    v_i = sigma^2 + k(x_i, x_i) - ||P_i||^2 + sigma^2 ||H_i||^2,     P = L^{-1} K_ZV, L L^T = K_ZZ,
    NLPD = mean 1/2 log(2 pi v_i) + (r_i - mu_i)^2 / (2 v_i),

which fixes the scale too (the variance kgp's ``predict(return_std=True, include_noise=True)``
returns for center-based solvers).

Cost per evaluation: O(|T| M^2 + M^3) for the Gram products and O(|V| M^2) for the |V| x M block
``K_ZV``, held in memory with its autograd graph (``max_holdout_rows`` bounds it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import kgp
from kgp.learning import LearningProblem, ObjectiveLoss
from kgp.linalg import psd_cholesky

from .gram import distinct_centers, gram_products

# first jitter (relative to the mean diagonal) tried when the centers' kernel matrix fails to factor,
# growing tenfold up to 1e-5: at the rounding level (eps) six tries were not enough for K_ZZ on pol
# with long lengthscales (numerically singular, M = 500); added only on failure, with a NumericalWarning
_KZZ_JITTER = 1e-10
# fewest held-out rows accepted (see the check in prepare)
MIN_HELD_OUT = 25
# fitting rows whose exact likelihood sets a learned mean (_gls_mean): an s x s Cholesky per evaluation
MEAN_ROWS = 1000


class HoldoutObjective:
    """Held-out MSE or NLPD of the Nystrom predictor on the model's centers (Meanti et al. 2022)."""

    option_defaults = {
        "holdout_fraction": kgp.Option.number(
            0.2,
            minimum=0.0,
            maximum=1.0,
            exclusive_minimum=True,
            exclusive_maximum=True,
            help="fraction of the rows held out for scoring (drawn once); the rest fit the Nystrom predictor",
        ),
        "max_holdout_rows": kgp.Option.integer(
            5000,
            minimum=1,
            help="at most this many held-out rows (their |V| x M kernel block is kept for the gradient)",
        ),
        "min_held_out": kgp.Option.integer(
            MIN_HELD_OUT,
            minimum=1,
            help="fewest held-out rows accepted: on fewer, the score learns a noise near 0 (measured at n = 10, 20)",
        ),
        "score": kgp.Option.choice(
            "nlpd", ("nlpd", "mse"), help="held-out negative log predictive density, or mean squared error"
        ),
    }
    # measured on pol (M = 1,000, initial lengthscale sqrt(d)): 50 L-BFGS evaluations, then FALKON at
    # M = 2,000: test RMSE 0.0874 against 0.1096 for sgpr (docs/benchmarks/gp-hyperparameters.md, section 8).
    # The constant mean stays at the targets' mean by default: the held-out score barely identifies it (a
    # kernel with a long lengthscale absorbs a constant), and learned by the score it drifted to -5.6 / -121 /
    # -1.1 on data in +-1 (three seeds, 300 rows, M = 40; test RMSE 0.164 against 0.029 with the mean kept).
    # With learn_mean=True it is the Nystrom likelihood's mean of the fitting rows (_gls_mean), not the score's
    capabilities = kgp.Capabilities(
        uses_centers=True, loop_defaults={"optimizer": "lbfgs", "iterations": 50, "learn_mean": False}
    )

    def prepare(self, problem: LearningProblem) -> ObjectiveLoss:
        options = problem.options  # resolved once by the model (kgp.options.resolve_options)
        if problem.centers is None:
            raise ValueError("objective 'holdout' needs centers (the Nystrom predictor's)")
        n = problem.n
        n_hold = min(int(round(options["holdout_fraction"] * n)), options["max_holdout_rows"])
        if n_hold < 1 or n - n_hold < 1:
            raise ValueError(
                f"objective 'holdout': holdout_fraction={options['holdout_fraction']} of n={n} rows leaves "
                f"{n_hold} held-out and {n - n_hold} fitting rows; both need at least one"
            )
        if n_hold < options["min_held_out"] and problem.shard is None:
            raise ValueError(
                f"objective 'holdout': holdout_fraction={options['holdout_fraction']} of n={n} rows holds out "
                f"{n_hold} rows, fewer than min_held_out={options['min_held_out']}: a held-out score on so few "
                "rows learns a noise near 0 "
                "(95% intervals covered 0.3% of test targets at n = 10 and 24% at n = 20). Use learn='exact' "
                "(the exact marginal likelihood of all rows), or a larger holdout_fraction"
            )
        perm = torch.randperm(n, generator=problem.generator).to(problem.device)
        hold, fit = perm[:n_hold], perm[n_hold:]
        X_t, Y_t, X_v, Y_v = problem.X[fit], problem.y[fit], problem.X[hold], problem.y[hold]
        Z = distinct_centers(problem.centers.points.detach())
        nlpd = options["score"] == "nlpd"
        mean_rows = min(X_t.shape[0], MEAN_ROWS, kgp.settings.max_exact_size.value())

        def loss(noise: Tensor, mean: Tensor) -> Tensor:
            # a mean the learning loop trains (learn_options['learn_mean']=True: it passes its trainable
            # parameter) is set by the likelihood, not by the score: the score is taken at the exact GP's
            # generalised-least-squares mean of the fitting rows (_gls_mean), and the loop's mean is drawn to
            # it by a quadratic term that is 0 there. A plain tensor (a direct call) is scored as given.
            profiled = isinstance(mean, torch.nn.Parameter) and mean.requires_grad
            ones = torch.ones(Y_t.shape[0], 1, dtype=Y_t.dtype, device=Y_t.device)
            # K_ZT [y, 1]: b = K_ZT (y - m) for the profiled m without a second pass over the rows
            rhs = torch.cat([Y_t, ones], 1) if profiled else Y_t - mean
            A, b = gram_products(problem.kernel, X_t, Z, rhs)
            kzz = problem.kernel_operator(Z).to_dense()
            # S = A + sigma^2 K_ZZ factored as it is, not whitened by K_ZZ's factor: with long lengthscales
            # K_ZZ is numerically singular and L^{-1} A L^{-T} lost positive definiteness (measured on pol).
            # Both matrices get a fixed jitter, sqrt(eps) of their mean diagonal, as part of the objective:
            # with near-duplicate centers S and K_ZZ are singular to rounding, and a jitter added only where
            # the plain factorization failed made the loss jump between neighbouring hyperparameters (by 1%
            # on a 600-row test problem, where L-BFGS then stalled above its start on one host and not on
            # another). The tenfold retries stay as a fallback.
            S = _jittered(A + noise * kzz)
            LS = psd_cholesky(
                S,
                what=f"objective 'holdout': K_ZT K_TZ + noise*K_ZZ with noise={float(noise.detach()):.6g}",
                remedy="raise learn_options['min_noise'] or use float64",
            )
            kzv = problem.kernel_operator(Z, X_v).to_dense()
            H = torch.linalg.solve_triangular(LS, kzv, upper=False)  # LS^{-1} K_ZV
            c = torch.linalg.solve_triangular(LS, b, upper=False)
            penalty = 0.0
            if profiled:
                c, c_one = c[:, :-1], c[:, -1:]
                center = _gls_mean(problem, X_t[:mean_rows], Y_t[:mean_rows], noise)
                c = c - c_one * center  # L_S^{-1} K_ZT (y - m): b is linear in the mean
                # 0 with a zero gradient where the loop's mean equals the profiled one: the joint minimum is the
                # profiled score's, with the mean there
                penalty = (mean - center).square().sum()
                mean = center
            err = (Y_v - mean) - H.T @ c  # mu_V = K_VZ S^{-1} b
            if not nlpd:
                return err.square().mean() + penalty
            L = psd_cholesky(
                _jittered(kzz),
                jitter=_KZZ_JITTER * float(kzz.detach().diagonal().mean()),
                what="objective 'holdout': K_ZZ of the centers",
                remedy="use fewer or better-spread centers, or float64",
            )
            P = torch.linalg.solve_triangular(L, kzv, upper=False)
            diag = problem.kernel_operator(X_v).diagonal()
            var = noise + (diag - P.square().sum(0)).clamp_min(0.0) + noise * H.square().sum(0)
            var = var.unsqueeze(-1)
            return (0.5 * torch.log(2 * math.pi * var) + err.square() / (2 * var)).mean() + penalty

        return ObjectiveLoss(loss)  # a score, not a likelihood: no terms


def _gls_mean(problem: LearningProblem, X: Tensor, Y: Tensor, noise: Tensor) -> Tensor:
    """The constant mean of each output that maximises the exact GP likelihood of the rows ``X``, ``Y``.

    The generalised-least-squares mean for a constant basis function (Rasmussen & Williams 2006, sec. 2.7,
    eq. 2.42 with ``H = 1``): ``1^T C^{-1} y / 1^T C^{-1} 1`` with ``C = K + sigma^2 I``, the stationary point
    of the exact objective in the mean, differentiable in the hyperparameters. On the fitting rows (a random
    order, so the first ``MEAN_ROWS`` are a random subset) it matched the exact objective's learned means
    within 0.1 of the targets' std on three outputs; the Nystrom (DTC) covariance's own GLS mean did not
    (0.6 off): with few centers the constant lies almost in their span, and its small remainder, weighted by
    ``1 / sigma^2``, decides the estimate.
    """
    K = problem.kernel_operator(X).to_dense()
    C = K + noise * torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
    L = psd_cholesky(
        C,
        what=f"objective 'holdout': K + noise*I of the mean's rows with noise={float(noise.detach()):.6g}",
        remedy="raise learn_options['min_noise'] or use float64",
    )
    ones = torch.ones(Y.shape[0], 1, dtype=Y.dtype, device=Y.device)
    solved = torch.cholesky_solve(torch.cat([Y, ones], 1), L)  # C^{-1} [y, 1]
    return solved[:, :-1].sum(0) / solved[:, -1].sum()


def _jittered(A: Tensor) -> Tensor:
    """``A + sqrt(eps) mean(diag A) I``: a fixed relative jitter, smooth in the hyperparameters (see ``loss``)."""
    scale = A.diagonal().mean().detach().abs()
    jitter = math.sqrt(torch.finfo(A.dtype).eps) * scale
    return A + jitter * torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
