"""Conformance kit for solver and center-selector plugins.

Run it from a plugin's own test suite, either as a pytest base class::

    from kgp.testing import SolverConformance, SelectorConformance

    class TestMySolver(SolverConformance):
        solver_name = "my-solver"
        solver_options = {"maxiter": 50}
        rtol = 1e-4              # iterative: relative error allowed against the dense oracle
        iterative = True

    class TestMySelector(SelectorConformance):
        selector_name = "my-selector"
        solver = "falkon"                    # also fit a model on the chosen centers (in_model check)
        solver_options = {"maxiter": 50}     # ... with enough iterations to meet rtol

or as plain functions (every check raises ``AssertionError`` with the measured numbers)::

    from kgp.testing import check_solver, check_selector

    check_solver("my-solver", solver_options={"maxiter": 50}, rtol=1e-4, iterative=True)
    check_selector("my-selector")

What is checked (one method / function per contract point of :mod:`kgp.hookspecs`):

========================  ==========================================================================
check                     passes when
========================  ==========================================================================
``protocol``              the name is registered with ``option_defaults`` / ``uses_centers`` / ``fit``;
                          ``fit(Problem)`` returns a registered predictor kind whose ``predict`` gives
                          ``n x k`` in the input dtype, whose ``state_dict`` holds only tensors and
                          plain values and whose ``from_state`` rebuilds identical predictions; the
                          problem's tensors are not modified
``oracle``                predictions on held-out points match the dense oracle within ``rtol``:
                          the GP posterior mean ``K_t* (K + sigma^2 I)^-1 y`` (``uses_centers=False``)
                          or the Nystrom solution of ``(K_nM^T K_nM + sigma^2 K_MM) a = K_nM^T y`` at
                          the same explicit centers (``uses_centers=True``), both computed in float64
                          by GPyTorch's dense kernel evaluation (independent of kgp's backend)
``dtype``                 float32 and float64 inputs give predictions of the same dtype; float32
                          matches the float64 oracle within ``rtol_float32``
``device``                CPU always; on CUDA (when available) predictions stay on the device and
                          match the oracle (skipped without a GPU)
``multi_output``          an ``n x 3`` target gives ``n x 3`` predictions, each column within ``rtol``
                          of the oracle; a 1-D target gives 1-D predictions
``seed``                  the same ``random_state`` gives identical predictions (up to
                          :data:`REPRO_RTOL`), whatever the global torch / numpy RNG state
                          (randomness only through the generators)
``callback``              the callback receives :class:`kgp.IterationInfo` with increasing 1-based
                          iterations, ``history_`` records them; returning True stops the solver
                          (``iterative=True``: a full run reports >= 2 iterations, a stopped run
                          exactly 1) and the stopped model still predicts finite values
``validation_metric``     with ``validation_data`` some reported iteration carries a finite metric
``unknown_option``        an unknown option name raises ValueError naming it and listing the valid ones
``invalid_options``       every option dict in ``invalid_options`` raises ValueError / TypeError
                          naming the option
``save_load``             ``model.save`` / :func:`kgp.load` gives identical predictions
``center_weights``        (``uses_centers`` only) centers with random weights D give the same
                          predictions as D = I: the Nystrom estimator does not depend on D
                          (Rudi et al. 2017, Appendix A, Def. 3-4)
``partial_fit``           (solvers with ``partial_fit`` only) two chunks give finite ``n x k``
                          predictions of the input dtype
========================  ==========================================================================

Selectors (:func:`check_selector`): a :class:`kgp.Centers` with ``M x d`` finite points in X's dtype
and device, ``M == n_centers`` (or ``1 <= M <= n_centers`` with ``exact_count=False``), weights
``None`` or positive of shape ``(M,)``, indices ``None`` or ``(M,)`` integers with
``X[indices] == points``, identical output (up to :data:`REPRO_RTOL`) for the same generator seed
whatever the global RNG state, a valid choice when ``n_centers`` is None, and unknown options
rejected.

Tolerances are explicit parameters: exact solvers meet the float64 default (1e-6) with room to
spare; iterative and stochastic solvers set their own.

The module itself imports only kgp, torch and numpy; pytest collects the ``*Conformance`` classes:
``pip install 'kgp[testing]'`` in a plugin's test environment.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import tempfile
import unittest
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from .kernels import make_kernel
from .models import KernelRegressor, load
from .monitor import IterationInfo
from .plugin import Centers, Problem, SelectionRequest, merge_options
from .registry import get_predictor_class, registry

__all__ = [
    "OracleSpec",
    "REPRO_RTOL",
    "SELECTOR_CHECKS",
    "SOLVER_CHECKS",
    "SelectorConformance",
    "SolverConformance",
    "check_selector",
    "check_selector_contract",
    "check_selector_device",
    "check_selector_in_model",
    "check_selector_seed",
    "check_selector_unknown_option",
    "check_solver",
    "check_solver_callback",
    "check_solver_center_weights",
    "check_solver_device",
    "check_solver_dtype",
    "check_solver_invalid_options",
    "check_solver_multi_output",
    "check_solver_oracle",
    "check_solver_partial_fit",
    "check_solver_protocol",
    "check_solver_save_load",
    "check_solver_seed",
    "check_solver_unknown_option",
    "check_solver_validation_metric",
    "dense_nystrom_mean",
    "dense_posterior_mean",
    "make_oracle_data",
    "relative_error",
]


# ---------------------------------------------------------------------------------------------
# Oracle problems
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OracleSpec:
    """The small regression problem every check fits.

    Attributes
    ----------
    n, n_test, d:
        Training points, held-out points, features. Inputs are uniform on ``[-2, 2]^d``.
    n_centers:
        Number of explicit centers given to ``uses_centers`` solvers (drawn from the training
        points with a fixed seed).
    noise:
        GP noise variance sigma^2 (the model's ``noise``).
    kernel:
        Kernel shortcut name (e.g. ``"rbf"``) or a GPyTorch kernel object.
    lengthscale:
        Lengthscale for a shortcut kernel.
    seed:
        Seed of the data draw.
    """

    n: int = 150
    n_test: int = 60
    d: int = 3
    n_centers: int = 40
    noise: float = 1e-2
    kernel: Any = "rbf"
    lengthscale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n", "n_test", "d", "n_centers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OracleSpec.{name}: expected a positive integer, got {value!r}")
        if self.n_centers > self.n:
            raise ValueError(f"OracleSpec.n_centers: expected at most n={self.n}, got {self.n_centers}")
        if not (isinstance(self.noise, (int, float)) and self.noise > 0):
            raise ValueError(f"OracleSpec.noise: expected a positive number, got {self.noise!r}")

    def make_kernel(self, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"):
        """A fresh GPyTorch kernel object on ``device`` / ``dtype``."""
        if isinstance(self.kernel, str):
            kernel = make_kernel(self.kernel, self.lengthscale)
        else:
            kernel = copy.deepcopy(self.kernel)
        return kernel.to(device=device, dtype=dtype)


@dataclass
class OracleData:
    """Tensors of one oracle problem (float64, CPU); ``cast`` converts them."""

    X: Tensor
    y: Tensor
    X_test: Tensor
    centers: Tensor
    center_indices: Tensor
    spec: OracleSpec = field(repr=False)

    def cast(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> OracleData:
        conv = {"dtype": dtype, "device": device}
        return OracleData(
            self.X.to(**conv),
            self.y.to(**conv),
            self.X_test.to(**conv),
            self.centers.to(**conv),
            self.center_indices.to(device),
            self.spec,
        )


def make_oracle_data(spec: OracleSpec = OracleSpec(), n_outputs: int = 1) -> OracleData:
    """Draw the oracle problem: ``y`` is an ``n x n_outputs`` smooth function plus 5% noise.

    Parameters
    ----------
    spec:
        Problem sizes, kernel and noise.
    n_outputs:
        Number of target columns (each a different smooth function of the inputs).
    """
    g = torch.Generator().manual_seed(spec.seed)
    X = torch.rand(spec.n, spec.d, generator=g, dtype=torch.float64) * 4 - 2
    X_test = torch.rand(spec.n_test, spec.d, generator=g, dtype=torch.float64) * 4 - 2
    cols = []
    for j in range(n_outputs):
        x0 = X[:, 0]
        x1 = X[:, 1 % spec.d]
        x2 = X[:, 2 % spec.d]
        cols.append(torch.sin((1.0 + 0.5 * j) * x0 + j) + 0.5 * torch.cos(x1) * x2 - 0.2 * j * x1)
    y = torch.stack(cols, dim=1)
    y = y + 0.05 * torch.randn(y.shape, generator=g, dtype=torch.float64)
    idx = torch.randperm(spec.n, generator=g)[: spec.n_centers]
    return OracleData(X, y, X_test, X[idx].clone(), idx, spec)


def _dense_kernel(spec: OracleSpec, A: Tensor, B: Tensor) -> Tensor:
    # GPyTorch's own dense evaluation: an oracle independent of kgp's block backend.
    kernel = spec.make_kernel(torch.float64)
    with torch.no_grad():
        return kernel(A.double().cpu(), B.double().cpu()).to_dense()


def dense_posterior_mean(data: OracleData, X_eval: Tensor | None = None) -> Tensor:
    """``K(X_eval, X) (K(X, X) + sigma^2 I)^-1 y`` by a float64 Cholesky (the ``exact`` target)."""
    X_eval = data.X_test if X_eval is None else X_eval
    X, y = data.X.double().cpu(), data.y.double().cpu()
    K = _dense_kernel(data.spec, X, X)
    K.diagonal().add_(data.spec.noise)
    alpha = torch.cholesky_solve(y, torch.linalg.cholesky(K))
    return _dense_kernel(data.spec, X_eval, X) @ alpha


def dense_nystrom_mean(data: OracleData, X_eval: Tensor | None = None, centers: Tensor | None = None) -> Tensor:
    """Nystrom solution ``K(X_eval, Z) a`` with ``(K_nM^T K_nM + sigma^2 K_MM) a = K_nM^T y``, float64.

    The M x M system is solved by SVD-based least squares, so duplicate or nearly dependent
    centers (a singular ``K_MM``) still give the minimum-norm solution, whose predictions are the
    Nystrom estimator's (Rudi et al. 2017, eq. 8 with ``lambda n = sigma^2``).
    """
    X_eval = data.X_test if X_eval is None else X_eval
    Z = (data.centers if centers is None else centers).double().cpu()
    X, y = data.X.double().cpu(), data.y.double().cpu()
    KnM = _dense_kernel(data.spec, X, Z)
    H = KnM.T @ KnM + data.spec.noise * _dense_kernel(data.spec, Z, Z)
    alpha = torch.linalg.lstsq(H, KnM.T @ y, driver="gelsd").solution
    return _dense_kernel(data.spec, X_eval, Z) @ alpha


def relative_error(pred: Tensor | np.ndarray, ref: Tensor | np.ndarray) -> float:
    """``||pred - ref||_F / ||ref||_F`` computed in float64 on the CPU."""
    p = torch.as_tensor(np.asarray(pred.detach().cpu() if isinstance(pred, Tensor) else pred), dtype=torch.float64)
    r = torch.as_tensor(np.asarray(ref.detach().cpu() if isinstance(ref, Tensor) else ref), dtype=torch.float64)
    p = p.reshape(r.shape)
    return float(torch.linalg.norm(p - r) / torch.linalg.norm(r))


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------
def _solver_info(name: str):
    if name not in registry.names("solver"):
        raise AssertionError(
            f"solver {name!r} is not registered; registered solvers: {', '.join(registry.names('solver')) or '(none)'}"
            " (is the plugin's distribution installed, and not excluded by KGP_PLUGINS / KGP_DISABLE_ENTRYPOINTS?)"
        )
    return registry.get("solver", name)


def _model(name: str, data: OracleData, solver_options: Mapping[str, Any] | None, **params: Any) -> KernelRegressor:
    solver = _solver_info(name).obj
    spec = data.spec
    kwargs: dict[str, Any] = {
        "kernel": spec.kernel if isinstance(spec.kernel, str) else copy.deepcopy(spec.kernel),
        "lengthscale": spec.lengthscale,
        "noise": spec.noise,
        "solver": name,
        "solver_options": dict(solver_options or {}),
        "random_state": 0,
    }
    if solver.uses_centers and "centers" not in params:
        kwargs["centers"] = data.centers
    kwargs.update(params)
    return KernelRegressor(**kwargs)


def _check_close(what: str, pred: Tensor, ref: Tensor, rtol: float) -> float:
    if not bool(torch.isfinite(torch.as_tensor(pred)).all()):
        raise AssertionError(f"{what}: predictions contain NaN or infinite values")
    err = relative_error(pred, ref)
    if not err <= rtol:
        raise AssertionError(f"{what}: relative error {err:.3e} against the dense float64 oracle > rtol={rtol:.1e}")
    return err


REPRO_RTOL: dict[torch.dtype, float] = {torch.float64: 1e-9, torch.float32: 1e-4}
"""How close "identical" results must be: ``max|a - b| <= rtol * max|b|``.

Not bit-for-bit, because MKL's LAPACK routines (e.g. ``torch.linalg.lstsq``) are not bitwise
reproducible across memory alignments: on the development machine two identical float64 solves of
the kit's ill-conditioned Nystrom system differed by 3e-11. A solver drawing from the global RNG
instead of the problem's generator differs by far more than these bounds."""


def _reproduces(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    if a.numel() == 0:
        return True
    scale = max(float(b.abs().max()), 1e-30)
    return float((a - b).abs().max()) <= REPRO_RTOL.get(a.dtype, 1e-9) * scale


def _oracle_for(name: str, data: OracleData) -> Tensor:
    if _solver_info(name).obj.uses_centers:
        return dense_nystrom_mean(data)
    return dense_posterior_mean(data)


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


class _GlobalRngGuard:
    """Restore the global torch / numpy RNG states after a check perturbs them."""

    def __enter__(self):
        self._torch = torch.random.get_rng_state()
        self._numpy = np.random.get_state()
        return self

    def __exit__(self, *exc):
        torch.random.set_rng_state(self._torch)
        np.random.set_state(self._numpy)
        return False


def _skip_types() -> tuple[type[BaseException], ...]:
    """The exceptions :func:`_skip` may raise (pytest's only when pytest is loaded)."""
    skip = getattr(sys.modules.get("pytest"), "skip", None)
    return (unittest.SkipTest, skip.Exception) if hasattr(skip, "Exception") else (unittest.SkipTest,)


def _skip(reason: str):
    # Under pytest, its own skip exception with the item's location, so that `pytest -rs` points at the
    # test rather than at pytest's unittest shim; elsewhere unittest.SkipTest (kgp never imports pytest).
    pytest = sys.modules.get("pytest")
    skip = getattr(pytest, "skip", None)
    if skip is not None and hasattr(skip, "Exception"):
        try:
            raise skip.Exception(reason, _use_item_location=True)
        except TypeError:  # a pytest without _use_item_location
            pass
    raise unittest.SkipTest(reason)


# ---------------------------------------------------------------------------------------------
# Solver checks
# ---------------------------------------------------------------------------------------------
def check_solver_protocol(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = OracleSpec(), **_: Any
) -> dict[str, Any]:
    """The registered object, the predictor it returns and that ``fit`` leaves its inputs alone."""
    info = _solver_info(name)
    solver = info.obj
    defaults = getattr(solver, "option_defaults", None)
    if not isinstance(defaults, Mapping) or not all(isinstance(k, str) for k in defaults):
        raise AssertionError(f"solver {name!r}: option_defaults must be a mapping with str keys, got {defaults!r}")
    if not isinstance(getattr(solver, "uses_centers", None), bool):
        got = getattr(solver, "uses_centers", None)
        raise AssertionError(f"solver {name!r}: uses_centers must be a bool, got {got!r}")
    if not callable(getattr(solver, "fit", None)):
        raise AssertionError(f"solver {name!r}: has no callable fit(problem)")
    data = make_oracle_data(spec, n_outputs=2)
    kernel = spec.make_kernel(torch.float64)
    problem = Problem(
        X=data.X.clone(),
        y=data.y.clone(),
        kernel=kernel,
        noise=spec.noise,
        centers=Centers(data.centers.clone(), indices=data.center_indices.clone()) if solver.uses_centers else None,
        options=merge_options(f"solver {name!r}", defaults, solver_options),
        generator=torch.Generator().manual_seed(1),
    )
    predictor = solver.fit(problem)
    for label, before, after in (("X", data.X, problem.X), ("y", data.y, problem.y)):
        if not torch.equal(before, after):
            raise AssertionError(f"solver {name!r}: fit modified problem.{label} in place")
    if solver.uses_centers and not torch.equal(data.centers, problem.centers.points):
        raise AssertionError(f"solver {name!r}: fit modified problem.centers in place")
    kind = getattr(predictor, "kind", None)
    if not isinstance(kind, str):
        raise AssertionError(f"solver {name!r}: the predictor has no str `kind` (got {type(predictor).__name__})")
    if kind not in registry.names("predictor"):
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
    if not isinstance(state, dict) or not _is_plain(state):
        raise AssertionError(
            f"solver {name!r}: state_dict() must hold only tensors and plain values (for weights_only loading)"
        )
    rebuilt = get_predictor_class(kind).from_state(state, spec.make_kernel(torch.float64))
    with torch.no_grad():
        again = rebuilt.predict(data.X_test)
    if not _reproduces(again, pred):
        raise AssertionError(
            f"solver {name!r}: from_state(state_dict()) predicts differently "
            f"(max abs diff {float((pred - again).abs().max()):.3e})"
        )
    return {"distribution": info.distribution, "predictor_kind": kind}


def check_solver_oracle(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    spec: OracleSpec = OracleSpec(),
    **_: Any,
) -> dict[str, Any]:
    """float64 fit against the dense posterior mean / dense Nystrom solution at the same centers."""
    data = make_oracle_data(spec)
    model = _model(name, data, solver_options).fit(data.X, data.y[:, 0])
    err = _check_close(f"solver {name!r} (float64)", model.predict(data.X_test), _oracle_for(name, data)[:, 0], rtol)
    return {"rel_error": err}


def check_solver_dtype(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    rtol_float32: float = 1e-3,
    spec: OracleSpec = OracleSpec(),
    **_: Any,
) -> dict[str, Any]:
    """float32 in -> float32 out (within ``rtol_float32`` of the float64 oracle); float64 in -> float64 out."""
    base = make_oracle_data(spec)
    ref = _oracle_for(name, base)
    errors = {}
    for dtype, tol in ((torch.float32, rtol_float32), (torch.float64, rtol)):
        data = base.cast(dtype)
        model = _model(name, data, solver_options).fit(data.X, data.y)
        pred = model.predict(data.X_test)
        if pred.dtype != dtype:
            raise AssertionError(f"solver {name!r}: {dtype} input gave {pred.dtype} predictions")
        for attr in ("centers_",):
            value = getattr(model, attr, None)
            if isinstance(value, Tensor) and value.dtype != dtype:
                raise AssertionError(f"solver {name!r}: model.{attr} is {value.dtype} for {dtype} input")
        errors[str(dtype).replace("torch.", "")] = _check_close(f"solver {name!r} ({dtype})", pred, ref, tol)
    # numpy float32 input keeps float32 too (the model converts, the solver must not upcast).
    data32 = base.cast(torch.float32)
    model = _model(name, data32, solver_options).fit(data32.X.numpy(), data32.y.numpy())
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
    spec: OracleSpec = OracleSpec(),
    device: str | torch.device | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Tensors on ``device`` (default: ``cuda`` when available) stay there and match the oracle."""
    if device is None:
        if not torch.cuda.is_available():
            _skip("no CUDA device available (the CPU is covered by every other check)")
        device = "cuda"
    device = torch.device(device)
    base = make_oracle_data(spec)
    ref = _oracle_for(name, base)
    errors = {}
    for dtype, tol in ((torch.float32, rtol_float32), (torch.float64, rtol)):
        data = base.cast(dtype, device)
        model = _model(name, data, solver_options).fit(data.X, data.y)
        pred = model.predict(data.X_test)
        if pred.device.type != device.type or pred.dtype != dtype:
            raise AssertionError(
                f"solver {name!r}: {dtype} input on {device} gave {pred.dtype} predictions on {pred.device}"
            )
        errors[f"rel_error_{device.type}_{str(dtype).replace('torch.', '')}"] = _check_close(
            f"solver {name!r} ({dtype} on {device})", pred, ref, tol
        )
    return errors


def check_solver_multi_output(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    spec: OracleSpec = OracleSpec(),
    **_: Any,
) -> dict[str, Any]:
    """``n x 3`` targets: ``n x 3`` predictions, every column within ``rtol`` of its oracle."""
    data = make_oracle_data(spec, n_outputs=3)
    ref = _oracle_for(name, data)
    model = _model(name, data, solver_options).fit(data.X, data.y)
    pred = model.predict(data.X_test)
    if tuple(pred.shape) != (spec.n_test, 3):
        raise AssertionError(f"solver {name!r}: 3 outputs gave predictions of shape {tuple(pred.shape)}")
    errors = [_check_close(f"solver {name!r} output {j}", pred[:, j], ref[:, j], rtol) for j in range(3)]
    single = _model(name, data, solver_options).fit(data.X, data.y[:, 0])
    shape = tuple(single.predict(data.X_test).shape)
    if shape != (spec.n_test,):
        raise AssertionError(f"solver {name!r}: a 1-D target gave predictions of shape {shape}, expected 1-D")
    return {"rel_error_max": max(errors)}


def check_solver_seed(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = OracleSpec(), **_: Any
) -> dict[str, Any]:
    """Same ``random_state`` -> identical predictions (:data:`REPRO_RTOL`), whatever the global RNG state."""
    data = make_oracle_data(spec)
    uses_centers = _solver_info(name).obj.uses_centers
    params: dict[str, Any] = {"random_state": 123}
    if uses_centers and "uniform" in registry.names("selector"):
        # Let the default selector draw the centers too: both seeded paths are exercised.
        params.update(centers=None, n_centers=spec.n_centers)
    preds = []
    with _GlobalRngGuard():
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            np.random.seed(global_seed)
            model = _model(name, data, solver_options, **params).fit(data.X, data.y)
            preds.append(model.predict(data.X_test))
    if not _reproduces(preds[1], preds[0]):
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
    spec: OracleSpec = OracleSpec(),
    **_: Any,
) -> dict[str, Any]:
    """The callback sees :class:`IterationInfo`; returning True stops the solver after that iteration."""
    data = make_oracle_data(spec)
    seen: list[Any] = []

    def record(info):
        seen.append(info)
        return None

    model = _model(name, data, solver_options, callback=record).fit(data.X, data.y)
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

    model = _model(name, data, solver_options, callback=stop).fit(data.X, data.y)
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
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = OracleSpec(), **_: Any
) -> dict[str, Any]:
    """With ``validation_data``, some reported iteration carries a finite validation metric."""
    data = make_oracle_data(spec)
    y_val = dense_posterior_mean(data)  # any finite targets do; these are smooth
    model = _model(name, data, solver_options).fit(data.X, data.y, validation_data=(data.X_test, y_val))
    if not model.history_:
        _skip(f"solver {name!r} reports no iterations")
    metrics = [i.metric for i in model.history_ if i.metric is not None]
    if not metrics or not all(math.isfinite(m) for m in metrics):
        raise AssertionError(
            f"solver {name!r}: with validation_data no iteration reported a finite metric (got {metrics}); "
            "pass the current predictor (or a function building it) to problem.monitor.step"
        )
    return {"last_metric": metrics[-1]}


def check_solver_unknown_option(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = OracleSpec(), **_: Any
) -> dict[str, Any]:
    """An unknown option name fails early with ValueError naming it and listing the valid ones."""
    data = make_oracle_data(spec)
    bogus = "no_such_option_xyz"
    options = {**dict(solver_options or {}), bogus: 1}
    try:
        _model(name, data, options).fit(data.X, data.y)
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"solver {name!r}: solver_options={{{bogus!r}: 1}} was accepted")
    valid = list(_solver_info(name).obj.option_defaults)
    missing = [opt for opt in [bogus, *valid] if opt not in message]
    if missing:
        raise AssertionError(f"solver {name!r}: the unknown-option error does not mention {missing}: {message}")
    return {}


def check_solver_invalid_options(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    invalid_options: tuple[Mapping[str, Any], ...] = (),
    spec: OracleSpec = OracleSpec(),
    **_: Any,
) -> dict[str, Any]:
    """Each dict in ``invalid_options`` raises ValueError / TypeError naming an option in it."""
    if not invalid_options:
        _skip("no invalid_options given")
    data = make_oracle_data(spec)
    for bad in invalid_options:
        options = {**dict(solver_options or {}), **dict(bad)}
        try:
            _model(name, data, options).fit(data.X, data.y)
        except (ValueError, TypeError) as exc:
            if not any(key in str(exc) for key in bad):
                raise AssertionError(
                    f"solver {name!r}: the error for {dict(bad)} names none of {list(bad)}: {exc}"
                ) from None
        else:
            raise AssertionError(f"solver {name!r}: invalid options {dict(bad)} were accepted")
    return {"cases": len(invalid_options)}


def check_solver_save_load(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = OracleSpec(), **_: Any
) -> dict[str, Any]:
    """``model.save`` then :func:`kgp.load` predicts identically (the file loads weights_only)."""
    data = make_oracle_data(spec, n_outputs=2)
    model = _model(name, data, solver_options).fit(data.X, data.y)
    before = model.predict(data.X_test)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.kgp.pt")
        model.save(path)
        loaded = load(path)
    after = loaded.predict(data.X_test)
    if loaded.solver_name_ != name:
        raise AssertionError(f"solver {name!r}: the loaded model names solver {loaded.solver_name_!r}")
    if not _reproduces(after, before):
        raise AssertionError(
            f"solver {name!r}: predictions after save/load differ "
            f"(max abs diff {float((before - after).abs().max()):.3e})"
        )
    return {}


def check_solver_center_weights(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    spec: OracleSpec = OracleSpec(),
    **_: Any,
) -> dict[str, Any]:
    """Weighted centers (FALKON's D) leave the Nystrom estimator unchanged (Appendix A, Def. 4)."""
    solver = _solver_info(name).obj
    if not solver.uses_centers:
        _skip(f"solver {name!r} does not use centers")
    data = make_oracle_data(spec)
    g = torch.Generator().manual_seed(7)
    weights = 0.5 + 1.5 * torch.rand(spec.n_centers, generator=g, dtype=torch.float64)
    problem = Problem(
        X=data.X,
        y=data.y,
        kernel=spec.make_kernel(torch.float64),
        noise=spec.noise,
        centers=Centers(data.centers, weights=weights, indices=data.center_indices),
        options=merge_options(f"solver {name!r}", solver.option_defaults, solver_options),
        generator=torch.Generator().manual_seed(1),
    )
    with torch.no_grad():
        pred = solver.fit(problem).predict(data.X_test)
    return {"rel_error": _check_close(f"solver {name!r} (weighted centers)", pred, dense_nystrom_mean(data), rtol)}


def check_solver_partial_fit(
    name: str, *, solver_options: Mapping[str, Any] | None = None, spec: OracleSpec = OracleSpec(), **_: Any
) -> dict[str, Any]:
    """Solvers with ``partial_fit``: two chunks give finite ``n x k`` predictions in the input dtype."""
    solver = _solver_info(name).obj
    if not hasattr(solver, "partial_fit"):
        _skip(f"solver {name!r} has no partial_fit")
    data = make_oracle_data(spec, n_outputs=2).cast(torch.float32)
    model = _model(name, data, solver_options, centers=None)
    half = spec.n // 2
    model.partial_fit(data.X[:half], data.y[:half]).partial_fit(data.X[half:], data.y[half:])
    pred = model.predict(data.X_test)
    if tuple(pred.shape) != (spec.n_test, 2) or pred.dtype != torch.float32 or not bool(torch.isfinite(pred).all()):
        raise AssertionError(
            f"solver {name!r}: partial_fit on two chunks gave predictions {tuple(pred.shape)} {pred.dtype} "
            f"(finite: {bool(torch.isfinite(pred).all())})"
        )
    return {}


SOLVER_CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "protocol": check_solver_protocol,
    "oracle": check_solver_oracle,
    "dtype": check_solver_dtype,
    "device": check_solver_device,
    "multi_output": check_solver_multi_output,
    "seed": check_solver_seed,
    "callback": check_solver_callback,
    "validation_metric": check_solver_validation_metric,
    "unknown_option": check_solver_unknown_option,
    "invalid_options": check_solver_invalid_options,
    "save_load": check_solver_save_load,
    "center_weights": check_solver_center_weights,
    "partial_fit": check_solver_partial_fit,
}
"""Every solver check by name, in the order :func:`check_solver` runs them."""


def _run_all(checks: Mapping[str, Callable[..., dict]], names, skip, label: str, **kwargs) -> dict[str, Any]:
    unknown = sorted(set(skip) - set(checks))
    if unknown:
        raise ValueError(f"skip: unknown check(s) {unknown}; valid: {', '.join(checks)}")
    results: dict[str, Any] = {}
    failures: list[str] = []
    for check_name in names:
        if check_name in skip:
            results[check_name] = "skipped (by request)"
            continue
        try:
            results[check_name] = checks[check_name](**kwargs)
        except _skip_types() as exc:
            results[check_name] = f"skipped ({getattr(exc, 'msg', None) or exc})"
        except AssertionError as exc:
            failures.append(f"[{check_name}] {exc}")
    if failures:
        raise AssertionError(f"{label} failed {len(failures)} conformance check(s):\n" + "\n".join(failures))
    return results


def check_solver(
    name: str,
    *,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    rtol_float32: float = 1e-3,
    iterative: bool = False,
    invalid_options: tuple[Mapping[str, Any], ...] = (),
    spec: OracleSpec = OracleSpec(),
    device: str | torch.device | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run every solver check (see the module docstring) and return what each measured.

    Parameters
    ----------
    name:
        Registered solver name.
    solver_options:
        Options used in every fit (e.g. enough iterations to meet ``rtol``).
    rtol:
        Largest relative error ``||f - f_oracle|| / ||f_oracle||`` on held-out points for float64
        fits (the oracle is the dense posterior mean, or the dense Nystrom solution at the same
        centers for ``uses_centers`` solvers).
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
    return _run_all(
        SOLVER_CHECKS,
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


# ---------------------------------------------------------------------------------------------
# Selector checks
# ---------------------------------------------------------------------------------------------
def _selector(name: str):
    if name not in registry.names("selector"):
        raise AssertionError(
            f"selector {name!r} is not registered; registered selectors: "
            f"{', '.join(registry.names('selector')) or '(none)'}"
        )
    return registry.get("selector", name).obj


def _request(name: str, data: OracleData, n_centers: int | None, seed: int, selector_options) -> SelectionRequest:
    selector = _selector(name)
    return SelectionRequest(
        X=data.X,
        n_centers=n_centers,
        kernel=data.spec.make_kernel(data.X.dtype, data.X.device),
        noise=data.spec.noise,
        generator=torch.Generator().manual_seed(seed),
        options=merge_options(f"selector {name!r}", selector.option_defaults, selector_options),
    )


def _validate_centers(name: str, centers: Any, data: OracleData, n_centers: int | None, exact_count: bool) -> int:
    if not isinstance(centers, Centers):
        raise AssertionError(f"selector {name!r}: select() returned {type(centers).__name__}, expected kgp.Centers")
    X = data.X
    pts = centers.points
    if not isinstance(pts, Tensor) or pts.dim() != 2 or pts.shape[1] != X.shape[1]:
        raise AssertionError(
            f"selector {name!r}: points must be an M x {X.shape[1]} tensor, got "
            f"{tuple(pts.shape) if isinstance(pts, Tensor) else type(pts).__name__}"
        )
    m = pts.shape[0]
    if n_centers is not None:
        if exact_count and m != n_centers:
            raise AssertionError(f"selector {name!r}: asked for {n_centers} centers, got {m}")
        if not 1 <= m <= n_centers:
            raise AssertionError(f"selector {name!r}: asked for at most {n_centers} centers, got {m}")
    elif not 1 <= m <= X.shape[0]:
        raise AssertionError(f"selector {name!r}: chose {m} centers for n={X.shape[0]}")
    if pts.dtype != X.dtype or pts.device != X.device:
        raise AssertionError(f"selector {name!r}: points are {pts.dtype} on {pts.device}, X is {X.dtype} on {X.device}")
    if not bool(torch.isfinite(pts).all()):
        raise AssertionError(f"selector {name!r}: points contain NaN / inf")
    w = centers.weights
    if w is not None:
        if not isinstance(w, Tensor) or tuple(w.shape) != (m,):
            raise AssertionError(
                f"selector {name!r}: weights must be None or shape ({m},), got "
                f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}"
            )
        if w.dtype != X.dtype or w.device != X.device:
            raise AssertionError(
                f"selector {name!r}: weights are {w.dtype} on {w.device}, X is {X.dtype} on {X.device}"
            )
        if not bool((torch.isfinite(w) & (w > 0)).all()):
            raise AssertionError(f"selector {name!r}: weights must be finite and positive")
    idx = centers.indices
    if idx is not None:
        if not isinstance(idx, Tensor) or tuple(idx.shape) != (m,) or idx.is_floating_point():
            raise AssertionError(f"selector {name!r}: indices must be None or an integer tensor of shape ({m},)")
        if int(idx.min()) < 0 or int(idx.max()) >= X.shape[0]:
            raise AssertionError(f"selector {name!r}: indices out of range [0, {X.shape[0]})")
        if not torch.equal(X[idx.to(X.device)], pts):
            raise AssertionError(f"selector {name!r}: X[indices] differs from points")
    if not isinstance(centers.info, dict):
        raise AssertionError(f"selector {name!r}: Centers.info must be a dict")
    return m


def _same_centers(a: Centers, b: Centers) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and _reproduces(u, v))

    return eq(a.points, b.points) and eq(a.weights, b.weights) and eq(a.indices, b.indices)


def check_selector(
    name: str,
    *,
    selector_options: Mapping[str, Any] | None = None,
    n_centers: int = 40,
    exact_count: bool = True,
    spec: OracleSpec = OracleSpec(),
    device: str | torch.device | None = None,
    solver: str | None = None,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run every selector check and return what each measured.

    Parameters
    ----------
    name:
        Registered selector name.
    selector_options:
        Options for every call.
    n_centers:
        Number of centers requested.
    exact_count:
        Whether exactly ``n_centers`` must come back (False: between 1 and ``n_centers``, e.g.
        for samplers that merge duplicates).
    spec:
        The oracle problem the centers are chosen from.
    device:
        Extra device for the device check (default: CUDA when available).
    solver:
        A ``uses_centers`` solver to run ``KernelRegressor(solver=solver, centers=name)`` with;
        its predictions must match the dense Nystrom solution at the selected centers within ``rtol``.
        None skips this check.
    solver_options:
        Options of that fit: an iterative solver needs enough iterations to meet ``rtol`` (FALKON's
        default 20 iterations reach 7e-6 on the kit's problem, 50 reach 1.4e-7).
    rtol:
        Largest relative error of the in-model fit against the dense Nystrom solution.
    skip:
        Names of checks not to run (keys of :data:`SELECTOR_CHECKS`).

    Raises
    ------
    AssertionError
        Listing every failed check.
    """
    return _run_all(
        SELECTOR_CHECKS,
        SELECTOR_CHECKS,
        skip,
        f"selector {name!r}",
        name=name,
        selector_options=selector_options,
        n_centers=n_centers,
        exact_count=exact_count,
        spec=spec,
        device=device,
        solver=solver,
        solver_options=solver_options,
        rtol=rtol,
    )


def check_selector_contract(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    exact_count: bool = True,
    spec: OracleSpec = OracleSpec(),
    **_: Any,
) -> dict[str, Any]:
    """Shapes, dtypes, weights and indices for float32 / float64 inputs, and ``n_centers=None``."""
    base = make_oracle_data(spec)
    sizes = {}
    for dtype in (torch.float32, torch.float64):
        data = base.cast(dtype)
        chosen = _selector(name).select(_request(name, data, n_centers, 0, selector_options))
        sizes[str(dtype).replace("torch.", "")] = _validate_centers(name, chosen, data, n_centers, exact_count)
    auto = _selector(name).select(_request(name, base, None, 0, selector_options))
    sizes["auto"] = _validate_centers(name, auto, base, None, exact_count)
    return {"n_centers": sizes}


def check_selector_seed(
    name: str, *, selector_options=None, n_centers: int = 40, spec: OracleSpec = OracleSpec(), **_: Any
) -> dict[str, Any]:
    """The same generator seed gives identical centers, whatever the global torch / numpy RNG state."""
    data = make_oracle_data(spec)
    results = []
    with _GlobalRngGuard():
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            np.random.seed(global_seed)
            results.append(_selector(name).select(_request(name, data, n_centers, 5, selector_options)))
    if not _same_centers(results[0], results[1]):
        raise AssertionError(
            f"selector {name!r}: two calls with the same generator seed chose different centers; draw every "
            "random number from request.generator"
        )
    return {}


def check_selector_device(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    exact_count: bool = True,
    spec: OracleSpec = OracleSpec(),
    device: str | torch.device | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Inputs on ``device`` (default CUDA when available) give centers on that device."""
    if device is None:
        if not torch.cuda.is_available():
            _skip("no CUDA device available")
        device = "cuda"
    data = make_oracle_data(spec).cast(torch.float32, device)
    m = _validate_centers(
        name, _selector(name).select(_request(name, data, n_centers, 0, selector_options)), data, n_centers, exact_count
    )
    return {"n_centers": m}


def check_selector_unknown_option(name: str, *, spec: OracleSpec = OracleSpec(), **_: Any) -> dict[str, Any]:
    """An unknown selector option fails with ValueError naming it and listing the valid ones."""
    selector = _selector(name)
    bogus = "no_such_option_xyz"
    try:
        merge_options(f"selector {name!r}", selector.option_defaults, {bogus: 1})
    except ValueError as exc:
        missing = [opt for opt in [bogus, *selector.option_defaults] if opt not in str(exc)]
        if missing:
            raise AssertionError(f"selector {name!r}: the unknown-option error does not mention {missing}") from None
    else:
        raise AssertionError(f"selector {name!r}: option_defaults accepted an unknown option")
    return {}


def check_selector_in_model(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    spec: OracleSpec = OracleSpec(),
    solver: str | None = None,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    **_: Any,
) -> dict[str, Any]:
    """``KernelRegressor(solver=solver, centers=name, solver_options=...)`` fits the Nystrom solution at the
    chosen centers within ``rtol``."""
    if solver is None:
        _skip("no solver given to fit with the selected centers")
    data = make_oracle_data(spec)
    model = _model(
        name=solver,
        data=data,
        solver_options=solver_options,
        centers=name,
        n_centers=n_centers,
        selector_options=dict(selector_options or {}),
    ).fit(data.X, data.y[:, 0])
    ref = dense_nystrom_mean(data, centers=model.centers_)[:, 0]
    err = _check_close(f"selector {name!r} with solver {solver!r}", model.predict(data.X_test), ref, rtol)
    return {"rel_error": err}


SELECTOR_CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "contract": check_selector_contract,
    "seed": check_selector_seed,
    "device": check_selector_device,
    "unknown_option": check_selector_unknown_option,
    "in_model": check_selector_in_model,
}
"""Every selector check by name, in the order :func:`check_selector` runs them."""


# ---------------------------------------------------------------------------------------------
# pytest base classes
# ---------------------------------------------------------------------------------------------
class SolverConformance:
    """Subclass as ``class TestMySolver(SolverConformance)`` and set the class attributes.

    Each ``test_*`` method runs one check of :data:`SOLVER_CHECKS`; checks that do not apply
    (no GPU, no centers, no ``partial_fit``) are reported as skipped.
    """

    solver_name: ClassVar[str] = ""
    solver_options: ClassVar[dict[str, Any]] = {}
    rtol: ClassVar[float] = 1e-6
    rtol_float32: ClassVar[float] = 1e-3
    iterative: ClassVar[bool] = False
    invalid_options: ClassVar[tuple[dict[str, Any], ...]] = ()
    spec: ClassVar[OracleSpec] = OracleSpec()
    device: ClassVar[str | None] = None
    skip_checks: ClassVar[tuple[str, ...]] = ()

    def run_check(self, check: str) -> dict[str, Any]:
        if not self.solver_name:
            raise AssertionError(f"{type(self).__name__}: set the class attribute solver_name")
        if check in self.skip_checks:
            _skip(f"{check} listed in skip_checks")
        return SOLVER_CHECKS[check](
            self.solver_name,
            solver_options=self.solver_options,
            rtol=self.rtol,
            rtol_float32=self.rtol_float32,
            iterative=self.iterative,
            invalid_options=tuple(self.invalid_options),
            spec=self.spec,
            device=self.device,
        )

    def test_protocol(self):
        self.run_check("protocol")

    def test_oracle(self):
        self.run_check("oracle")

    def test_dtype(self):
        self.run_check("dtype")

    def test_device(self):
        self.run_check("device")

    def test_multi_output(self):
        self.run_check("multi_output")

    def test_seed(self):
        self.run_check("seed")

    def test_callback(self):
        self.run_check("callback")

    def test_validation_metric(self):
        self.run_check("validation_metric")

    def test_unknown_option(self):
        self.run_check("unknown_option")

    def test_invalid_options(self):
        self.run_check("invalid_options")

    def test_save_load(self):
        self.run_check("save_load")

    def test_center_weights(self):
        self.run_check("center_weights")

    def test_partial_fit(self):
        self.run_check("partial_fit")


class SelectorConformance:
    """Subclass as ``class TestMySelector(SelectorConformance)``; one ``test_*`` per selector check."""

    selector_name: ClassVar[str] = ""
    selector_options: ClassVar[dict[str, Any]] = {}
    n_centers: ClassVar[int] = 40
    exact_count: ClassVar[bool] = True
    spec: ClassVar[OracleSpec] = OracleSpec()
    device: ClassVar[str | None] = None
    solver: ClassVar[str | None] = None
    solver_options: ClassVar[dict[str, Any]] = {}
    rtol: ClassVar[float] = 1e-6
    skip_checks: ClassVar[tuple[str, ...]] = ()

    def run_check(self, check: str) -> dict[str, Any]:
        if not self.selector_name:
            raise AssertionError(f"{type(self).__name__}: set the class attribute selector_name")
        if check in self.skip_checks:
            _skip(f"{check} listed in skip_checks")
        return SELECTOR_CHECKS[check](
            self.selector_name,
            selector_options=self.selector_options,
            n_centers=self.n_centers,
            exact_count=self.exact_count,
            spec=self.spec,
            device=self.device,
            solver=self.solver,
            solver_options=self.solver_options,
            rtol=self.rtol,
        )

    def test_contract(self):
        self.run_check("contract")

    def test_seed(self):
        self.run_check("seed")

    def test_device(self):
        self.run_check("device")

    def test_unknown_option(self):
        self.run_check("unknown_option")

    def test_in_model(self):
        self.run_check("in_model")
