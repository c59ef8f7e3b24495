"""Per-iteration reporting for iterative solvers: callback, validation metric, progress bar."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["IterationInfo", "Monitor"]


@dataclass(frozen=True)
class IterationInfo:
    """What a solver reports after one iteration (or epoch).

    Attributes
    ----------
    iteration:
        1-based iteration (or epoch) number.
    elapsed:
        Seconds since the solver started.
    metric:
        Validation metric (mean squared error for regression, error rate for classification) on the
        held-out data given to ``fit(..., validation_data=...)``, else None.
    extras:
        Solver-specific values (e.g. residual norm).
    """

    iteration: int
    elapsed: float
    metric: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Monitor:
    """Collects iteration reports; a solver calls :meth:`step` once per iteration.

    Parameters
    ----------
    callback:
        ``callback(info: IterationInfo) -> bool | None``; returning True stops the solver.
    progress:
        Show a tqdm progress bar.
    validation:
        ``(X_val, y_val)`` tensors; with a predictor given to :meth:`step`, the metric is computed.
    metric:
        ``metric(predictions, y_val) -> float``.
    """

    def __init__(
        self,
        callback: Callable[[IterationInfo], bool | None] | None = None,
        progress: bool = False,
        validation: tuple[Tensor, Tensor] | None = None,
        metric: Callable[[Tensor, Tensor], float] | None = None,
    ):
        self.callback = callback
        self.progress = progress
        self.validation = validation
        self.metric = metric or _mse
        self.history: list[IterationInfo] = []
        self._start: float | None = None
        self._bar = None

    @property
    def wants_predictor(self) -> bool:
        """Whether :meth:`step` will use a predictor (skip building one otherwise)."""
        return self.validation is not None

    def start(self, total: int | None = None, desc: str = "kgp") -> None:
        """Start the clock (and the bar with ``total`` steps); called by the solver before iterating."""
        self._start = time.perf_counter()
        self.history = []
        if self.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, leave=False)

    def step(self, iteration: int, predictor=None, **extras: Any) -> bool:
        """Report one iteration; return True if the solver should stop.

        ``predictor`` may be a predictor or a zero-argument function returning one (built only
        if validation data are present).
        """
        if self._start is None:
            self.start()
        metric = self._validation_metric(predictor)
        info = IterationInfo(iteration, time.perf_counter() - self._start, metric, dict(extras))
        self.history.append(info)
        if self._bar is not None:
            self._bar.update(1)
            # what a user watches: the learning objective and noise, the solver's residual, the metric
            shown = {k: extras[k] for k in _SHOWN if isinstance(extras.get(k), (int, float))}
            if metric is not None:
                shown["metric"] = metric
            if shown:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()})
        stop = bool(self.callback(info)) if self.callback is not None else False
        return stop

    def _validation_metric(self, predictor) -> float | None:
        """The metric on the validation data (None without them or without a predictor)."""
        if self.validation is None or predictor is None:
            return None
        current = predictor() if callable(predictor) and not hasattr(predictor, "predict") else predictor
        X_val, y_val = self.validation
        with torch.no_grad():
            return float(self.metric(current.predict(X_val), y_val))

    @contextlib.contextmanager
    def stage(self, desc: str):
        """A bar without a step count (elapsed time only) for work that reports no iterations, e.g.
        the variance pass of a GP fit (tens of seconds at large M that would otherwise show nothing)."""
        if not self.progress:
            yield
            return
        from tqdm.auto import tqdm

        self.close()
        bar = tqdm(total=None, desc=desc, leave=False, bar_format="{desc}: {elapsed}")
        try:
            yield
        finally:
            bar.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_SHOWN = ("objective", "noise", "residual")


def _mse(pred: Tensor, target: Tensor) -> float:
    return float(((pred.reshape(target.shape) - target) ** 2).mean())
