"""The core predictor form: a kernel expansion over centers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import gpytorch
import torch
from torch import Tensor

from .hookspecs import hookimpl
from .operators import kernel_operator

__all__ = ["KernelExpansion"]


class KernelExpansion:
    r"""``f(x) = sum_j alpha_j k(x, z_j)`` with multi-output coefficients.

    Parameters
    ----------
    kernel:
        GPyTorch kernel.
    centers:
        ``M x d`` points z_j.
    alpha:
        ``M x k`` coefficients (a 1-D ``alpha`` is taken as k = 1).
    """

    kind: ClassVar[str] = "kernel_expansion"

    def __init__(self, kernel: gpytorch.kernels.Kernel, centers: Tensor, alpha: Tensor):
        if alpha.dim() == 1:
            alpha = alpha.unsqueeze(-1)
        if centers.dim() != 2 or alpha.shape[0] != centers.shape[0]:
            raise ValueError(
                f"KernelExpansion: centers {tuple(centers.shape)} and alpha {tuple(alpha.shape)} do not match"
            )
        self.kernel = kernel
        self.centers = centers
        self.alpha = alpha

    def predict(self, X: Tensor) -> Tensor:
        """Return ``K(X, centers) @ alpha`` (``n x k``), streamed in row blocks."""
        with torch.no_grad():
            return kernel_operator(self.kernel, X.to(self.centers), self.centers) @ self.alpha

    def state_dict(self) -> dict[str, Any]:
        return {"centers": self.centers.detach().cpu(), "alpha": self.alpha.detach().cpu()}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], kernel: gpytorch.kernels.Kernel) -> KernelExpansion:
        return cls(kernel, state["centers"], state["alpha"])

    def to(self, device=None, dtype=None) -> KernelExpansion:
        return KernelExpansion(
            self.kernel, self.centers.to(device=device, dtype=dtype), self.alpha.to(device=device, dtype=dtype)
        )

    def __repr__(self) -> str:
        m, k = self.alpha.shape
        return f"KernelExpansion(centers={m}, outputs={k})"


@hookimpl
def register_predictors(register) -> None:
    register(KernelExpansion.kind, KernelExpansion)
