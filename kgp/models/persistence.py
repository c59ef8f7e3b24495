"""Model files: the contents an estimator writes (format version 4) and the estimator rebuilt from them.

Layout (tensors and plain values only; the container, version and checksum are :mod:`kgp.io`'s)::

    estimator     "KernelRegressor" | "KernelClassifier"
    params        the estimator's plain constructor parameters
    kernel_spec   the kernel's class description (kgp.kernels.serialize); kernel_state its tensors
    solver        the solver plugin's name
    posterior     kgp.Posterior.state_dict(): version, noise, offset, target scaling, predictor, variance
    fitted        n_features_in, seed, the targets' description, feature names, center weights,
                  learning history and refit
    probe         two input rows, the posterior mean there at save time and, where the variance is cheap
                  to have (:func:`_probe_std`), the latent std: the rebuilt model must reproduce them
                  (every entry that shapes a prediction or its std is checked together)

Every entry is checked before anything it sizes is allocated (:func:`check_contents`); files of format
versions 1 and 2 (kgp before the Posterior) are read through :func:`upgrade`; version 3 differs from 4 only in
the Nystrom variance's factors (two square arrays, folded on loading by :mod:`kgp.variance.nystrom`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import io
from ..fitting.stages import FitHyperparameters, FitResult
from ..io import ModelFileError
from ..kernels.serialize import kernel_from_spec, kernel_to_spec
from ..plugin import Centers
from ..posterior import Posterior, PosteriorStateError
from ..registry import UnknownPluginError, get_predictor_class, get_solver
from ..validation import all_finite

__all__ = ["check_contents", "model_from_state", "save_model"]

# constructor parameters stored in model files as plain values (the others are objects or derived)
PLAIN_PARAMS = (
    "lengthscale",
    "noise",
    "solver",
    "n_centers",
    "solver_options",
    "selector_options",
    "random_state",
    "learn",
    "learn_options",
    "ard",
    "normalize_y",
    "normalize_X",
)
DTYPES = {"float32": torch.float32, "float64": torch.float64}
_MAX_SPEC_DEPTH = 32  # kernels nest a few levels (Scale(Product(...))); deeper is not a kgp file


def save_model(model: Any, path) -> None:
    """Write the fitted ``model`` to ``path`` (format version 4, see the module docstring)."""
    params = {name: getattr(model, name) for name in PLAIN_PARAMS}
    params["learn_options"] = _plain_learn_options(model.learn_options)
    params["kernel"] = model.kernel if isinstance(model.kernel, str) else None
    params["centers"] = model.centers if isinstance(model.centers, str) else None
    params["dtype"] = str(model.dtype_).replace("torch.", "")
    fitted: dict[str, Any] = {"n_features_in": int(model.n_features_in_), "seed": int(model.seed_)}
    fitted.update(model._target_state())
    if getattr(model, "feature_names_in_", None) is not None:
        fitted["feature_names"] = [str(name) for name in model.feature_names_in_]
    if model.center_weights_ is not None:
        fitted["center_weights"] = model.center_weights_.detach().cpu()
    fitted["learning"] = {"history": [float(v) for v in model.learn_history_]}
    if model.learn_summary_ is not None:
        fitted["learning"]["summary"] = dict(model.learn_summary_)
    if model.learn_refit_ is not None:
        fitted["learning"]["refit"] = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in model.learn_refit_.items()
        }
    probe = _probe_rows(model)
    with torch.no_grad():
        probe_mean = model.posterior_.mean(probe)
    recorded = {"X": probe.detach().cpu(), "mean": probe_mean.detach().cpu()}
    std = _probe_std(model.posterior_, probe)
    if std is not None:
        recorded["std"], recorded["std_with_noise"] = (v.detach().cpu() for v in std)
    io.write_model(
        {
            "estimator": type(model).__name__,
            "params": params,
            "kernel_spec": kernel_to_spec(model.kernel_),
            "kernel_state": {k: v.detach().cpu() for k, v in model.kernel_.state_dict().items()},
            "solver": model.solver_name_,
            "posterior": model.posterior_.state_dict(),
            "fitted": fitted,
            "probe": recorded,
        },
        path,
    )


def _plain_learn_options(options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``learn_options`` without ``noise_prior``: a GPyTorch prior is a Python object, not plain data.

    Like the priors of a kernel object (the kernel spec records none), it shapes only the learning,
    not the fitted posterior: the loaded model predicts the same; a refit of it learns without the
    prior unless it is given again (docs/gp-workflow.md).
    """
    if options is None or options.get("noise_prior") is None:
        return options
    plain = {k: v for k, v in options.items() if k != "noise_prior"}
    return plain or None


