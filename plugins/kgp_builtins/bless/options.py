"""The options of BLESS and BLESS-R, declared once as plain :class:`kgp.Option` tables.

:data:`BLESS_OPTIONS` and :data:`BLESS_R_OPTIONS` declare the keyword arguments of
:func:`~kgp_builtins.bless.bless` / :func:`~kgp_builtins.bless.bless_r` (their defaults are the
functions' keyword defaults; tests/test_bless.py checks that they agree). The selectors'
``option_defaults`` are these tables plus ``lam`` (:data:`LAM_OPTION`), which kgp validates once
(:func:`kgp.resolve_options`); a direct call of the functions checks its arguments with the same
declarations (:func:`parse_options`), so both accept the same values with kgp's one message format
(``<owner> option '<name>': expected <what>, got <value>``, :class:`kgp.options.InvalidOptionError`).
"""

from __future__ import annotations

from typing import Any

from kgp.options import Option

__all__ = ["BLESS_OPTIONS", "BLESS_R_OPTIONS", "LAM_OPTION", "parse_option", "parse_options"]

LINALG_DTYPES = ("float64", "input")
SCORE_LAMBDAS = ("current", "previous")


def _positive(default: float, help: str) -> Option:
    return Option.number(default, minimum=0.0, exclusive_minimum=True, help=help)


_Q = Option.number(2.0, minimum=1.0, exclusive_minimum=True, help="lambda step of the path, lambda_h = lambda_0 / q^h")
_T = _positive(1.0, help="accuracy parameter of Thm. 1; lambda_0 = kappa^2 / min(t, 1)")
_Q2 = _positive(3.0, help="centers per unit of d_eff: M_h = q2 d_h (Alg. 2: inclusion p = min(q2 l~, 1))")
_EARLY_STOP = Option.boolean(True, help="with n_centers: stop the path at the first lambda_h with q2 d_h >= n_centers")
_LINALG_DTYPE = Option.choice(
    "float64", LINALG_DTYPES, help="dtype of the |J| x |J| factorisation and solves ('input': X's)"
)

BLESS_OPTIONS: dict[str, Option] = {
    "q": _Q,
    "t": _T,
    "q1": _positive(2.0, help="candidates per level (Alg. 1): R_h = q1 min(kappa^2 / lambda_h, n)"),
    "q2": _Q2,
    "early_stop": _EARLY_STOP,
    "linalg_dtype": _LINALG_DTYPE,
}
"""Options of :func:`~kgp_builtins.bless.bless` (Alg. 1) and the selector ``bless``."""

BLESS_R_OPTIONS: dict[str, Option] = {
    "q": _Q,
    "t": _T,
    "q2": _Q2,
    "score_lambda": Option.choice(
        "current",
        SCORE_LAMBDAS,
        help="score level h at lambda_h ('current') or at lambda_{h-1} ('previous', Alg. 2 as printed)",
    ),
    "early_stop": _EARLY_STOP,
    "linalg_dtype": _LINALG_DTYPE,
}
"""Options of :func:`~kgp_builtins.bless.bless_r` (Alg. 2) and the selector ``bless-r``."""

LAM_OPTION = Option.number(
    None,
    minimum=0.0,
    exclusive_minimum=True,
    allow_none=True,
    help="sampling lambda (lambda_bless); None: noise / n, the model's",
)
"""The selectors' ``lam`` option (the functions take ``lam`` as their third argument)."""


def parse_options(owner: str, table: dict[str, Option], **values: Any) -> dict[str, Any]:
    """``values`` (arguments of a direct call) checked and normalised by their declarations in ``table``."""
    return {name: table[name].parse(owner, name, value) for name, value in values.items()}


def parse_option(owner: str, name: str, value: Any) -> Any:
    """One argument checked and normalised by its declaration (for functions that take only some)."""
    declaration = BLESS_OPTIONS.get(name) or BLESS_R_OPTIONS[name]
    return declaration.parse(owner, name, value)
