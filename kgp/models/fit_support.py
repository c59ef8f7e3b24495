"""What the estimator needs around a fit: interrupt handling, the check of a lossy cast of X, and the
estimator repr's helpers (used by :mod:`.base`)."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from ..safeguards import warn_accuracy

# a cast whose rounding error (root mean square over the column) exceeds this fraction of the column's
# standard deviation is reported: float32's own rounding of standardised data is about 1e-7 of it
CAST_ERROR_LIMIT = 0.01


@contextlib.contextmanager
def released_on_interrupt(model: Any) -> Iterator[None]:
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


def same_as_default(value: Any, default: Any) -> bool:
    if isinstance(value, (Tensor, np.ndarray, gpytorch.kernels.Kernel)):
        return False
    return type(value) is type(default) and value == default


def short_repr(value: Any) -> str:
    if isinstance(value, (Tensor, np.ndarray)):
        return f"<array {tuple(value.shape)}>"
    if isinstance(value, gpytorch.kernels.Kernel):
        return type(value).__name__ + "()"
    return repr(value)


def warn_if_cast_collapses(data: Any, dtype: torch.dtype | None, feature_names: Any = None) -> None:
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
