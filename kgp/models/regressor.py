"""Kernel ridge regression / GP posterior mean with pluggable solvers."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..monitor import Monitor
from ..plugin import Problem
from .base import BaseKernelModel

__all__ = ["KernelRegressor"]


class KernelRegressor(BaseKernelModel):
    r"""GP posterior mean / kernel ridge regressor, solved by a plugin chosen by name.

    The fitted function approximates the GP posterior mean with fixed noise,
    ``f(x) = K(x, X) (K(X, X) + noise * I)^{-1} y``; center-based solvers compute its Nystrom
    version on ``n_centers`` inducing points. ``noise`` is sigma^2: scikit-learn's
    ``KernelRidge(alpha=noise)``, FALKON's ``lambda = noise / n``, EigenPro's ``lambda = noise``.

    Parameters
    ----------
    kernel:
        A GPyTorch kernel object (copied at fit time, never mutated), or a shortcut: ``"rbf"``
        (``"gaussian"``), ``"laplacian"`` (``"matern12"``), ``"matern32"``, ``"matern52"``,
        ``"linear"``.
    lengthscale:
        Lengthscale for a shortcut kernel (sigma of the papers' Gaussian kernel). Ignored when
        ``kernel`` is an object.
    noise:
        GP observation-noise variance sigma^2 > 0 (default 1e-2).
    solver:
        Solver plugin name (``kgp plugins`` lists them). Default ``"exact"``.
    centers:
        Center-selector plugin name (default ``"uniform"`` for solvers that use centers) or an
        ``M x d`` array/tensor of centers (not necessarily training points).
    n_centers:
        Number of centers M (default: chosen by the selector; ``uniform`` takes
        ``min(n, max(100, 5 sqrt(n)))``).
    solver_options, selector_options:
        Dicts passed to the plugins; unknown keys raise ValueError listing the valid ones.
    device:
        Torch device for fitting (default: the device of X, CPU for numpy input).
    dtype:
        ``"float32"`` or ``"float64"`` (default: X's float dtype; integer input becomes float64).
    random_state:
        Seed for center selection and stochastic solvers (None: a fresh seed, stored in ``seed_``).
    callback:
        ``callback(info: IterationInfo) -> bool | None`` called by iterative solvers after each
        iteration; returning True stops early.
    progress:
        Show a tqdm progress bar for iterative solvers.

    Attributes
    ----------
    predictor_:
        The fitted plugin result (e.g. :class:`kgp.KernelExpansion`).
    solver_:
        The solver plugin object that produced it; ``solver_name_`` its name.
    kernel_:
        The GPyTorch kernel used (on the fitting device and dtype).
    centers_, center_weights_:
        Centers used (None for solvers without centers) and their weights (None: uniform).
    history_:
        List of :class:`kgp.IterationInfo` reported during the fit.
    fit_time_, seed_, n_features_in_, n_outputs_:
        Fit wall time (s), seed used, number of features, number of outputs.
    """

    _metric_name = "mse"

    def fit(self, X, y, *, validation_data=None) -> KernelRegressor:
        """Fit on ``X`` (n x d) and ``y`` (n or n x k).

        Parameters
        ----------
        validation_data:
            Optional ``(X_val, y_val)``; iterative solvers then report the validation mean
            squared error to the callback after every iteration.

        Returns
        -------
        self
        """
        _, _, dtype, device = self._check_params()
        Xt, yt = self._prepare_inputs(X, y, dtype, device)
        self._y_ndim = yt.dim()
        y2 = yt.unsqueeze(-1) if yt.dim() == 1 else yt
        validation = self._prepare_validation(validation_data, Xt, y2)
        self._fit_targets(Xt, y2, dtype, device, validation, None)
        self.n_outputs_ = y2.shape[1]
        return self

    def partial_fit(self, X, y) -> KernelRegressor:
        """Continue fitting on a new chunk of data (solvers with ``partial_fit`` only, e.g. streaming SGD)."""
        solver, options, dtype, device = self._check_params()
        if not hasattr(solver, "partial_fit"):
            raise ValueError(f"solver {self.solver!r} does not support partial_fit")
        first = not hasattr(self, "predictor_")
        Xt, yt = self._prepare_inputs(X, y, dtype if first else self.dtype_, device if first else self.device_)
        y2 = yt.unsqueeze(-1) if yt.dim() == 1 else yt
        if first:
            self._y_ndim = yt.dim()
            self.n_outputs_ = y2.shape[1]
            self.kernel_ = self._build_kernel(Xt.dtype, Xt.device)
            self.seed_ = int(self.random_state) if self.random_state is not None else int(torch.randint(0, 2**62, (1,)))
            self.n_features_in_, self.dtype_, self.device_ = Xt.shape[1], Xt.dtype, Xt.device
            self.solver_, self.solver_name_ = solver, self.solver
            self.centers_ = self.center_weights_ = None
            self.history_ = []
            self._chunks_seen = 0
        elif Xt.shape[1] != self.n_features_in_ or y2.shape[1] != self.n_outputs_:
            raise ValueError("partial_fit: X / y shapes differ from the first chunk")
        monitor = Monitor(self.callback, bool(self.progress))
        problem = Problem(
            X=Xt,
            y=y2,
            kernel=self.kernel_,
            noise=float(self.noise),
            options=options,
            generator=torch.Generator().manual_seed(self.seed_ + 1 + self._chunks_seen),
            monitor=monitor,
        )
        self.predictor_ = solver.partial_fit(problem, None if first else self.predictor_)
        self._chunks_seen += 1
        self.history_.extend(monitor.history)
        return self

    def _prepare_validation(self, validation_data, Xt: Tensor, y2: Tensor):
        if validation_data is None:
            return None
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
            raise ValueError("validation_data: expected a pair (X_val, y_val)")
        Xv, yv = self._prepare_inputs(validation_data[0], validation_data[1], Xt.dtype, Xt.device)
        if Xv.shape[1] != Xt.shape[1]:
            raise ValueError(f"validation_data: X_val has {Xv.shape[1]} features, X has {Xt.shape[1]}")
        yv = yv.unsqueeze(-1) if yv.dim() == 1 else yv
        if yv.shape[1] != y2.shape[1]:
            raise ValueError(f"validation_data: y_val has {yv.shape[1]} outputs, y has {y2.shape[1]}")
        return Xv, yv

    def predict(self, X):
        """Posterior mean at ``X``; numpy in, numpy out; tensor in, tensor out (1-D if y was 1-D)."""
        out, numpy_out = self._raw_predict(X)
        if self._y_ndim == 1:
            out = out[:, 0]
        return out.cpu().numpy() if numpy_out else out

    def score(self, X, y) -> float:
        """Coefficient of determination R^2 (averaged uniformly over outputs)."""
        pred = np.asarray(_numpy(self.predict(X)), dtype=np.float64)
        target = np.asarray(_numpy(y), dtype=np.float64).reshape(pred.shape)
        if target.ndim == 1:
            target, pred = target[:, None], pred[:, None]
        ss_res = ((target - pred) ** 2).sum(axis=0)
        ss_tot = ((target - target.mean(axis=0)) ** 2).sum(axis=0)
        r2 = np.where(ss_tot > 0, 1.0 - ss_res / np.where(ss_tot > 0, ss_tot, 1.0), 0.0)
        return float(r2.mean())


def _numpy(a):
    return a.detach().cpu().numpy() if isinstance(a, Tensor) else np.asarray(a)
