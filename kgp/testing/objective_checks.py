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

from ..capabilities import Capabilities
from ..models import KernelRegressor
from ..options import resolve_options
from .memory import check_objective_memory
from .objective_oracles import (
    LOSS_POINTS,
    OBJECTIVE_ORACLES,
    evaluate_loss,
    objective_problem,
    prepare_loss,
    set_hyperparameters,
)
from .oracles import DEFAULT_SPEC, OracleSpec, make_oracle_data
from .support import GlobalRngGuard, plugin_info, reproduces, run_all, skip

__all__ = [
    "GRADCHECK_SPEC",
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
        loss = prepare_loss(name, problem)
        value, noise, mean = evaluate_loss(loss, problem, *LOSS_POINTS[1][2:], grad=True)
        what = f"objective {name!r} ({str(dtype).replace('torch.', '')})"
        if info.capabilities.likelihood:
            # -value * terms is reported as the model's log_marginal_likelihood_value_
            terms, most = getattr(loss, "terms", None), problem.n * problem.y.shape[1]
            if isinstance(terms, bool) or not isinstance(terms, int) or not 1 <= terms <= most:
                raise AssertionError(
                    f"{what}: declares Capabilities(likelihood=True), so the loss prepare returns must carry "
                    f"loss.terms, the number of (row, output) terms its value averages (1 to {most}), got {terms!r}"
                )
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
    loss = prepare_loss(name, problem)
    errors, values = [], []
    for lengthscale, outputscale, noise, mean in LOSS_POINTS:
        set_hyperparameters(problem, lengthscale, outputscale)
        with torch.no_grad():
            value, noise_t, mean_t = evaluate_loss(loss, problem, noise, mean)
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
    loss = prepare_loss(name, problem)
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
                values.append(evaluate_loss(prepare_loss(name, problem), problem, *LOSS_POINTS[0][2:])[0])
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
    value, _, _ = evaluate_loss(prepare_loss(name, problem), problem, *LOSS_POINTS[0][2:], grad=True)
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
