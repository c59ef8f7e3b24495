"""Shared machinery of the scikit-learn-style estimators: one validation, one fit path, one setter.

``fit`` validates every parameter once (:meth:`BaseKernelModel._validate`), converts the inputs,
lets the subclass encode its targets, selects centers, runs the solver and only then writes the
fitted attributes, all in :meth:`BaseKernelModel._set_fitted` (also used by ``partial_fit`` and by
:func:`kgp.load`). A fit that raises or is interrupted leaves the estimator as it was.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from .. import distributed as _dist
from .. import io
from ..diagnostics import ill_conditioned, not_fitted
from ..kernels import KERNEL_SHORTCUTS, make_kernel
from ..kernels.serialize import kernel_from_spec, kernel_to_spec
from ..monitor import IterationInfo, Monitor
from ..plugin import Centers, Problem, SelectionRequest, merge_options
from ..registry import UnknownPluginError, get_predictor_class, get_selector, get_solver
from ..validation import check_n_centers, check_positive, resolve_dtype, to_tensor
from .sklearn_compat import SklearnProtocol, feature_names_of

__all__ = ["BaseKernelModel"]

DEFAULT_SOLVER = "exact"
DEFAULT_SELECTOR = "uniform"

# constructor parameters stored in model files as plain values (the others are objects or derived)
_PLAIN_PARAMS = ("lengthscale", "noise", "solver", "n_centers", "solver_options", "selector_options", "random_state")


@dataclass(frozen=True)
class _FitSetup:
    """Everything :meth:`BaseKernelModel._validate` resolved from the constructor parameters."""

    solver: Any
    solver_options: dict[str, Any]
    selector_name: str | None  # None: explicit centers, or a solver without centers
    selector: Any
    selector_options: dict[str, Any]
    dtype: torch.dtype | None
    device: torch.device | None


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


class BaseKernelModel(SklearnProtocol):
    """Parameters and fitting logic shared by :class:`KernelRegressor` and :class:`KernelClassifier`.

    See :class:`kgp.KernelRegressor` for the parameters. Subclasses say how targets are encoded
    (:meth:`_encode_fit_targets`, :meth:`_encode_targets`) and which validation metric iterative
    solvers report (:attr:`_validation_metric`).
    """

    _validation_metric: Callable[[Tensor, Tensor], float] | None = None

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

    # ------------------------------------------------------------------ validation (once per fit)
    def _validate(self) -> _FitSetup:
        """Check every constructor parameter and resolve the plugins, before any work."""
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
        device = _check_device(self.device)
        solver = _get_plugin(get_solver, self.solver, DEFAULT_SOLVER, "solver=<name>", "solver")
        solver_options = merge_options(f"solver {self.solver!r}", solver.option_defaults, self.solver_options)
        selector_name, selector, selector_options = None, None, {}
        if not solver.uses_centers:
            if self.centers is not None or self.n_centers is not None:
                raise ValueError(
                    f"solver {self.solver!r} takes no centers (it uses no inducing points or Nystrom centers); "
                    "leave centers and n_centers as None"
                )
        elif self.centers is None or isinstance(self.centers, str):
            selector_name = self.centers or DEFAULT_SELECTOR
            selector = get_selector(selector_name) if self.centers else _default_selector()
            selector_options = merge_options(
                f"selector {selector_name!r}", selector.option_defaults, self.selector_options
            )
        elif not isinstance(self.centers, (Tensor, np.ndarray, list)):
            raise TypeError(
                f"centers: expected a selector name, an (M x d) array/tensor or None, got {type(self.centers).__name__}"
            )
        return _FitSetup(solver, solver_options, selector_name, selector, selector_options, dtype, device)

    # ------------------------------------------------------------------ subclass hooks
    def _encode_fit_targets(self, y: Any, X: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """Targets of ``fit`` as an ``n x k`` tensor, and the fitted attributes they define."""
        raise NotImplementedError

    def _encode_targets(self, y: Any, name: str, X: Tensor, targets: dict[str, Any]) -> Tensor:
        """Targets given later (e.g. ``validation_data``), encoded like the fitted ones in ``targets``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the fit path
    def fit(self, X, y, *, validation_data=None, distributed=False):
        """Fit on ``X`` (n x d) and ``y``; see the subclass for the target format.

        Parameters
        ----------
        validation_data:
            Optional ``(X_val, y_val)``; iterative solvers then report the validation metric
            (mean squared error for regression, error rate for classification) after every
            iteration, to the callback and in ``history_``.
        distributed:
            ``True`` (the default process group) or a ``torch.distributed`` ProcessGroup: ``X`` and
            ``y`` are this rank's rows of a row-sharded data set, every rank of the group calls
            ``fit`` with its rows, and each gets the model of all rows (docs/scaling-out.md).
            Explicit, never automatic: kgp cannot tell a shard from a replicated copy.

        Returns
        -------
        self
        """
        group = _dist.resolve_group(distributed)
        if group is None:
            return self._fit(X, y, validation_data, None)
        with _dist.guarded(group) as channel:  # every rank's failure, validation included, reaches the others
            return self._fit(X, y, validation_data, channel)

    def _fit(self, X, y, validation_data, channel):
        """The one fit path; ``channel`` is None for a local fit, else the distributed fit's channel."""
        setup = self._validate()
        if channel is not None:
            _check_distributed_plugins(setup, self.solver)
        feature_names = feature_names_of(X)
        Xt = to_tensor(X, "X", ndim=(2,), dtype=setup.dtype, device=setup.device, allow_empty=channel is not None)
        Y, targets = self._encode_fit_targets(y, Xt)
        if Y.shape[0] != Xt.shape[0]:
            raise ValueError(f"X and y: expected the same number of samples, got {Xt.shape[0]} and {Y.shape[0]}")
        validation = self._validation(validation_data, Xt, targets)
        shard = None
        if channel is not None:
            shard = _dist.shard_rows(
                channel,
                Xt.shape[0],
                **{"number of features": Xt.shape[1], "number of outputs": Y.shape[1], "dtype": Xt.element_size()},
            )
        check_n_centers(self.n_centers, Xt.shape[0] if shard is None else shard.n_total)
        seed = self._draw_seed()
        if shard is not None:  # random_state=None draws on every rank: rank 0's draw is the fit's seed
            seed = int(shard.broadcast_(torch.tensor([seed], dtype=torch.int64, device=shard._device())).item())
        kernel = self._build_kernel(Xt.dtype, Xt.device)
        start = time.perf_counter()
        if shard is None:
            monitor = Monitor(self.callback, bool(self.progress), validation, self._validation_metric)
        else:  # one rank's stop request stops all; one progress bar
            progress = bool(self.progress) and shard.rank == 0
            monitor = _dist.ShardedMonitor(shard, self.callback, progress, validation, self._validation_metric)
        with _closing(monitor):
            centers = self._centers(setup, Xt, kernel, seed, shard=shard)
            problem = self._problem(setup, Xt, Y, kernel, centers, seed + 1, monitor)
            problem.shard = shard
            with _gradients(setup.solver):
                predictor = setup.solver.fit(problem)
        if shard is not None:
            predictor = _same_on_every_rank(predictor, kernel, shard)
        self._set_fitted(
            kernel=kernel,
            solver_name=self.solver,
            predictor=predictor,
            centers=centers,
            history=list(monitor.history),
            seed=seed,
            n_features=Xt.shape[1],
            dtype=Xt.dtype,
            device=Xt.device,
            targets=targets,
            fit_time=time.perf_counter() - start,
            chunks_seen=1,  # a partial_fit continuing this fit draws from seed + 2 on
            shard=shard,
            feature_names=feature_names,
        )
        return self

    def _draw_seed(self) -> int:
        if self.random_state is not None:
            return int(self.random_state)
        return int(torch.randint(0, 2**62, (1,)).item())

    def _build_kernel(self, dtype: torch.dtype, device) -> gpytorch.kernels.Kernel:
        if isinstance(self.kernel, str):
            kernel = make_kernel(self.kernel, self.lengthscale)
        else:
            kernel = copy.deepcopy(self.kernel)  # fitting never mutates the user's kernel object
        return kernel.to(device=device, dtype=dtype)

    def _validation(self, validation_data, X: Tensor, targets: dict[str, Any]) -> tuple[Tensor, Tensor] | None:
        if validation_data is None:
            return None
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
            raise ValueError("validation_data: expected a pair (X_val, y_val)")
        Xv = to_tensor(validation_data[0], "X_val", ndim=(2,), dtype=X.dtype, device=X.device)
        if Xv.shape[1] != X.shape[1]:
            raise ValueError(f"validation_data: X_val has {Xv.shape[1]} features, X has {X.shape[1]}")
        Yv = self._encode_targets(validation_data[1], "y_val", Xv, targets)
        if Yv.shape[0] != Xv.shape[0]:
            raise ValueError(
                f"validation_data: expected as many samples in X_val as in y_val, got {Xv.shape[0]} and {Yv.shape[0]}"
            )
        return Xv, Yv

    def _centers(self, setup: _FitSetup, X: Tensor, kernel, seed: int, shard=None) -> Centers | None:
        """The selector's centers, the user's explicit centers, or None for solvers without centers."""
        if not setup.solver.uses_centers:
            return None
        if setup.selector is not None:
            request = SelectionRequest(
                X=X,
                n_centers=self.n_centers,
                kernel=kernel,
                noise=float(self.noise),
                generator=torch.Generator().manual_seed(seed),
                options=setup.selector_options,
                shard=shard,
            )
            with _gradients(setup.selector):
                return setup.selector.select(request)
        points = to_tensor(self.centers, "centers", ndim=(2,), dtype=X.dtype, device=X.device)
        if points.shape[1] != X.shape[1]:
            raise ValueError(f"centers: expected {X.shape[1]} columns like X, got shape {tuple(points.shape)}")
        if self.n_centers is not None and self.n_centers != points.shape[0]:
            raise ValueError(f"n_centers={self.n_centers} does not match the {points.shape[0]} centers given")
        if shard is not None:
            if not shard.identical([points]):
                raise ValueError("centers: a distributed fit needs the same explicit centers on every rank")
        return Centers(points=points)

    def _problem(self, setup: _FitSetup, X, Y, kernel, centers, seed: int, monitor: Monitor) -> Problem:
        return Problem(
            X=X,
            y=Y,
            kernel=kernel,
            noise=float(self.noise),
            centers=centers,
            options=setup.solver_options,
            generator=torch.Generator().manual_seed(seed),
            monitor=monitor,
        )

    def _set_fitted(
        self,
        *,
        kernel: gpytorch.kernels.Kernel,
        solver_name: str,
        predictor: Any,
        centers: Centers | None,
        history: list[IterationInfo],
        seed: int,
        n_features: int,
        dtype: torch.dtype,
        device: torch.device,
        targets: dict[str, Any],
        fit_time: float,
        chunks_seen: int = 0,
        shard: _dist.Shard | None = None,
        feature_names: np.ndarray | None = None,
    ) -> None:
        """Write every fitted attribute (the one place that does: fit, partial_fit and load call it)."""
        self.kernel_ = kernel
        self.solver_name_ = solver_name
        self.solver_ = get_solver(solver_name)
        self.predictor_ = predictor
        self.centers_ = None if centers is None else centers.points
        self.center_weights_ = None if centers is None else centers.weights
        self.selection_info_ = {} if centers is None else centers.info
        self.history_ = history
        self.seed_ = seed
        self.n_features_in_ = n_features
        self.dtype_ = dtype
        self.device_ = device
        self.fit_time_ = fit_time
        self._chunks_seen = chunks_seen
        # distributed fit: where this rank's rows sat (plain values; the process group is not kept)
        self.shard_ = None
        if shard is not None:
            self.shard_ = {"rank": shard.rank, "world_size": shard.world_size}
            self.shard_.update(n_local=shard.n_local, n_total=shard.n_total)
        if feature_names is not None:
            self.feature_names_in_ = feature_names
        elif hasattr(self, "feature_names_in_"):
            del self.feature_names_in_  # refitted on an array: the old names no longer describe X
        for name, value in targets.items():
            setattr(self, name, value)

    # ------------------------------------------------------------------ prediction helpers
    def _check_fitted(self) -> None:
        if not hasattr(self, "predictor_"):
            raise not_fitted(f"this {type(self).__name__} is not fitted yet; call fit(X, y) first")

    def _raw_predict(self, X) -> tuple[Tensor, bool]:
        """Return the ``n x k`` predictor output and whether the input was numpy-like."""
        self._check_fitted()
        is_tensor = isinstance(X, Tensor)
        self._check_feature_names(X)
        Xt = to_tensor(X, "X", ndim=(2,), dtype=self.dtype_, device=self.device_)
        if Xt.shape[1] != self.n_features_in_:
            # scikit-learn's wording (its checks match it)
            raise ValueError(
                f"X has {Xt.shape[1]} features, but {type(self).__name__} is expecting "
                f"{self.n_features_in_} features as input"
            )
        with torch.no_grad():
            out = self.predictor_.predict(Xt)
        if out.dim() == 1:
            out = out.unsqueeze(-1)
        if is_tensor:
            out = out.to(X.device)
        return out, not is_tensor

    # ------------------------------------------------------------------ persistence
    def _target_state(self) -> dict[str, Any]:
        """Plain values describing the fitted targets (the subclass's fitted target attributes)."""
        raise NotImplementedError

    @classmethod
    def _targets_from_state(cls, state: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, path) -> None:
        """Write the fitted model to ``path`` (loads with ``torch.load(weights_only=True)``).

        The file holds the kernel's class description and hyperparameters, the solver plugin name,
        the predictor's kind and tensors, and the estimator's plain parameters. Callbacks and
        explicit center arrays given as parameters are not stored (the fitted centers are, inside
        the predictor). After a distributed fit only rank 0 writes (every rank holds the same model);
        on the other ranks ``save`` does nothing, so both ``model.save(path)`` on every rank and
        ``if rank == 0: model.save(path)`` work.
        """
        self._check_fitted()
        if getattr(self, "shard_", None) is not None and self.shard_["rank"] != 0:
            return
        params = {name: getattr(self, name) for name in _PLAIN_PARAMS}
        params["kernel"] = self.kernel if isinstance(self.kernel, str) else None
        params["centers"] = self.centers if isinstance(self.centers, str) else None
        params["dtype"] = str(self.dtype_).replace("torch.", "")
        fitted: dict[str, Any] = {"n_features_in": int(self.n_features_in_), "seed": int(self.seed_)}
        fitted.update(self._target_state())
        if getattr(self, "feature_names_in_", None) is not None:
            fitted["feature_names"] = [str(name) for name in self.feature_names_in_]
        if self.center_weights_ is not None:
            fitted["center_weights"] = self.center_weights_.detach().cpu()
        io.write_model(
            {
                "estimator": type(self).__name__,
                "params": params,
                "kernel_spec": kernel_to_spec(self.kernel_),
                "kernel_state": {k: v.detach().cpu() for k, v in self.kernel_.state_dict().items()},
                "solver": self.solver_name_,
                "predictor_kind": self.predictor_.kind,
                "predictor_state": self.predictor_.state_dict(),
                "fitted": fitted,
            },
            path,
        )

    @classmethod
    def _from_state(cls, state: dict[str, Any], path, device: torch.device) -> BaseKernelModel:
        """Rebuild a fitted estimator from the contents of a model file (see :func:`kgp.load`)."""
        solver_name = state["solver"]
        try:
            get_solver(solver_name)
            predictor_cls = get_predictor_class(state["predictor_kind"])
        except UnknownPluginError as exc:
            raise ValueError(
                f"{path}: this model was fitted by solver {solver_name!r} (predictor kind "
                f"{state['predictor_kind']!r}), which is not installed here: {exc}"
            ) from exc
        params = dict(state["params"])
        dtype = getattr(torch, params.pop("dtype"))
        # convert before loading: a float32 kernel would round float64 hyperparameters
        kernel = kernel_from_spec(state["kernel_spec"]).to(device=device, dtype=dtype)
        kernel.load_state_dict(state["kernel_state"])
        model = cls(**{k: v for k, v in params.items() if k != "kernel"})
        model.kernel = params["kernel"] if params["kernel"] is not None else kernel
        model.dtype = dtype
        predictor = predictor_cls.from_state(io.to_device(state["predictor_state"], device, dtype), kernel)
        fitted = state["fitted"]
        points = getattr(predictor, "centers", None)
        weights = fitted.get("center_weights")
        centers = None
        if points is not None:
            weights = None if weights is None else weights.to(device=device, dtype=dtype)
            centers = Centers(points=points, weights=weights)
        model._set_fitted(
            kernel=kernel,
            solver_name=solver_name,
            predictor=predictor,
            centers=centers,
            history=[],
            seed=fitted["seed"],
            n_features=fitted["n_features_in"],
            dtype=dtype,
            device=device,
            targets=cls._targets_from_state(fitted),
            fit_time=0.0,
            feature_names=None if "feature_names" not in fitted else np.asarray(fitted["feature_names"], dtype=object),
        )
        return model


