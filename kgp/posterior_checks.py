"""Entry-by-entry checks of a stored :class:`kgp.Posterior` state (a model file's ``posterior``), and the
tensor moves its persistence needs; every failure is a :class:`PosteriorStateError` naming the entry."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .validation import all_finite

__all__ = ["PosteriorStateError", "StateChecker", "cpu_copy"]


class PosteriorStateError(ValueError):
    """A saved posterior state that cannot be used; the message names the entry and what was expected."""


class StateChecker:
    """Entry checks of a stored state, with messages naming the entry as ``<root>.<path>``."""

    def __init__(self, root: str):
        self.root = root

    def _where(self, path: str) -> str:
        return f"{self.root}.{path}" if path else self.root

    def mapping(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise PosteriorStateError(f"{self._where(path)}: expected a dict, got {type(value).__name__}")
        return value

    def positive_number(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise PosteriorStateError(f"{self._where(path)}: expected a finite positive number, got {value!r}")
        return float(value)

    def tensor(self, value: Any, path: str) -> Tensor:
        if not torch.is_tensor(value) or not value.is_floating_point():
            raise PosteriorStateError(f"{self._where(path)}: expected a floating-point tensor")
        if not all_finite(value):
            raise PosteriorStateError(f"{self._where(path)}: contains non-finite values")
        return value

    def vector(self, value: Any, path: str, lengths: tuple[int, ...]) -> Tensor:
        t = self.tensor(value, path)
        if t.dim() != 1 or t.shape[0] not in lengths:
            raise PosteriorStateError(
                f"{self._where(path)}: expected a vector of length {' or '.join(map(str, sorted(set(lengths))))}, "
                f"got shape {tuple(t.shape)}"
            )
        return t

    def matrix(self, value: Any, path: str, rows: int | None = None, cols: int | None = None) -> Tensor:
        t = self.tensor(value, path)
        if t.dim() != 2 or (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
            want = f"({rows if rows is not None else 'any'}, {cols if cols is not None else 'any'})"
            raise PosteriorStateError(f"{self._where(path)}: expected a matrix of shape {want}, got {tuple(t.shape)}")
        return t

    def points(self, value: Any, path: str, cols: int) -> Tensor:
        """Input rows of the kernel: a matrix whose rows' squared norms are finite in its dtype (the kernel's
        distances are formed from them; a row beyond that makes every kernel value with it NaN)."""
        t = self.matrix(value, path, cols=cols)
        if not bool(torch.isfinite(t.square().sum(dim=1)).all()):
            raise PosteriorStateError(
                f"{self._where(path)}: rows whose squared norm overflows {str(t.dtype).replace('torch.', '')} "
                f"(largest entry {float(t.abs().max()):.3g}); not the inputs of a fitted kernel"
            )
        return t


def cpu_copy(t: Tensor | None) -> Tensor | None:
    """``t`` detached and on the CPU (None stays None)."""
    return None if t is None else t.detach().cpu()
