"""The memory FALKON's ``M x M`` factors need, checked before any of them is allocated.

The preconditioner of Def. 3 holds two ``M x M`` factors at its peak (:mod:`.preconditioner`): ``T``,
written over ``K_MM``, and ``A``; in float64, or in float32 for ``precond_dtype="mixed"`` (one buffer of
the size of one float64 array) and for ``"input"`` on float32 inputs. The eigendecomposition path holds
``K_MM``, its eigenvectors and LAPACK's workspace, about three arrays. These are not kernel blocks, so
``kgp.settings.memory_budget`` does not bound them: they are compared with the memory the device has
(:func:`kgp.safeguards.check_memory`), so that ``n_centers=60000`` (57.6 GB in float64) is refused with
a message naming ``n_centers`` instead of the allocator's error, or hours of swapping.
"""

from __future__ import annotations

import math

import torch

from kgp.safeguards import available_memory, check_memory, format_bytes

__all__ = ["check_factor_memory", "factor_bytes"]


def factor_bytes(m: int, dtype: torch.dtype, options: dict) -> tuple[int, str]:
    """Bytes of the ``M x M`` arrays alive at the preconditioner's peak, and what they are."""
    precond = options["precond_dtype"]
    if precond == "auto":
        precond = "mixed" if dtype == torch.float32 else "float64"
    factorization = options["factorization"]
    if precond == "mixed" and factorization in ("auto", "cholesky"):
        return 2 * m * m * 4, f"two float32 {m:,} x {m:,} factors"
    itemsize = 4 if precond == "input" and dtype == torch.float32 else 8
    arrays = 3 if factorization == "eigh" else 2
    name = "float32" if itemsize == 4 else "float64"
    what = "K_MM, its eigenvectors and workspace" if arrays == 3 else "factors"
    return arrays * m * m * itemsize, f"{arrays} {name} {m:,} x {m:,} arrays ({what})"


def check_factor_memory(m: int, dtype: torch.dtype, device: torch.device, options: dict) -> None:
    """Raise :class:`kgp.safeguards.InsufficientMemoryError` when the factors of ``m`` centers cannot fit."""
    needed, what = factor_bytes(m, dtype, options)
    per_entry = needed / (m * m)
    available = available_memory(device)
    fits = max(1, math.isqrt(int(available / per_entry))) if available else None
    check_memory(
        needed,
        what=f"solver 'falkon' with n_centers={m:,}: its preconditioner's {what}",
        remedy=(
            f"lower n_centers (at most about {fits:,} centers' factors fit {format_bytes(available)}; the "
            "default n_centers, or solver='auto', sizes them from kgp.settings.memory_budget), or fit on a "
            "machine with more memory"
            if fits
            else "lower n_centers"
        ),
        device=device,
    )
