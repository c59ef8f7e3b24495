"""The smallest exponent kgp passes to ``exp``, per dtype.

``exp`` of arguments whose result is subnormal or underflows ran 10-70x slower on the development CPUs
(float64, 3,000 x 3,000: 4.5 ms for arguments in [-700, 0], 42-69 ms once a few percent of the results
are subnormal; docs/backend.md), and subnormal kernel entries slow every later GEMM that reads them.
Arguments are floored here instead: an entry below ``exp(EXP_FLOOR)`` (2.1e-19 in float32, 1e-304 in
float64) becomes that value, far below what any sum it enters can resolve.

float32's floor is about ``sqrt(tiny)`` (2^-63), not just above ``tiny``: a product of a floored entry with a
vector entry below 2^-11 is subnormal at a floor of e^-80 (2^-115), and FALKON's float32 ``K^T u``
over UCI parkinsons' kernel (92% of its entries below 2^-63) then took 17 ms a product against about 5 ms
(docs/backend.md). float64's stays at e^-700: its learned-GP results are sensitive to the
rounding of such changes (docs/gp-workflow.md), and no float64 product was measured slow.
"""

from __future__ import annotations

import torch

__all__ = ["EXP_FLOOR"]

EXP_FLOOR = {torch.float32: -43.0, torch.float64: -700.0}
"""Smallest exponent passed to ``exp`` (its results stay normal numbers)."""
