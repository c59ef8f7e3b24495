"""Solver checks on the fit itself: the protocol, the oracle of the declared target, dtypes, devices,
several outputs, weighted centers and ``partial_fit``.

The oracle is chosen from ``capabilities.target`` (:func:`~kgp.testing.oracles.target_oracle`), not
from ``uses_centers``: a solver that uses its centers only to precondition and targets the exact
posterior is compared with the exact posterior mean. ``fit`` is called as the model calls it,
under ``torch.no_grad()`` unless the solver declares ``needs_grad``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..capabilities import Capabilities
from ..models import KernelRegressor
from ..plugin import Centers, Problem
from ..registry import get_predictor_class
from .oracles import DEFAULT_SPEC, OracleData, OracleSpec, make_oracle_data, target_oracle
from .support import (
    capabilities_of,
    check_close,
    current_registry,
    is_plain,
    options_for,
    plugin_info,
    plugin_work,
    reproduces,
    skip,
)

__all__ = [
    "check_solver_center_weights",
    "check_solver_device",
    "check_solver_dtype",
    "check_solver_multi_output",
    "check_solver_oracle",
    "check_solver_partial_fit",
    "check_solver_protocol",
    "solver_model",
]


def solver_model(
    name: str, data: OracleData, solver_options: Mapping[str, Any] | None, **params: Any
) -> KernelRegressor:
    """A ``KernelRegressor`` for the kit's problem; solvers that use centers get the explicit ones."""
    spec = data.spec
    kwargs: dict[str, Any] = {
        "kernel": spec.kernel if isinstance(spec.kernel, str) else copy.deepcopy(spec.kernel),
        "lengthscale": spec.lengthscale,
        "noise": spec.noise,
        "solver": name,
        "solver_options": dict(solver_options or {}),
        "random_state": 0,
    }
    if capabilities_of("solver", name).uses_centers and "centers" not in params:
        kwargs["centers"] = data.centers
    kwargs.update(params)
    return KernelRegressor(**kwargs)


def _oracle(name: str, data: OracleData) -> Tensor:
    return target_oracle(capabilities_of("solver", name).target, data)


def _fit_directly(name: str, problem: Problem):
    """``solver.fit(problem)`` as the model calls it (no autograd unless the solver needs it)."""
    info = plugin_info("solver", name)
    with plugin_work(info.capabilities):
        return info.obj.fit(problem)


