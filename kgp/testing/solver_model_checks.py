"""Solver checks through the model: seeds, the monitor (callback, validation metric), options and
model files; then :data:`SOLVER_CHECKS` and :func:`check_solver`, which runs all of them."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..models import load
from ..monitor import IterationInfo
from . import solver_checks as fit_checks
from .oracles import DEFAULT_SPEC, OracleSpec, dense_posterior_mean, make_oracle_data
from .solver_checks import solver_model
from .support import GlobalRngGuard, capabilities_of, current_registry, plugin_info, reproduces, run_all, skip

__all__ = [
    "SOLVER_CHECKS",
    "check_solver",
    "check_solver_callback",
    "check_solver_invalid_options",
    "check_solver_save_load",
    "check_solver_seed",
    "check_solver_unknown_option",
    "check_solver_validation_metric",
]


def check_solver_seed(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """Same ``random_state`` -> identical predictions (:data:`REPRO_RTOL`), whatever the global RNG state."""
    data = make_oracle_data(spec)
    params: dict[str, Any] = {"random_state": 123}
    if capabilities_of("solver", name).uses_centers and "uniform" in current_registry().names("selector"):
        # Let the default selector draw the centers too: both seeded paths are exercised.
        params.update(centers=None, n_centers=spec.n_centers)
    preds = []
    with GlobalRngGuard():
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            np.random.seed(global_seed)
            model = solver_model(name, data, solver_options, **params).fit(data.X, data.y)
            preds.append(model.predict(data.X_test))
    if not reproduces(preds[1], preds[0]):
        diff = float((preds[0] - preds[1]).abs().max())
        raise AssertionError(
            f"solver {name!r}: two fits with random_state=123 differ (max abs diff {diff:.3e}); draw every "
            "random number from problem.generator, not from the global torch / numpy RNG"
        )
    return {}


def check_solver_callback(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    iterative: bool = False,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """The callback sees :class:`IterationInfo`; returning True stops the solver after that iteration."""
    data = make_oracle_data(spec)
    seen: list[Any] = []

    def record(info):
        seen.append(info)
        return None

    model = solver_model(name, data, solver_options, callback=record).fit(data.X, data.y)
    full = len(seen)
    for info in seen:
        if not isinstance(info, IterationInfo):
            raise AssertionError(f"solver {name!r}: callback received {type(info).__name__}, expected IterationInfo")
    iterations = [info.iteration for info in seen]
    if iterations and (iterations[0] < 1 or any(b <= a for a, b in zip(iterations, iterations[1:], strict=False))):
        raise AssertionError(f"solver {name!r}: iteration numbers must be 1-based and increasing, got {iterations}")
    if [i.iteration for i in model.history_] != iterations:
        raise AssertionError(f"solver {name!r}: history_ does not match the iterations the callback saw")
    if iterative and full < 2:
        raise AssertionError(
            f"solver {name!r} is declared iterative but reported {full} iteration(s); call "
            "problem.monitor.step(...) once per iteration (and give options that run at least 2)"
        )
    stopped: list[Any] = []

    def stop(info):
        stopped.append(info)
        return True

    model = solver_model(name, data, solver_options, callback=stop).fit(data.X, data.y)
    if full >= 1 and len(stopped) != 1:
        raise AssertionError(
            f"solver {name!r}: the callback returned True at iteration 1 but was called {len(stopped)} times "
            f"(a full run makes {full} calls); stop when monitor.step(...) returns True"
        )
    pred = model.predict(data.X_test)
    if not bool(torch.isfinite(pred).all()):
        raise AssertionError(f"solver {name!r}: the early-stopped model predicts NaN / inf")
    return {"iterations_full": full, "iterations_stopped": len(stopped)}


def check_solver_validation_metric(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """With ``validation_data``, some reported iteration carries a finite validation metric."""
    data = make_oracle_data(spec)
    y_val = dense_posterior_mean(data)  # any finite targets do; these are smooth
    model = solver_model(name, data, solver_options).fit(data.X, data.y, validation_data=(data.X_test, y_val))
    if not model.history_:
        skip(f"solver {name!r} reports no iterations")
    metrics = [i.metric for i in model.history_ if i.metric is not None]
    if not metrics or not all(math.isfinite(m) for m in metrics):
        raise AssertionError(
            f"solver {name!r}: with validation_data no iteration reported a finite metric (got {metrics}); "
            "pass the current predictor (or a function building it) to problem.monitor.step"
        )
    return {"last_metric": metrics[-1]}


def check_solver_unknown_option(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """An unknown option name fails early with ValueError naming it and listing the valid ones."""
    data = make_oracle_data(spec)
    bogus = "no_such_option_xyz"
    options = {**dict(solver_options or {}), bogus: 1}
    try:
        solver_model(name, data, options).fit(data.X, data.y)
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"solver {name!r}: solver_options={{{bogus!r}: 1}} was accepted")
    valid = list(plugin_info("solver", name).obj.option_defaults)
    missing = [opt for opt in [bogus, *valid] if opt not in message]
    if missing:
        raise AssertionError(f"solver {name!r}: the unknown-option error does not mention {missing}: {message}")
    return {}


def check_solver_invalid_options(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    invalid_options: tuple[Mapping[str, Any], ...] = (),
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """Each dict in ``invalid_options`` raises ValueError / TypeError naming an option in it."""
    if not invalid_options:
        skip("no invalid_options given")
    data = make_oracle_data(spec)
    for bad in invalid_options:
        options = {**dict(solver_options or {}), **dict(bad)}
        try:
            solver_model(name, data, options).fit(data.X, data.y)
        except (ValueError, TypeError) as exc:
            if not any(key in str(exc) for key in bad):
                raise AssertionError(
                    f"solver {name!r}: the error for {dict(bad)} names none of {list(bad)}: {exc}"
                ) from None
        else:
            raise AssertionError(f"solver {name!r}: invalid options {dict(bad)} were accepted")
    return {"cases": len(invalid_options)}


def check_solver_save_load(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """``model.save`` then :func:`kgp.load` predicts identically (the file loads weights_only)."""
    data = make_oracle_data(spec, n_outputs=2)
    model = solver_model(name, data, solver_options).fit(data.X, data.y)
    before = model.predict(data.X_test)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.kgp.pt")
        model.save(path)
        loaded = load(path)
    after = loaded.predict(data.X_test)
    if loaded.solver_name_ != name:
        raise AssertionError(f"solver {name!r}: the loaded model names solver {loaded.solver_name_!r}")
    if not reproduces(after, before):
        raise AssertionError(
            f"solver {name!r}: predictions after save/load differ "
            f"(max abs diff {float((before - after).abs().max()):.3e})"
        )
    return {}


SOLVER_CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "protocol": fit_checks.check_solver_protocol,
    "oracle": fit_checks.check_solver_oracle,
    "dtype": fit_checks.check_solver_dtype,
    "device": fit_checks.check_solver_device,
    "multi_output": fit_checks.check_solver_multi_output,
    "seed": check_solver_seed,
    "callback": check_solver_callback,
    "validation_metric": check_solver_validation_metric,
    "unknown_option": check_solver_unknown_option,
    "invalid_options": check_solver_invalid_options,
    "save_load": check_solver_save_load,
    "center_weights": fit_checks.check_solver_center_weights,
    "partial_fit": fit_checks.check_solver_partial_fit,
}
"""Every solver check by name, in the order :func:`check_solver` runs them."""


def check_solver(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    rtol_float32: float = 1e-3,
    iterative: bool = False,
    invalid_options: tuple[Mapping[str, Any], ...] = (),
    spec: OracleSpec = DEFAULT_SPEC,
    device: str | torch.device | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run every solver check (see :mod:`kgp.testing`) and return what each measured.

    Parameters
    ----------
    name:
        Registered solver name.
    solver_options:
        Options used in every fit (e.g. enough iterations to meet ``rtol``).
    rtol:
        Largest relative error ``||f - f_oracle|| / ||f_oracle||`` on held-out points for float64
        fits. The oracle follows the solver's ``capabilities.target``: the dense posterior mean
        (``"exact"``, ``"mean_only"``) or the dense Nystrom solution at the same centers (``"nystrom"``).
    rtol_float32:
        The same bound for float32 fits.
    iterative:
        Whether the solver iterates: then a full run must report >= 2 iterations and a callback
        returning True must stop it after the first.
    invalid_options:
        Option dicts with bad values that ``fit`` must reject (ValueError / TypeError naming them).
    spec:
        The oracle problem (sizes, kernel, noise).
    device:
        Extra device for the device check (default: CUDA when available).
    skip:
        Names of checks not to run (keys of :data:`SOLVER_CHECKS`).

    Returns
    -------
    dict
        Check name -> measured values (e.g. relative errors) or a "skipped (...)" note.

    Raises
    ------
    AssertionError
        Listing every failed check with its numbers.
    """
    return run_all(
        SOLVER_CHECKS,
        skip,
        f"solver {name!r}",
        name=name,
        solver_options=solver_options,
        rtol=rtol,
        rtol_float32=rtol_float32,
        iterative=iterative,
        invalid_options=tuple(invalid_options),
        spec=spec,
        device=device,
    )
