"""The model file format: plain tensors and values, loadable with ``torch.load(weights_only=True)``.

This module knows the container (format tag, version, how to read and write it), not the
estimators: :meth:`kgp.KernelRegressor.save` builds the contents and :func:`kgp.load` rebuilds the
estimator from them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["FORMAT", "FORMAT_VERSION", "read_model", "to_device", "write_model"]

FORMAT = "kgp-model"
FORMAT_VERSION = 1


def write_model(contents: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``contents`` (tensors and plain values only) with the format tag and version."""
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **contents}, path)


def read_model(path: str | os.PathLike) -> dict[str, Any]:
    """Read a model file written by :func:`write_model`; no code in the file is ever executed.

    Raises
    ------
    ValueError
        If the file is not a kgp model file or has an unsupported format version.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kgp model file")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: model format version {state.get('format_version')} is not supported")
    return state


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move every tensor inside nested dicts / lists to ``device``; floating ones also to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value
