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
    distance_dtype:
        Precision of the kernel's distance GEMM at prediction time (see :func:`kgp.kernel_operator`);
        None: the input dtype. A solver that found float32 distances too coarse for its problem
        (e.g. FALKON, docs/solvers/falkon.md) sets float64 here, so predictions are as accurate as
        the fit.
    """

    kind: ClassVar[str] = "kernel_expansion"

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel,
        centers: Tensor,
        alpha: Tensor,
        distance_dtype: torch.dtype | None = None,
    ):
        if alpha.dim() == 1:
            alpha = alpha.unsqueeze(-1)
        if centers.dim() != 2 or alpha.shape[0] != centers.shape[0]:
            raise ValueError(
                f"KernelExpansion: centers {tuple(centers.shape)} and alpha {tuple(alpha.shape)} do not match"
            )
        self.kernel = kernel
        self.centers = centers
        self.alpha = alpha
        self.distance_dtype = None if distance_dtype == centers.dtype else distance_dtype

    def predict(self, X: Tensor) -> Tensor:
        """Return ``K(X, centers) @ alpha`` (``n x k``), streamed in row blocks."""
        with torch.no_grad():
            op = kernel_operator(self.kernel, X.to(self.centers), self.centers, distance_dtype=self.distance_dtype)
            return op @ self.alpha

    def state_dict(self) -> dict[str, Any]:
        state = {"centers": self.centers.detach().cpu(), "alpha": self.alpha.detach().cpu()}
        if self.distance_dtype is not None:
            state["distance_dtype"] = str(self.distance_dtype).replace("torch.", "")
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any], kernel: gpytorch.kernels.Kernel) -> KernelExpansion:
        name = state.get("distance_dtype")
        if name not in (None, "float32", "float64"):
            raise ValueError(f"kernel_expansion state: unknown distance_dtype {name!r}")
        return cls(kernel, state["centers"], state["alpha"], None if name is None else getattr(torch, name))

    def to(self, device=None, dtype=None) -> KernelExpansion:
        return KernelExpansion(
            self.kernel,
            self.centers.to(device=device, dtype=dtype),
            self.alpha.to(device=device, dtype=dtype),
            self.distance_dtype,
        )

    def __repr__(self) -> str:
        m, k = self.alpha.shape
        return f"KernelExpansion(centers={m}, outputs={k})"


@hookimpl
def register_predictors(register) -> None:
    register(KernelExpansion.kind, KernelExpansion)
