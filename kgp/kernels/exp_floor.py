"""The smallest exponent kgp passes to ``exp``, per dtype.

``exp`` of arguments whose result is subnormal or underflows ran 10-70x slower on the development CPUs
(float64, 3,000 x 3,000: 4.5 ms for arguments in [-700, 0], 42-69 ms once a few percent of the results
are subnormal; docs/backend.md), and subnormal kernel entries slow every later GEMM that reads them.
Arguments are floored here instead: an entry below ``exp(EXP_FLOOR)`` (1.8e-35 in float32, 1e-304 in
float64) becomes that value, far below what any sum it enters can resolve.
"""

from __future__ import annotations

import torch

__all__ = ["EXP_FLOOR"]

EXP_FLOOR = {torch.float32: -80.0, torch.float64: -700.0}
"""Smallest exponent passed to ``exp`` (its results stay normal numbers)."""
