"""How solvers say that an answer may be wrong: one warning class, one error class, one wording.

Every iterative solver checks its own progress (a residual or loss that grows, non-finite values, a
final residual far above the tolerance) and reports through these, so that a user can filter or
escalate them in one place::

    import warnings, kgp
    warnings.simplefilter("error", kgp.ConvergenceWarning)   # make every such warning an error

A solver never returns a result it knows to be garbage without saying so.
"""

from __future__ import annotations

import warnings

__all__ = ["ConvergenceWarning", "DivergenceError", "diverged", "warn_not_converged"]


class ConvergenceWarning(RuntimeWarning):
    """An iterative solver stopped before reaching its tolerance; the result may be inaccurate."""


class DivergenceError(FloatingPointError):
    """An iterative solver diverged (non-finite or exploding iterates); no usable result exists."""


def _message(solver: str, what: str, cause: str, remedy: str) -> str:
    text = f"solver {solver!r}: {what}"
    if cause:
        text += f"; likely cause: {cause}"
    if remedy:
        text += f"; remedy: {remedy}"
    return text


def warn_not_converged(solver: str, what: str, *, cause: str = "", remedy: str = "", stacklevel: int = 3) -> None:
    """Emit a :class:`ConvergenceWarning` naming the solver, what was observed, its cause and a remedy."""
    warnings.warn(_message(solver, what, cause, remedy), ConvergenceWarning, stacklevel=stacklevel)


def diverged(solver: str, what: str, *, cause: str = "", remedy: str = "") -> DivergenceError:
    """A :class:`DivergenceError` with the same wording (raise it)."""
    return DivergenceError(_message(solver, what, cause, remedy))
