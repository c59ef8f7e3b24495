"""The learning loop's own options (``learn_options`` next to the objective's) and their validation.

The loop's options are declared once in :data:`LEARN_OPTIONS`, the rules between them in
:data:`LEARN_RULES`; an objective may change their defaults through ``Capabilities(loop_defaults=...)``
and declares its own in ``option_defaults``. All are resolved by :func:`kgp.options.resolve_options`,
the function every plugin's options go through, once per fit, before any data work; a recipe's values
enter there as suggestions, under the same precedence rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import gpytorch

from ..options import Option, Requires, ResolvedOptions, merge_options, resolve_options

__all__ = [
    "LEARN_OPTIONS",
    "LEARN_RULES",
    "LearnDeclarations",
    "ResolvedLearnOptions",
    "loop_declarations",
    "resolve_learn_options",
    "split_learn_options",
]


def _prior_or_none(value: Any) -> gpytorch.priors.Prior | None:
    if value is not None and not isinstance(value, gpytorch.priors.Prior):
        raise TypeError("not a gpytorch.priors.Prior")
    return value


LEARN_OPTIONS: dict[str, Option] = {
    "iterations": Option.integer(
        100,
        minimum=1,
        help="objective evaluations: Adam steps, or the L-BFGS budget of evaluations (line searches included)",
    ),
    "lr": Option.number(
        None, minimum=0.0, exclusive_minimum=True, allow_none=True, help="step size; None: 0.1 for Adam, 1 for L-BFGS"
    ),
    "optimizer": Option.choice("adam", ("adam", "lbfgs"), help="torch.optim.Adam or torch.optim.LBFGS (strong Wolfe)"),
    "min_noise": Option.number(
        1e-6, minimum=0.0, exclusive_minimum=True, help="lower bound of the learned noise variance (GreaterThan)"
    ),
    "min_lengthscale": Option.number(
        None,
        minimum=0.0,
        allow_none=True,
        help="lower bound of every lengthscale while learning (None: numerical floor, kgp.learning.bounds; 0: none)",
    ),
    "max_iterations": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="Adam only: while the objective is still falling after 'iterations' steps (kgp.learning.outcome), go "
        "on in quarters of 'iterations' up to this many steps; None: stop at 'iterations'",
    ),
    "polish_iterations": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="Adam only: if the objective is still falling after the Adam steps (kgp.learning.outcome), at most "
        "this many L-BFGS evaluations (strong Wolfe) from the best point; None: off. learn='auto' sets it",
    ),
    "initial_noise_fraction": Option.number(
        None,
        minimum=0.0,
        exclusive_minimum=True,
        allow_none=True,
        help="start the noise variance at this fraction of the targets' variance (mean over outputs) instead of "
        "the model's noise; None: the model's noise. learn='auto' sets it (kgp_builtins.recipes)",
    ),
    "learn_noise": Option.boolean(True, help="train the noise variance (False: keep the model's noise)"),
    "learn_mean": Option.boolean(True, help="train a constant mean per output (False: keep the initial mean)"),
    "noise_prior": Option(
        None,
        help="a GPyTorch prior on the noise variance sigma^2 (the likelihood's noise_prior): its log-density / n "
        "is subtracted from the minimised value, as the kernel's priors are; None: no prior",
        expected="a gpytorch.priors.Prior on the noise variance (e.g. gpytorch.priors.GammaPrior(1.1, 0.05)) or None",
        check=_prior_or_none,
    ),
    "refine_subset": Option.integer(
        None,
        minimum=2,
        allow_none=True,
        help="after the Adam steps (and any polish), at most 'refine_iterations' L-BFGS evaluations (strong Wolfe) "
        "from the best point on this many random rows, a superset of 'subset''s rows; only for an objective with "
        "a 'subset' option ('exact'); None: off. learn='auto' sets it",
    ),
    "refine_iterations": Option.integer(
        15, minimum=1, help="L-BFGS evaluations of the refine stage (with 'refine_subset')"
    ),
    "refit_subset": Option.integer(
        None,
        minimum=2,
        allow_none=True,
        help="after the objective, re-estimate the outputscale and the noise by the exact marginal likelihood of "
        "this many random rows, the other hyperparameters fixed (kgp.learning.refit); None: off",
    ),
}
"""Options of the loop itself, accepted in ``learn_options`` next to the objective's own options."""


def _adam_only(key: str) -> Requires:
    # they extend or follow Adam's steps; L-BFGS has one budget ('iterations')
    return Requires(
        key,
        lambda o: o["optimizer"] == "adam",
        lambda owner, o: (
            f"{owner}: learn_options[{key!r}] applies to optimizer='adam', but optimizer is "
            f"{o['optimizer']!r}; drop {key!r} or raise 'iterations' (L-BFGS's budget of evaluations)"
        ),
    )


