"""Model files: plain tensors and values, loadable with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .kernels.serialize import kernel_from_spec, kernel_to_spec
from .registry import UnknownPluginError, get_predictor_class, get_solver

__all__ = ["load", "save_model"]

FORMAT = "kgp-model"
FORMAT_VERSION = 1
_PLAIN_PARAMS = ("lengthscale", "noise", "solver", "n_centers", "solver_options", "selector_options", "random_state")


def save_model(model, path: str | os.PathLike) -> None:
    """Save a fitted :class:`~kgp.KernelRegressor` / :class:`~kgp.KernelClassifier`.

    The file holds the kernel's class description and hyperparameters, the solver plugin name,
    the predictor's kind and tensors, and the estimator's plain parameters. Callbacks and
    explicit center arrays given as parameters are not stored (the fitted centers are, inside the
    predictor).
    """
    model._check_fitted()
    params = {name: getattr(model, name) for name in _PLAIN_PARAMS}
    params["kernel"] = model.kernel if isinstance(model.kernel, str) else None
    params["centers"] = model.centers if isinstance(model.centers, str) else None
    params["dtype"] = str(model.dtype_).replace("torch.", "")
    fitted: dict[str, Any] = {
        "n_features_in": int(model.n_features_in_),
        "seed": int(model.seed_),
    }
    if hasattr(model, "classes_"):
        fitted["classes"] = model.classes_.tolist()
    else:
        fitted["y_ndim"] = int(model._y_ndim)
        fitted["n_outputs"] = int(model.n_outputs_)
    if model.center_weights_ is not None:
        fitted["center_weights"] = model.center_weights_.detach().cpu()
    state = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "estimator": type(model).__name__,
        "params": params,
        "kernel_spec": kernel_to_spec(model.kernel_),
        "kernel_state": {k: v.detach().cpu() for k, v in model.kernel_.state_dict().items()},
        "solver": model.solver_name_,
        "predictor_kind": model.predictor_.kind,
        "predictor_state": model.predictor_.state_dict(),
        "fitted": fitted,
    }
    torch.save(state, path)


def load(path: str | os.PathLike, *, device: str | torch.device | None = None):
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
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kgp model file")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: model format version {state.get('format_version')} is not supported")
    from .models import KernelClassifier, KernelRegressor

    solver_name = state["solver"]
    try:
        get_solver(solver_name)
        predictor_cls = get_predictor_class(state["predictor_kind"])
    except UnknownPluginError as exc:
        raise ValueError(
            f"{path}: this model was fitted by solver {solver_name!r} (predictor kind "
            f"{state['predictor_kind']!r}), which is not installed here: {exc}"
        ) from exc
    estimators = {"KernelRegressor": KernelRegressor, "KernelClassifier": KernelClassifier}
    if state["estimator"] not in estimators:
        raise ValueError(f"{path}: unknown estimator {state['estimator']!r}")
    params = dict(state["params"])
    dtype = getattr(torch, params.pop("dtype"))
    device = torch.device(device) if device is not None else torch.device("cpu")
    # convert before loading: a float32 kernel would round float64 hyperparameters
    kernel = kernel_from_spec(state["kernel_spec"]).to(device=device, dtype=dtype)
    kernel.load_state_dict(state["kernel_state"])
    model = estimators[state["estimator"]](**{k: v for k, v in params.items() if k != "kernel"})
    model.kernel = params["kernel"] if params["kernel"] is not None else kernel
    model.dtype = dtype
    predictor_state = _to_device(state["predictor_state"], device, dtype)
    model.predictor_ = predictor_cls.from_state(predictor_state, kernel)
    fitted = state["fitted"]
    model.kernel_ = kernel
    model.solver_ = get_solver(solver_name)
    model.solver_name_ = solver_name
    model.n_features_in_ = fitted["n_features_in"]
    model.seed_ = fitted["seed"]
    model.dtype_ = dtype
    model.device_ = device
    model.centers_ = getattr(model.predictor_, "centers", None)
    weights = fitted.get("center_weights")
    model.center_weights_ = None if weights is None else weights.to(device=device, dtype=dtype)
    model.history_ = []
    if "classes" in fitted:
        model.classes_ = np.asarray(fitted["classes"])
    else:
        model._y_ndim = fitted["y_ndim"]
        model.n_outputs_ = fitted["n_outputs"]
    return model


def _to_device(value, device, dtype):
    """Move every tensor inside nested dicts / lists to ``device``; floating ones also to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, dtype) for v in value)
    return value
