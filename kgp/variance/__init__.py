"""Predictive variances of the fitted GP (``predict(return_std=True)``, ``posterior_.covariance``, ``sample_y``).

One strategy class per kind, chosen once per fit from the solver's declared target (:mod:`.kinds`):

- :class:`ExactVariance` (``target="exact"``): the GP posterior variance on the training rows
  (Rasmussen & Williams 2006, Algorithm 2.1), :mod:`.exact`;
- :class:`NystromVariance` (``target="nystrom"``): the DTC / SGPR variance on the centers (Titsias
  2009, eq. 6), :mod:`.nystrom`;
- :class:`NoVariance` (``target="mean_only"``, or a fit lacking what the others need), :mod:`.none`.

Each owns its build from the fit, the latent variance and covariance at query rows, its state in a
model file and the checks of that state (:class:`VarianceStrategy`, :mod:`.base`). All are variances
of the latent f in the units the kernel works in; :class:`kgp.Posterior` adds the noise and the target
scaling. Query rows are processed in blocks under ``kgp.settings.memory_budget``.
"""

from .base import (
    FitInputs,
    LoadContext,
    VarianceFactors,
    VarianceStrategy,
    check_dense_size,
    cross_kernel,
    latent_covariance,
    latent_variance,
    pair_kernel,
)
from .exact import ExactFactors, ExactVariance, exact_factors
from .kinds import KINDS, STRATEGIES, for_fit, for_target, from_state, legacy_state
from .none import NoVariance
from .nystrom import (
    GRAM_MIN_ROWS,
    GRAM_ROWS_PER_CENTER,
    NystromFactors,
    NystromVariance,
    gram_rows,
    gram_subset,
    nystrom_factors,
)

__all__ = [
    "GRAM_MIN_ROWS",
    "GRAM_ROWS_PER_CENTER",
    "KINDS",
    "STRATEGIES",
    "ExactFactors",
    "ExactVariance",
    "FitInputs",
    "LoadContext",
    "NoVariance",
    "NystromFactors",
    "NystromVariance",
    "VarianceFactors",
    "VarianceStrategy",
    "check_dense_size",
    "cross_kernel",
    "exact_factors",
    "for_fit",
    "for_target",
    "from_state",
    "gram_rows",
    "gram_subset",
    "latent_covariance",
    "latent_variance",
    "legacy_state",
    "nystrom_factors",
    "pair_kernel",
]
