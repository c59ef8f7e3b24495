"""Center selectors ``bless`` and ``bless-r``: approximate ridge leverage-score sampling.

Implements Rudi, Calandriello, Carratino and Rosasco, "On Fast Leverage Score Sampling and Optimal
Learning" (NeurIPS 2018): Algorithm 1 (BLESS, sampling with replacement) and Algorithm 2 (BLESS-R,
sampling without replacement), both sweeping the decreasing path
``lambda_h = lambda_0 / q^h`` from ``lambda_0 = kappa^2 / min(t, 1)`` down to the target lambda, and
scoring points with the estimator of eq. 3 (:mod:`.scores`). The selected centers come with the
weights of FALKON's weighted Nystrom (:mod:`.result`).

Conventions: ``lam`` is the FALKON/BLESS per-sample lambda = sigma^2 / n (``request.lam``).

Modules: :mod:`.scores` (eq. 3), :mod:`.path` (the lambda path and the level driver both algorithms
share), :mod:`.algorithms` (the per-level draws of Alg. 1 and 2), :mod:`.result` (BlessResult,
FALKON's D), :mod:`.options` (the option tables of both algorithms),
:mod:`.checks` (data-argument checks), :mod:`.selector` (the selector adapter).
"""

from __future__ import annotations

import kgp

from .algorithms import bless, bless_r
from .result import BlessResult, center_weights
from .scores import estimate_leverage_scores
from .selector import BlessRSelector, BlessSelector

__all__ = [
    "BlessResult",
    "BlessRSelector",
    "BlessSelector",
    "bless",
    "bless_r",
    "center_weights",
    "estimate_leverage_scores",
]


@kgp.hookimpl
def register_selectors(register) -> None:
    register("bless", BlessSelector)
    register("bless-r", BlessRSelector)
