"""The estimators' own parameters, declared: what each accepts, checked by one function.

In the spirit of scikit-learn's ``_parameter_constraints``: :data:`ESTIMATOR_PARAMETERS` maps every
constructor parameter of :class:`kgp.KernelRegressor` / :class:`kgp.KernelClassifier` to a
:class:`Parameter` (what it accepts, in words, and the check that enforces it), and
:func:`check_parameters` runs them in the table's order. Each error is a ``ValueError`` or
``TypeError`` that names the parameter and what was expected. The rules between parameters
(``learn_options`` without ``learn``, ``ard`` with a kernel object, ...) follow in
:func:`kgp.fitting.plan.resolve_plan`; plugin options are declared apart (:mod:`kgp.options`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from ..kernels import KERNEL_SHORTCUTS
from ..validation import check_n_centers, check_positive, resolve_dtype

__all__ = ["ESTIMATOR_PARAMETERS", "Parameter", "check_device", "check_parameters"]


@dataclass(frozen=True)
class Parameter:
    """One declared estimator parameter.

    Attributes
    ----------
    expected:
        What it accepts, in words (for errors and docs).
    check:
        ``check(name, value)``: raises ``ValueError`` / ``TypeError`` naming ``name`` when the value is
        not accepted; its return value is not used (the plan normalises values where it reads them).
    """

    expected: str
    check: Callable[[str, Any], Any]

    @classmethod
    def instance(cls, types: tuple[type, ...], expected: str, *, none: bool = True, show: str = "type") -> Parameter:
        """An instance of ``types`` (bools refused where ``int`` is asked), or None when ``none``.

        ``show``: how the error shows a refused value, ``"type"`` (its type's name), ``"value"`` (its
        repr) or ``""`` (not at all).
        """

        def check(name: str, value: Any) -> None:
            if value is None and none:
                return
            refused_bool = isinstance(value, bool) and bool not in types
            if refused_bool or not isinstance(value, types):
                raise TypeError(f"{name}: expected {expected}{_got(value, show)}")

        return cls(expected, check)

    @classmethod
    def switch(cls) -> Parameter:
        """True, False, or None (on exactly when hyperparameters are learned)."""
        expected = "True, False or None (on when learning)"

        def check(name: str, value: Any) -> None:
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name}: expected {expected}, got {value!r}")

        return cls(expected, check)


def _got(value: Any, show: str) -> str:
    if show == "value":
        return f", got {value!r}"
    if show == "type":
        return f", got {type(value).__name__}"
    return ""


def _positive(name: str, value: Any) -> None:
    check_positive(value, name)


def _optional_positive(name: str, value: Any) -> None:
    if value is not None:
        check_positive(value, name)


def _n_centers(name: str, value: Any) -> None:
    check_n_centers(value)


def _kernel(name: str, value: Any) -> None:
    if not isinstance(value, (gpytorch.kernels.Kernel, str)):
        raise TypeError(
            f"{name}: expected a gpytorch.kernels.Kernel or one of {KERNEL_SHORTCUTS}, got {type(value).__name__}"
        )
    if isinstance(value, str) and value.lower() not in KERNEL_SHORTCUTS:
        raise ValueError(f"{name}: unknown shortcut {value!r}; expected one of {KERNEL_SHORTCUTS}")


def _callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a callable taking an IterationInfo")


def _dtype(name: str, value: Any) -> None:
    resolve_dtype(value)


def _device(name: str, value: Any) -> None:
    check_device(value)


def check_device(device: Any) -> torch.device | None:
    """``device`` as a torch.device; a ValueError naming it if torch does not know it or it is absent here."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r} ({exc})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested, but CUDA is not available to this torch ({torch.__version__})")
    return resolved


_OPTIONS = "a dict or None"

ESTIMATOR_PARAMETERS: dict[str, Parameter] = {
    "noise": Parameter("a finite positive number (the noise variance sigma^2)", _positive),
    "lengthscale": Parameter("a finite positive number or None", _optional_positive),
    "n_centers": Parameter("a positive integer or None", _n_centers),
    "solver": Parameter.instance((str,), "a plugin name (str) or 'auto'", none=False),
    "kernel": Parameter(f"a gpytorch.kernels.Kernel or one of {KERNEL_SHORTCUTS}", _kernel),
    "solver_options": Parameter.instance((dict,), _OPTIONS),
    "selector_options": Parameter.instance((dict,), _OPTIONS),
    "random_state": Parameter.instance((int, np.integer), "an int or None", show="value"),
    "callback": Parameter("a callable taking an IterationInfo, or None", _callable),
    "learn_options": Parameter.instance((dict,), _OPTIONS),
    "learn": Parameter.instance((str,), "an objective plugin name (str), 'auto' or None", show="value"),
    "dtype": Parameter("None, 'float32' or 'float64' (or the torch / numpy dtype)", _dtype),
    "device": Parameter("a torch device such as 'cpu' or 'cuda:0', or None", _device),
    "centers": Parameter.instance(
        (str, Tensor, np.ndarray, list), "a selector name, an (M x d) array/tensor or None", show="type"
    ),
    "ard": Parameter.switch(),
    "normalize_y": Parameter.switch(),
    "normalize_X": Parameter.switch(),
    "progress": Parameter("any value (truthy: a progress bar on stderr)", lambda name, value: None),
}
"""Every estimator parameter and what it accepts, in the order :func:`check_parameters` checks them."""


def check_parameters(params: Mapping[str, Any]) -> None:
    """Check each parameter present in ``params`` against :data:`ESTIMATOR_PARAMETERS`.

    Raises
    ------
    ValueError, TypeError
        The first parameter (in the table's order) that is not accepted, named with what was expected.
    """
    for name, declared in ESTIMATOR_PARAMETERS.items():
        if name in params:
            declared.check(name, params[name])
