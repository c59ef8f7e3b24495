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
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from ..learning import learn_hyperparameters
from ..learning.loop import split_learn_options
from ..monitor import IterationInfo, Monitor
from ..plugin import Centers, Problem, SelectionRequest, merge_options
from ..registry import UnknownPluginError, get_objective, get_predictor_class, get_selector, get_solver
from ..validation import check_n_centers, check_positive, resolve_dtype, to_tensor
from ..variance import VarianceFactors, exact_factors, latent_variance, nystrom_factors
from .sklearn_compat import SklearnProtocol, feature_names_of

__all__ = ["BaseKernelModel"]

DEFAULT_SOLVER = "exact"
DEFAULT_SELECTOR = "uniform"

# constructor parameters stored in model files as plain values (the others are objects or derived)
_PLAIN_PARAMS = ("lengthscale", "noise", "solver", "n_centers", "solver_options", "selector_options", "random_state")
# hyperparameter-learning parameters (issue 13), stored the same way
_LEARN_PARAMS = ("learn", "learn_options", "ard", "normalize_y")


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
    objective: Any = None  # the learn objective plugin, None: hyperparameters fixed
    learn_options: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_centers(self) -> bool:
        """Whether the solver or the learning objective works on centers."""
        return bool(self.solver.uses_centers or getattr(self.objective, "uses_centers", False))


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
        learn: str | None = None,
        learn_options: dict | None = None,
        ard: bool = False,
        normalize_y: bool = False,
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
        self.learn = learn
        self.learn_options = learn_options
        self.ard = ard
        self.normalize_y = normalize_y

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
        objective, learn_options = self._validate_learning()
        selector_name, selector, selector_options = None, None, {}
        if not (solver.uses_centers or getattr(objective, "uses_centers", False)):
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
        return _FitSetup(
            solver, solver_options, selector_name, selector, selector_options, dtype, device, objective, learn_options
        )

    def _validate_learning(self) -> tuple[Any, dict[str, Any]]:
        """Check ``learn``, ``learn_options``, ``ard`` and ``normalize_y``; resolve the objective plugin."""
        for name in ("ard", "normalize_y"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.ard and not isinstance(self.kernel, str):
            raise ValueError("ard=True applies to shortcut kernels; give your GPyTorch kernel ard_num_dims=d instead")
        if self.ard and self.kernel.lower() == "linear":
            raise ValueError("ard=True: the 'linear' shortcut kernel has no lengthscale")
        if self.learn_options is not None and not isinstance(self.learn_options, dict):
            raise TypeError(f"learn_options: expected a dict or None, got {type(self.learn_options).__name__}")
        if self.learn is None:
            if self.learn_options:
                raise ValueError("learn_options: given without learn; set learn='sgpr' or learn='exact' to use them")
            return None, {}
        if not isinstance(self.learn, str):
            raise TypeError(f"learn: expected an objective plugin name (str) or None, got {type(self.learn).__name__}")
        objective = get_objective(self.learn)
        _, _ = split_learn_options(self.learn, objective, self.learn_options)  # unknown keys / bad values: now
        return objective, dict(self.learn_options or {})

    # ------------------------------------------------------------------ subclass hooks
    def _encode_fit_targets(self, y: Any, X: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """Targets of ``fit`` as an ``n x k`` tensor, and the fitted attributes they define."""
        raise NotImplementedError

    def _encode_sharded_targets(self, y: Any, X: Tensor, channel: Any) -> tuple[Tensor, dict[str, Any]]:
        """As :meth:`_encode_fit_targets` for this rank's rows of a distributed fit (``channel``:
        :func:`kgp.distributed.guarded`); a subclass whose encoding depends on all rows (the class set)
        overrides it."""
        return self._encode_fit_targets(y, X)

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
        with _released_on_interrupt(self):
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
        if channel is None:
            Y, targets = self._encode_fit_targets(y, Xt)
        else:
            Y, targets = self._encode_sharded_targets(y, Xt, channel)
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
        kernel = self._build_kernel(Xt.dtype, Xt.device, Xt.shape[1])
        Y, scaling = _normalize(Y, self.normalize_y, shard)
        start = time.perf_counter()
        noise, mean, learn_history = float(self.noise), torch.zeros(Y.shape[1], dtype=Y.dtype, device=Y.device), []
        learn_refit = None
        # the solver fits (y - shift) / scale - mean: validation predictions are mapped back before scoring
        shift = {"mean": mean, **scaling}
        metric = _in_target_units(self._validation_metric, shift) if (scaling or setup.objective) else None
        if shard is None:
            monitor = Monitor(self.callback, bool(self.progress), validation, metric or self._validation_metric)
        else:  # one rank's stop request stops all; one progress bar
            progress = bool(self.progress) and shard.rank == 0
            monitor = _dist.ShardedMonitor(
                shard, self.callback, progress, validation, metric or self._validation_metric
            )
        with _closing(monitor):
            centers = self._centers(setup, Xt, kernel, seed, shard=shard)
            if setup.objective is not None:
                learned = learn_hyperparameters(
                    self.learn,
                    Xt,
                    Y,
                    kernel,
                    noise=noise,
                    mean=_column_mean(Y, shard),
                    centers=centers,
                    options=setup.learn_options,
                    generator=torch.Generator().manual_seed(seed + 3),
                    monitor=monitor,
                    shard=shard,
                )
                if shard is not None:  # the same steps on every rank; the checksum confirms it
                    shard.replicate_([p.data for p in kernel.parameters()] + [learned.mean])
                monitor.close()  # the solver's stage starts its own bar
                noise, mean, learn_history = learned.noise, learned.mean, learned.history
                learn_refit = learned.refit
                shift["mean"] = mean
                kernel = _without_grads(kernel)
            solver_centers = centers if setup.solver.uses_centers else None
            problem = self._problem(setup, Xt, Y - mean, kernel, solver_centers, seed + 1, monitor, noise=noise)
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
            gp={"noise": noise, "mean": mean, **scaling, "learn_history": learn_history, "learn_refit": learn_refit},
        )
        self._X_train = Xt  # for the Nystrom predictive variance, computed on the first return_std call
        return self

    def _draw_seed(self) -> int:
        if self.random_state is not None:
            return int(self.random_state)
        return int(torch.randint(0, 2**62, (1,)).item())

    def _build_kernel(self, dtype: torch.dtype, device, n_features: int | None = None) -> gpytorch.kernels.Kernel:
        if isinstance(self.kernel, str):
            kernel = make_kernel(self.kernel, self.lengthscale)
            if self.ard and n_features is not None:
                # one lengthscale per input dimension, all starting at the given value
                ard_kernel = type(kernel)(ard_num_dims=n_features, **_kernel_kwargs(kernel))
                ard_kernel.lengthscale = kernel.lengthscale.detach().expand(1, n_features)
                kernel = ard_kernel
            if self.learn is not None and self.kernel.lower() != "linear":
                # a GP's amplitude is a hyperparameter too: learned with the lengthscales (starts at 1)
                kernel = gpytorch.kernels.ScaleKernel(kernel)
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
        if not setup.needs_centers:
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

    def _problem(
        self, setup: _FitSetup, X, Y, kernel, centers, seed: int, monitor: Monitor, noise: float | None = None
    ) -> Problem:
        return Problem(
            X=X,
            y=Y,
            kernel=kernel,
            noise=float(self.noise) if noise is None else noise,
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
        gp: dict[str, Any] | None = None,
    ) -> None:
        """Write every fitted attribute (the one place that does: fit, partial_fit and load call it).

        ``gp`` holds the GP quantities of a fit: noise, constant mean, target scaling and learning
        history (None: the fixed ``noise``, zero mean, no scaling).
        """
        gp = dict(gp or {})
        like = torch.zeros(1, dtype=dtype, device=device)
        self.noise_ = float(gp.get("noise", self.noise))
        # per-output vectors (length 1 broadcasts over the outputs)
        self.mean_ = _as_vector(gp.get("mean"), like, 0.0)
        self._y_train_mean = _as_vector(gp.get("y_train_mean"), like, 0.0)
        self._y_train_std = _as_vector(gp.get("y_train_std"), like, 1.0)
        self.learn_history_ = list(gp.get("learn_history", []))
        self.learn_refit_ = gp.get("learn_refit")
        self._X_train = None
        self._variance = VarianceFactors.from_state(gp["variance"]) if "variance" in gp else None
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
        out = self._unscale(out, self.mean_)
        if is_tensor:
            out = out.to(X.device)
        return out, not is_tensor

    def _latent_std(self, X, include_noise: bool) -> Tensor:
        """``n x k`` predictive standard deviation at X in the targets' units (see ``predict``)."""
        self._check_fitted()
        if not isinstance(include_noise, bool):
            raise TypeError(f"include_noise: expected True or False, got {include_noise!r}")
        Xt = to_tensor(X, "X", ndim=(2,), dtype=self.dtype_, device=self.device_)
        if Xt.shape[1] != self.n_features_in_:
            raise ValueError(f"X: expected {self.n_features_in_} features, got {Xt.shape[1]}")
        factors = self._variance_factors()
        var = latent_variance(self.kernel_, Xt, factors)
        if include_noise:
            var = var + self.noise_
        return var.sqrt().unsqueeze(-1) * self._y_train_std

    def _variance_factors(self) -> VarianceFactors:
        if self._variance is not None:
            return self._variance
        name = self.solver_name_
        if getattr(self.solver_, "exact_posterior", False):
            points = getattr(self.predictor_, "centers", None)
            if points is None:
                raise RuntimeError(f"solver {name!r} declares exact_posterior but its predictor has no centers")
            self._variance = exact_factors(self.kernel_, points, self.noise_)
        elif self.centers_ is not None:
            if getattr(self, "shard_", None) is not None:
                # this rank's rows alone would give a variance of the wrong data set, silently
                raise ValueError(
                    f"return_std=True: not supported after a distributed fit (solver {name!r}): the Nystrom "
                    "variance needs K_Mn K_nM summed over all ranks' rows, which the fit does not compute"
                )
            if self._X_train is None:
                raise ValueError(
                    f"return_std=True: the Nystrom variance of solver {name!r} needs one pass over the training "
                    "data, which model files do not hold; call predict(..., return_std=True) once before save()"
                )
            self._variance = nystrom_factors(self.kernel_, self._X_train, self.centers_, self.noise_)
        else:
            raise ValueError(
                f"return_std=True: solver {name!r} gives no predictive variance: it neither solves the exact GP "
                "(exact_posterior = True, e.g. solver='exact') nor fits on centers (Nystrom/DTC variance, e.g. "
                "solver='falkon')"
            )
        self._X_train = None  # the factors hold all that is needed now
        return self._variance

    def _unscale(self, out: Tensor, offset: Tensor | None = None) -> Tensor:
        """Map predictions of the (normalised, centred) training targets back to the targets' units."""
        mean, std = getattr(self, "_y_train_mean", None), getattr(self, "_y_train_std", None)
        if offset is not None and bool((offset != 0).any()):
            out = out + offset
        if std is not None and bool((std != 1).any()):
            out = out * std
        if mean is not None and bool((mean != 0).any()):
            out = out + mean
        return out

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
        params = {name: getattr(self, name) for name in _PLAIN_PARAMS + _LEARN_PARAMS}
        params["kernel"] = self.kernel if isinstance(self.kernel, str) else None
        params["centers"] = self.centers if isinstance(self.centers, str) else None
        params["dtype"] = str(self.dtype_).replace("torch.", "")
        fitted: dict[str, Any] = {"n_features_in": int(self.n_features_in_), "seed": int(self.seed_)}
        fitted.update(self._target_state())
        if getattr(self, "feature_names_in_", None) is not None:
            fitted["feature_names"] = [str(name) for name in self.feature_names_in_]
        if self.center_weights_ is not None:
            fitted["center_weights"] = self.center_weights_.detach().cpu()
        fitted["gp"] = {
            "noise": float(self.noise_),
            "mean": self.mean_.detach().cpu(),
            "y_train_mean": self._y_train_mean.detach().cpu(),
            "y_train_std": self._y_train_std.detach().cpu(),
            "learn_history": [float(v) for v in self.learn_history_],
        }
        if self.learn_refit_ is not None:
            fitted["gp"]["learn_refit"] = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in self.learn_refit_.items()
            }
        if self._variance is not None:
            fitted["gp"]["variance"] = {
                k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in self._variance.state_dict().items()
            }
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
            gp=io.to_device(fitted["gp"], device, dtype) if "gp" in fitted else None,
        )
        return model


