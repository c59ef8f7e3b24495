r"""The delayed projection of EigenPro 4: the temporary part of the model re-expressed on the centers.

Every T steps the function's temporary part ``t = K(., X_s) c + K(., X_tmp) w`` is replaced by its
RKHS projection onto span K(., Z), whose coefficients solve ``K(Z, Z) v = t(Z) = h``. As in the
paper and its reference code, the solve is inexact: ``projection_epochs`` EigenPro 2.0 epochs on
``K(Z, Z)`` from 0 with the "model" Nystrom preconditioner on a subsample of Z (EigenPro 3 eq. 32),
kgp's :class:`~kgp_builtins.eigenpro.projection.EigenPro2Projection`. Its blocks are ``batch x M``
rows of ``K(Z, Z)`` within ``kgp.settings.memory_budget``: ``K(Z, Z)`` itself is never formed.

The error of an inexact solve changes the iterate, not the fixed point: the part of ``t`` that the
solve missed is dropped with the rest of the temporary part, and the next steps' gradients see it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp_builtins.eigenpro.nystrom import KernelOpFactory
from kgp_builtins.eigenpro.options import resolve_subsample
from kgp_builtins.eigenpro.projection import EigenPro2Projection

from .options import OWNER

__all__ = ["DelayedProjection"]


class DelayedProjection:
    """``v ~ K(Z, Z)^{-1} h`` by inner EigenPro 2.0 epochs (see the module docstring).

    Parameters
    ----------
    kop, Z:
        Kernel factory and the centers.
    s, q:
        Subsample and level of the model preconditioner (None: :func:`resolve_subsample`'s defaults,
        ``min(M, 2000, budget side)``, and ``s - 1`` when that is every center, else ``s // 10``).
    epochs:
        Inner epochs per projection.
    generator:
        The fit's generator (subsample and batch order).
    """

    def __init__(
        self, kop: KernelOpFactory, Z: Tensor, s: int | None, q: int | None, epochs: int, generator: torch.Generator
    ):
        self.s, self.q = resolve_subsample(
            OWNER,
            Z.shape[0],
            s,
            q,
            s_name="projection_subsample_size",
            q_name="projection_q",
            points="centers",
            device=Z.device,
        )
        self.inner = EigenPro2Projection(kop, Z, self.s, self.q, epochs, generator)
        self.count = 0

    @property
    def batch(self) -> int:
        """The inner solver's batch (rows of ``K(Z, Z)`` per inner step)."""
        return self.inner.state.batch

    def solve(self, h: Tensor) -> Tensor:
        self.count += 1
        return self.inner.solve(h)
