"""What BLESS returns: :class:`BlessResult`, and FALKON's center weights D from BLESS's A.

The weights are those of FALKON's weighted Nystrom (Rudi et al. 2017, Appendix A, Def. 2): the
diagonal of D with ``D_jj^2 = (M / n) / A_jj`` for the M returned (distinct) centers. That is
``D_jj = 1 / sqrt(n p_j)`` for a center drawn once with per-draw probability ``p_j``, and reduces to
D = I for uniform sampling (A = (M/n) I); see :func:`center_weights` and docs/selectors/bless.md for
the treatment of duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kgp.plugin import Centers


@dataclass
class BlessResult:
    """Output of :func:`bless` / :func:`bless_r` at the final lambda.

    Attributes
    ----------
    indices:
        Distinct indices of the M selected centers in X (order of first selection).
    a:
        Diagonal of A_H for these centers (Alg. 1 line 10 / Alg. 2 line 13; duplicates of Alg. 1
        merged as ``A_jj / c_j``, which leaves eq. 3 unchanged). Use with
        :func:`estimate_leverage_scores`.
    weights:
        Diagonal of FALKON's D (Appendix A, Def. 2): ``sqrt((M / n) / a)``.
    counts:
        How often each center was drawn (all ones for BLESS-R).
    leverage_scores:
        Estimated ``l~(x_j, lam)`` of the selected centers at the final level (the scores they were
        sampled with).
    d_eff:
        Estimate of ``d_eff(lam)`` from the final level (Alg. 1: ``d_H``).
    lambda_path:
        ``[lambda_1, ..., lambda_H]`` (lambda_H = lam).
    levels:
        One dict per level: ``lam``, ``candidates`` (|U_h|), ``draws``, ``centers``, ``d_eff``.
    """

    indices: Tensor
    a: Tensor
    weights: Tensor
    counts: Tensor
    leverage_scores: Tensor
    d_eff: float
    lambda_path: list[float]
    levels: list[dict[str, float]] = field(default_factory=list)

    def to_centers(self, X: Tensor, points: Tensor | None = None) -> Centers:
        """Package as :class:`kgp.Centers` (points, D weights, indices, diagnostics).

        ``points``: the center rows when ``X`` does not hold them all (a distributed selection);
        default ``X[indices]``.
        """
        info = {
            "leverage_scores": self.leverage_scores,
            "d_eff": self.d_eff,
            "lambda_path": list(self.lambda_path),
            "a": self.a,
            "counts": self.counts,
            "levels": list(self.levels),
        }
        points = X[self.indices] if points is None else points
        return Centers(points=points, weights=self.weights, indices=self.indices, info=info)


def center_weights(a: Tensor, n: int) -> Tensor:
    """FALKON's D diagonal from BLESS's A diagonal: ``D_jj = sqrt((M / n) / A_jj)``, M = len(a).

    With this choice ``(n/M) K_MM D^2 K_MM = sum_j K_{J,j} K_{j,J} / A_jj`` is the importance-sampling
    estimate of ``K_nM^T K_nM`` that FALKON's preconditioner approximates (Appendix A, Def. 3), for
    every sampling rule: multinomial (A = M_draws diag(p), duplicates merged as A_jj / c_j),
    Bernoulli inclusion (A = diag(p)) and uniform without replacement (A = (M/n) I, so D = I).
    """
    m = a.shape[0]
    return torch.sqrt((m / n) / a)
