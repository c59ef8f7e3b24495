"""The options of BLESS and BLESS-R, declared once.

An option's default is the keyword default of :func:`~kgp_builtins.bless.bless` /
:func:`~kgp_builtins.bless.bless_r`; what it accepts and its help line are declared here. The
selectors' ``option_defaults`` are built from both (:func:`declared_options`), and the functions check
their own arguments with the same declarations (:func:`parse_options`), so a direct call and
``selector_options`` accept the same values, with kgp's one message format
(``<owner> option '<name>': expected <what>, got <value>``, :class:`kgp.options.InvalidOptionError`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from kgp.options import Option, merge_options

LINALG_DTYPES = ("float64", "input")
SCORE_LAMBDAS = ("current", "previous")

_positive = functools.partial(Option.number, minimum=0.0, exclusive_minimum=True)

# name -> declaration given the default (the function's keyword default)
_DECLARATIONS: dict[str, Callable[[Any], Option]] = {
    "q": functools.partial(
        Option.number, minimum=1.0, exclusive_minimum=True, help="lambda step of the path, lambda_h = lambda_0 / q^h"
    ),
    "t": functools.partial(_positive, help="accuracy parameter of Thm. 1; lambda_0 = kappa^2 / min(t, 1)"),
    "q1": functools.partial(_positive, help="candidates per level (Alg. 1): R_h = q1 min(kappa^2 / lambda_h, n)"),
    "q2": functools.partial(
        _positive, help="centers per unit of d_eff: M_h = q2 d_h (Alg. 2: inclusion p = min(q2 l~, 1))"
    ),
    "score_lambda": functools.partial(
        Option.choice,
        choices=SCORE_LAMBDAS,
        help="score level h at lambda_h ('current') or at lambda_{h-1} ('previous', Alg. 2 as printed)",
    ),
    "early_stop": functools.partial(
        Option.boolean, help="with n_centers: stop the path at the first lambda_h with q2 d_h >= n_centers"
    ),
    "linalg_dtype": functools.partial(
        Option.choice, choices=LINALG_DTYPES, help="dtype of the |J| x |J| factorisation and solves ('input': X's)"
    ),
}

LAM_OPTION = _positive(None, allow_none=True, help="sampling lambda (lambda_bless); None: noise / n, the model's")
"""The selectors' ``lam`` option (the functions take ``lam`` as their third argument)."""

# keyword arguments that are not options: the selector passes them from the request
_FROM_REQUEST = ("n_centers", "generator", "shard")


def declared_options(function: Callable[..., Any]) -> dict[str, Option]:
    """The options of ``function`` (:func:`bless` or :func:`bless_r`): each keyword-only argument but
    ``n_centers``, ``generator`` and ``shard``, declared with the function's default, in signature order."""
    return {
        name: _DECLARATIONS[name](parameter.default)
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in _FROM_REQUEST
    }


def parse_options(owner: str, function: Callable[..., Any], **values: Any) -> dict[str, Any]:
    """``values`` (every option of ``function``) checked and normalised by their declarations."""
    return merge_options(owner, declared_options(function), values)


def parse_option(owner: str, name: str, value: Any) -> Any:
    """One option checked and normalised by its declaration (for functions that take only some)."""
    return _DECLARATIONS[name](value).parse(owner, name, value)
