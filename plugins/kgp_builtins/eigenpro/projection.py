r"""The projection ``proj_Z`` of EigenPro 3.0 in coefficients: ``theta = K(Z, Z)^{-1} h`` (eq. 32).

- :class:`CholeskyProjection`: exact, by a Cholesky factor of ``K(Z, Z)`` (p^2 memory); kgp's default
  whenever the p x p matrix fits ``kgp.settings.memory_budget`` (on a CPU at p <= ~8k it is cheaper
  than an inner EigenPro 2.0 epoch per step).
- :class:`EigenPro2Projection`: inexact, by ``epochs`` EigenPro 2.0 epochs on Z from 0 with its own
  ("model") Nystrom preconditioner (the paper's choice, eq. 32 and Remark 4).

Both offer ``solve(h)`` and ``solve_ridge(h, alpha, sigma2) = K_ZZ^{-1}(h + sigma2 K_ZZ alpha)``, the
latter routed through the same (inexact or jittered) solve so that the fixed point of the outer
iteration stays exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .ep2 import ep2_epoch, ep2_setup
from .nystrom import KernelOpFactory

__all__ = ["CholeskyProjection", "EigenPro2Projection"]


class CholeskyProjection:
    """Exact ``K(Z, Z)^{-1} h`` (Cholesky with the smallest jitter that factorises)."""

    kind = "cholesky"

    def __init__(self, kop: KernelOpFactory, Z: Tensor):
        K = kop(Z, Z).to_dense()
        scale = float(K.diagonal().max())
        eps = torch.finfo(Z.dtype).eps
        jitter = 10 * eps * scale
        while True:
            A = K.clone()
            A.diagonal().add_(jitter)
            L, info = torch.linalg.cholesky_ex(A)
            if int(info) == 0:
                break
            jitter *= 10
            if jitter > 1e-2 * scale:
                raise ValueError("eigenpro: K(Z, Z) is not positive definite even with jitter; are centers duplicated?")
        self.L = L
        self.jitter = jitter

    def solve(self, h: Tensor) -> Tensor:
        return torch.cholesky_solve(h, self.L)

    def solve_ridge(self, h: Tensor, alpha: Tensor, sigma2: float) -> Tensor:
        """``K_ZZ^{-1}(h + sigma2 K_ZZ alpha)`` with ``K_ZZ = L L^T - jitter I`` exactly, in one solve."""
        if not sigma2:
            return self.solve(h)
        return self.solve(h - (sigma2 * self.jitter) * alpha).add_(alpha, alpha=sigma2)


class EigenPro2Projection:
    """Inexact ``K(Z, Z)^{-1} h`` by ``epochs`` EigenPro 2.0 epochs from 0 (EigenPro 3 eq. 32)."""

    kind = "eigenpro2"

    def __init__(self, kop: KernelOpFactory, Z: Tensor, s: int, q: int, epochs: int, generator: torch.Generator):
        self.kop = kop
        self.Z = Z
        self.epochs = epochs
        self.generator = generator
        self.state = ep2_setup(kop, Z, s, q, 0.0, None, 1.0, generator)

    def solve(self, h: Tensor) -> Tensor:
        theta = torch.zeros_like(h)
        for _ in range(self.epochs):
            ep2_epoch(self.kop, self.state, theta, h, self.generator)
        return theta

    def solve_ridge(self, h: Tensor, alpha: Tensor, sigma2: float) -> Tensor:
        # The ridge part goes through the same inexact solve, so that the fixed point stays exact.
        return self.solve(h + sigma2 * (self.kop(self.Z, self.Z) @ alpha) if sigma2 else h)
