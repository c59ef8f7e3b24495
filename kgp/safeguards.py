"""Checks that run before heavy work: memory a step needs against what the machine has, and warnings for
results that are silently far less accurate than the user would expect.

* :class:`InsufficientMemoryError` (a ``MemoryError`` and a ``ValueError``): a step would allocate more
  than the device can hold. Raised before the allocation, naming the option that sets the size and the
  numbers, instead of the allocator's message after minutes of work, or a machine swapping to death.
* :class:`CostWarning` (a ``UserWarning``): a step that fits in memory but will run for a long time
  (EigenPro on hundreds of thousands of centers), with its size and number of passes, before it starts.
* :class:`AccuracyWarning` (a ``RuntimeWarning``): the fit ran, but something about the inputs or the
  approximation makes its answer much worse than the user would expect (float32 inputs that lost most of
  their distinct values, Nystrom centers that resolve only part of the kernel), with the remedy.

Memory is compared with what the device has available now: on a CPU ``MemAvailable`` of
``/proc/meminfo`` (physical memory the kernel can hand out without swapping; a size that fits virtual
memory or swap but not RAM is refused as well), else ``os.sysconf('SC_AVPHYS_PAGES')``; on a CUDA device
the free memory plus what torch's caching allocator holds unused. Where it cannot be read nothing is
refused.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

__all__ = [
    "AccuracyWarning",
    "CostWarning",
    "InsufficientMemoryError",
    "available_memory",
    "check_memory",
    "format_bytes",
]


class InsufficientMemoryError(MemoryError, ValueError):
    """A step would need more memory than the device has; raised before it allocates anything.

    The message names the option that sets the size (e.g. ``n_centers``), the bytes needed and the bytes
    available. A ``MemoryError`` (what running out of memory raises) and a ``ValueError`` (a parameter
    too large for the machine).
    """


class AccuracyWarning(RuntimeWarning):
    """The fit's answer is likely much less accurate than expected (collapsed inputs, too few centers)."""


class CostWarning(UserWarning):
    """A step is about to run far longer than a typical fit (its size and passes in the message)."""


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number at least 1 (``"26.8 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: Any = None) -> int | None:
    """Bytes the device can hand out now without swapping; None where that cannot be read.

    ``KGP_AVAILABLE_MEMORY`` (bytes) overrides the reading, for tests and for containers whose limit the
    kernel's numbers do not show.
    """
    override = os.environ.get("KGP_AVAILABLE_MEMORY")
    if override:
        try:
            return int(override)
        except ValueError:
            raise ValueError(f"KGP_AVAILABLE_MEMORY: expected a number of bytes, got {override!r}") from None
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        # memory torch's allocator reserved but does not use is free for torch, not for the driver
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0))
    if device.type != "cpu":
        return None
    available = _meminfo_available()
    if available is not None:
        return available
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(needed: int, *, what: str, remedy: str, device: Any = None) -> None:
    """Raise :class:`InsufficientMemoryError` when ``needed`` bytes exceed the device's available memory.

    Parameters
    ----------
    needed:
        Bytes the step allocates at its peak.
    what:
        What allocates them, with the option that sets the size (``"FALKON with n_centers=60,000: two
        60,000 x 60,000 float64 factors"``).
    remedy:
        What to change (``"lower n_centers to at most 38,000"``).
    device:
        Where the memory is allocated (default: the CPU).
    """
    available = available_memory(device)
    if available is None or needed <= available:
        return
    where = "this machine's available RAM" if torch.device(device or "cpu").type == "cpu" else f"{device}'s free memory"
    raise InsufficientMemoryError(
        f"{what} need {format_bytes(needed)} ({needed:,} bytes), more than {where}, {format_bytes(available)} "
        f"({available:,} bytes); nothing was allocated. Remedy: {remedy}"
    )


def warn_accuracy(message: str, stacklevel: int = 2) -> None:
    """Issue an :class:`AccuracyWarning` (one place, so that users can filter or escalate all of them)."""
    warnings.warn(message, AccuracyWarning, stacklevel=stacklevel + 1)
