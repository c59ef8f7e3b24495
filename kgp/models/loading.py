"""Load a saved estimator: read the file (:mod:`kgp.io`), validate it, pick the estimator class, rebuild it.

Nothing in a model file is trusted: after :func:`kgp.io.read_model` (format, version, checksum)
:func:`load` checks every entry it uses before allocating anything it sizes (types, ranges, shapes,
finite tensors: :func:`kgp.models.persistence.check_contents` and :meth:`kgp.Posterior.from_state`),
rebuilds the estimator, and checks that its mean at the two probe rows recorded in the file is the
one recorded at save time, so that a tampered or inconsistent file fails here with one
:class:`kgp.io.ModelFileError` naming the entry instead of predicting garbage later.
"""

from __future__ import annotations

import os

import torch

from .. import io
from ..fitting.plan import check_device
from ..io import ModelFileError
from .base import BaseKernelModel
from .classifier import KernelClassifier
from .persistence import check_contents, check_probe, model_from_state
from .regressor import KernelRegressor
from .upgrade import upgrade

__all__ = ["ModelFileError", "load"]

_ESTIMATORS: dict[str, type[BaseKernelModel]] = {
    "KernelRegressor": KernelRegressor,
    "KernelClassifier": KernelClassifier,
}


def load(path: str | os.PathLike, *, device: str | torch.device | None = None) -> BaseKernelModel:
    """Load a model saved with ``model.save(path)``.

    Parameters
    ----------
    path:
        Model file.
    device:
        Device to place tensors on (default CPU).

    Raises
    ------
    FileNotFoundError
        If there is no such file.
    ModelFileError
        (a ValueError) If the file is empty, truncated, not a kgp model, holds Python objects,
        was changed after saving, is inconsistent (shapes, dtypes, non-finite values, noise <= 0,
        a kernel spec that does not fit its hyperparameters, a mean at the probe rows that differs
        from the recorded one...), or the solver / predictor plugin that made it is not installed (the
        message names it).
    """
    target = check_device(device) or torch.device("cpu")  # an absent device fails here, naming it
    try:
        state = io.read_model(path)
    except RecursionError:
        raise ModelFileError(f"{path}: invalid model file: its contents are nested too deeply") from None
    name = state.get("estimator")
    estimator = _ESTIMATORS.get(name) if isinstance(name, str) else None
    if estimator is None:
        raise ModelFileError(f"{path}: unknown estimator {state.get('estimator')!r}")
    upgraded = state.get("format_version", 0) < 3
    if upgraded:
        state = upgrade(state)
    check_contents(state, path, upgraded=upgraded)
    try:
        model = model_from_state(estimator, state, path, target)
    except ModelFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        message = io.one_line(exc)
        if message.startswith(str(path)):  # already names the file (e.g. a plugin that is not installed)
            raise ModelFileError(message) from None
        raise ModelFileError(f"{path}: inconsistent model file: {type(exc).__name__}: {message}") from None
    check_probe(model, state, path)
    return model
