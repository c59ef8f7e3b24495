"""Load a saved estimator: read the file (:mod:`kgp.io`), pick the estimator class, rebuild it."""

from __future__ import annotations

import os

import torch

from .. import io
from .base import BaseKernelModel
from .classifier import KernelClassifier
from .regressor import KernelRegressor

__all__ = ["load"]

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
    ValueError
        If the file is not a kgp model, or the solver / predictor plugin that made it is not
        installed (the message names it).
    """
    state = io.read_model(path)
    estimator = _ESTIMATORS.get(state.get("estimator"))
    if estimator is None:
        raise ValueError(f"{path}: unknown estimator {state.get('estimator')!r}")
    return estimator._from_state(state, path, torch.device(device) if device is not None else torch.device("cpu"))