def _probe_rows(model: Any) -> torch.Tensor:
    """Two rows where the saved model's mean is recorded: the first centers, or zeros."""
    points = getattr(model.posterior_.predictor, "centers", None)
    if torch.is_tensor(points) and points.dim() == 2 and points.shape[0] >= 2:
        points = points[:2].detach()
        scaling = model.posterior_.input_scaling
        if scaling is not None:  # the predictor's centers are standardised; the probe is in the user's units
            points = scaling.undo(points)  # (else, far outside the data, the std there is the prior's)
        return points.to(dtype=model.dtype_)
    return torch.zeros(2, model.n_features_in_, dtype=model.dtype_, device=model.device_)


# ---------------------------------------------------------------------- reading
def check_contents(state: dict[str, Any], path, *, upgraded: bool = False) -> None:
    """Types, ranges and shapes of every entry that :func:`model_from_state` reads (version-3 layout).

    ``upgraded``: the contents came from an older file through :func:`upgrade` (no recorded probe mean).
    """
    for key, kind in (
        ("params", dict),
        ("kernel_spec", dict),
        ("kernel_state", dict),
        ("solver", str),
        ("posterior", dict),
        ("fitted", dict),
        ("probe", dict),
    ):
        if not isinstance(state.get(key), kind):
            raise _fail(path, key, f"is missing or not a {kind.__name__} (got {type(state.get(key)).__name__})")
    params, fitted, probe = state["params"], state["fitted"], state["probe"]
    noise = params.get("noise")
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise <= 0:
        raise _fail(path, "params.noise", f"must be a finite positive number, got {noise!r}")
    scale = params.get("lengthscale")
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        raise _fail(path, "params.lengthscale", f"must be None or a finite positive number, got {scale!r}")
    if not isinstance(params.get("dtype"), str) or params.get("dtype") not in DTYPES:
        raise _fail(path, "params.dtype", f"must be one of {', '.join(DTYPES)}, got {params.get('dtype')!r}")
    probe_X = probe.get("X")
    if not torch.is_tensor(probe_X) or probe_X.dim() != 2 or probe_X.shape[0] != 2:
        raise _fail(path, "probe.X", "must be a 2 x d tensor")
    if not upgraded and not torch.is_tensor(probe.get("mean")):
        raise _fail(path, "probe.mean", "must be a tensor (the mean at probe.X recorded at save time)")
    n_features = fitted.get("n_features_in")
    # the probe rows are in the file already: a feature count that matches them allocates nothing new
    if isinstance(n_features, bool) or not isinstance(n_features, int) or n_features != probe_X.shape[1]:
        raise _fail(
            path, "fitted.n_features_in", f"must be the probe's {probe_X.shape[1]} features, got {n_features!r}"
        )
    if not isinstance(fitted.get("seed"), int):
        raise _fail(path, "fitted.seed", f"must be an integer, got {fitted.get('seed')!r}")
    names = fitted.get("feature_names")
    if names is not None and (
        not isinstance(names, list) or len(names) != n_features or not all(isinstance(n, str) for n in names)
    ):
        raise _fail(path, "fitted.feature_names", f"must be {n_features} strings (one per feature)")
    if state.get("estimator") == "KernelClassifier":
        classes = fitted.get("classes")
        if not isinstance(classes, list) or len(classes) < 2 or len(set(map(repr, classes))) != len(classes):
            raise _fail(path, "fitted.classes", f"must be a list of at least 2 distinct labels, got {classes!r}")
    else:
        outputs = fitted.get("n_outputs")
        if isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 1:
            raise _fail(path, "fitted.n_outputs", f"must be a positive integer, got {outputs!r}")
        if fitted.get("y_ndim") not in (1, 2) or (fitted.get("y_ndim") == 1 and outputs != 1):
            raise _fail(path, "fitted.y_ndim", f"must be 1 (one output) or 2, got {fitted.get('y_ndim')!r}")
    _check_spec(state["kernel_spec"], n_features, path, "kernel_spec", 0)
    for where, tensor in _tensors(state):
        if not tensor.is_floating_point() or all_finite(tensor):
            continue
        if bool(torch.isnan(tensor).any()):
            raise _fail(path, where, "contains NaN values")
        # GPyTorch stores constraint bounds (e.g. an upper bound of +inf) as buffers: infinity is valid there only
        if "_constraint." not in where and not bool(torch.isfinite(tensor).all()):
            raise _fail(path, where, "contains infinite values")


