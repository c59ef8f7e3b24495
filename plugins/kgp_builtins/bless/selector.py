"""Adapter from kgp's center-selector contract to `bless` (Alg. 1) and `bless_r` (Alg. 2)."""

from __future__ import annotations

from typing import Any

from kgp.plugin import Centers, SelectionRequest

from .algorithms import bless, bless_r
from .checks import _positive


def _selector_lam(request: SelectionRequest, options: dict[str, Any]) -> float:
    lam = options.get("lam")
    if lam is None:
        return request.lam
    return _positive(lam, "lam")


class _BlessFamilySelector:
    """Adapter from the selector contract to :func:`bless` / :func:`bless_r`.

    The option names are exactly the keyword arguments of ``run`` besides the data, so one
    ``select`` serves both algorithms.
    """

    def __init__(self, run, option_defaults: dict[str, Any]):
        self._run = run
        self.option_defaults = option_defaults

    def select(self, request: SelectionRequest) -> Centers:
        options = dict(request.options)
        lam = _selector_lam(request, options)
        options.pop("lam", None)
        result = self._run(
            request.X,
            request.kernel,
            lam,
            n_centers=request.n_centers,
            generator=request.generator,
            **options,
        )
        return result.to_centers(request.X)


BlessSelector = _BlessFamilySelector(
    bless,
    {"q": 2.0, "t": 1.0, "q1": 2.0, "q2": 3.0, "lam": None, "early_stop": True, "linalg_dtype": "float64"},
)
"""Selector ``bless``: :func:`bless` (Alg. 1) at ``request.lam`` (or the ``lam`` option)."""

BlessRSelector = _BlessFamilySelector(
    bless_r,
    {
        "q": 2.0,
        "t": 1.0,
        "q2": 3.0,
        "lam": None,
        "score_lambda": "current",
        "early_stop": True,
        "linalg_dtype": "float64",
    },
)
"""Selector ``bless-r``: :func:`bless_r` (Alg. 2) at ``request.lam`` (or the ``lam`` option)."""
