"""Entry-by-entry checks of a stored :class:`kgp.Posterior` state (a model file's ``posterior``), and the
tensor moves its persistence needs; every failure is a :class:`PosteriorStateError` naming the entry."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .variance import VarianceFactors

__all__ = ["PosteriorStateError"]


class PosteriorStateError(ValueError):
    """A saved posterior state that cannot be used; the message names the entry and what was expected."""


def _factors_from_state(
    check: _Checker, raw: Any, kind: str, n_features: int, device: torch.device, dtype: torch.dtype
) -> VarianceFactors:
    state = check.mapping(raw, "variance.factors")
    if state.get("kind") != kind:
        raise PosteriorStateError(
            f"posterior.variance.factors.kind: expected {kind!r} (the variance kind), got {state.get('kind')!r}"
        )
    points = check.points(state.get("points"), "variance.factors.points", cols=n_features)
    p = points.shape[0]
    chol = check.matrix(state.get("chol"), "variance.factors.chol", rows=p, cols=p)
    _check_cholesky(chol, "variance.factors.chol")
    chol_s = None
    if kind == "nystrom":
        chol_s = check.matrix(state.get("chol_s"), "variance.factors.chol_s", rows=p, cols=p)
        _check_cholesky(chol_s, "variance.factors.chol_s")
    noise = check.positive_number(state.get("noise"), "variance.factors.noise")
    # a float32 model's Nystrom factors are float64 (kgp.variance): keep what the file holds if it is wider
    work = torch.float64 if kind == "nystrom" and chol.dtype == torch.float64 else dtype
    to = {"device": device, "dtype": work}
    return VarianceFactors(kind, points.to(**to), chol.to(**to), None if chol_s is None else chol_s.to(**to), noise)


def _check_cholesky(L: Tensor, where: str) -> None:
    """A lower Cholesky factor: lower triangular with a positive diagonal (a zero one would give NaN)."""
    if not bool((L.diagonal() > 0).all()):
        raise PosteriorStateError(f"posterior.{where}: expected a Cholesky factor with a positive diagonal")
    if bool(torch.triu(L, diagonal=1).ne(0).any()):
        raise PosteriorStateError(f"posterior.{where}: expected a lower-triangular Cholesky factor")


class _Checker:
    """Entry checks with messages naming the entry as ``posterior.<path>``."""

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
        if not bool(torch.isfinite(value).all()):
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


def _cpu(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().cpu()
