"""Checks of the data arguments of `bless`, `bless_r` and the eq. 3 estimator (options: :mod:`.options`)."""

from __future__ import annotations

import math
from typing import Any

import gpytorch
import torch
from torch import Tensor

__all__ = ["as_generator", "check_inputs", "check_n_centers", "work_dtype"]


def check_inputs(X: Any, kernel: Any, lam: Any, *, allow_empty: bool = False) -> float:
    """``lam`` as a float after checking X, kernel and lam (``allow_empty``: a rank of a distributed
    selection may hold no rows)."""
    if not isinstance(X, Tensor):
        raise TypeError(f"X: expected a torch.Tensor (n x d), got {type(X).__name__}")
    if X.dim() != 2 or (X.shape[0] < 1 and not allow_empty):
        raise ValueError(f"X: expected a non-empty 2-D tensor (n x d), got shape {tuple(X.shape)}")
    if X.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"X: expected dtype float32 or float64, got {X.dtype}")
    if not isinstance(kernel, gpytorch.kernels.Kernel):
        raise TypeError(f"kernel: expected a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
    return _positive(lam, "lam")


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite positive number, got {value!r}")
    return float(value)


def check_n_centers(n_centers: Any, n: int) -> int | None:
    if n_centers is None:
        return None
    if isinstance(n_centers, bool) or not isinstance(n_centers, int):
        raise ValueError(f"n_centers: expected None or a positive integer, got {n_centers!r}")
    if not 1 <= n_centers <= n:
        raise ValueError(f"n_centers: expected 1 <= n_centers <= n_samples={n}, got {n_centers}")
    return n_centers


def as_generator(generator: torch.Generator | int | None) -> torch.Generator:
    if generator is None:
        return torch.Generator()  # torch's fixed default seed: reproducible
    if isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        return torch.Generator().manual_seed(generator)
    raise TypeError(f"generator: expected a torch.Generator, an int seed or None, got {type(generator).__name__}")


def work_dtype(X: Tensor, linalg_dtype: str) -> torch.dtype:
    return torch.float64 if linalg_dtype == "float64" else X.dtype
