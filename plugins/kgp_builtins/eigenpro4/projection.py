r"""The delayed projection of EigenPro 4: the temporary part of the model re-expressed on the centers.

Every T steps the function's temporary part ``t = K(., X_s) c + K(., X_tmp) w`` is replaced by its
RKHS projection onto span K(., Z), whose coefficients solve ``K(Z, Z) v = t(Z) = h``. As in the
paper and its reference code, the solve is inexact: ``projection_epochs`` EigenPro 2.0 epochs on
``K(Z, Z)`` from 0 with the "model" Nystrom preconditioner on a subsample of Z (EigenPro 3 eq. 32),
kgp's :class:`~kgp_builtins.eigenpro.projection.EigenPro2Projection`. Its blocks are ``batch x M``
rows of ``K(Z, Z)`` within ``kgp.settings.memory_budget``: ``K(Z, Z)`` itself is never formed.

The error of an inexact solve changes the iterate, not the fixed point: the part of ``t`` that the
solve missed is dropped with the rest of the temporary part, and the next steps' gradients see it.

An inner step needs the batch's residual ``g = K(Z_b, Z) theta - h_b`` and the preconditioner's
``K(Z_s, Z_b) g``; Z_s is a subset of Z, so both come from the one block ``K(Z_b, Z)``, formed once by
:meth:`kgp.operators.KernelOperator.residual_matmul` (natively on a CPU: no block in memory, each kernel
entry evaluated once per inner epoch instead of once for each of the two products).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp_builtins.eigenpro.ep2 import EP2State
from kgp_builtins.eigenpro.nystrom import KernelOpFactory
from kgp_builtins.eigenpro.options import resolve_subsample
from kgp_builtins.eigenpro.projection import EigenPro2Projection

from .options import OWNER

__all__ = ["DelayedProjection", "inner_epoch"]


def inner_epoch(kop: KernelOpFactory, st: EP2State, theta: Tensor, targets: Tensor, generator: torch.Generator) -> None:
    r"""One EigenPro 2.0 epoch on ``(K(Z, Z) + shift I) theta = targets``, updating ``theta`` in place.

    The iteration of :func:`kgp_builtins.eigenpro.ep2.ep2_epoch` (EigenPro 3 eq. 32 with the model
    preconditioner; Lemma 5 with the batch Z_b: the preconditioned gradient stays in span K(., Z)): per batch,
    ``g = K'(Z_b, Z) theta - t_b``, ``theta_S += (eta_m / m) Q_s K'(Z_S, Z_b) g``, ``theta_b -= (eta_m / m) g``,
    with ``K' = K + shift delta`` and the exact ``k(z, z)`` where a row meets its own column. Both products
    come from one formation of ``K(Z_b, Z)`` (module docstring): ``K(Z_S, Z_b) g`` is the subsample's rows of
    ``K(Z_b, Z)^T g``. The batches are drawn from ``generator`` as ``ep2_epoch`` draws them.
    """
    N = st.points.shape[0]
    perm = torch.randperm(N, generator=generator).to(st.points.device)
    correct = st.pre.q > 0
    for start in range(0, N, st.batch):
        b = perm[start : start + st.batch]
        offset = -targets[b]
        if st.shift:  # the shift sits on the row's own entry: K'(Z_b, Z) theta = K(Z_b, Z) theta + shift theta_b
            offset.add_(theta[b], alpha=st.shift)
        g, kt = kop(st.points[b], st.points).residual_matmul(theta, offset, own_columns=b, transpose=correct)
        lr = st.lr_scale * st.step(b.shape[0]) / b.shape[0]
        if correct:
            ks = kt[st.pre.idx]
            if st.shift:  # ... and on K'(Z_S, Z_b)'s entries where a batch row is a subsample point
                pos = st.pos_in_s[b]
                inside = (pos >= 0).nonzero(as_tuple=True)[0]
                ks.index_add_(0, pos[inside], g[inside], alpha=st.shift)
            theta.index_add_(0, st.pre.idx, st.pre.apply(ks), alpha=lr)
        theta[b] -= lr * g


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
        """``v ~ K(Z, Z)^{-1} h``: ``epochs`` inner epochs (:func:`inner_epoch`) from 0."""
        self.count += 1
        theta = torch.zeros_like(h)
        for _ in range(self.inner.epochs):
            inner_epoch(self.inner.kop, self.inner.state, theta, h, self.inner.generator)
        return theta