LEARN_RULES: tuple[Requires, ...] = (
    # a prior on a fixed noise moves nothing but the reported value: most likely a forgotten switch
    Requires(
        "noise_prior",
        lambda o: o["learn_noise"],
        lambda owner, o: (
            f"{owner}: learn_options['noise_prior'] is a prior on the learned noise, but "
            "learn_options['learn_noise'] is False (the noise is kept fixed); drop noise_prior or set learn_noise=True"
        ),
    ),
    _adam_only("max_iterations"),
    _adam_only("polish_iterations"),
    Requires(
        "refine_subset",
        lambda o: "subset" in o,
        lambda owner, o: (
            f"{owner}: learn_options['refine_subset'] refines on a larger random subset of rows, but "
            "the objective has no 'subset' option; use learn='exact' or drop refine_subset"
        ),
    ),
    Requires(
        "refine_subset",
        lambda o: o["subset"] is not None and o["refine_subset"] > o["subset"],
        lambda owner, o: (
            f"{owner}: learn_options['refine_subset']={o['refine_subset']} must exceed "
            f"learn_options['subset'] (got {o['subset']!r}: None means all rows already); "
            "raise refine_subset or drop it"
        ),
    ),
)
"""The rules between the loop's options (and the objective's ``subset``), applied by
:func:`kgp.options.resolve_options` with its precedence rule: a value the user gave raises when its rule
fails; one the user did not give (a recipe's, an objective's ``loop_defaults``) is switched off."""


@dataclass(frozen=True)
class ResolvedLearnOptions:
    """``learn_options`` validated once (by the fit plan): the loop's options and the objective's.

    :func:`~kgp.learning.loop.learn_hyperparameters` takes it in place of a dict and validates nothing
    again (every option is validated exactly once per fit).
    """

    loop: dict[str, Any]
    objective: ResolvedOptions


class LearnDeclarations:
    """What :func:`kgp.options.resolve_options` reads for ``learn_options``: one plugin-like declaration.

    ``option_defaults`` holds the loop's options (:data:`LEARN_OPTIONS` with the objective's
    ``loop_defaults``) and the objective's own; ``option_rules`` is :data:`LEARN_RULES`; an objective's
    optional ``check_options`` runs on its own options.

    Raises
    ------
    TypeError
        The objective declares an option the loop owns, or ``loop_defaults`` the loop does not have.
    """

    option_rules = LEARN_RULES

    def __init__(self, name: str, objective: Any) -> None:
        own = dict(getattr(objective, "option_defaults", {}) or {})
        clash = sorted(set(own) & set(LEARN_OPTIONS))
        if clash:
            raise TypeError(f"objective {name!r} declares options {clash} that the learning loop owns; rename them")
        self.option_defaults = {**loop_declarations(name, objective), **own}
        self._objective = objective

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        check = getattr(self._objective, "check_options", None)
        if check is None:
            return options
        own = check({k: v for k, v in options.items() if k not in LEARN_OPTIONS})
        if not isinstance(own, dict):
            return own  # resolve_options names the wrong return type
        return {**{k: options[k] for k in LEARN_OPTIONS}, **own}


def resolve_learn_options(
    name: str, objective: Any, given: Mapping[str, Any] | None, suggested: Mapping[str, Any] | None = None
) -> ResolvedLearnOptions:
    """Validate ``learn_options`` against the loop's and the objective's declarations, once.

    The one resolution of :func:`kgp.options.resolve_options` (owner ``learn 'NAME'``), then split
    into the loop's options and the objective's.

    Parameters
    ----------
    name, objective:
        The objective plugin's name and object.
    given:
        The user's ``learn_options``.
    suggested:
        The recipe's ``learn_options`` (``learn="auto"``), or None: the user's values win, and a
        suggestion gives way where it conflicts with them (:data:`LEARN_RULES`).

    Raises
    ------
    InvalidOptionError
        An invalid value, named as ``learn 'NAME' option 'KEY': expected ..., got ...``.
    ValueError
        An unknown key (the message lists the valid ones), or a rule between the user's values.
    """
    merged = resolve_options(f"learn {name!r}", LearnDeclarations(name, objective), given, suggested)
    loop = {k: merged[k] for k in LEARN_OPTIONS}
    own_values = {k: v for k, v in merged.items() if k not in LEARN_OPTIONS}
    # the objective reads them as they are (validated here, once)
    return ResolvedLearnOptions(loop, ResolvedOptions(f"objective {name!r}", own_values))


def split_learn_options(name: str, objective: Any, given: Mapping[str, Any] | None) -> tuple[dict, ResolvedOptions]:
    """:func:`resolve_learn_options` as ``(loop options, objective options)``, each merged with its defaults."""
    resolved = resolve_learn_options(name, objective, given)
    return resolved.loop, resolved.objective


def loop_declarations(name: str, objective: Any) -> dict[str, Option]:
    """:data:`LEARN_OPTIONS` with the defaults an objective chooses for itself (its ``loop_defaults``).

    An objective may declare ``Capabilities(loop_defaults=...)``, e.g. ``{"optimizer": "lbfgs", "iterations": 50}``:
    the loop's defaults that suit it (measured, and documented with the objective). Each value is
    checked as a user's value would be, so a bad default fails at once, naming the objective.

    Raises
    ------
    TypeError
        ``loop_defaults`` names an option the loop does not have.
    InvalidOptionError
        A default the loop's declaration rejects.
    """
    chosen = dict(objective.capabilities.loop_defaults)  # a Mapping, checked by Capabilities
    unknown = sorted(set(chosen) - set(LEARN_OPTIONS))
    if unknown:
        raise TypeError(
            f"objective {name!r}: loop_defaults names {unknown}, which the learning loop does not have "
            f"(its options: {', '.join(LEARN_OPTIONS)})"
        )
    merge_options(f"objective {name!r} loop_defaults", LEARN_OPTIONS, chosen)  # bad values fail here
    return {k: replace(opt, default=chosen[k]) if k in chosen else opt for k, opt in LEARN_OPTIONS.items()}
