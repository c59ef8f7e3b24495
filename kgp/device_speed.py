"""The float64 matrix-product rate of a device, measured once per process.

``solver="auto"`` sizes FALKON's centers by the time their ``M^3`` setup takes, and that time is set by
the device's float64 GEMM rate: a GPU runs it about 100x faster than the 2-core CPU the recipe's cap of 11,241
centers was measured on (``kgp_builtins.recipes.rule``). :func:`measured_flops` times a few products of
square float64 matrices on the device and keeps the best rate, for the rest of the process, per device
(and per CPU thread count, which sets a CPU's rate). :data:`kgp.settings.device_flops` pins a rate
instead, so that a fit chooses the same centers on every host; the recipe then measures nothing
(:class:`kgp.recipes.RecipeRequest` carries both, and the probe runs only when the recipe calls it).

The probe: one untimed product (thread pools, kernel selection, the accelerator's context), then
``_RUNS`` timed ones, the fastest counted (``2 N^3`` flops each, the usual GEMM count); on a CPU
``N = 1,024`` (2.1 GFLOP each: 0.09 s for the four at 100 GFLOP/s), on an accelerator ``N = 4,096`` (a smaller
product does not fill a large GPU). Each product ends with a read of one entry, which waits for an
accelerator's queue without naming its backend. The matrices are constant (no random numbers are drawn:
the global generator a seeded fit relies on is left alone). Where the device cannot run float64
products (an error from torch) the rate is unknown (None) and the recipe keeps its measured defaults.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import torch

__all__ = ["measured_flops"]

_CPU_SIZE = 1024
_ACCELERATOR_SIZE = 4096
_RUNS = 3
# (device, CPU threads) -> measured flop/s, or None where the device could not run the probe
_measured: dict[tuple[str, int], float | None] = {}
_lock = threading.Lock()


def _probe(device: torch.device) -> float:
    """Best float64 GEMM rate, in flop/s, over ``_RUNS`` timed square products on ``device``."""
    size = _CPU_SIZE if device.type == "cpu" else _ACCELERATOR_SIZE
    with torch.no_grad():
        a = torch.full((size, size), 0.5, dtype=torch.float64, device=device)
        b = torch.full((size, size), 0.25, dtype=torch.float64, device=device)
        c = torch.empty((size, size), dtype=torch.float64, device=device)
        torch.matmul(a, b, out=c)
        float(c[0, 0])  # waits for the device
        best = math.inf
        for _ in range(_RUNS):
            start = time.perf_counter()
            torch.matmul(a, b, out=c)
            float(c[0, 0])
            best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def _key(device: torch.device) -> tuple[str, int]:
    return str(device), torch.get_num_threads() if device.type == "cpu" else 0


def measured_flops(device: Any = "cpu") -> float | None:
    """The float64 GEMM rate of ``device`` in flop/s, measured on the first call and kept for the process.

    Parameters
    ----------
    device : torch.device or str
        The device to time (a CPU's rate is kept per ``torch.get_num_threads()``).

    Returns
    -------
    float or None
        A positive, finite rate; None where the device cannot run float64 products (then the probe is
        not tried again).
    """
    device = torch.device(device)
    backend = getattr(torch, device.type, None)
    if device.index is None and device.type != "cpu" and hasattr(backend, "current_device"):
        device = torch.device(device.type, backend.current_device())  # "cuda" and "cuda:0" share one probe
    key = _key(device)
    with _lock:  # one probe at a time: two concurrent ones would each time half the device
        if key not in _measured:
            try:
                rate = _probe(device)
            except (RuntimeError, TypeError):
                rate = None
            _measured[key] = rate if rate is not None and math.isfinite(rate) and rate > 0 else None
        return _measured[key]
