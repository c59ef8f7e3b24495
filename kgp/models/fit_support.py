"""What a fit needs around its stages: the distributed capability check, interrupt and monitor handling,
the validation metric in target units, the check of a lossy cast of X, and the estimator repr's helpers
(used by :mod:`.base`)."""

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
from ..safeguards import warn_accuracy

# a cast whose rounding error (root mean square over the column) exceeds this fraction of the column's
# standard deviation is reported: float32's own rounding of standardised data is about 1e-7 of it
CAST_ERROR_LIMIT = 0.01


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


def _warn_if_cast_collapses(data: Any, dtype: torch.dtype | None, feature_names: Any = None) -> None:
    """Warn (:class:`kgp.AccuracyWarning`) when casting ``X`` to ``dtype`` destroys a column's variation.

    float32 keeps 24 bits: integers near 2**40 that differ by less than 2**16, or float64 timestamps that
    differ by seconds, round to a few values or one, and the fit then cannot tell the rows apart. A column
    is checked in detail only when float32's spacing at its largest magnitude is above 1e-3 of its range
    (one pass over X, no copy, for the others); there the root-mean-square rounding error is compared with
    the column's standard deviation (:data:`CAST_ERROR_LIMIT`). The warning names the columns and the
    remedy: centre them before fitting, or fit in float64.
    """
    if dtype != torch.float32:
        return
    if isinstance(data, Tensor):
        values = data.detach()
    else:
        try:
            array = np.asarray(data)
        except Exception:  # to_tensor reports what is wrong with the input
            return
        if array.dtype.kind not in "iuf" or array.ndim != 2 or array.size == 0:
            return
        values = torch.from_numpy(np.ascontiguousarray(array)) if array.dtype != np.float16 else None
    if values is None or values.dim() != 2 or values.numel() == 0 or values.dtype in (torch.float32, torch.bool):
        return
    if values.dtype.is_complex or values.dtype in (torch.float16, torch.bfloat16):
        return
    spacing = torch.finfo(torch.float32).eps
    high, low = values.amax(0).double(), values.amin(0).double()
    magnitude = torch.maximum(high.abs(), low.abs())
    suspect = torch.nonzero((spacing * magnitude > 1e-3 * (high - low)) & (high > low)).flatten().tolist()
    lost = []
    for j in suspect:
        column = values[:, j].double()
        if not bool(torch.isfinite(column).all()):
            continue  # to_tensor reports non-finite values
        rounded = column.to(torch.float32).double()
        spread = float(column.std(correction=0))
        error = float((rounded - column).square().mean().sqrt())
        if spread > 0 and error > CAST_ERROR_LIMIT * spread:
            before, after = int(torch.unique(column).numel()), int(torch.unique(rounded).numel())
            lost.append((j, before, after, error / spread))
    if not lost:
        return
    names = None if feature_names is None else [str(name) for name in feature_names]
    parts = [
        f"column {j}{f' ({names[j]!r})' if names is not None else ''}: {before:,} distinct values become "
        f"{after:,}, rounding error {ratio:.3g}x its standard deviation"
        for j, before, after, ratio in lost[:5]
    ]
    more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
    warn_accuracy(
        f"X: casting the {values.dtype} features to float32 (dtype='float32') destroys most of their variation: "
        f"{'; '.join(parts)}{more}. float32 keeps about 7 significant digits, and these columns vary far below "
        "that relative to their magnitude. Remedy: centre the columns before fitting (X - X.mean(axis=0)), or "
        "fit in float64 (dtype='float64')",
        stacklevel=4,
    )
