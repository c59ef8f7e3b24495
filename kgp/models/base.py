"""The scikit-learn glue shared by :class:`KernelRegressor` and :class:`KernelClassifier`.

``fit`` converts the inputs (tensors, encoded targets, feature names), hands them with the parameters to
:func:`kgp.fitting.fit.fit_model`, which runs the whole fit, and writes the fitted attributes from what it
returns, all in :meth:`BaseKernelModel._set_fitted` (also used by ``partial_fit`` and by :func:`kgp.load`).
A fit that raises or is interrupted leaves the estimator as it was. Predictions come from the fitted
:class:`kgp.Posterior` (``posterior_``); model files are written and read by :mod:`.persistence`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from .. import distributed as dist
from ..diagnostics import not_fitted
from ..fitting.fit import ModelFit, build_kernel, draw_seed, fit_model
from ..fitting.plan import FitPlan, check_device, prepare_plan, resolve_flags
from ..fitting.stages import FitResult
from ..monitor import IterationInfo
from ..plugin import Centers
from ..validation import resolve_dtype, to_tensor
from .fit_support import released_on_interrupt, same_as_default, short_repr, warn_if_cast_collapses
from .gp_quantities import GPQuantities
from .sklearn_compat import SklearnProtocol, feature_names_of

__all__ = ["BaseKernelModel"]


class BaseKernelModel(GPQuantities, SklearnProtocol):
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
        solver: str = "auto",
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
        ard: bool | None = None,
        normalize_y: bool | None = None,
        normalize_X: bool | None = None,
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
        self.normalize_X = normalize_X

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
            f"{name}={short_repr(value)}"
            for name, value in self.get_params().items()
            if not same_as_default(value, defaults[name].default)
        ]
        return f"{type(self).__name__}({', '.join(changed)})"

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
        group = dist.resolve_group(distributed)
        with released_on_interrupt(self):
            if group is None:
                return self._fit(X, y, validation_data, None)
            with dist.guarded(group) as channel:  # every rank's failure, validation included, reaches the others
                return self._fit(X, y, validation_data, channel)

    def _fit(self, X, y, validation_data, channel):
        """Convert the inputs, fit (:func:`kgp.fitting.fit.fit_model`), write the fitted attributes.

        ``channel`` is None for a local fit, else the distributed fit's channel.
        """
        params = self.get_params()
        plan = prepare_plan(params)  # a bad parameter is reported before the data are looked at
        feature_names = feature_names_of(X)
        dtype, device = resolve_dtype(self.dtype), check_device(self.device)
        warn_if_cast_collapses(X, dtype, feature_names)
        Xt = to_tensor(X, "X", ndim=(2,), dtype=dtype, device=device, allow_empty=channel is not None)
        if channel is None:
            Y, targets = self._encode_fit_targets(y, Xt)
        else:
            Y, targets = self._encode_sharded_targets(y, Xt, channel)
        if Y.shape[0] != Xt.shape[0]:
            raise ValueError(f"X and y: expected the same number of samples, got {Xt.shape[0]} and {Y.shape[0]}")
        validation = self._validation(validation_data, Xt, targets)
        fitted = fit_model(
            params, Xt, Y, channel, plan=plan, validation=validation, validation_metric=self._validation_metric
        )
        self._write_fit(fitted, targets, feature_names)
        return self

    def _write_fit(self, fitted: ModelFit, targets: dict[str, Any], feature_names: np.ndarray | None) -> None:
        """The fitted attributes of a :class:`kgp.fitting.fit.ModelFit` (see :meth:`_set_fitted`)."""
        self._set_fitted(
            solver_name=fitted.solver.name,
            solver=fitted.solver.plugin,
            result=fitted.result,
            recipe=fitted.recipe,
            seed=fitted.seed,
            n_features=fitted.n_features,
            targets=targets,
            fit_time=fitted.fit_time,
            chunks_seen=fitted.chunks_seen,
            shard=fitted.shard,
            feature_names=feature_names,
        )

    def _draw_seed(self) -> int:
        return draw_seed(self.random_state)

    def _build_kernel(
        self, dtype: torch.dtype, device, n_features: int | None = None, plan: FitPlan | None = None
    ) -> gpytorch.kernels.Kernel:
        """The kernel a fit of ``plan`` builds (:func:`kgp.fitting.fit.build_kernel`); without a plan, the
        ``ard`` switch as the parameters resolve it."""
        params = self.get_params()
        ard = plan.ard if plan is not None else resolve_flags(params, learning=self.learn is not None)["ard"]
        return build_kernel(params, ard, dtype, device, n_features)

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

    def _set_fitted(
        self,
        *,
        solver_name: str,
        solver: Any,
        result: FitResult,
        seed: int,
        n_features: int,
        targets: dict[str, Any],
        fit_time: float,
        chunks_seen: int = 0,
        shard: dist.Shard | None = None,
        feature_names: np.ndarray | None = None,
        recipe: Any = None,
    ) -> None:
        """Write every fitted attribute (the one place that does: fit, partial_fit and load call it).

        ``solver`` is the plugin object of ``solver_name`` (the one the fit's plan resolved, or the one
        :func:`kgp.load` found); ``recipe`` plain values or a :class:`kgp.recipes.RecipeChoice`.
        """
        posterior = result.posterior
        centers: Centers | None = result.centers
        self.posterior_ = posterior
        # what solver='auto' / learn='auto' chose and why (kgp.recipes); None when nothing was left to it
        self.recipe_ = recipe if recipe is None or isinstance(recipe, dict) else recipe.as_dict()
        self.kernel_ = posterior.kernel
        self.solver_name_ = solver_name
        self.solver_ = solver
        self.predictor_ = posterior.predictor
        points = None if centers is None else centers.points
        if points is not None and posterior.input_scaling is not None:
            points = posterior.input_scaling.undo(points)  # in the user's units, like X
        self.centers_ = points
        self.center_weights_ = None if centers is None else centers.weights
        self.selection_info_ = {} if centers is None else centers.info
        self.learn_history_ = list(result.learned.history)
        # how learning ended (best point, why it stopped, the likelihood); None without learning
        self.learn_summary_ = result.learned.summary
        self.learn_refit_ = result.learned.refit
        self.history_ = result.history
        self.seed_ = seed
        self.n_features_in_ = n_features
        like = posterior.offset
        self.dtype_ = like.dtype
        self.device_ = like.device
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
        if "posterior_" not in self.__dict__:
            raise not_fitted(f"this {type(self).__name__} is not fitted yet; call fit(X, y) first")

    def _query(self, X, argument: str = "X") -> Tensor:
        Xt = to_tensor(X, argument, ndim=(2,), dtype=self.dtype_, device=self.device_)
        if Xt.shape[1] != self.n_features_in_:
            # scikit-learn's wording (its checks match it)
            raise ValueError(
                f"X has {Xt.shape[1]} features, but {type(self).__name__} is expecting "
                f"{self.n_features_in_} features as input"
            )
        return Xt

    def _raw_predict(self, X) -> tuple[Tensor, bool]:
        """Return the ``n x k`` posterior mean and whether the input was numpy-like."""
        self._check_fitted()
        is_tensor = isinstance(X, Tensor)
        self._check_feature_names(X)
        out = self.posterior_.mean(self._query(X))
        if is_tensor:
            out = out.to(X.device)
        return out, not is_tensor

    def _latent_std(self, X, include_noise: bool) -> Tensor:
        """``n x k`` predictive standard deviation at X in the targets' units (see ``predict``)."""
        self._check_fitted()
        if not isinstance(include_noise, bool):
            raise TypeError(f"include_noise: expected True or False, got {include_noise!r}")
        return self.posterior_.std(self._query(X), include_noise)

    # ------------------------------------------------------------------ persistence
    def save(self, path) -> None:
        """Write the fitted model to ``path`` (loads with ``torch.load(weights_only=True)``).

        The file holds the kernel's class description and hyperparameters, the solver plugin name,
        the fitted :class:`kgp.Posterior` (the predictor's kind and tensors, the noise, mean and target
        scaling, and what the predictive variance needs) and the estimator's plain parameters. Callbacks
        and explicit center arrays given as parameters are not stored (the fitted centers are, inside
        the predictor). After a distributed fit only rank 0 writes (every rank holds the same model);
        on the other ranks ``save`` does nothing, so both ``model.save(path)`` on every rank and
        ``if rank == 0: model.save(path)`` work.
        """
        from .persistence import save_model

        self._check_fitted()
        if self.shard_ is not None and self.shard_["rank"] != 0:
            return
        save_model(self, path)
