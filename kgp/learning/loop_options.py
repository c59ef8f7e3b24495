"""The learning loop's own options (``learn_options`` next to the objective's) and their validation.

The loop's options are declared once in :data:`LEARN_OPTIONS`; an objective may change their defaults
through ``Capabilities(loop_defaults=...)`` and declares its own in ``option_defaults``. Both are
validated here, once per fit, before any data work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import gpytorch

from ..options import Option, ResolvedOptions, merge_options

__all__ = ["LEARN_OPTIONS", "loop_declarations", "split_learn_options"]


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


@dataclass(frozen=True)
class ResolvedLearnOptions:
    """``learn_options`` validated once (by the fit plan): the loop's options and the objective's.

    :func:`~kgp.learning.loop.learn_hyperparameters` takes it in place of a dict and validates nothing
    again (every option is validated exactly once per fit).
    """

    loop: dict[str, Any]
    objective: ResolvedOptions


def resolve_learn_options(name: str, objective: Any, given: dict[str, Any] | None) -> ResolvedLearnOptions:
    """:func:`split_learn_options` as one :class:`ResolvedLearnOptions`."""
    loop, own = split_learn_options(name, objective, given)
    return ResolvedLearnOptions(loop, own)


def split_learn_options(name: str, objective: Any, given: dict[str, Any] | None) -> tuple[dict, dict]:
    """Validate ``learn_options`` against the loop's and the objective's declarations.

    Returns
    -------
    (loop options, objective options), each merged with its defaults.

    Raises
    ------
    InvalidOptionError
        An invalid value, named as ``learn 'NAME' option 'KEY': expected ..., got ...``.
    ValueError
        An unknown key (the message lists the valid ones).
    """
    own = dict(getattr(objective, "option_defaults", {}) or {})
    clash = sorted(set(own) & set(LEARN_OPTIONS))
    if clash:
        raise TypeError(f"objective {name!r} declares options {clash} that the learning loop owns; rename them")
    merged = merge_options(f"learn {name!r}", {**loop_declarations(name, objective), **own}, given)
    loop = {k: merged[k] for k in LEARN_OPTIONS}
    if loop["noise_prior"] is not None and not loop["learn_noise"]:
        # a prior on a fixed noise moves nothing but the reported value: most likely a forgotten switch
        raise ValueError(
            f"learn {name!r}: learn_options['noise_prior'] is a prior on the learned noise, but "
            "learn_options['learn_noise'] is False (the noise is kept fixed); drop noise_prior or set learn_noise=True"
        )
    for key in ("max_iterations", "polish_iterations"):
        if loop[key] is not None and loop["optimizer"] != "adam":
            # they extend or follow Adam's steps; L-BFGS has one budget ('iterations')
            raise ValueError(
                f"learn {name!r}: learn_options[{key!r}] applies to optimizer='adam', but optimizer is "
                f"{loop['optimizer']!r}; drop {key!r} or raise 'iterations' (L-BFGS's budget of evaluations)"
            )
    refine = loop["refine_subset"]
    if refine is not None:
        if "subset" not in own:
            raise ValueError(
                f"learn {name!r}: learn_options['refine_subset'] refines on a larger random subset of rows, but "
                f"objective {name!r} has no 'subset' option; use learn='exact' or drop refine_subset"
            )
        if merged["subset"] is None or refine <= merged["subset"]:
            raise ValueError(
                f"learn {name!r}: learn_options['refine_subset']={refine} must exceed learn_options['subset'] "
                f"(got {merged['subset']!r}: None means all rows already); raise refine_subset or drop it"
            )
    own_values = {k: v for k, v in merged.items() if k not in LEARN_OPTIONS}
    # the objective reads them as they are (validated here, once)
    return loop, ResolvedOptions(f"objective {name!r}", own_values)


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