def _check_spec(spec: Any, n_features: int, path, where: str, depth: int) -> None:
    """A kernel spec whose shapes fit the data: ARD dimensions and active dimensions within n_features."""
    if depth > _MAX_SPEC_DEPTH:
        raise _fail(path, where, f"nests kernels more than {_MAX_SPEC_DEPTH} deep")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("kwargs", {}), Mapping):
        raise _fail(path, where, "must be a dict with a 'kwargs' dict")
    kwargs = spec.get("kwargs", {})
    ard = kwargs.get("ard_num_dims")
    if ard is not None and (isinstance(ard, bool) or not isinstance(ard, int) or not 1 <= ard <= n_features):
        raise _fail(path, f"{where}.kwargs.ard_num_dims", f"must be an integer in [1, {n_features}], got {ard!r}")
    active = kwargs.get("active_dims")
    if active is not None and (
        not isinstance(active, list)
        or len(active) > n_features
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_features for i in active)
    ):
        raise _fail(path, f"{where}.kwargs.active_dims", f"must be feature indices below {n_features}")
    batch = kwargs.get("batch_shape")
    if batch is not None and (
        not isinstance(batch, list) or len(batch) > 4 or not all(isinstance(b, int) and 1 <= b <= 1024 for b in batch)
    ):
        raise _fail(path, f"{where}.kwargs.batch_shape", "must be a short list of small positive integers")
    children = spec.get("children", [])
    if not isinstance(children, list) or len(children) > 64:
        raise _fail(path, f"{where}.children", "must be a list of at most 64 kernel specs")
    for i, child in enumerate(children):
        _check_spec(child, n_features, path, f"{where}.children[{i}]", depth + 1)


def model_from_state(cls: type, state: dict[str, Any], path, device: torch.device) -> Any:
    """Rebuild a fitted estimator of class ``cls`` from checked contents (see :func:`kgp.load`)."""
    solver_name = state["solver"]
    posterior_state = state["posterior"]
    try:
        solver = get_solver(solver_name)
        predictor_cls = get_predictor_class(posterior_state.get("predictor_kind"))
    except UnknownPluginError as exc:
        raise ValueError(
            f"{path}: this model was fitted by solver {solver_name!r} (predictor kind "
            f"{posterior_state.get('predictor_kind')!r}), which is not installed here: {exc}"
        ) from exc
    params = dict(state["params"])
    dtype = DTYPES[params.pop("dtype")]
    # convert before loading: a float32 kernel would round float64 hyperparameters
    kernel = kernel_from_spec(state["kernel_spec"]).to(device=device, dtype=dtype)
    kernel.load_state_dict(state["kernel_state"])
    model = cls(**{k: v for k, v in params.items() if k != "kernel"})
    model.kernel = params["kernel"] if params["kernel"] is not None else kernel
    model.dtype = dtype
    fitted = state["fitted"]
    targets = cls._targets_from_state(fitted)
    n_outputs = targets.get("n_outputs_") or (1 if len(targets["classes_"]) == 2 else len(targets["classes_"]))
    try:
        posterior = Posterior.from_state(
            posterior_state,
            kernel,
            predictor_cls,
            n_features=fitted["n_features_in"],
            n_outputs=n_outputs,
            device=device,
            dtype=dtype,
        )
    except PosteriorStateError as exc:
        raise ModelFileError(f"{path}: invalid model file: {exc}") from None
    points = getattr(posterior.predictor, "centers", None) if solver.capabilities.uses_centers else None
    centers = None
    if points is not None:
        weights = fitted.get("center_weights")
        weights = None if weights is None else weights.to(device=device, dtype=dtype)
        centers = Centers(points=points, weights=weights)
    learning = fitted.get("learning", {})
    learned = FitHyperparameters(
        kernel,
        posterior.noise,
        posterior.offset,
        list(learning.get("history", [])),
        learning.get("refit"),
        _learn_summary(path, learning.get("summary")),
    )
    model._set_fitted(
        solver_name=solver_name,
        solver=solver,
        result=FitResult(posterior, centers, learned, []),
        seed=fitted["seed"],
        n_features=fitted["n_features_in"],
        targets=targets,
        fit_time=0.0,
        feature_names=None if "feature_names" not in fitted else np.asarray(fitted["feature_names"], dtype=object),
    )
    return model


