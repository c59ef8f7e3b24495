"""Declared options of ``eigenpro4`` (EigenPro 4, delayed projections) and the rules between them.

Each option is a :class:`kgp.Option`; :func:`kgp.resolve_options` validates them once, before any
work, and runs :func:`check_options` for the rules between options. The bounds that depend on the
data (``batch_size <= n``, ``subsample_size <= M`` or ``n``) are checked at the start of ``fit`` by
:func:`check_data_options`, and the memory the fit will hold by :mod:`.memory`, both before any
kernel evaluation and in the same message format.
"""

from __future__ import annotations

from typing import Any

from kgp.options import InvalidOptionError, Option

__all__ = ["DEFAULT_MAX_BATCH", "EIGENPRO4_DEFAULTS", "check_data_options", "check_options", "invalid_option"]

#: Largest default batch: the reference code takes ``min(10_000, critical batch)``; above the critical
#: batch a larger batch buys no larger step (EigenPro 2.0's rule saturates), only more work per step.
DEFAULT_MAX_BATCH = 10_000

OWNER = "solver 'eigenpro4'"

EIGENPRO4_DEFAULTS: dict[str, Option] = {
    # The paper's large runs make one pass; a small problem needs more to reach the ridge solution
    # (measurements in docs/solvers/eigenpro4.md).
    "epochs": Option.integer(10, minimum=1, help="passes over the training data"),
    "batch_size": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help=f"minibatch size m (<= n); None: the critical batch beta / lambda, at most {DEFAULT_MAX_BATCH}",
    ),
    # The reference code sets T = (tmp_centers_coeff - 1) M / m with tmp_centers_coeff = 2: as many
    # temporary centers as model centers before each projection.
    "projection_period": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="steps T between projections onto the centers; None: max(1, M // m) (about M temporary centers)",
    ),
    # "centers": the Nystrom subsample is drawn from the centers, so the preconditioner maps span Z to
    # itself and commutes with the projection: the fixed point is the ridge solution on the centers.
    # "data": drawn from the training rows, as in the paper; with q > 0 the fixed point is then an
    # (I - Q)-weighted solution (EigenPro 3 Lemma 6; measured in docs/solvers/eigenpro4.md).
    "preconditioner": Option.choice(
        "centers",
        ("centers", "data"),
        help="draw the Nystrom subsample of the preconditioner from the 'centers' (exact fixed point) or the 'data'",
    ),
    "subsample_size": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="Nystrom subsample s of the preconditioner (<= M or n); None: min(M or n, 2000, budget side)",
    ),
    "q": Option.integer(
        None,
        minimum=0,
        allow_none=True,
        help="preconditioner level (< s); None: s // 10; 0: no preconditioner",
    ),
    # the exact solve where its factor fits the budget: at M <= 4,000 the inner epochs were most of a fit's time
    # (docs/benchmarks/eigenpro4.md); above, no M x M array (the paper's inexact solve)
    "projection": Option.choice(
        "auto",
        ("auto", "cholesky", "eigenpro2"),
        help="K(Z, Z) v = h by 'cholesky' (exact; three float64 M x M arrays) or inner 'eigenpro2' epochs (the "
        "paper; no M x M array); 'auto': cholesky when those arrays fit kgp.settings.memory_budget",
    ),
    "projection_epochs": Option.integer(
        1, minimum=1, help="projection='eigenpro2': inner EigenPro 2.0 epochs on K(Z, Z) w = h per projection"
    ),
    "projection_residual": Option.choice(
        "carry",
        ("carry", "drop"),
        help="'carry': the projection's residual h - K(Z, Z) v starts the next period's h; 'drop': the paper",
    ),
    "projection_subsample_size": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="projection='eigenpro2': its model preconditioner's subsample (<= M); None: min(M, 2000, budget side)",
    ),
    "projection_q": Option.integer(
        None,
        minimum=0,
        allow_none=True,
        help="level of the model preconditioner (< its subsample); None: s - 1 if s = M, else s // 10",
    ),
    "regularization": Option.choice(
        "ridge", ("ridge", "none"), help="'ridge': GP posterior mean on the centers (lambda = noise); 'none': LS"
    ),
    "lr_scale": Option.number(
        1.0, minimum=0.0, exclusive_minimum=True, help="multiplies the step size of the EigenPro 2.0 rule"
    ),
    "average_epochs": Option.integer(
        None,
        minimum=0,
        allow_none=True,
        help="return the mean of the projected iterates of the last k epochs (<= epochs); None: epochs // 2",
    ),
    "tol": Option.number(
        0.0, minimum=0.0, help="stop when the epoch's running training MSE <= tol * mean(y^2); 0: never"
    ),
}


def invalid_option(name: str, expected: str, value: Any) -> InvalidOptionError:
    """An option refused by a rule between options or against the data, in :meth:`kgp.Option.parse`'s format."""
    return InvalidOptionError(f"{OWNER} option {name!r}: expected {expected}, got {value!r}")


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """``average_epochs <= epochs`` (None: ``epochs // 2``); each level below its subsample when both are given."""
    epochs, average = options["epochs"], options["average_epochs"]
    if average is None:
        options["average_epochs"] = epochs // 2
    elif average > epochs:
        raise invalid_option("average_epochs", f"an integer <= epochs={epochs}", average)
    for s_name, q_name in (("subsample_size", "q"), ("projection_subsample_size", "projection_q")):
        s, q = options[s_name], options[q_name]
        if s is not None and q is not None and q >= s:
            raise invalid_option(q_name, f"an integer < {s_name}={s} or None", q)
    return options


def check_data_options(options: dict[str, Any], n: int, n_centers: int) -> None:
    """The bounds set by the data: ``batch_size <= n``, ``subsample_size <= M`` (or n with a data subsample),
    ``projection_subsample_size <= M``."""
    on_centers = options["preconditioner"] == "centers"
    for name, bound, what in (
        ("batch_size", n, "training points"),
        ("subsample_size", n_centers if on_centers else n, "centers" if on_centers else "training points"),
        ("projection_subsample_size", n_centers, "centers"),
    ):
        value = options[name]
        if value is not None and value > bound:
            raise invalid_option(name, f"an integer <= {bound} (the number of {what}) or None", value)
