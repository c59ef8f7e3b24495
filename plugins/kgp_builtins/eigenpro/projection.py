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

from kgp.linalg import LowerFactor, NotPSDError, flush_below_scale, psd_cholesky

from .ep2 import ep2_epoch, ep2_setup
from .nystrom import KernelOpFactory

__all__ = ["CholeskyProjection", "EigenPro2Projection"]


def _spectral_norm(S: Tensor, iterations: int = 30) -> float:
    """Largest |eigenvalue| of a symmetric matrix by power iteration (a full SVD took 300 s at p = 4,700)."""
    v = torch.ones(S.shape[0], 1, dtype=S.dtype, device=S.device) / S.shape[0] ** 0.5
    est = 0.0
    for _ in range(iterations):
        w = S @ v
        est = float(w.norm())
        if est == 0.0:
            return 0.0
        v = w / est
    return est


class CholeskyProjection:
    """Exact ``K(Z, Z)^{-1} h`` by the Cholesky factor of ``K(Z, Z) + jitter I``.

    ``jitter`` is the smallest of ``10^k eps max_i K_ii`` (k = 1, 2, ...) that factorises, at most
    ``1e-2 max_i K_ii``; beyond that :class:`kgp.linalg.NotPSDError` (duplicated centers). The jitter
    is kept: :meth:`solve_ridge` removes it from the ridge term exactly.
    """

    kind = "cholesky"

    def __init__(self, kop: KernelOpFactory, Z: Tensor):
        # K(Z, Z) is evaluated and factored in float64 whatever the input dtype, the factor cast back:
        # the float32 kernel evaluation ((||x||^2 + ||z||^2 - 2 x.z) after scaling by short ARD
        # lengthscales) was off by 3e-4 = 0.45% of the outputscale on UCI parkinsons (M = 4,700), an
        # indefinite matrix (lowest eigenvalue -1.2e-3, float64: +2.2e-8) that no jitter up to 1% factored.
        # Cost: the float64 Cholesky at p = 5,000 takes 0.47 s against 0.28 s (shared/notes/machine.md).
        dtype = Z.dtype
        K = kop(Z.double(), Z.double()).to_dense()
        K = 0.5 * (K + K.mT)
        scale = float(K.diagonal().max())
        # entries below 2^-511 of the scale have subnormal products in the Cholesky's GEMMs (UCI parkinsons,
        # float32 fit, p = 4,700: a 19 s factorization); zeroed, they change K by under 1e-150 of its scale
        flush_below_scale(K, scale)
        # Always some jitter, from 10 eps up, instead of psd_cholesky's plain first try: the one-jitter
        # loop below keeps the schedule (and results) of the hand-written factorisation it replaced,
        # and tells solve_ridge which jitter was added.
        jitter = 10 * torch.finfo(dtype).eps * scale
        if dtype != torch.float64:
            # The iteration's gradients use the kernel evaluated in the input dtype: K(Z, Z) is known to
            # that precision only, and directions below it are noise that L^{-1} amplified (UCI parkinsons,
            # float32: divergence at epoch 4). The jitter starts at the spectral norm of the evaluation
            # error instead (1e-3 = 1.5% of the outputscale there, 1e-7 relative on standardised RBF inputs).
            E = kop(Z, Z).to_dense().double() - K
            jitter = max(jitter, _spectral_norm(0.5 * (E + E.mT)))
        while True:
            A = K.clone()
            A.diagonal().add_(jitter)
            last = jitter * 10 > max(1e-2 * scale, jitter)
            try:
                L = psd_cholesky(
                    A,
                    max_tries=0,
                    what=f"K(Z, Z) + {jitter:.1e} I of the eigenpro centers (in float64)",
                    remedy="are centers duplicated (or not finite)? Remove them",
                )
                break
            except NotPSDError:
                if last:
                    raise
            jitter *= 10
        self.L = L.to(dtype)
        self.jitter = jitter
        self._factor: LowerFactor | None = None

    @property
    def factor(self) -> LowerFactor:
        """``L`` prepared for the per-batch solves (:mod:`kgp.linalg.lower_factor`; one column with passive threads:
        0.2-0.3x LAPACK's time at p = 4,000). Built at the first solve, after a distributed fit has
        replicated ``L`` in place."""
        if self._factor is None:
            self._factor = LowerFactor(self.L)
        return self._factor

    def solve(self, h: Tensor) -> Tensor:
        # two solve_triangular calls, not cholesky_solve: at p = 5000 (1 right-hand side) cholesky_solve
        # took 118 ms against 2 x 5 ms here (it copies the factor into LAPACK's layout on every call)
        return self.factor.solve(self.factor.solve(h), transpose=True)

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
