"""Kernel ridge regression / GP posterior mean with pluggable solvers."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..fitting.fit import ChunkState, fit_chunk, learn_only
from ..fitting.plan import check_device, prepare_plan
from ..validation import resolve_dtype, to_tensor
from .base import BaseKernelModel
from .sklearn_compat import feature_names_of, solver_method

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
        GP observation-noise variance sigma^2 > 0 (default 1e-2); with a named ``learn`` objective, the
        noise learning starts from (``learn="auto"`` starts from 0.7 of the targets' variance instead).
    solver:
        Solver plugin name (``kgp plugins`` lists them), or ``"auto"`` (default): the exact solve while the
        dense n x n matrix fits ``kgp.settings.memory_budget`` and ``max_exact_size``, else FALKON on as many
        uniform centers as the budget holds (up to 15,000 on a CPU, more on a faster device); the choice and
        its reason are in ``recipe_``.
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
    learn:
        None (default: the hyperparameters given are used as they are), an objective plugin name
        (``"exact"``, ``"sgpr"``, ``"holdout"``; ``kgp plugins``), or ``"auto"``: **the recommended GP** --
        the exact marginal likelihood on min(n, 3,000) random rows by 100 Adam steps (then up to 20
        L-BFGS evaluations while it still falls, ``learn_options`` ``polish_iterations``; else, above
        3,000 rows, up to 15 L-BFGS evaluations on min(n, 5,000) rows containing them, ``refine_subset``)
        from a noise of 0.7 times the targets' variance (``learn_options`` ``initial_noise_fraction``; ``noise`` is
        the start for a named objective), then the solve of ``solver`` (measured against the exact GP
        and GPyTorch's SGPR in docs/benchmarks/gp-default.md).
        Learns the kernel's hyperparameters, the noise variance and a constant mean; the best point
        evaluated is kept, and a :class:`kgp.ConvergenceWarning` says when learning failed, went astray or
        was still improving at its budget.
    learn_options:
        Options of the learning loop (``iterations``, ``lr``, ``optimizer``, ``min_noise``, ``refit_subset``,
        ...) and of the objective (e.g. ``subset`` for ``"exact"``); ``kgp plugins --options exact`` lists
        them. Unknown keys raise ValueError listing the valid ones.
    ard:
        One lengthscale per feature for shortcut kernels. None (default): on when learning, off otherwise.
    normalize_y:
        Standardise the targets (mean and std per output) for the fit and undo it in predictions and stds.
        None (default): on when learning.
    normalize_X:
        Standardise the feature columns with the training mean and std (constant columns keep scale 1);
        ``predict`` and ``centers_`` take and give the user's units, while ``kernel_`` (its lengthscales)
        acts on the standardised columns (``posterior_.input_scaling`` holds the mean and std). None
        (default): on when learning, where unscaled columns can learn a constant predictor.

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
    recipe_:
        What ``solver="auto"`` / ``learn="auto"`` chose (solver, n_centers, learn, learn_options) and why
        (``reasons``); with ``solver="auto"`` also ``memory``, the fit's estimated peak memory by part in
        bytes (checked before the fit allocated: :mod:`kgp.fitting.memory_estimate`). None when nothing was
        left to the recipe.
    noise_, mean_:
        The noise variance and constant mean used (learned with ``learn``), in the targets' units.
    learn_history_, learn_summary_, learn_refit_:
        The minimised objective per evaluation; how learning ended (``objective``, ``evaluations``,
        ``best_value``, ``best_evaluation``, ``stopped``: ``"budget"``, ``"callback"``, ``"interrupted"``
        or ``"failed: ..."``, ``log_marginal_likelihood``, ``likelihood_terms``; None without learning);
        what ``refit_subset`` changed. All three are kept by ``save`` / ``kgp.load``.
    log_marginal_likelihood_value_:
        scikit-learn's attribute: the log marginal likelihood at the learned hyperparameters, of the rows
        the objective used (``learn="exact"``; the collapsed lower bound for ``"sgpr"``); None without
        learning, for ``"holdout"`` and after ``refit_subset``.
    fit_time_, seed_, n_features_in_, n_outputs_:
        Fit wall time (s), seed used, number of features, number of outputs.
    shard_:
        None, or after ``fit(..., distributed=True)`` a dict ``rank``, ``world_size``, ``n_local``,
        ``n_total`` (docs/scaling-out.md).
    feature_names_in_:
        Column names of ``X`` when it was a table with string column names (a pandas DataFrame);
        ``predict`` then requires the same names in the same order. Absent otherwise.
    """

    _estimator_type = "regressor"

    def _encode_fit_targets(self, y, X: Tensor) -> tuple[Tensor, dict]:
        # X without rows only passes validation on a rank of a distributed fit: y matches it
        yt = to_tensor(y, "y", ndim=(1, 2), dtype=X.dtype, device=X.device, allow_empty=X.shape[0] == 0)
        Y = yt.unsqueeze(-1) if yt.dim() == 1 else yt
        return Y, {"_y_ndim": yt.dim(), "n_outputs_": Y.shape[1]}

    def _encode_targets(self, y, name: str, X: Tensor, targets: dict) -> Tensor:
        yt = to_tensor(y, name, ndim=(1, 2), dtype=X.dtype, device=X.device)
        Y = yt.unsqueeze(-1) if yt.dim() == 1 else yt
        if Y.shape[1] != targets["n_outputs_"]:
            raise ValueError(f"{name}: expected {targets['n_outputs_']} output(s) like y, got {Y.shape[1]}")
        return Y

    def _target_state(self) -> dict:
        return {"y_ndim": int(self._y_ndim), "n_outputs": int(self.n_outputs_)}

    @classmethod
    def _targets_from_state(cls, state: dict) -> dict:
        return {"_y_ndim": int(state["y_ndim"]), "n_outputs_": int(state["n_outputs"])}

    def fit(self, X, y, *, validation_data=None, distributed=False) -> KernelRegressor:
        """Fit on ``X`` (n x d) and ``y`` (n or n x k).

        Parameters
        ----------
        validation_data:
            Optional ``(X_val, y_val)``; iterative solvers then report the validation mean
            squared error to the callback after every iteration (in a distributed fit: this
            rank's validation rows).
        distributed:
            ``True`` or a ``torch.distributed`` ProcessGroup: ``X``, ``y`` are this rank's rows and
            every rank gets the model of all ranks' rows (docs/scaling-out.md). Default False.

        Returns
        -------
        self
        """
        return super().fit(X, y, validation_data=validation_data, distributed=distributed)

    @solver_method
    def partial_fit(self, X, y) -> KernelRegressor:
        """Continue fitting on a new chunk of data (solvers with ``partial_fit`` only, e.g. streaming SGD).

        The first call (on an unfitted model) starts a new model; later calls continue the fitted one
        with the same kernel, seed and dtype. Chunk ``c`` draws its randomness from the solve stream of
        chunk ``c`` (:class:`kgp.fitting.RandomStreams`).
        The method exists only when the solver implements it (``hasattr(model, "partial_fit")``).
        """
        params = self.get_params()
        plan = prepare_plan(params)
        first = "posterior_" not in self.__dict__
        if first:
            feature_names, dtype, device = feature_names_of(X), resolve_dtype(self.dtype), check_device(self.device)
        else:
            self._check_feature_names(X)
            feature_names, dtype, device = getattr(self, "feature_names_in_", None), self.dtype_, self.device_
        Xt = to_tensor(X, "X", ndim=(2,), dtype=dtype, device=device)
        Y, targets = self._encode_fit_targets(y, Xt)
        if Y.shape[0] != Xt.shape[0]:
            raise ValueError(f"X and y: expected the same number of samples, got {Xt.shape[0]} and {Y.shape[0]}")
        previous = None
        if not first:
            targets = {"_y_ndim": self._y_ndim, "n_outputs_": self.n_outputs_}
            previous = ChunkState(
                seed=self.seed_,
                kernel=self.kernel_,
                chunks_seen=self._chunks_seen,
                history=list(self.history_),
                predictor=self.predictor_,
                fit_time=self.fit_time_,
                n_features=self.n_features_in_,
                n_outputs=self.n_outputs_,
            )
        self._write_fit(fit_chunk(params, Xt, Y, previous, plan), targets, feature_names)
        return self

    def predict(self, X, return_std: bool = False, *, include_noise: bool = False):
        """Posterior mean at ``X``, and with ``return_std=True`` its predictive standard deviation.

        numpy in, numpy out; tensor in, tensor out (1-D if y was 1-D).

        Parameters
        ----------
        return_std:
            Also return the standard deviation, as scikit-learn's ``GaussianProcessRegressor``: of
            the **latent function f** (the observation noise ``noise_`` is not included, like
            scikit-learn's ``alpha``), in the targets' units (times the ``normalize_y`` scale). The
            exact GP variance for solvers with ``Capabilities(target="exact")`` (``exact``); the DTC / SGPR
            variance on the fitted centers for center-based solvers (``falkon``, ...), see
            :mod:`kgp.variance`. Other solvers raise ValueError naming the solver.
        include_noise:
            Add the noise variance: the standard deviation of a new observation y (for NLPD or
            prediction intervals).

        Returns
        -------
        mean, or (mean, std)
        """
        if not isinstance(return_std, bool):
            raise TypeError(f"return_std: expected True or False, got {return_std!r}")
        if include_noise and not return_std:
            raise ValueError("include_noise=True needs return_std=True")
        out, numpy_out = self._raw_predict(X)
        std = self._latent_std(X, include_noise).to(out.device) if return_std else None
        if self._y_ndim == 1:
            out = out[:, 0]
            std = None if std is None else std[:, 0]
        elif std is not None:
            std = std.expand_as(out)
        if numpy_out:
            out = out.cpu().numpy()
            std = None if std is None else std.cpu().numpy()
        return out if std is None else (out, std)

    def sample_y(self, X, n_samples: int = 1, random_state: int | None = 0):
        """Draws of the latent function at ``X`` from the fitted posterior (scikit-learn's ``sample_y``).

        Returns an array of shape ``(n, n_samples)`` for one output, ``(n, n_outputs, n_samples)``
        otherwise, in the targets' units (numpy in, numpy out). The joint covariance of the rows of ``X``
        is dense (:meth:`kgp.Posterior.covariance`): for up to a few thousand rows.
        """
        self._check_fitted()
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"n_samples: expected a positive integer, got {n_samples!r}")
        if random_state is not None and (isinstance(random_state, bool) or not isinstance(random_state, int)):
            raise TypeError(f"random_state: expected an int or None, got {random_state!r}")
        self._check_feature_names(X)
        Xt = self._query(X)
        generator = torch.Generator()
        generator.manual_seed(random_state if random_state is not None else int(torch.randint(0, 2**62, (1,))))
        draws = self.posterior_.sample(Xt, n_samples, generator)  # q x k x s
        if self._y_ndim == 1:
            draws = draws[:, 0, :]
        return draws if isinstance(X, Tensor) else draws.cpu().numpy()

    def fit_hyperparameters(self, X, y) -> dict:
        """Only learn: select centers and learn the hyperparameters, without solving; return them.

        The same stages as :meth:`fit` up to the solve (``learn`` must be set); the estimator is left as
        it was. Returns ``kernel`` (the learned GPyTorch kernel), ``noise`` and ``mean`` (in the scaled
        target units), ``history`` (the minimised value per evaluation) and the input and target
        scalings (``x_mean``, ``x_std``, ``y_mean``, ``y_std``; None when off).
        """
        params = self.get_params()
        plan = prepare_plan(params)
        Xt = to_tensor(X, "X", ndim=(2,), dtype=resolve_dtype(self.dtype), device=check_device(self.device))
        Y, _ = self._encode_fit_targets(y, Xt)
        if Y.shape[0] != Xt.shape[0]:
            raise ValueError(f"X and y: expected the same number of samples, got {Xt.shape[0]} and {Y.shape[0]}")
        return learn_only(params, Xt, Y, plan).as_dict()

    def score(self, X, y) -> float:
        """Coefficient of determination R^2 (averaged uniformly over outputs)."""
        pred = np.asarray(as_numpy(self.predict(X)), dtype=np.float64)
        target = np.asarray(as_numpy(y), dtype=np.float64).reshape(pred.shape)
        if target.ndim == 1:
            target, pred = target[:, None], pred[:, None]
        ss_res = ((target - pred) ** 2).sum(axis=0)
        ss_tot = ((target - target.mean(axis=0)) ** 2).sum(axis=0)
        r2 = np.where(ss_tot > 0, 1.0 - ss_res / np.where(ss_tot > 0, ss_tot, 1.0), 0.0)
        return float(r2.mean())


def as_numpy(a):
    return a.detach().cpu().numpy() if isinstance(a, Tensor) else np.asarray(a)
