"""Shared machinery of the scikit-learn-style estimators."""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from ..kernels import KERNEL_SHORTCUTS, make_kernel
from ..monitor import IterationInfo, Monitor
from ..plugin import Centers, Problem, SelectionRequest, merge_options
from ..registry import UnknownPluginError, get_selector, get_solver
from ..validation import check_n_centers, check_positive, resolve_dtype, to_tensor

__all__ = ["BaseKernelModel"]

DEFAULT_SOLVER = "exact"
DEFAULT_SELECTOR = "uniform"


def _get_plugin(getter: Callable[[str], Any], name: str, default: str, argument: str, kind: str) -> Any:
    try:
        return getter(name)
    except UnknownPluginError as exc:
        if name != default:
            raise
        # The user may not know the name came from a default (e.g. KGP_PLUGINS=falkon leaves it out).
        raise UnknownPluginError(
            f"{exc}. The default {kind} is {default!r}: pass {argument} explicitly to use another one"
        ) from None


def _default_selector() -> Any:
    return _get_plugin(get_selector, DEFAULT_SELECTOR, DEFAULT_SELECTOR, "centers=<selector name or array>", "selector")


class BaseKernelModel:
    """Parameters and fitting logic shared by :class:`KernelRegressor` and :class:`KernelClassifier`.

    See :class:`kgp.KernelRegressor` for the parameters.
    """

    def __init__(
        self,
        kernel: str | gpytorch.kernels.Kernel = "rbf",
        *,
        lengthscale: float | None = 1.0,
        noise: float = 1e-2,
        solver: str = DEFAULT_SOLVER,
        centers: str | Tensor | np.ndarray | None = None,
        n_centers: int | None = None,
        solver_options: dict | None = None,
        selector_options: dict | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        random_state: int | None = None,
        callback: Callable[[IterationInfo], bool | None] | None = None,
        progress: bool = False,
    ):
        self.kernel = kernel
        self.lengthscale = lengthscale
        self.noise = noise
        self.solver = solver
        self.centers = centers
        self.n_centers = n_centers
        self.solver_options = solver_options
        self.selector_options = selector_options
        self.device = device
        self.dtype = dtype
        self.random_state = random_state
        self.callback = callback
        self.progress = progress

    # ------------------------------------------------------------------ sklearn protocol
    @classmethod
    def _param_names(cls) -> list[str]:
        sig = inspect.signature(BaseKernelModel.__init__)
        return [p for p in sig.parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Constructor parameters (scikit-learn convention)."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params: Any):
        """Set constructor parameters; unknown names raise ValueError."""
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(f"invalid parameter {name!r} for {type(self).__name__}; valid: {', '.join(valid)}")
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        defaults = inspect.signature(BaseKernelModel.__init__).parameters
        changed = [
            f"{name}={_short(value)}"
            for name, value in self.get_params().items()
            if not _same(value, defaults[name].default)
        ]
        return f"{type(self).__name__}({', '.join(changed)})"

    # ------------------------------------------------------------------ parameter checks
    def _check_params(self):
        """Validate constructor parameters; return (solver, solver_options, dtype, device)."""
        check_positive(self.noise, "noise")
        if self.lengthscale is not None:
            check_positive(self.lengthscale, "lengthscale")
        check_n_centers(self.n_centers)
        if not isinstance(self.solver, str):
            raise TypeError(f"solver: expected a plugin name (str), got {type(self.solver).__name__}")
        if not isinstance(self.kernel, (gpytorch.kernels.Kernel, str)):
            got = type(self.kernel).__name__
            raise TypeError(f"kernel: expected a gpytorch.kernels.Kernel or one of {KERNEL_SHORTCUTS}, got {got}")
        if isinstance(self.kernel, str) and self.kernel.lower() not in KERNEL_SHORTCUTS:
            raise ValueError(f"kernel: unknown shortcut {self.kernel!r}; expected one of {KERNEL_SHORTCUTS}")
        for opt_name in ("solver_options", "selector_options"):
            value = getattr(self, opt_name)
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{opt_name}: expected a dict or None, got {type(value).__name__}")
        if self.random_state is not None and (
            isinstance(self.random_state, bool) or not isinstance(self.random_state, (int, np.integer))
        ):
            raise TypeError(f"random_state: expected an int or None, got {self.random_state!r}")
        if self.callback is not None and not callable(self.callback):
            raise TypeError("callback: expected a callable taking an IterationInfo")
        dtype = resolve_dtype(self.dtype)
        device = torch.device(self.device) if self.device is not None else None
        solver = _get_plugin(get_solver, self.solver, DEFAULT_SOLVER, "solver=<name>", "solver")
        options = merge_options(f"solver {self.solver!r}", solver.option_defaults, self.solver_options)
        if not solver.uses_centers and (self.centers is not None or self.n_centers is not None):
            raise ValueError(
                f"solver {self.solver!r} uses every training point and takes no centers; "
                "leave centers and n_centers as None"
            )
        if isinstance(self.centers, str):
            get_selector(self.centers)  # unknown names fail before any work
        elif self.centers is None and solver.uses_centers:
            _default_selector()
        elif self.centers is not None and not isinstance(self.centers, (Tensor, np.ndarray, list)):
            raise TypeError(
                f"centers: expected a selector name, an (M x d) array/tensor or None, got {type(self.centers).__name__}"
            )
        return solver, options, dtype, device

    def _build_kernel(self, dtype: torch.dtype, device) -> gpytorch.kernels.Kernel:
        if isinstance(self.kernel, str):
            kernel = make_kernel(self.kernel, self.lengthscale)
        else:
            kernel = copy.deepcopy(self.kernel)  # fitting never mutates the user's kernel object
        return kernel.to(device=device, dtype=dtype)

    # ------------------------------------------------------------------ fitting
    def _prepare_inputs(self, X, y, dtype, device):
        Xt = to_tensor(X, "X", ndim=(2,), dtype=dtype, device=device)
        yt = to_tensor(y, "y", ndim=(1, 2), dtype=Xt.dtype, device=Xt.device)
        if yt.shape[0] != Xt.shape[0]:
            raise ValueError(f"X and y: expected the same number of samples, got {Xt.shape[0]} and {yt.shape[0]}")
        return Xt, yt

    def _fit_targets(self, X: Tensor, y: Tensor, dtype, device, validation_data, metric):
        """Run the selector and solver on 2-D targets ``y``; set fitted attributes."""
        solver, options, _, _ = self._check_params()
        n = X.shape[0]
        check_n_centers(self.n_centers, n)
        seed = int(self.random_state) if self.random_state is not None else int(torch.randint(0, 2**62, (1,)).item())
        kernel = self._build_kernel(X.dtype, X.device)
        monitor = Monitor(self.callback, bool(self.progress), validation_data, metric)
        start = time.perf_counter()
        centers = self._select_centers(solver, X, kernel, seed)
        problem = Problem(
            X=X,
            y=y,
            kernel=kernel,
            noise=float(self.noise),
            centers=None if centers is None else centers.points,
            center_weights=None if centers is None else centers.weights,
            center_indices=None if centers is None else centers.indices,
            options=options,
            generator=torch.Generator().manual_seed(seed + 1),
            monitor=monitor,
        )
        try:
            predictor = solver.fit(problem)
        finally:
            monitor.close()
        self.fit_time_ = time.perf_counter() - start
        self.kernel_ = kernel
        self.solver_ = solver
        self.solver_name_ = self.solver
        self.predictor_ = predictor
        self.centers_ = None if centers is None else centers.points
        self.center_weights_ = None if centers is None else centers.weights
        self.selection_info_ = {} if centers is None else centers.info
        self.history_ = list(monitor.history)
        self.seed_ = seed
        self.n_features_in_ = X.shape[1]
        self.dtype_ = X.dtype
        self.device_ = X.device
        return self

    def _select_centers(self, solver, X: Tensor, kernel, seed: int) -> Centers | None:
        if not solver.uses_centers:
            return None
        if self.centers is None or isinstance(self.centers, str):
            name = self.centers or DEFAULT_SELECTOR
            selector = get_selector(name) if self.centers else _default_selector()
            options = merge_options(f"selector {name!r}", selector.option_defaults, self.selector_options)
            request = SelectionRequest(
                X=X,
                n_centers=self.n_centers,
                kernel=kernel,
                noise=float(self.noise),
                generator=torch.Generator().manual_seed(seed),
                options=options,
            )
            return selector.select(request)
        points = to_tensor(self.centers, "centers", ndim=(2,), dtype=X.dtype, device=X.device)
        if points.shape[1] != X.shape[1]:
            raise ValueError(f"centers: expected {X.shape[1]} columns like X, got shape {tuple(points.shape)}")
        if self.n_centers is not None and self.n_centers != points.shape[0]:
            raise ValueError(f"n_centers={self.n_centers} does not match the {points.shape[0]} centers given")
        return Centers(points=points)

    # ------------------------------------------------------------------ prediction helpers
    def _check_fitted(self) -> None:
        if not hasattr(self, "predictor_"):
            raise RuntimeError(f"this {type(self).__name__} is not fitted yet; call fit(X, y) first")

    def _raw_predict(self, X) -> tuple[Tensor, bool]:
        """Return the ``n x k`` predictor output and whether the input was numpy-like."""
        self._check_fitted()
        is_tensor = isinstance(X, Tensor)
        Xt = to_tensor(X, "X", ndim=(2,), dtype=self.dtype_, device=self.device_)
        if Xt.shape[1] != self.n_features_in_:
            raise ValueError(f"X: expected {self.n_features_in_} features, got {Xt.shape[1]}")
        with torch.no_grad():
            out = self.predictor_.predict(Xt)
        if out.dim() == 1:
            out = out.unsqueeze(-1)
        if is_tensor:
            out = out.to(X.device)
        return out, not is_tensor

    def save(self, path) -> None:
        """Write the fitted model to ``path`` (loads with ``torch.load(weights_only=True)``)."""
        from ..io import save_model

        save_model(self, path)


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, (Tensor, np.ndarray, gpytorch.kernels.Kernel)):
        return False
    return type(value) is type(default) and value == default


def _short(value: Any) -> str:
    if isinstance(value, (Tensor, np.ndarray)):
        return f"<array {tuple(value.shape)}>"
    if isinstance(value, gpytorch.kernels.Kernel):
        return type(value).__name__ + "()"
    return repr(value)
