"""Built-in hyperparameter objectives (hook ``register_objectives``): ``exact``, ``sgpr``, ``holdout``.

- ``exact`` (:mod:`.exact`): negative exact log marginal likelihood by Cholesky, on every training
  point up to ``kgp.settings.max_exact_size``, or on a random ``subset`` of rows.
- ``sgpr`` (:mod:`.sgpr`): negative collapsed variational bound of Titsias (2009) on fixed
  inducing points, O(n M^2 + M^3) per evaluation, n x M never stored beyond the memory budget
  (:mod:`.gram` streams the Gram products forward and backward).
- ``holdout`` (:mod:`.holdout`): held-out NLPD or MSE of the Nystrom predictor on the centers
  (Meanti et al. 2022's validation criterion), same O(n M^2) cost as ``sgpr``.
"""

from __future__ import annotations

import kgp

from .exact import ExactObjective
from .holdout import HoldoutObjective
from .sgpr import SGPRObjective

__all__ = ["ExactObjective", "HoldoutObjective", "SGPRObjective"]


@kgp.hookimpl
def register_objectives(register):
    register("exact", ExactObjective())
    register("sgpr", SGPRObjective())
    register("holdout", HoldoutObjective())
