r"""EigenPro 3's whitened features ``Phi = K(X, Z) L^{-T}``, kept for the whole fit when they fit the budget
and pay for themselves.

With ``K(Z, Z) + jitter I = L L^T`` (the Cholesky projection) and the whitened coefficients ``b = L^T alpha``,
a minibatch step of ``correction="projected"`` needs ``g = K(X_m, Z) alpha - y_m = Phi_m b - y_m`` and the
whitened gradient ``L^{-1} K(Z, X_m) g = Phi_m^T g``: two products with ``m`` rows of ``Phi`` instead of a
kernel block and two triangular solves with ``L`` per step. Forming ``Phi`` costs one kernel pass over the
data and one triangular solve with ``n`` right-hand sides (``n p^2`` flops, once); a fit of ``E`` epochs
takes ``E n / m`` steps of two solves each (:func:`features_pay`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kgp import settings
from kgp.linalg.subnormal import flush_denormals
from kgp.operators.blocks import row_slices

from .nystrom import KernelOpFactory

__all__ = ["SOLVE_BALANCE", "features_fit", "features_pay", "whitened_features"]

SOLVE_BALANCE = 25
"""Flops a triangular solve with few right-hand sides could do in the time it reads one entry of the factor:
the GEMM rate times the itemsize over the memory rate (2-core AMD EPYC host: float32
190 GFLOP/s x 4 B / 30 GB/s = 25, float64 98 x 8 / 30 = 26). A step's two solves with ``k`` columns cost
about ``2 p^2 max(k, SOLVE_BALANCE)`` flop-equivalents, ``Phi`` costs ``n p^2``."""


def features_fit(X: Tensor, p: int) -> bool:
    """Whether ``Phi`` (``n x p``) and one kernel block of the same size may be kept: ``kgp.settings.kernel_cache``
    is ``"auto"`` and they fit ``kgp.settings.memory_budget``."""
    if settings.kernel_cache.value() != "auto":
        return False
    n, itemsize = X.shape[0], X.element_size()
    budget = settings.memory_budget.value(X.device)
    return (n + _block_rows(n, p, itemsize, budget)) * p * itemsize <= budget


def features_pay(epochs: int, batch: int, k: int) -> bool:
    """Whether forming ``Phi`` (``n p^2`` flops) costs less than the solves it saves: ``E n / m`` steps of
    two solves with ``k`` columns, ``2 p^2 max(k, SOLVE_BALANCE)`` each, i.e. ``2 E max(k, 25) >= m``.

    Measured (15-set sweep, AMD EPYC host, every set with ``Phi`` against the per-step kernel blocks):
    kin40k (m = 589, k = 1; the rule: no) 1.04-1.06x the time, pumadyn32nm (m = 3,237: no) 1.02-1.12x,
    protein / tamielectric / keggdirected / pol / bike (m = 313-362: yes) 0.68-0.82x, letter (m = 459,
    k = 26: yes) 0.56x.
    """
    return 2 * epochs * max(k, SOLVE_BALANCE) >= batch


def _block_rows(n: int, p: int, itemsize: int, budget: int) -> int:
    return max(1, min(n, budget // (2 * itemsize * max(p, 1)), 4096))


def whitened_features(kop: KernelOpFactory, X: Tensor, Z: Tensor, L: Tensor) -> Tensor | None:
    """``Phi = K(X, Z) L^{-T}`` (``n x p``, ``X``'s dtype), or None where it is not kept.

    Kept under ``kgp.settings.kernel_cache("auto")`` (the solver's ``kernel_cache`` option, default
    ``"auto"``, sets it for the fit) when ``Phi`` and one kernel block of the same size fit
    ``kgp.settings.memory_budget``; never under ``"never"``. The solve runs in ``L``'s dtype under
    flush-to-zero (:func:`kgp.linalg.subnormal.flush_denormals`): forward substitution with small kernel entries
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
    n, p = X.shape[0], Z.shape[0]
    if not features_fit(X, p):
        return None
    rows = _block_rows(n, p, X.element_size(), settings.memory_budget.value(X.device))
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