def _check_distributed_plugins(setup: _FitSetup, solver_name: str) -> None:
    """Refuse, before any work, plugins that do not declare ``supports_distributed = True``."""
    if not getattr(setup.solver, "supports_distributed", False):
        raise ValueError(
            f"solver {solver_name!r} does not support distributed fitting (distributed=True): it does not "
            "declare supports_distributed = True. Use solver='falkon', or fit on one process holding all rows."
        )
    if setup.selector is not None and not getattr(setup.selector, "supports_distributed", False):
        raise ValueError(
            f"centers={setup.selector_name!r} does not support distributed fitting (distributed=True): the "
            "selector does not declare supports_distributed = True. Use centers='uniform' or explicit centers."
        )


def _same_on_every_rank(predictor: Any, kernel: gpytorch.kernels.Kernel, shard: _dist.Shard) -> Any:
    """The fitted predictor, made bitwise identical on every rank (rank 0's where they differ)."""
    state = predictor.state_dict()
    names = [k for k, v in state.items() if isinstance(v, Tensor)]
    device = shard._device()
    moved = {k: state[k].to(device) for k in names}
    if not shard.replicate_(list(moved.values())):
        return predictor
    rebuilt = {**state, **{k: v.to(state[k].device) for k, v in moved.items()}}
    return type(predictor).from_state(rebuilt, kernel)


def _check_device(device: Any) -> torch.device | None:
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


@contextlib.contextmanager
def _closing(monitor: Monitor) -> Iterator[Monitor]:
    """The model owns the monitor: its progress bar is closed however the fit ends."""
    try:
        yield monitor
    finally:
        monitor.close()


@contextlib.contextmanager
def _gradients(plugin: Any) -> Iterator[None]:
    """Run a plugin call under ``torch.no_grad()`` unless the plugin declares ``needs_grad = True``.

    A solver that multiplies with the kernel operator while the kernel's hyperparameters require
    gradients would otherwise build an autograd graph across all its iterations. A raw
    ``torch.linalg.LinAlgError`` escaping the plugin (LAPACK gave up) becomes kgp's
    :class:`~kgp.diagnostics.IllConditionedError`, which says what it means and what helps.
    """
    grad = contextlib.nullcontext() if getattr(plugin, "needs_grad", False) else torch.no_grad()
    try:
        with grad:
            yield
    except torch.linalg.LinAlgError as exc:
        raise ill_conditioned(type(plugin).__name__, io.one_line(exc)) from exc


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
