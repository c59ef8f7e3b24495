"""How solvers say that an answer may be wrong: one warning class, one error class, one wording.

Every iterative solver checks its own progress (a residual or loss that grows, non-finite values, a
final residual far above the tolerance) and reports through these, so that a user can filter or
escalate them in one place::

    import warnings, kgp
    warnings.simplefilter("error", kgp.ConvergenceWarning)   # make every such warning an error

A solver never returns a result it knows to be garbage without saying so.
"""

from __future__ import annotations

import sys
import warnings

__all__ = [
    "ConvergenceWarning",
    "DivergenceError",
    "IllConditionedError",
    "NotFittedError",
    "diverged",
    "ill_conditioned",
    "not_fitted",
    "warn_not_converged",
]


class ConvergenceWarning(RuntimeWarning):
    """An iterative solver stopped before reaching its tolerance; the result may be inaccurate."""


class DivergenceError(FloatingPointError):
    """An iterative solver diverged (non-finite or exploding iterates); no usable result exists."""


class IllConditionedError(ValueError):
    """A dense factorization or eigen-decomposition failed: the problem is too ill-conditioned for the data."""


def ill_conditioned(where: str, detail: str) -> IllConditionedError:
    """An :class:`IllConditionedError` for a raw LAPACK failure in ``where`` (a plugin or routine)."""
    return IllConditionedError(
        f"{where}: numerical failure ({detail}); the kernel matrix is too ill-conditioned for these inputs. "
        "Likely cause: duplicate or nearly identical points with a tiny noise, unscaled features (extreme "
        "magnitudes), or float32; remedy: standardise the columns of X, use dtype='float64', or increase noise"
    )


class NotFittedError(RuntimeError, ValueError, AttributeError):
    """A method that needs a fitted estimator was called before ``fit``.

    A RuntimeError (what kgp raised before), and a ValueError and AttributeError like
    scikit-learn's ``NotFittedError``, so that scikit-learn's tools recognise it. When scikit-learn
    is imported, :func:`not_fitted` raises a subclass that is also scikit-learn's ``NotFittedError``.
    """


_SKLEARN_NOT_FITTED: dict[type, type] = {}


def not_fitted(message: str) -> NotFittedError:
    """A :class:`NotFittedError`; also an instance of scikit-learn's if scikit-learn is imported.

    kgp never imports scikit-learn itself; code that catches scikit-learn's class has imported it.
    """
    sklearn_exceptions = sys.modules.get("sklearn.exceptions")
    base = getattr(sklearn_exceptions, "NotFittedError", None)
    if base is None:
        return NotFittedError(message)
    if base not in _SKLEARN_NOT_FITTED:
        _SKLEARN_NOT_FITTED[base] = type("NotFittedError", (NotFittedError, base), {"__module__": __name__})
    return _SKLEARN_NOT_FITTED[base](message)


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