def _check_distributed_plugins(setup: _FitSetup, solver_name: str) -> None:
    """Refuse, before any work, plugins that do not declare ``supports_distributed = True``."""
    if not getattr(setup.solver, "supports_distributed", False):
        # a solver may say why it is not distributed and what to use instead (eigenpro2)
        reason = getattr(setup.solver, "distributed_refusal", None)
        raise ValueError(
            f"solver {solver_name!r} does not support distributed fitting (distributed=True): "
            + (
                f"{reason}."
                if reason
                else "it does not declare supports_distributed = True. Use solver='falkon', or fit on one process "
                "holding all rows."
            )
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
def _released_on_interrupt(model: Any) -> Iterator[None]:
    """On Ctrl-C or CUDA out-of-memory, drop the fit's tensors now and say what state is kept.

    The traceback of an interrupted fit holds every frame below ``fit``, with the kernel blocks,
    preconditioner and data copies in their locals; a notebook keeps that traceback
    (``sys.last_traceback``) until the next error, so the memory would stay taken. Clearing the
    finished frames keeps the traceback's file and line information and frees the tensors.
    """
    try:
        yield
    except (KeyboardInterrupt, torch.cuda.OutOfMemoryError) as exc:
        traceback.clear_frames(exc.__traceback__)
        state = "keeps its previous fitted state" if hasattr(model, "predictor_") else "is left unfitted"
        exc.add_note(
            f"kgp: {type(model).__name__}.fit stopped ({type(exc).__name__}); the estimator {state}, and the "
            "fit's tensors were released"
        )
        raise


@contextlib.contextmanager
def _closing(monitor: Monitor) -> Iterator[Monitor]:
    """The model owns the monitor: its progress bar is closed however the fit ends."""
    try:
        yield monitor
    finally:
        monitor.close()


def _column_mean(Y: Tensor, shard: _dist.Shard | None = None) -> Tensor:
    """Mean of each column over all rows (all ranks' rows in a distributed fit: one all-reduce)."""
    if shard is None:
        return Y.mean(0)
    return shard.all_reduce_(Y.sum(0)).div_(shard.n_total)


def _normalize(Y: Tensor, normalize: bool, shard: _dist.Shard | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """scikit-learn's ``GaussianProcessRegressor(normalize_y=True)``: centre and scale each column.

    A constant column keeps the scale 1 (as scikit-learn does), so nothing is divided by zero.
    Distributed: the mean and the standard deviation of all ranks' rows (two all-reduces of k
    numbers: the sums, then the squared deviations from the global mean, as ``Tensor.std`` does).
    """
    if not normalize:
        return Y, {}
    mean = _column_mean(Y, shard)
    if shard is None:
        std = Y.std(0, correction=0)
    else:
        std = shard.all_reduce_((Y - mean).square().sum(0)).div_(shard.n_total).sqrt_()
    if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(std).all())):
        # the squared deviations overflow (|y| above ~1e154 in float64): std inf, every
        # prediction NaN (issue 25); the caller can rescale, kgp cannot pick the constant for them
        raise ValueError(
            f"y: normalize_y=True cannot standardize targets of magnitude {float(Y.abs().max()):.3g}: their "
            f"{'mean' if not bool(torch.isfinite(mean).all()) else 'standard deviation'} overflows "
            f"{str(Y.dtype).replace('torch.', '')}; divide y by a constant (e.g. its largest magnitude) first"
        )
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (Y - mean) / std, {"y_train_mean": mean, "y_train_std": std}


