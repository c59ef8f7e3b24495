"""What a fit needs around its stages: the distributed capability check, interrupt and monitor handling,
the validation metric in target units, and the estimator repr's helpers (used by :mod:`.base`)."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from ..fitting.plan import FitPlan
from ..monitor import Monitor


def _check_distributed_plugins(plan: FitPlan) -> None:
    """Refuse, before any work, plugins that do not declare the ``distributed`` capability."""
    caps = plan.solver.capabilities
    if not caps.distributed:
        # a solver may say why it is not distributed and what to use instead (eigenpro2)
        reason = caps.distributed_refusal
        raise ValueError(
            f"solver {plan.solver.name!r} does not support distributed fitting (distributed=True): "
            + (
                f"{reason}."
                if reason
                else "it does not declare Capabilities(distributed=True). Use solver='falkon', or fit on one process "
                "holding all rows."
            )
        )
    if plan.selector is not None and not plan.selector.capabilities.distributed:
        raise ValueError(
            f"centers={plan.selector.name!r} does not support distributed fitting (distributed=True): the "
            "selector does not declare Capabilities(distributed=True). Use centers='uniform' or explicit centers."
        )


@contextlib.contextmanager
def _released_on_interrupt(model: Any) -> Iterator[None]:
    """On Ctrl-C or CUDA out-of-memory, drop the fit's tensors now and say what state is kept.

    The traceback of an interrupted fit holds every frame below ``fit``, with the kernel blocks,
    preconditioner and data copies in their locals; a notebook keeps that traceback
    (``sys.last_traceback``) until the next error, so the memory would stay taken. Clearing the
    finished frames keeps the traceback's file and line information and frees the tensors.
    """
    try:
        yield
    except (KeyboardInterrupt, torch.cuda.OutOfMemoryError) as exc:
        traceback.clear_frames(exc.__traceback__)
        state = "keeps its previous fitted state" if "posterior_" in model.__dict__ else "is left unfitted"
        exc.add_note(
            f"kgp: {type(model).__name__}.fit stopped ({type(exc).__name__}); the estimator {state}, and the "
            "fit's tensors were released"
        )
        raise


@contextlib.contextmanager
def _closing(monitor: Monitor) -> Iterator[Monitor]:
    """The model owns the monitor: its progress bar is closed however the fit ends."""
    try:
        yield monitor
    finally:
        monitor.close()


def _in_target_units(metric: Callable[[Tensor, Tensor], float] | None, shift: dict[str, Tensor]) -> Callable:
    """``metric`` applied to predictions mapped back from the solver's (centred, scaled) targets."""

    def scored(pred: Tensor, target: Tensor) -> float:
        out = pred.unsqueeze(-1) if pred.dim() == 1 else pred
        out = out + shift["mean"]
        if "y_train_std" in shift:
            out = out * shift["y_train_std"] + shift["y_train_mean"]
        if metric is not None:
            return metric(out, target)
        return float(((out.reshape(target.shape) - target) ** 2).mean())

    return scored


def _kernel_kwargs(kernel: gpytorch.kernels.Kernel) -> dict[str, Any]:
    return {"nu": kernel.nu} if isinstance(kernel, gpytorch.kernels.MaternKernel) else {}


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, (Tensor, np.ndarray, gpytorch.kernels.Kernel)):
        return False
    return type(value) is type(default) and value == default


def _short(value: Any) -> str:
    if isinstance(value, (Tensor, np.ndarray)):
        return f"<array {tuple(value.shape)}>"
    if isinstance(value, gpytorch.kernels.Kernel):
        return type(value).__name__ + "()"
    return repr(value)
