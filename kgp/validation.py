"""Early, explicit checks of user input: every error names the argument and what was expected."""

from __future__ import annotations

import math
import warnings
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "check_positive",
    "check_n_centers",
    "resolve_dtype",
    "to_tensor",
]

_FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: Any) -> torch.dtype | None:
    """Map ``None``, ``"float32"``, ``"float64"``, ``torch.float32/64`` or ``numpy.float32/64`` to a torch dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.float64):
            return dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
        if name in _FLOAT_DTYPES:
            return _FLOAT_DTYPES[name]
    raise TypeError(f"dtype: expected None, 'float32' or 'float64', got {dtype!r}")


def check_positive(value: Any, name: str) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite positive number, got {value!r}")
    return value


def check_n_centers(value: Any, n: int | None = None) -> int | None:
    """Validate ``n_centers``: None, or an integer in [1, n]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"n_centers: expected a positive integer or None, got {value!r}")
    value = int(value)
    if value < 1:
        raise ValueError(f"n_centers: expected a positive integer, got {value}")
    if n is not None and value > n:
        raise ValueError(f"n_centers: expected at most n_samples={n} centers, got {value}")
    return value


def to_tensor(
    data: Any,
    name: str,
    *,
    ndim: tuple[int, ...],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    allow_int: bool = True,
    allow_empty: bool = False,
) -> Tensor:
    """Convert a numpy array / torch tensor / nested list to a checked floating tensor.

    Parameters
    ----------
    data:
        The user's input.
    name:
        Argument name used in error messages (``"X"``, ``"y"``...).
    ndim:
        Allowed numbers of dimensions.
    dtype:
        Target dtype; None keeps a float32/float64 input's dtype and maps integers to float64.
    device:
        Target device; None keeps a tensor's device (CPU for numpy).
    allow_int:
        Whether integer / boolean input is accepted (converted to ``dtype`` or float64).
    allow_empty:
        Whether zero rows are accepted (a rank of a distributed fit may hold no rows).

    Raises
    ------
    TypeError
        float16 / bfloat16 / sparse / non-numeric input (an object array of numbers is converted).
    ValueError
        Complex values, wrong number of dimensions, empty input, NaN or infinity.
    """
    if data is None:
        # the second part is scikit-learn's wording (its estimator checks match it)
        raise ValueError(f"{name}: Expected array-like (array or non-string sequence), got None")
    if isinstance(data, Tensor):
        if data.is_sparse or data.layout != torch.strided:
            raise TypeError(f"{name}: sparse tensors are not supported; pass a dense tensor (X.to_dense())")
        tensor = data.detach()
    else:
        if hasattr(data, "tocsr") or hasattr(data, "sparse"):  # scipy.sparse / pandas sparse
            raise TypeError(f"{name}: sparse input is not supported; pass a dense array (X.toarray())")
        try:
            array = np.asarray(data)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"{name}: expected an array or tensor, got {type(data).__name__}") from exc
        if array.dtype.kind == "c":
            # ValueError with scikit-learn's wording (its estimator checks match "Complex data not supported")
            raise ValueError(f"{name}: Complex data not supported (got {array.dtype}); pass real values")
        if array.dtype.kind == "O":
            # an object array of numbers (e.g. from a mixed-type table) is numeric data: convert it;
            # anything else (strings, dicts, None) is refused, with numpy's reason
            try:
                array = array.astype(np.float64)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{name}: expected numbers, got an object array that is not numeric ({exc})") from None
        if array.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected a numeric array, got dtype {array.dtype}")
        if array.dtype == np.float16:
            raise TypeError(f"{name}: float16 is not supported; use float32 or float64")
        array = np.ascontiguousarray(array)
        if array.flags.writeable:
            tensor = torch.from_numpy(array)
        else:
            # a read-only array (a .npy opened with mmap_mode="r") is shared, not copied: kgp never writes
            # into its inputs, and a copy would hold a second n x d array in memory for the whole fit
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tensor = torch.from_numpy(array)
    if tensor.dtype in (torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: {tensor.dtype} is not supported; use float32 or float64")
    if tensor.is_complex():
        raise ValueError(f"{name}: Complex data not supported (got {tensor.dtype}); pass real values")
    is_float = tensor.dtype in (torch.float32, torch.float64)
    if not is_float and not allow_int:
        raise TypeError(f"{name}: expected floating-point values, got {tensor.dtype}")
    if tensor.dim() not in ndim:
        shapes = " or ".join(f"{d}-D" for d in ndim)
        hint = ""
        if name.startswith("X") and tensor.dim() == 1:
            hint = ". Reshape your data: X.reshape(1, -1) for a single sample, X.reshape(-1, 1) for a single feature"
        raise ValueError(f"{name}: expected a {shapes} array, got shape {tuple(tensor.shape)}{hint}")
    if tensor.dim() == 2 and tensor.shape[1] == 0:
        # the second sentence is scikit-learn's wording (its estimator checks match it)
        raise ValueError(
            f"{name}: expected at least one column; found array with 0 feature(s) "
            f"(shape=({tensor.shape[0]}, 0)) while a minimum of 1 is required."
        )
    if not allow_empty and (tensor.numel() == 0 or tensor.shape[0] == 0):
        raise ValueError(f"{name}: expected a non-empty array, got shape {tuple(tensor.shape)}")
    target = dtype or (tensor.dtype if is_float else torch.float64)
    source = tensor
    tensor = tensor.to(device=device if device is not None else tensor.device, dtype=target)
    if is_float or target != tensor.dtype:
        _check_finite(tensor, name, source)
    return tensor


_FINITE_BLOCK = 1 << 20
"""Elements per block of the finiteness count (8 MB of float64)."""


def _check_finite(tensor: Tensor, name: str, source: Tensor | None = None) -> None:
    """Raise ValueError naming ``name`` if ``tensor`` holds a NaN or an infinity.

    NaN and infinities propagate through a sum, so a finite sum proves every element finite without the
    temporaries of ``torch.isfinite`` (an ``abs`` as large as the input on the CPU); only a sum that is not
    finite (a bad value, or finite values that overflow) is followed by the exact count, block by block.

    ``source``: the values before their cast to ``tensor``'s dtype. Where they were finite and the cast
    made infinities (1e300 given to a float32 model), the message says that the values overflow the dtype,
    with its largest value, instead of calling them NaN or infinite.
    """
    if tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return
    bad = _count_non_finite(tensor)
    if not bad:
        return
    if source is not None and source.dtype != tensor.dtype and source.dtype.is_floating_point:
        if _count_non_finite(source) == 0:
            flat = source.reshape(-1)
            largest = max(
                float(flat[lo : lo + _FINITE_BLOCK].abs().max()) for lo in range(0, flat.numel(), _FINITE_BLOCK)
            )
            dtype = str(tensor.dtype).replace("torch.", "")
            raise ValueError(
                f"{name}: {bad} finite value(s) overflow {dtype}: the largest magnitude is {largest:.3g}, "
                f"{dtype} holds at most {torch.finfo(tensor.dtype).max:.4g}. {name} is converted to {dtype} (the "
                f"model's or the dtype= parameter's precision): rescale {name}, or fit in float64 (dtype='float64')"
            )
    raise ValueError(f"{name}: contains {bad} NaN or infinite value(s)")


def all_finite(tensor: Tensor) -> bool:
    """Whether every entry of ``tensor`` is finite: its sum first (NaN and infinities propagate through it),
    the exact count block by block only when the sum is not finite (no input-sized temporary)."""
    return tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())) or _count_non_finite(tensor) == 0


def _count_non_finite(tensor: Tensor) -> int:
    """NaN and infinite entries of ``tensor``, counted block by block (no input-sized temporary)."""
    flat = tensor.reshape(-1)
    return sum(
        int((~torch.isfinite(flat[lo : lo + _FINITE_BLOCK])).sum()) for lo in range(0, flat.numel(), _FINITE_BLOCK)
    )
