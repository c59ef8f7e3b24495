"""Load a saved estimator: read the file (:mod:`kgp.io`), validate it, pick the estimator class, rebuild it.

Nothing in a model file is trusted: after :func:`kgp.io.read_model` (format, version, checksum)
:func:`load` checks every entry it uses (types, ranges, finite tensors), rebuilds the estimator,
and probes the rebuilt predictor on two points (it must return finite values of the saved output
shape), so that a tampered or inconsistent file fails here with one :class:`kgp.io.ModelFileError`
instead of predicting garbage later.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from .. import io
from ..io import ModelFileError
from .base import BaseKernelModel
from .classifier import KernelClassifier
from .regressor import KernelRegressor

__all__ = ["ModelFileError", "load"]

_ESTIMATORS: dict[str, type[BaseKernelModel]] = {
    "KernelRegressor": KernelRegressor,
    "KernelClassifier": KernelClassifier,
}
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


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
        a kernel spec that does not fit its hyperparameters...), or the solver / predictor plugin
        that made it is not installed (the message names it).
    """
    state = io.read_model(path)
    estimator = _ESTIMATORS.get(state.get("estimator"))
    if estimator is None:
        raise ModelFileError(f"{path}: unknown estimator {state.get('estimator')!r}")
    _check_contents(state, path)
    target = torch.device(device) if device is not None else torch.device("cpu")
    try:
        model = estimator._from_state(state, path, target)
    except ModelFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        message = io.one_line(exc)
        if message.startswith(str(path)):  # already names the file (e.g. a plugin that is not installed)
            raise ModelFileError(message) from None
        raise ModelFileError(f"{path}: inconsistent model file: {type(exc).__name__}: {message}") from None
    _probe(model, path)
    return model


def _fail(path, where: str, what: str) -> ModelFileError:
    return ModelFileError(f"{path}: invalid model file: {where} {what}")


def _check_contents(state: dict[str, Any], path) -> None:
    """Types and ranges of every entry that :meth:`BaseKernelModel._from_state` reads."""
    for key, kind in (
        ("params", dict),
        ("kernel_spec", dict),
        ("kernel_state", dict),
        ("solver", str),
        ("predictor_kind", str),
        ("predictor_state", dict),
        ("fitted", dict),
    ):
        if not isinstance(state.get(key), kind):
            raise _fail(path, key, f"is missing or not a {kind.__name__} (got {type(state.get(key)).__name__})")
    params, fitted = state["params"], state["fitted"]
    noise = params.get("noise")
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise <= 0:
        raise _fail(path, "params.noise", f"must be a finite positive number, got {noise!r}")
    scale = params.get("lengthscale")
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        raise _fail(path, "params.lengthscale", f"must be None or a finite positive number, got {scale!r}")
    if params.get("dtype") not in _DTYPES:
        raise _fail(path, "params.dtype", f"must be one of {', '.join(_DTYPES)}, got {params.get('dtype')!r}")
    n_features = fitted.get("n_features_in")
    if isinstance(n_features, bool) or not isinstance(n_features, int) or n_features < 1:
        raise _fail(path, "fitted.n_features_in", f"must be a positive integer, got {n_features!r}")
    if not isinstance(fitted.get("seed"), int):
        raise _fail(path, "fitted.seed", f"must be an integer, got {fitted.get('seed')!r}")
    names = fitted.get("feature_names")
    if names is not None and (
        not isinstance(names, list) or len(names) != n_features or not all(isinstance(n, str) for n in names)
    ):
        raise _fail(path, "fitted.feature_names", f"must be {n_features} strings (one per feature)")
    if state["estimator"] == "KernelClassifier":
        classes = fitted.get("classes")
        if not isinstance(classes, list) or len(classes) < 2 or len(set(map(repr, classes))) != len(classes):
            raise _fail(path, "fitted.classes", f"must be a list of at least 2 distinct labels, got {classes!r}")
    else:
        outputs = fitted.get("n_outputs")
        if isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 1:
            raise _fail(path, "fitted.n_outputs", f"must be a positive integer, got {outputs!r}")
        if fitted.get("y_ndim") not in (1, 2) or (fitted.get("y_ndim") == 1 and outputs != 1):
            raise _fail(path, "fitted.y_ndim", f"must be 1 (one output) or 2, got {fitted.get('y_ndim')!r}")
    for where, tensor in _tensors(state):
        if not tensor.is_floating_point():
            continue
        if bool(torch.isnan(tensor).any()):
            raise _fail(path, where, "contains NaN values")
        # GPyTorch stores constraint bounds (e.g. an upper bound of +inf) as buffers: infinity is valid there only
        if "_constraint." not in where and not bool(torch.isfinite(tensor).all()):
            raise _fail(path, where, "contains infinite values")


def _tensors(value: Any, where: str = ""):
    if torch.is_tensor(value):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")


def _probe(model: BaseKernelModel, path) -> None:
    """The rebuilt predictor must map two points to finite values of the saved output shape."""
    outputs = getattr(model, "n_outputs_", None)
    if outputs is None:  # classifier: one score for two classes, one per class otherwise
        outputs = 1 if len(model.classes_) == 2 else len(model.classes_)
    X = torch.zeros(2, model.n_features_in_, dtype=model.dtype_, device=model.device_)
    try:
        with torch.no_grad():
            out = model.predictor_.predict(X)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise ModelFileError(
            f"{path}: inconsistent model file: its predictor fails on {model.n_features_in_} features "
            f"({type(exc).__name__}: {io.one_line(exc)})"
        ) from None
    out = out.unsqueeze(-1) if out.dim() == 1 else out
    if tuple(out.shape) != (2, outputs):
        raise ModelFileError(
            f"{path}: inconsistent model file: the predictor gives {out.shape[-1]} output(s), the estimator "
            f"records {outputs}"
        )
    if not bool(torch.isfinite(out).all()):
        raise ModelFileError(f"{path}: inconsistent model file: the predictor gives non-finite values")
