"""Which variance strategy a fit or a model file gets: the one place that maps targets and tags to classes.

A fit chooses once, from its solver's declared ``Capabilities.target`` (:func:`for_fit`); a model file
names the strategy by its tag in ``posterior.variance.kind`` (:func:`from_state`). Nothing else in kgp
compares kinds: the chosen strategy object does the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..capabilities import TARGETS
from ..posterior_checks import PosteriorStateError
from .base import FitInputs, LoadContext, VarianceStrategy
from .exact import ExactVariance
from .none import NoVariance
from .nystrom import NystromVariance

__all__ = ["KINDS", "STRATEGIES", "for_fit", "for_target", "from_state", "legacy_state"]

STRATEGIES: Mapping[str, type[VarianceStrategy]] = MappingProxyType(
    {cls.kind: cls for cls in (ExactVariance, NystromVariance, NoVariance)}
)
"""Strategy class per serialised tag (``posterior.variance.kind`` of a model file)."""

KINDS = tuple(STRATEGIES)
"""The tags a model file may hold."""

_BY_TARGET: Mapping[str, type[VarianceStrategy]] = MappingProxyType(
    {"exact": ExactVariance, "nystrom": NystromVariance, "mean_only": NoVariance}
)
if set(_BY_TARGET) != set(TARGETS):  # a new target must say which variance it gives
    raise ImportError(f"kgp.variance: no strategy for the targets {sorted(set(TARGETS) - set(_BY_TARGET))}")


def for_target(target: str) -> type[VarianceStrategy]:
    """The strategy class of solvers declaring ``target`` (one of ``kgp.capabilities.TARGETS``).

    Raises
    ------
    ValueError
        If ``target`` is not a declared target.
    """
    cls = _BY_TARGET.get(target)
    if cls is None:
        raise ValueError(f"target: expected one of {TARGETS}, got {target!r}")
    return cls


def for_fit(target: str, fit: FitInputs) -> VarianceStrategy:
    """The variance strategy of a fit whose solver declares ``target``: chosen here, once per fit.

    Raises
    ------
    ValueError
        If ``target`` is not a declared target.
    """
    return for_target(target).for_fit(fit)


def from_state(state: Mapping[str, Any], context: LoadContext) -> VarianceStrategy:
    """The strategy stored as ``state`` (a model file's ``posterior.variance``), checked entry by entry.

    Raises
    ------
    kgp.posterior_checks.PosteriorStateError
        Naming the entry: an unknown tag, or an entry the tag's strategy refuses.
    """
    state = context.check.mapping(state, "variance")
    cls = STRATEGIES.get(state.get("kind"))
    if cls is None:
        raise PosteriorStateError(f"posterior.variance.kind: expected one of {KINDS}, got {state.get('kind')!r}")
    return cls.from_state(state, context)


def legacy_state(target: str | None, factors: Any, predictor_centers: Any) -> dict[str, Any]:
    """The ``posterior.variance`` entry of a file written before the Posterior (format versions 1 and 2).

    ``target``: the declared target of the file's solver (None when it is not installed); ``factors``: the
    factors the file stored, if any (their own tag then decides). Those files read every solver without
    the exact target as a Nystrom one.
    """
    if isinstance(factors, Mapping):
        cls = STRATEGIES.get(factors.get("kind"))
        if cls is None:  # an unknown tag: kept, for from_state to refuse it by name
            return {"kind": factors.get("kind"), "factors": factors}
        return cls.legacy_state(factors, predictor_centers)
    cls = ExactVariance if _BY_TARGET.get(target) is ExactVariance else NystromVariance
    return cls.legacy_state(None, predictor_centers)