def check_solver_protocol(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """The declarations, the predictor ``fit`` returns, and that ``fit`` leaves its inputs alone."""
    info = plugin_info("solver", name)
    solver, caps = info.obj, info.capabilities
    if not isinstance(caps, Capabilities) or getattr(solver, "capabilities", caps) != caps:
        raise AssertionError(f"solver {name!r}: capabilities must be a kgp.Capabilities, got {caps!r}")
    if caps.partial_fit != callable(getattr(solver, "partial_fit", None)):
        raise AssertionError(f"solver {name!r}: Capabilities.partial_fit={caps.partial_fit} but partial_fit method")
    data = make_oracle_data(spec, n_outputs=2)
    problem = Problem(
        X=data.X.clone(),
        y=data.y.clone(),
        kernel=spec.make_kernel(torch.float64),
        noise=spec.noise,
        centers=Centers(data.centers.clone(), indices=data.center_indices.clone()) if caps.uses_centers else None,
        options=options_for("solver", name, solver_options),
        generator=torch.Generator().manual_seed(1),
    )
    predictor = _fit_directly(name, problem)
    for label, before, after in (("X", data.X, problem.X), ("y", data.y, problem.y)):
        if not torch.equal(before, after):
            raise AssertionError(f"solver {name!r}: fit modified problem.{label} in place")
    if caps.uses_centers and not torch.equal(data.centers, problem.centers.points):
        raise AssertionError(f"solver {name!r}: fit modified problem.centers in place")
    kind = getattr(predictor, "kind", None)
    if not isinstance(kind, str):
        raise AssertionError(f"solver {name!r}: the predictor has no str `kind` (got {type(predictor).__name__})")
    if kind not in current_registry().names("predictor"):
        raise AssertionError(
            f"solver {name!r}: predictor kind {kind!r} is not registered (implement register_predictors), "
            "so saved models cannot be loaded"
        )
    with torch.no_grad():
        pred = predictor.predict(data.X_test)
    if not isinstance(pred, Tensor) or tuple(pred.shape) != (spec.n_test, 2):
        raise AssertionError(
            f"solver {name!r}: predict(X) must return an n x k tensor, expected {(spec.n_test, 2)}, got "
            f"{tuple(pred.shape) if isinstance(pred, Tensor) else type(pred).__name__}"
        )
    if pred.dtype != data.X.dtype:
        raise AssertionError(f"solver {name!r}: predict returned {pred.dtype} for {data.X.dtype} input")
    state = predictor.state_dict()
    if not isinstance(state, dict) or not is_plain(state):
        raise AssertionError(
            f"solver {name!r}: state_dict() must hold only tensors and plain values (for weights_only loading)"
        )
    rebuilt = get_predictor_class(kind).from_state(state, spec.make_kernel(torch.float64))
    with torch.no_grad():
        again = rebuilt.predict(data.X_test)
    if not reproduces(again, pred):
        raise AssertionError(
            f"solver {name!r}: from_state(state_dict()) predicts differently "
            f"(max abs diff {float((pred - again).abs().max()):.3e})"
        )
    return {"distribution": info.distribution, "predictor_kind": kind, "target": caps.target}


def check_solver_oracle(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """float64 fit against the oracle of the declared target (exact posterior mean or Nystrom estimator)."""
    data = make_oracle_data(spec)
    model = solver_model(name, data, solver_options).fit(data.X, data.y[:, 0])
    err = check_close(f"solver {name!r} (float64)", model.predict(data.X_test), _oracle(name, data)[:, 0], rtol)
    return {"rel_error": err, "target": capabilities_of("solver", name).target}


def check_solver_dtype(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    rtol_float32: float = 1e-3,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """float32 in -> float32 out (within ``rtol_float32`` of the float64 oracle); float64 in -> float64 out."""
    base = make_oracle_data(spec)
    ref = _oracle(name, base)
    errors = {}
    for dtype, tol in ((torch.float32, rtol_float32), (torch.float64, rtol)):
        data = base.cast(dtype)
        model = solver_model(name, data, solver_options).fit(data.X, data.y)
        pred = model.predict(data.X_test)
        if pred.dtype != dtype:
            raise AssertionError(f"solver {name!r}: {dtype} input gave {pred.dtype} predictions")
        centers = getattr(model, "centers_", None)
        if isinstance(centers, Tensor) and centers.dtype != dtype:
            raise AssertionError(f"solver {name!r}: model.centers_ is {centers.dtype} for {dtype} input")
        errors[str(dtype).replace("torch.", "")] = check_close(f"solver {name!r} ({dtype})", pred, ref, tol)
    # numpy float32 input keeps float32 too (the model converts, the solver must not upcast).
    data32 = base.cast(torch.float32)
    model = solver_model(name, data32, solver_options).fit(data32.X.numpy(), data32.y.numpy())
    out = model.predict(data32.X_test.numpy())
    if out.dtype != np.float32:
        raise AssertionError(f"solver {name!r}: numpy float32 input gave {out.dtype} predictions")
    return {"rel_error_" + k: v for k, v in errors.items()}


def check_solver_device(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    rtol_float32: float = 1e-3,
    spec: OracleSpec = DEFAULT_SPEC,
    device: str | torch.device | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Tensors on ``device`` (default: ``cuda`` when available) stay there and match the oracle."""
    if device is None:
        if not torch.cuda.is_available():
            skip("no CUDA device available (the CPU is covered by every other check)")
        device = "cuda"
    device = torch.device(device)
    base = make_oracle_data(spec)
    ref = _oracle(name, base)
    errors = {}
    for dtype, tol in ((torch.float32, rtol_float32), (torch.float64, rtol)):
        data = base.cast(dtype, device)
        model = solver_model(name, data, solver_options).fit(data.X, data.y)
        pred = model.predict(data.X_test)
        if pred.device.type != device.type or pred.dtype != dtype:
            raise AssertionError(
                f"solver {name!r}: {dtype} input on {device} gave {pred.dtype} predictions on {pred.device}"
            )
        errors[f"rel_error_{device.type}_{str(dtype).replace('torch.', '')}"] = check_close(
            f"solver {name!r} ({dtype} on {device})", pred, ref, tol
        )
    return errors


def check_solver_multi_output(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """``n x 3`` targets: ``n x 3`` predictions, every column within ``rtol`` of its oracle."""
    data = make_oracle_data(spec, n_outputs=3)
    ref = _oracle(name, data)
    model = solver_model(name, data, solver_options).fit(data.X, data.y)
    pred = model.predict(data.X_test)
    if tuple(pred.shape) != (spec.n_test, 3):
        raise AssertionError(f"solver {name!r}: 3 outputs gave predictions of shape {tuple(pred.shape)}")
    errors = [check_close(f"solver {name!r} output {j}", pred[:, j], ref[:, j], rtol) for j in range(3)]
    single = solver_model(name, data, solver_options).fit(data.X, data.y[:, 0])
    shape = tuple(single.predict(data.X_test).shape)
    if shape != (spec.n_test,):
        raise AssertionError(f"solver {name!r}: a 1-D target gave predictions of shape {shape}, expected 1-D")
    return {"rel_error_max": max(errors)}


def check_solver_center_weights(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """Weighted centers (FALKON's D) leave the target unchanged (Rudi et al. 2017, Appendix A, Def. 4)."""
    caps = capabilities_of("solver", name)
    if not caps.uses_centers:
        skip(f"solver {name!r} does not use centers")
    data = make_oracle_data(spec)
    g = torch.Generator().manual_seed(7)
    weights = 0.5 + 1.5 * torch.rand(spec.n_centers, generator=g, dtype=torch.float64)
    problem = Problem(
        X=data.X,
        y=data.y,
        kernel=spec.make_kernel(torch.float64),
        noise=spec.noise,
        centers=Centers(data.centers, weights=weights, indices=data.center_indices),
        options=options_for("solver", name, solver_options),
        generator=torch.Generator().manual_seed(1),
    )
    predictor = _fit_directly(name, problem)
    with torch.no_grad():
        pred = predictor.predict(data.X_test)
    ref = target_oracle(caps.target, data)  # the same target, whatever the weights
    return {"rel_error": check_close(f"solver {name!r} (weighted centers)", pred, ref, rtol)}


def check_solver_partial_fit(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """Solvers declaring ``partial_fit``: two chunks give finite ``n x k`` predictions in the input dtype."""
    if not capabilities_of("solver", name).partial_fit:
        skip(f"solver {name!r} has no partial_fit")
    data = make_oracle_data(spec, n_outputs=2).cast(torch.float32)
    model = solver_model(name, data, solver_options, centers=None)
    half = spec.n // 2
    model.partial_fit(data.X[:half], data.y[:half]).partial_fit(data.X[half:], data.y[half:])
    pred = model.predict(data.X_test)
    if tuple(pred.shape) != (spec.n_test, 2) or pred.dtype != torch.float32 or not bool(torch.isfinite(pred).all()):
        raise AssertionError(
            f"solver {name!r}: partial_fit on two chunks gave predictions {tuple(pred.shape)} {pred.dtype} "
            f"(finite: {bool(torch.isfinite(pred).all())})"
        )
    return {}
