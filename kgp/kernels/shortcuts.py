"""Build GPyTorch kernels from short names ("rbf", "laplacian", ...)."""

from __future__ import annotations

import gpytorch

__all__ = ["KERNEL_SHORTCUTS", "make_kernel"]

KERNEL_SHORTCUTS = ("rbf", "gaussian", "laplacian", "matern12", "matern32", "matern52", "linear")


def make_kernel(name: str, lengthscale: float | None = 1.0):
    """Return a GPyTorch kernel for a shortcut name.

    Parameters
    ----------
    name:
        ``"rbf"`` (alias ``"gaussian"``): exp(-||x - z||^2 / (2 l^2)), the papers' Gaussian kernel
        with sigma = l; ``"laplacian"`` (alias ``"matern12"``): exp(-||x - z|| / l);
        ``"matern32"``, ``"matern52"``; ``"linear"``: x . z (``lengthscale`` is ignored).
    lengthscale:
        Positive lengthscale (sigma in the papers); ``None`` keeps GPyTorch's initial value.

    Raises
    ------
    ValueError
        Unknown name or non-positive lengthscale.
    """
    if not isinstance(name, str) or name.lower() not in KERNEL_SHORTCUTS:
        raise ValueError(f"kernel: unknown shortcut {name!r}; expected a gpytorch kernel or one of {KERNEL_SHORTCUTS}")
    key = name.lower()
    if key == "linear":
        kernel = gpytorch.kernels.LinearKernel()
        kernel.variance = 1.0  # GPyTorch initialises softplus(0) = 0.69; the shortcut means plain x . z
        return kernel
    if lengthscale is not None:
        if isinstance(lengthscale, bool) or not isinstance(lengthscale, (int, float)) or not lengthscale > 0:
            raise ValueError(f"lengthscale: expected a positive number, got {lengthscale!r}")
    if key in ("rbf", "gaussian"):
        kernel = gpytorch.kernels.RBFKernel()
    else:
        nu = {"laplacian": 0.5, "matern12": 0.5, "matern32": 1.5, "matern52": 2.5}[key]
        kernel = gpytorch.kernels.MaternKernel(nu=nu)
    if lengthscale is not None:
        kernel.lengthscale = float(lengthscale)
    return kernel
