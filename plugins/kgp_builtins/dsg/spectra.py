"""Spectral measures of shift-invariant kernels and the per-step seeds of random Fourier features.

Bochner's theorem (Dai et al., NIPS 2014, Thm. 2; Rahimi & Recht 2007): a continuous shift-invariant
kernel with ``k(x, x) = s`` is ``s E_omega,b[2 cos(omega^T x + b) cos(omega^T x' + b)]`` with
``omega`` drawn from the kernel's normalised spectral density and ``b ~ U[0, 2 pi]``. This module
draws ``(omega, b)`` for the RBF and Matern(1/2, 3/2, 5/2) kernels, always from a seeded generator,
so that the same features can be drawn again at predict time (Algorithm 2) instead of being stored.
"""

from __future__ import annotations

import math

import gpytorch
import torch
from torch import Tensor

from kgp.kernels import kernel_parameters

__all__ = ["SpectralSampler", "spectral_sampler", "step_seed"]

_MASK64 = (1 << 64) - 1
_TWO_PI = 2.0 * math.pi
# Chi-square degrees of freedom 2 nu of the multivariate Student-t spectral density of Matern nu.
_MATERN_DOF = {"matern12": 1, "matern32": 3, "matern52": 5}


def step_seed(seed: int, step: int) -> int:
    """Seed of step ``step`` (1-based) derived from the model seed by SplitMix64 mixing.

    Distinct steps get unrelated 64-bit seeds; the same (seed, step) always gives the same value,
    which is what makes Algorithm 2 (predict) regenerate the features Algorithm 1 used.
    """
    z = (int(seed) + int(step) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SpectralSampler:
    r"""Spectral measure of a shift-invariant GPyTorch kernel (Bochner, Dai et al. Thm. 2).

    ``k(x, x') = s E[2 cos(omega^T x + b) cos(omega^T x' + b)]`` with ``b ~ U[0, 2 pi]`` and
    ``omega = z / lengthscale`` (per dimension for ARD), where z is drawn from

    - ``rbf``: N(0, I_d) (the density of exp(-||u||^2 / 2));
    - ``matern12`` / ``matern32`` / ``matern52``: the multivariate Student-t with ``2 nu`` degrees of
      freedom, ``z = g / sqrt(u / (2 nu))``, ``g ~ N(0, I_d)``, ``u ~ chi^2_{2 nu}`` (one u per
      feature). The Matern density with Euclidean distance is proportional to
      ``(2 nu + ||z||^2)^{-(nu + d/2)}`` (Rasmussen & Williams eq. 4.15). For nu = 1/2, GPyTorch's
      ``exp(-||x - x'|| / l)`` (Euclidean norm), this is the multivariate Cauchy, *not* a product of
      d one-dimensional Cauchys, which belongs to ``exp(-||x - x'||_1 / l)``.

    Parameters
    ----------
    family:
        ``rbf``, ``matern12``, ``matern32`` or ``matern52``.
    lengthscale:
        Length-1 or length-d tensor.
    outputscale:
        s = k(x, x).
    """

    def __init__(self, family: str, lengthscale: Tensor, outputscale: float):
        if family not in ("rbf", *_MATERN_DOF):
            raise ValueError(f"SpectralSampler: unknown family {family!r}")
        self.family = family
        self.lengthscale = lengthscale.detach().reshape(-1)
        self.outputscale = float(outputscale)

    def sample(self, seed: int, d: int, r: int) -> tuple[Tensor, Tensor]:
        """Draw the unscaled frequencies ``z`` (d x r) and phases ``b`` (r) from one seeded generator.

        Always drawn in float64 on the CPU, so the features do not depend on the dtype or device
        they are later evaluated in.
        """
        gen = torch.Generator().manual_seed(int(seed))
        z = torch.randn(d, r, generator=gen, dtype=torch.float64)
        b = torch.rand(r, generator=gen, dtype=torch.float64).mul_(_TWO_PI)
        dof = _MATERN_DOF.get(self.family)
        if dof is not None:
            g = torch.randn(dof, r, generator=gen, dtype=torch.float64)
            u = g.square().sum(dim=0)  # chi^2 with an integer number 2 nu of degrees of freedom
            z.mul_(torch.rsqrt(u / dof))
        return z, b

    def scale_inputs(self, X: Tensor) -> Tensor:
        """``X / lengthscale`` in X's dtype and device (so that ``omega^T x = z^T (x / l)``)."""
        ls = self.lengthscale.to(device=X.device, dtype=X.dtype)
        if ls.numel() not in (1, X.shape[1]):
            raise ValueError(f"kernel lengthscale has {ls.numel()} entries but X has {X.shape[1]} features")
        return X / ls.reshape(1, -1)


def spectral_sampler(kernel: gpytorch.kernels.Kernel) -> SpectralSampler:
    """Return the spectral sampler of an RBF / Matern(1/2, 3/2, 5/2) kernel, optionally in a ScaleKernel.

    Raises
    ------
    TypeError
        If ``kernel`` is not a GPyTorch kernel.
    ValueError
        For a kernel without a spectral sampler (not shift-invariant, other Matern nu, ``active_dims``,
        batch shapes, sums / products), naming the kernel.
    """
    params = kernel_parameters(kernel)
    if params.family not in ("rbf", *_MATERN_DOF):
        raise ValueError(
            f"solver 'dsg': kernel {type(kernel).__name__} has no spectral sampler; random features are "
            "implemented for RBFKernel (incl. ARD) and MaternKernel(nu=0.5, 1.5, 2.5), optionally wrapped in "
            "one ScaleKernel, without active_dims or batch shapes"
        )
    return SpectralSampler(params.family, params.shape, params.outputscale)
