"""Objective checks: the protocol, the value against a dense oracle, ``torch.autograd.gradcheck``,
randomness only from ``problem.generator``, options, memory under a budget, and devices.

Each check prepares the registered objective on a :class:`kgp.learning.LearningProblem` built by
:func:`~kgp.testing.objective_oracles.objective_problem` (the kit's data, a ``ScaleKernel`` whose
parameters all train, the spec's centers when the objective uses centers, options resolved as the
model resolves them) and evaluates ``loss(noise, mean)`` as the learning loop does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.autograd.gradcheck import GradcheckError

from .. import settings
from ..capabilities import Capabilities
from ..models import KernelRegressor
from ..options import resolve_options
from .memory import LargestTensor
from .objective_oracles import OBJECTIVE_ORACLES, objective_problem, set_hyperparameters
from .oracles import DEFAULT_SPEC, OracleSpec, make_oracle_data
from .support import GlobalRngGuard, plugin_info, reproduces, run_all, skip

__all__ = [
    "GRADCHECK_SPEC",
    "MEMORY_BUDGET",
    "MEMORY_EXACT_SIZE",
    "MEMORY_SPEC",
    "OBJECTIVE_CHECKS",
    "check_objective",
    "check_objective_device",
    "check_objective_gradcheck",
    "check_objective_invalid_options",
    "check_objective_memory",
    "check_objective_protocol",
    "check_objective_seed",
    "check_objective_unknown_option",
    "check_objective_value",
]

GRADCHECK_SPEC = OracleSpec(n=24, n_test=1, d=2, n_centers=6, noise=0.1)
"""The small float64 problem of :func:`check_objective_gradcheck` (finite differences cost 2 losses per input)."""

MEMORY_SPEC = OracleSpec(n=2000, n_test=1, d=3, n_centers=20)
"""The problem of :func:`check_objective_memory`: n x M = 40,000 entries, above its budget."""

MEMORY_EXACT_SIZE = 100
"""``kgp.settings.max_exact_size`` in :func:`check_objective_memory`: dense blocks up to 100 x 100 are allowed."""

MEMORY_BUDGET = 2**16
"""Bytes of ``kgp.settings.memory_budget`` in :func:`check_objective_memory` (8,192 float64 entries,
below ``n x M`` of :data:`MEMORY_SPEC`: an objective must stream ``K_nM`` over row blocks)."""

# (lengthscale, outputscale, noise, mean) at which values are compared and the protocol is probed
_POINTS = ((1.0, 1.0, 1e-2, 0.0), (0.6, 2.0, 0.3, 0.4))


def _evaluate(loss: Callable, problem, noise: float, mean: float, grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    like = {"dtype": problem.dtype, "device": problem.device}
    noise_t = torch.tensor(noise, **like, requires_grad=grad)
    mean_t = torch.full((problem.n_outputs,), mean, **like, requires_grad=grad)
    return loss(noise_t, mean_t), noise_t, mean_t


def _prepare(name: str, problem) -> Callable:
    loss = plugin_info("objective", name).obj.prepare(problem)
    if not callable(loss):
        raise AssertionError(
            f"objective {name!r}: prepare(problem) returned {type(loss).__name__}, not loss(noise, mean)"
        )
    return loss


def check_objective_protocol(
    name: str, *, objective_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """Declarations; a finite 0-d loss in the input dtype with a gradient for every trained quantity; inputs kept."""
    info = plugin_info("objective", name)
    if not isinstance(info.capabilities, Capabilities) or info.capabilities.partial_fit:
        raise AssertionError(
            f"objective {name!r}: needs a kgp.Capabilities without partial_fit, got {info.capabilities}"
        )
    data = make_oracle_data(spec, n_outputs=2)
    values = {}
    for dtype in (torch.float64, torch.float32):
        problem = objective_problem(name, data, objective_options, dtype=dtype)
        X, y = problem.X.clone(), problem.y.clone()
        value, noise, mean = _evaluate(_prepare(name, problem), problem, *_POINTS[1][2:], grad=True)
        what = f"objective {name!r} ({str(dtype).replace('torch.', '')})"
        if not isinstance(value, Tensor) or value.dim() != 0 or value.dtype != dtype:
            got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise AssertionError(f"{what}: loss(noise, mean) must return a 0-d {dtype} tensor, got {got}")
        if not bool(torch.isfinite(value)):
            raise AssertionError(f"{what}: loss(noise, mean) = {float(value)} is not finite")
        value.backward()
        trained = {f"kernel.{n}": p for n, p in problem.kernel.named_parameters() if p.requires_grad}
        for label, tensor in {**trained, "noise": noise, "mean": mean}.items():
            if tensor.grad is None or not bool(torch.isfinite(tensor.grad).all()):
                raise AssertionError(
                    f"{what}: the loss has no finite gradient with respect to {label} (grad {tensor.grad}); it must "
                    "be differentiable in the kernel's parameters, noise and mean"
                )
        if not (torch.equal(X, problem.X) and torch.equal(y, problem.y)):
            raise AssertionError(f"{what}: prepare or loss modified problem.X or problem.y in place")
        values[str(dtype).replace("torch.", "")] = float(value.detach())
    return {"loss": values}


def check_objective_value(
    name: str,
    *,
    objective_options: Mapping[str, Any] | None = None,
    oracle: str | Callable | None = None,
    rtol: float = 1e-6,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """``loss(noise, mean)`` at two hyperparameter points within ``rtol`` of the oracle (2 outputs, float64).

    The error is ``|loss - oracle| / max(1, |oracle|)``: per-point values of order one, absolute below that.
    """
    if oracle is None:
        skip(f"objective {name!r}: no oracle (declare what it computes: {', '.join(OBJECTIVE_ORACLES)}, or a function)")
    if isinstance(oracle, str):
        if oracle not in OBJECTIVE_ORACLES:
            raise ValueError(f"oracle: expected one of {', '.join(OBJECTIVE_ORACLES)} or a function, got {oracle!r}")
        oracle = OBJECTIVE_ORACLES[oracle]
    data = make_oracle_data(spec, n_outputs=2)
    problem = objective_problem(name, data, objective_options, seed=3)
    loss = _prepare(name, problem)
    errors, values = [], []
    for lengthscale, outputscale, noise, mean in _POINTS:
        set_hyperparameters(problem, lengthscale, outputscale)
        with torch.no_grad():
            value, noise_t, mean_t = _evaluate(loss, problem, noise, mean)
        # the oracle sees the problem with a generator seeded like prepare's: it may draw the same rows
        expected = float(
            oracle(dataclasses.replace(problem, generator=torch.Generator().manual_seed(3)), noise_t, mean_t)
        )
        error = abs(float(value) - expected) / max(1.0, abs(expected))
        if not error <= rtol:
            raise AssertionError(
                f"objective {name!r}: loss = {float(value):.10g} at lengthscale {lengthscale}, outputscale "
                f"{outputscale}, noise {noise}, mean {mean}; the dense oracle gives {expected:.10g} (error "
                f"{error:.2e} > rtol={rtol:.1e})"
            )
        errors.append(error)
        values.append(expected)
    return {"max_error": max(errors), "oracle_values": values}


def check_objective_gradcheck(
    name: str,
    *,
    objective_options: Mapping[str, Any] | None = None,
    gradcheck_spec: OracleSpec = GRADCHECK_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """``torch.autograd.gradcheck`` in float64 on a small problem: kernel parameters, noise and mean."""
    data = make_oracle_data(gradcheck_spec, n_outputs=2)
    problem = objective_problem(name, data, objective_options)
    loss = _prepare(name, problem)
    kernel = problem.kernel
    names = [n for n, p in kernel.named_parameters() if p.requires_grad]

    class Bound(torch.nn.Module):  # holds the kernel so that functional_call can swap its parameters
        def __init__(self):
            super().__init__()
            self.kernel = kernel

        def forward(self, noise, mean):
            return loss(noise, mean)

    bound = Bound()

    def value(*inputs: Tensor) -> Tensor:
        *raw, noise, mean = inputs
        return torch.func.functional_call(bound, {f"kernel.{n}": r for n, r in zip(names, raw)}, (noise, mean))

    params = dict(kernel.named_parameters())
    inputs = [params[n].detach().clone().requires_grad_() for n in names]
    inputs += [torch.tensor(gradcheck_spec.noise, dtype=torch.float64, requires_grad=True)]
    inputs += [torch.full((2,), 0.2, dtype=torch.float64, requires_grad=True)]
    try:
        torch.autograd.gradcheck(value, tuple(inputs), eps=1e-6, atol=1e-6, rtol=1e-4)
    except GradcheckError as exc:
        raise AssertionError(
            f"objective {name!r}: the gradient of loss(noise, mean) with respect to ({', '.join(names)}, noise, "
            f"mean) disagrees with finite differences: {exc}"
        ) from None
    return {"inputs": [*names, "noise", "mean"]}


def check_objective_seed(
    name: str, *, objective_options: Mapping[str, Any] | None = None, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """The same generator seed gives the same loss, whatever the global torch / numpy RNG state."""
    data = make_oracle_data(spec)
    values = []
    with GlobalRngGuard():
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            np.random.seed(global_seed)
            problem = objective_problem(name, data, objective_options, seed=11)
            with torch.no_grad():
                values.append(_evaluate(_prepare(name, problem), problem, *_POINTS[0][2:])[0])
    if not reproduces(values[1], values[0]):
        raise AssertionError(
            f"objective {name!r}: two runs with the same problem.generator seed gave {float(values[0])!r} and "
            f"{float(values[1])!r}; draw every random number from problem.generator"
        )
    return {}


def check_objective_unknown_option(name: str, *, spec: OracleSpec = DEFAULT_SPEC, **_: Any) -> dict[str, Any]:
    """An unknown option fails, naming it and the valid ones, when resolved and from ``learn_options``."""
    objective = plugin_info("objective", name).obj
    bogus = "no_such_option_xyz"
    try:
        resolve_options(f"objective {name!r}", objective, {bogus: 1})
    except ValueError as exc:
        missing = [opt for opt in [bogus, *objective.option_defaults] if opt not in str(exc)]
        if missing:
            raise AssertionError(f"objective {name!r}: the unknown-option error does not mention {missing}") from None
    else:
        raise AssertionError(f"objective {name!r}: option_defaults accepted an unknown option")
    data = make_oracle_data(spec)
    try:
        KernelRegressor(learn=name, learn_options={bogus: 1}).fit(data.X, data.y[:, 0])
    except ValueError as exc:
        if bogus not in str(exc):
            raise AssertionError(
                f"objective {name!r}: learn_options with {bogus!r} failed without naming it: {exc}"
            ) from None
    else:
        raise AssertionError(f"objective {name!r}: learn_options={{{bogus!r}: 1}} was accepted")
    return {}


def check_objective_invalid_options(
    name: str, *, invalid_options: tuple[Mapping[str, Any], ...] = (), **_: Any
) -> dict[str, Any]:
    """Each dict in ``invalid_options`` is refused when resolved (ValueError / TypeError naming an option in it)."""
    if not invalid_options:
        skip("no invalid_options given")
    objective = plugin_info("objective", name).obj
    for bad in invalid_options:
        try:
            resolve_options(f"objective {name!r}", objective, bad)
        except (ValueError, TypeError) as exc:
            if not any(key in str(exc) for key in bad):
                raise AssertionError(
                    f"objective {name!r}: the error for {dict(bad)} names none of {list(bad)}: {exc}"
                ) from None
        else:
            raise AssertionError(f"objective {name!r}: invalid options {dict(bad)} were accepted")
    return {"cases": len(invalid_options)}


def check_objective_memory(
    name: str,
    *,
    objective_options: Mapping[str, Any] | None = None,
    memory_options: Mapping[str, Any] | None = None,
    memory_spec: OracleSpec = MEMORY_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """Under ``kgp.settings.max_exact_size`` = :data:`MEMORY_EXACT_SIZE` (far below n) and ``memory_budget`` =
    :data:`MEMORY_BUDGET`: no n x n tensor, and none larger than ``max(budget, max_exact_size^2, M^2,
    n x max(d, k))`` entries, in ``prepare``, ``loss`` and its backward pass.

    Dense blocks up to ``max_exact_size`` square are what that setting allows (an exact likelihood on a
    subset of rows); an ``n x M`` block must be streamed. An objective that needs more may refuse with a
    ValueError naming ``max_exact_size`` (give ``memory_options`` that make it fit, e.g. a subset).
    """
    data = make_oracle_data(memory_spec)
    n, m, d = memory_spec.n, memory_spec.n_centers, memory_spec.d
    options = {**dict(objective_options or {}), **dict(memory_options or {})}
    with settings.max_exact_size(MEMORY_EXACT_SIZE), settings.memory_budget(MEMORY_BUDGET):
        problem = objective_problem(name, data, options)
        with LargestTensor() as probe:
            try:
                value, _, _ = _evaluate(_prepare(name, problem), problem, *_POINTS[0][2:], grad=True)
                value.backward()
            except ValueError as exc:
                if "max_exact_size" not in str(exc):
                    raise AssertionError(f"objective {name!r}: failed at n={n} under a memory budget: {exc}") from exc
                return {"refused": str(exc)}
    itemsize = problem.X.element_size()
    bound = max(MEMORY_BUDGET // itemsize, MEMORY_EXACT_SIZE**2, m * m, n * max(d, problem.n_outputs))
    if probe.largest >= n * n:
        raise AssertionError(
            f"objective {name!r}: formed a {probe.shape} tensor ({probe.op}) at n={n} > max_exact_size="
            f"{MEMORY_EXACT_SIZE}: never n x n; refuse with a ValueError naming kgp.settings.max_exact_size"
        )
    if probe.largest > bound:
        raise AssertionError(
            f"objective {name!r}: formed a {probe.shape} tensor ({probe.op}), {probe.largest} entries, above "
            f"max(memory_budget={MEMORY_BUDGET} bytes, max_exact_size^2, M^2, n x max(d, k)) = {bound} at n={n}, "
            f"M={m}: stream n x M products over row blocks under kgp.settings.memory_budget"
        )
    return {"largest": probe.largest, "shape": probe.shape, "bound": bound}


def check_objective_device(
    name: str,
    *,
    objective_options: Mapping[str, Any] | None = None,
    spec: OracleSpec = DEFAULT_SPEC,
    device: str | torch.device | None = None,
    **_: Any,
) -> dict[str, Any]:
    """On ``device`` (default CUDA when available) the loss is computed there and is finite."""
    if device is None:
        if not torch.cuda.is_available():
            skip("no CUDA device available (the CPU is covered by every other check)")
        device = "cuda"
    device = torch.device(device)
    problem = objective_problem(name, make_oracle_data(spec), objective_options, device=device)
    value, _, _ = _evaluate(_prepare(name, problem), problem, *_POINTS[0][2:], grad=True)
    if value.device.type != device.type or not bool(torch.isfinite(value)):
        raise AssertionError(f"objective {name!r}: on {device} the loss is {value} on {value.device}")
    value.backward()
    return {"loss": float(value.detach())}


OBJECTIVE_CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "protocol": check_objective_protocol,
    "value": check_objective_value,
    "gradcheck": check_objective_gradcheck,
    "seed": check_objective_seed,
    "unknown_option": check_objective_unknown_option,
    "invalid_options": check_objective_invalid_options,
    "memory": check_objective_memory,
    "device": check_objective_device,
}
"""Every objective check by name, in the order :func:`check_objective` runs them."""


def check_objective(
    name: str,
    *,
    oracle: str | Callable | None = None,
    objective_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    invalid_options: tuple[Mapping[str, Any], ...] = (),
    memory_options: Mapping[str, Any] | None = None,
    spec: OracleSpec = DEFAULT_SPEC,
    device: str | torch.device | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run every objective check and return what each measured.

    Parameters
    ----------
    name:
        Registered objective name.
    oracle:
        What the objective computes: ``"exact_nll"`` or ``"sgpr_bound"``
        (:mod:`kgp.testing.objective_oracles`), or a function ``oracle(problem, noise, mean) -> float``;
        None skips the value check.
    objective_options:
        Options for every check (``learn_options`` of the objective's own).
    rtol:
        Largest ``|loss - oracle| / max(1, |oracle|)`` in float64.
    invalid_options:
        Option dicts that resolving must refuse, naming an option.
    memory_options:
        Options added in the memory check (e.g. a subset of rows for an objective on the dense matrix).
    spec:
        The problem of the value, protocol, seed and option checks.
    device:
        Extra device for the device check (default: CUDA when available).
    skip:
        Names of checks not to run (keys of :data:`OBJECTIVE_CHECKS`).

    Raises
    ------
    AssertionError
        Listing every failed check.
    """
    return run_all(
        OBJECTIVE_CHECKS,
        skip,
        f"objective {name!r}",
        name=name,
        oracle=oracle,
        objective_options=objective_options,
        rtol=rtol,
        invalid_options=tuple(invalid_options),
        memory_options=memory_options,
        spec=spec,
        device=device,
    )