# the probe's std is recorded when the variance is built, or building it costs at most this many flops and
# keeps at most PROBE_STD_BYTES (a save never turns into minutes of work or a large allocation)
PROBE_STD_FLOPS = 1e10
PROBE_STD_BYTES = 64 * 2**20


def _affordable(posterior: Any) -> bool:
    """Whether the posterior has a variance that is built, or whose build costs at most
    :data:`PROBE_STD_FLOPS` and :data:`PROBE_STD_BYTES`."""
    variance = getattr(posterior, "variance", None)
    if variance is None or not posterior.has_variance:
        return False
    cost = variance.build_cost()
    return cost is not None and cost[0] <= PROBE_STD_FLOPS and cost[1] <= PROBE_STD_BYTES


def _stds(posterior: Any, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent std and the std with the noise at ``X``, from a copy of the posterior's variance: a variance
    the model had not built stays unbuilt (built when the user asks for a std, under the settings then)."""
    clone = copy.copy(posterior)
    clone.variance = copy.copy(posterior.variance)
    with torch.no_grad():
        return clone.std(X), clone.std(X, include_noise=True)


def _probe_std(posterior: Any, probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The latent std at the probe rows and the std of a new observation there (the noise included), in the
    targets' units; None without a variance, or where building it would cost more than
    :data:`PROBE_STD_FLOPS` / :data:`PROBE_STD_BYTES`."""
    if not _affordable(posterior):
        return None
    try:
        std = _stds(posterior, probe)
    except (ValueError, RuntimeError):
        return None  # a variance that cannot be built here (settings, not positive definite) is not recorded
    return std if all(bool(torch.isfinite(v).all()) for v in std) else None


def check_probe(model: Any, state: dict[str, Any], path) -> None:
    """The rebuilt model's mean at the file's probe rows must be the one recorded at save time, and so must
    its std where the file records one (the variance entries: noise, training rows, centers, factors)."""
    probe = state["probe"]
    X = probe["X"].to(device=model.device_, dtype=model.dtype_)
    expected = probe.get("mean")
    try:
        with torch.no_grad():
            out = model.posterior_.mean(X)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise ModelFileError(
            f"{path}: inconsistent model file: its predictor fails on {model.n_features_in_} features "
            f"({type(exc).__name__}: {io.one_line(exc)})"
        ) from None
    if not bool(torch.isfinite(out).all()):
        raise ModelFileError(f"{path}: inconsistent model file: the predictor gives non-finite values")
    outputs = getattr(model, "n_outputs_", None)
    if outputs is None:  # classifier: one score for two classes, one per class otherwise
        outputs = 1 if len(model.classes_) == 2 else len(model.classes_)
    if out.shape[-1] != outputs:
        raise ModelFileError(
            f"{path}: inconsistent model file: the predictor gives {out.shape[-1]} output(s), the estimator "
            f"records {outputs}"
        )
    if expected is None:  # a file from before the probe (upgraded): nothing was recorded to compare with
        return
    if not torch.is_tensor(expected) or tuple(expected.shape) != tuple(out.shape):
        raise ModelFileError(
            f"{path}: invalid model file: probe.mean must be the {tuple(out.shape)} mean at probe.X "
            f"(the predictor gives {out.shape[-1]} output(s))"
        )
    expected = expected.to(device=out.device, dtype=torch.float64)
    # the same computation on the same entries: equal up to the rounding of another BLAS code path
    eps = torch.finfo(model.dtype_).eps
    tol = 1e4 * eps * (1.0 + float(expected.abs().max()))
    if float((out.double() - expected).abs().max()) > tol:
        raise ModelFileError(
            f"{path}: inconsistent model file: the mean at the probe rows differs from the one recorded at save "
            "time (an entry of kernel_state or posterior was changed)"
        )
    _check_probe_std(model, probe, X, path)


def _check_probe_std(model: Any, probe: dict[str, Any], X: torch.Tensor, path) -> None:
    """The std at the probe rows against the recorded one: changed variance entries (a noise x1e8, replaced
    training rows or centers) leave the mean as it was and move the std by orders of magnitude."""
    recorded = {key: probe.get(key) for key in ("std", "std_with_noise") if probe.get(key) is not None}
    if not recorded:  # not recorded (no variance, or too costly to build at save time)
        return
    posterior = model.posterior_
    for key, expected in recorded.items():
        if not torch.is_tensor(expected) or expected.dim() != 2 or expected.shape[0] != X.shape[0]:
            raise ModelFileError(f"{path}: invalid model file: probe.{key} must be the std at probe.X (2 x outputs)")
    if not posterior.has_variance:
        raise ModelFileError(f"{path}: inconsistent model file: probe.std records a std, but the posterior has none")
    if not _affordable(posterior):
        return  # the file's rows make the variance costly to build: not checked here (nor recorded at save)
    try:
        got = dict(zip(("std", "std_with_noise"), _stds(posterior, X), strict=True))
    except ValueError as exc:
        if "kgp.settings." in str(exc):
            return  # the settings in effect refuse to build the variance now; the first std will say so
        raise ModelFileError(
            f"{path}: inconsistent model file: its variance fails on the probe rows ({io.one_line(exc)})"
        ) from None
    except (RuntimeError, IndexError, TypeError) as exc:
        raise ModelFileError(
            f"{path}: inconsistent model file: its variance fails on the probe rows ({type(exc).__name__}: "
            f"{io.one_line(exc)})"
        ) from None
    for key, expected in recorded.items():
        _compare_probe_std(posterior, expected, got[key], f"probe.{key}", path)


def _compare_probe_std(posterior: Any, expected: torch.Tensor, got: torch.Tensor, key: str, path) -> None:
    if tuple(got.shape) != tuple(expected.shape):
        raise ModelFileError(f"{path}: invalid model file: {key} must have the shape {tuple(got.shape)}")
    # compared in the scaled units the kernel works in, where the prior std is about 1: rounding of another
    # BLAS code path moves it by far less than 1e-3, a changed noise or set of rows by orders more
    unit = posterior.scaling.std.reshape(1, -1).double()
    difference = ((got.double() - expected.to(device=got.device, dtype=torch.float64)) / unit).abs().max()
    scale = float((expected.to(device=got.device, dtype=torch.float64) / unit).abs().max())
    if not bool(torch.isfinite(got).all()) or float(difference) > 1e-4 + 1e-3 * scale:
        raise ModelFileError(
            f"{path}: inconsistent model file: the std at the probe rows differs from the one recorded at save "
            f"time ({key}; a variance entry of posterior was changed: the noise, the training rows or the centers)"
        )


def _fail(path, where: str, what: str) -> ModelFileError:
    return ModelFileError(f"{path}: invalid model file: {where} {what}")


def _tensors(value: Any, where: str = ""):
    if torch.is_tensor(value):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")


# the learning summary's entries and the types a file may give them (None allowed for each)
_SUMMARY_TYPES: dict[str, tuple[type, ...]] = {
    "objective": (str,),
    "evaluations": (int,),
    "best_value": (int, float),
    "best_evaluation": (int,),
    "stopped": (str,),
    "log_marginal_likelihood": (int, float),
    "likelihood_terms": (int,),
    "refine": (dict,),
}
# the refine stage's entries (learn_options['refine_subset'], kgp.learning.LearnResult.refine)
_REFINE_TYPES: dict[str, tuple[type, ...]] = {
    "subset": (int,),
    "first_evaluation": (int,),
    "evaluations": (int,),
    "start": (int, float),
    "first_stage_best": (int, float),
}


def _checked_entries(path: Any, where: str, entries: dict, types: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for key, value in entries.items():
        kinds = types.get(key)
        if kinds is None:
            raise _fail(path, f"{where}.{key}", f"is not an entry kgp writes ({sorted(types)})")
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise _fail(path, f"{where}.{key}", f"must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        checked[key] = value
    return checked


def _learn_summary(path: Any, summary: Any) -> dict[str, Any] | None:
    """The file's ``fitted.learning.summary`` checked entry by entry (None in files written before it)."""
    if summary is None:
        return None
    if not isinstance(summary, dict):
        raise _fail(path, "fitted.learning.summary", f"must be a dict, got {type(summary).__name__}")
    checked = _checked_entries(path, "fitted.learning.summary", summary, _SUMMARY_TYPES)
    if checked.get("refine") is not None:
        checked["refine"] = _checked_entries(path, "fitted.learning.summary.refine", checked["refine"], _REFINE_TYPES)
    return checked
