"""Memory under a budget: a deterministic probe (the largest tensor any torch operation returns inside a
block), the problem and settings it runs under, and the objective check built on it (the selector check,
:func:`kgp.testing.selector_checks.check_selector_memory`, uses the same probe and settings)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import settings
from .objective_oracles import LOSS_POINTS, evaluate_loss, objective_problem, prepare_loss
from .oracles import OracleSpec, make_oracle_data

__all__ = ["MEMORY_BUDGET", "MEMORY_EXACT_SIZE", "MEMORY_SPEC", "LargestTensor", "check_objective_memory"]

MEMORY_SPEC = OracleSpec(n=2000, n_test=1, d=3, n_centers=20)
"""The problem of :func:`check_objective_memory`: n x M = 40,000 entries, above its budget."""

MEMORY_EXACT_SIZE = 100
"""``kgp.settings.max_exact_size`` in :func:`check_objective_memory`: dense blocks up to 100 x 100 are allowed."""

MEMORY_BUDGET = 2**16
"""Bytes of ``kgp.settings.memory_budget`` in :func:`check_objective_memory` (8,192 float64 entries,
below ``n x M`` of :data:`MEMORY_SPEC`: an objective must stream ``K_nM`` over row blocks)."""


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) that an aten op returns while the mode is active.

    ``with LargestTensor() as probe: ...`` then ``probe.largest`` (elements), ``probe.shape`` and
    ``probe.op`` (the op that returned it). Unlike a peak-RSS reading it does not depend on the
    allocator or on other threads, so a check can assert that no ``n x n`` (or ``n x M`` above the
    memory budget) tensor was ever formed, in the forward and the backward pass alike (the autograd
    engine runs CPU backward ops in the calling thread, inside the mode).
    """

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.shape, self.op = 0, (), None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.largest:
                self.largest, self.shape, self.op = tensor.numel(), tuple(tensor.shape), str(func)
        return out


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
                value, _, _ = evaluate_loss(prepare_loss(name, problem), problem, *LOSS_POINTS[0][2:], grad=True)
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
