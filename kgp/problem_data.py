"""What a solver's :class:`~kgp.plugin.Problem` and an objective's :class:`~kgp.learning.LearningProblem` share:
the rows' sizes (:class:`RowData`) and the centers of a Nystrom model (:class:`Centers`).

Both problem classes build on this module, and :mod:`kgp.plugin` re-exports it, so neither the plugin contract
nor the learning package imports the other at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["Centers", "RowData"]


@dataclass
class Centers:
    """Result of a center selector.

    Attributes
    ----------
    points:
        ``M x d`` centers.
    weights:
        Optional length-M diagonal of FALKON's D (Appendix A, Def. 2); None means D = I.
    indices:
        Optional indices into the training inputs.
    info:
        Diagnostics (e.g. ``"leverage_scores"``, ``"d_eff"``).
    """

    points: Tensor
    weights: Tensor | None = None
    indices: Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)


class RowData:
    """Sizes, dtype and device of a problem that holds rows ``X``, targets ``y`` and an optional ``shard``.

    Shared by :class:`kgp.plugin.Problem` (solvers) and :class:`kgp.learning.LearningProblem` (objectives), so
    that ``n`` means the same thing to both: all ranks' rows in a distributed fit.
    """

    X: Tensor
    y: Tensor
    shard: Any

    @property
    def n(self) -> int:
        """Training rows of the (global) problem: all ranks' rows in a distributed fit."""
        return self.X.shape[0] if self.shard is None else self.shard.n_total

    @property
    def n_local(self) -> int:
        """Rows of ``X`` held here (``n`` unless the fit is distributed)."""
        return self.X.shape[0]

    @property
    def n_outputs(self) -> int:
        return self.y.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.X.dtype

    @property
    def device(self) -> torch.device:
        return self.X.device