def _in_target_units(metric: Callable[[Tensor, Tensor], float] | None, shift: dict[str, Tensor]) -> Callable:
    """``metric`` applied to predictions mapped back from the solver's (centred, scaled) targets."""

    def scored(pred: Tensor, target: Tensor) -> float:
        out = pred.unsqueeze(-1) if pred.dim() == 1 else pred
        out = out + shift["mean"]
        if "y_train_std" in shift:
            out = out * shift["y_train_std"] + shift["y_train_mean"]
        if metric is not None:
            return metric(out, target)
        return float(((out.reshape(target.shape) - target) ** 2).mean())

    return scored


def _as_vector(value: Any, like: Tensor, fill: float) -> Tensor:
    if value is None:
        return torch.full_like(like, fill)
    return torch.as_tensor(value).to(dtype=like.dtype, device=like.device).reshape(-1).clone()


def _without_grads(kernel: gpytorch.kernels.Kernel) -> gpytorch.kernels.Kernel:
    """The learned kernel, detached from the optimiser's graph (its parameters keep ``requires_grad``)."""
    for p in kernel.parameters():
        p.grad = None
    return kernel


def _kernel_kwargs(kernel: gpytorch.kernels.Kernel) -> dict[str, Any]:
    return {"nu": kernel.nu} if isinstance(kernel, gpytorch.kernels.MaternKernel) else {}


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
