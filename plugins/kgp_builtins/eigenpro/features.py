r"""EigenPro 3's whitened features ``Phi = K(X, Z) L^{-T}``, kept for the whole fit when they fit the budget.

With ``K(Z, Z) + jitter I = L L^T`` (the Cholesky projection) and the whitened coefficients ``b = L^T alpha``,
a minibatch step of ``correction="projected"`` needs ``g = K(X_m, Z) alpha - y_m = Phi_m b - y_m`` and the
whitened gradient ``L^{-1} K(Z, X_m) g = Phi_m^T g``: two products with ``m`` rows of ``Phi`` instead of a
kernel block and two triangular solves with ``L`` per step. Forming ``Phi`` costs one kernel pass over the
data and one triangular solve with ``n`` right-hand sides (``n p^2`` flops, once), the same work as
``2 n / m`` of the steps' solves; a fit of ``E`` epochs takes ``E n / m`` steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp import settings
from kgp.denormals import flush_denormals
from kgp.operators.blocks import row_slices

from .nystrom import KernelOpFactory

__all__ = ["whitened_features"]


def whitened_features(kop: KernelOpFactory, X: Tensor, Z: Tensor, L: Tensor) -> Tensor | None:
    """``Phi = K(X, Z) L^{-T}`` (``n x p``, ``X``'s dtype), or None where it is not kept.

    Kept under ``kgp.settings.kernel_cache("auto")`` (the solver's ``kernel_cache`` option, default
    ``"auto"``, sets it for the fit) when ``Phi`` and one kernel block of the same size fit
    ``kgp.settings.memory_budget``; never under ``"never"``. The solve runs in ``L``'s dtype under
    flush-to-zero (:func:`kgp.denormals.flush_denormals`): forward substitution with small kernel entries
    otherwise builds subnormal chains (:func:`kgp.linalg.solve_lower_wide`), which flushing removes at no
    cost to the accuracy the iteration has (float32 kernel blocks). Where that mode cannot be set on the
    CPU, None: the steps' own solves flush as they go.

    Parameters
    ----------
    kop : KernelOpFactory
        The problem's kernel operator factory, ``kop(A, B)`` is ``K(A, B)``.
    X : Tensor
        Training rows (``n x d``).
    Z : Tensor
        Centers (``p x d``).
    L : Tensor
        Lower Cholesky factor of ``K(Z, Z) + jitter I`` (``p x p``), the projection's.
    """
    if settings.kernel_cache.value() != "auto":
        return None
    n, p = X.shape[0], Z.shape[0]
    itemsize = X.element_size()
    budget = settings.memory_budget.value(X.device)
    rows = max(1, min(n, budget // (2 * itemsize * max(p, 1)), 4096))
    if (n + rows) * p * itemsize > budget:
        return None
    phi = torch.empty(n, p, dtype=X.dtype, device=X.device)
    upper = L.mT
    with torch.no_grad(), flush_denormals() as flushing:
        if not flushing and X.device.type == "cpu":
            return None  # no flush-to-zero here: the steps' own solves flush as they go
        for block in row_slices(0, n, rows):
            Kb = kop(X[block], Z).to_dense()
            # Phi_b L^T = K(X_b, Z)
            phi[block] = torch.linalg.solve_triangular(upper, Kb, upper=True, left=False)
    return phi
