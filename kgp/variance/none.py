"""No predictive variance: the solver's form has none, or the fit lacks what one needs.

Solvers declaring ``Capabilities(target="mean_only")`` approximate the exact posterior mean in a form
without a variance (e.g. random features); a Nystrom-target fit without centers, or a distributed one
that did not learn the GP, has none either. Asking for one raises a ValueError quoting the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from ..posterior_checks import PosteriorStateError
from .base import FitInputs, LoadContext, VarianceStrategy

__all__ = ["NoVariance"]


class NoVariance(VarianceStrategy):
    """The strategy of a posterior without a variance.

    Parameters
    ----------
    reason:
        Why there is none and what would give one (one sentence, quoted in the error).
    """

    kind: ClassVar[str] = "none"
    has_variance: ClassVar[bool] = False

    def __init__(self, reason: str):
        self.reason = reason

    @classmethod
    def for_fit(cls, fit: FitInputs) -> VarianceStrategy:
        return cls(
            f"solver {fit.solver!r} gives no predictive variance: it neither solves the exact GP "
            "(target 'exact', e.g. solver='exact') nor fits on centers (target 'nystrom', Nystrom/DTC "
            "variance, e.g. solver='falkon')"
        )

    @property
    def built(self) -> bool:
        return False

    def _refusal(self) -> ValueError:
        return ValueError(f"return_std=True: {self.reason}")

    def build(self) -> None:
        raise self._refusal()

    def latent_variance(self, Xq: Tensor) -> Tensor:
        raise self._refusal()

    def latent_covariance(self, Xq: Tensor) -> Tensor:
        raise self._refusal()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "reason": self.reason}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], context: LoadContext) -> VarianceStrategy:
        reason = state.get("reason")
        if not isinstance(reason, str):
            raise PosteriorStateError("posterior.variance.reason: expected a str")
        return cls(reason)
