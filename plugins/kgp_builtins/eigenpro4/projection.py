r"""The delayed projection of EigenPro 4: the temporary part of the model re-expressed on the centers.

Every T steps the function's temporary part ``t = K(., X_s) c + K(., X_tmp) w`` is replaced by its
RKHS projection onto span K(., Z), whose coefficients solve ``K(Z, Z) v = t(Z) = h``. Two solves, the
option ``projection``:

- ``"eigenpro2"`` (the paper and its reference code): inexact, ``projection_epochs`` EigenPro 2.0 epochs
  on ``K(Z, Z)`` from 0 with the "model" Nystrom preconditioner on a subsample of Z (EigenPro 3 eq. 32),
  kgp's :class:`~kgp_builtins.eigenpro.projection.EigenPro2Projection`. Each inner step forms one
  ``batch x M`` block of ``K(Z, Z)`` (:func:`kgp_builtins.eigenpro.ep2.ep2_epoch`: the residual and the
  preconditioner's product from one formation); ``K(Z, Z)`` itself is never formed. Cost per projection:
  ``M^2`` kernel entries per inner epoch, and ``M^2`` more for the carried residual.
- ``"cholesky"``: exact, two triangular solves against the Cholesky factor of ``K(Z, Z) + jitter I``
  (:class:`~kgp_builtins.eigenpro.projection.CholeskyProjection`, formed once in float64: ``M^3 / 3`` flops
  and three ``M x M`` float64 arrays at its peak, one ``M x M`` factor kept). Cost per projection: ``2 M^2 k``
  flops, no kernel entry; the residual of the jittered solve is ``jitter v`` exactly.

``"auto"`` takes the factor when its three float64 arrays fit ``kgp.settings.memory_budget`` (measured in
docs/benchmarks/eigenpro4.md: at M <= 4,000 the inner epochs were most of a fit's time), and the inner
epochs otherwise, so that a model of 1e5-1e6 centers holds no ``M x M`` array.

The error of an inexact solve changes the iterate, not the fixed point: with ``projection_residual="carry"``
the part of ``t`` that the solve missed starts the next period's ``h`` (:meth:`DelayedProjection.residual`);
with ``"drop"`` it is dropped with the rest of the temporary part, and the next steps' gradients see it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp import settings
from kgp_builtins.eigenpro.budget import CHOLESKY_PEAK_ARRAYS, ITEMSIZE
from kgp_builtins.eigenpro.nystrom import KernelOpFactory
from kgp_builtins.eigenpro.options import resolve_subsample
from kgp_builtins.eigenpro.projection import CholeskyProjection, EigenPro2Projection

from .options import OWNER

__all__ = ["DelayedProjection", "resolve_projection"]


def resolve_projection(projection: str, n_centers: int, device: torch.device) -> str:
    """``"cholesky"`` or ``"eigenpro2"``; ``"auto"``: the factor when :data:`CHOLESKY_PEAK_ARRAYS` float64 ``M x M``
    arrays fit ``kgp.settings.memory_budget`` on ``device``."""
    if projection != "auto":
        return projection
    fits = CHOLESKY_PEAK_ARRAYS * ITEMSIZE * n_centers**2 <= settings.memory_budget.value(device)
    return "cholesky" if fits else "eigenpro2"


class DelayedProjection:
    """``v ~ K(Z, Z)^{-1} h`` and its residual ``h - K(Z, Z) v`` (see the module docstring).

    Parameters
    ----------
    kop, Z:
        Kernel factory and the centers.
    kind:
        ``"cholesky"`` or ``"eigenpro2"`` (resolved by :func:`resolve_projection`).
    s, q:
        ``"eigenpro2"``: subsample and level of the model preconditioner (None: :func:`resolve_subsample`'s
        defaults, ``min(M, 2000, budget side)``, and ``s - 1`` when that is every center, else ``s // 10``).
    epochs:
        ``"eigenpro2"``: inner epochs per projection.
    generator:
        The fit's generator (subsample and batch order of the inner epochs).
    """

    def __init__(
        self,
        kop: KernelOpFactory,
        Z: Tensor,
        kind: str,
        s: int | None,
        q: int | None,
        epochs: int,
        generator: torch.Generator,
    ):
        self.kop, self.Z, self.kind = kop, Z, kind
        self.count = 0
        self.inner: EigenPro2Projection | None = None
        self.exact: CholeskyProjection | None = None
        self.s = self.q = None
        if kind == "cholesky":
            self.exact = CholeskyProjection(kop, Z)
            return
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

    @property
    def batch(self) -> int | None:
        """The inner solver's batch (rows of ``K(Z, Z)`` per inner step); None for the exact solve."""
        return None if self.inner is None else self.inner.state.batch

    def solve(self, h: Tensor) -> Tensor:
        """``v ~ K(Z, Z)^{-1} h``: the factor's two triangular solves, or ``epochs`` inner epochs from 0."""
        self.count += 1
        return (self.exact or self.inner).solve(h)

    def residual(self, v: Tensor, h: Tensor) -> Tensor:
        """``h - K(Z, Z) v`` for ``v = solve(h)``: ``jitter v`` after the exact solve of ``(K(Z, Z) + jitter I) v = h``;
        after the inner epochs, ``K(Z, Z) v`` with its exact diagonal, streamed (natively on a CPU, where the
        square operator runs its blocked pass)."""
        if self.exact is not None:
            return v.mul(self.exact.jitter)
        return self.kop(self.Z, self.Z).residual_matmul(v.neg(), h, transpose=False)[0]
