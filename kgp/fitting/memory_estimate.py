"""A fit's peak memory, estimated from its sizes before anything is allocated.

A Nystrom-type fit (FALKON, the default recipe's solvers, the predictive variance) runs in phases, and the
arrays of one phase are freed before the next allocates its own; what stays resident throughout is the fit's
copy of the training rows. The peak is therefore

    rows + max(standardisation, learning, solve, variance)

with, for ``n`` rows of ``d`` features, ``k`` target columns, ``M`` centers and ``s`` bytes per element of
the fit's dtype:

* **rows** -- the fit's own arrays of the inputs: a converted ``X`` (``n d s``, only where the input's dtype
  or device differs; a read-only memory-mapped ``.npy`` of the fit's dtype is shared, see
  :func:`kgp.validation.to_tensor`), the standardised ``X`` (``n d s`` with ``normalize_X``) and the targets
  (``n k s``, twice with ``normalize_y``);
* **standardisation** -- ``(X - mean) / std`` builds one temporary ``n d s`` array next to its result;
* **learning** -- the dense ``r x r`` arrays of the exact objective on a subset of ``r`` rows (kernel matrix,
  its Cholesky factor and the backward pass's matrix: ``learn_arrays`` of them);
* **solve** -- a stored ``K_nM`` (``n M s``, at most ``kgp.settings.memory_budget``: under
  ``kernel_cache="auto"`` the operator keeps the leading rows that fit), the kernel row blocks
  (``block_rows x M x s`` per buffer) and the solver's ``M x M`` arrays (``solver_arrays``: FALKON holds
  ``K_MM`` and its two triangular factors at its peak on the CPU);
* **variance** -- the predictive variance's ``M x M`` arrays (``variance_arrays``: the Gram and ``K_MM``, each
  factored over itself, :func:`kgp.variance.nystrom.nystrom_factors`) and its row blocks; the factor a learned
  fit then measures (:mod:`kgp.variance.calibration`) holds the factors (one ``M x M`` array once built) and
  the std's query blocks, which the same budget plans, so it adds no phase above this one.

Measured on the CPU (float64, FALKON, fixed hyperparameters, the resident anonymous memory of the process
sampled every 2 ms): n = 60,000, d = 4, M = 800: peak +407 MB (estimate 419 MB); n = 20,000, d = 4,
M = 3,000: +708 MB (estimate 714 MB) (tests/test_memory_estimate.py holds the estimate within 25% of such a
measurement). The estimate counts kgp's arrays, not the allocator's fragmentation, the BLAS library's
per-thread buffers or Python objects: tens of MB.

A fit whose solver the recipe chose (``solver="auto"``) estimates its peak once the plan has fixed the solver
and M, checks it with :func:`check_fit_memory` before it allocates, and reports it in ``recipe_["memory"]``
(:func:`kgp.fitting.fit.fit_memory`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from numbers import Integral
from typing import Any

import torch

from ..safeguards import check_memory, format_bytes

__all__ = ["FitMemory", "check_fit_memory", "estimate_fit_memory", "largest_fitting_centers"]

CPU_BLOCK_BYTES = 8 * 2**20
"""Bytes of one kernel row block on the CPU (sized for the cache; :func:`kgp.operators.plan_block_rows`)."""


@dataclass(frozen=True)
class FitMemory:
    """Bytes of each part of a fit (see the module docstring); :attr:`peak` is the estimate."""

    rows: int
    standardisation: int
    learning: int
    stored_kernel: int
    kernel_blocks: int
    solver_factors: int
    variance: int

    @property
    def solve(self) -> int:
        """The solve phase: stored kernel, row blocks and the solver's ``M x M`` arrays."""
        return self.stored_kernel + self.kernel_blocks + self.solver_factors

    @property
    def peak(self) -> int:
        """``rows + max(standardisation, learning, solve, variance)``: the most bytes alive at once."""
        return self.rows + max(self.standardisation, self.learning, self.solve, self.variance)

    @property
    def largest_phase(self) -> str:
        phases = {
            "standardisation": self.standardisation,
            "learning": self.learning,
            "solve": self.solve,
            "variance": self.variance,
        }
        return max(phases, key=phases.__getitem__)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (bytes), as ``recipe_["memory"]`` would hold them, with the peak and its phase."""
        return {**asdict(self), "peak": self.peak, "largest_phase": self.largest_phase}

    def describe(self) -> str:
        parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in asdict(self).items() if value)
        return f"peak {format_bytes(self.peak)} (in {self.largest_phase}; {parts})"


def _count(value: Any, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return int(value)


def _itemsize(dtype: Any, name: str) -> int:
    if dtype in (torch.float32, "float32"):
        return 4
    if dtype in (torch.float64, "float64"):
        return 8
    raise TypeError(f"{name}: expected torch.float32 or torch.float64, got {dtype!r}")


def estimate_fit_memory(
    n: int,
    d: int,
    *,
    n_centers: int,
    k: int = 1,
    dtype: Any = torch.float64,
    input_dtype: Any = None,
    normalize_X: bool = True,
    normalize_y: bool = True,
    kernel_cache: str = "auto",
    budget: int | None = None,
    block_bytes: int = CPU_BLOCK_BYTES,
    block_buffers: int = 2,
    solver_arrays: int = 3,
    variance: bool = True,
    variance_arrays: int = 2,
    learn_rows: int = 0,
    learn_arrays: int = 3,
) -> FitMemory:
    """The bytes a fit of ``n x d`` rows with ``n_centers`` centers needs at its peak, before it allocates.

    Parameters
    ----------
    n, d, k:
        Rows (this process's, in a distributed fit), features and target columns.
    n_centers:
        M, the number of centers (the exact solver: ``n``).
    dtype:
        The fit's dtype.
    input_dtype:
        The dtype of ``X`` as given; None (or the fit's dtype) when the fit shares it without a copy.
    normalize_X, normalize_y:
        Whether the fit standardises the inputs / targets (each a copy).
    kernel_cache:
        ``"auto"``: the solve keeps ``K_nM``, or its leading rows, within ``budget``; ``"never"``: it does not.
    budget:
        ``kgp.settings.memory_budget`` in bytes (None: the value in effect).
    block_bytes, block_buffers:
        Bytes of one kernel row block (at least one row) and how many are alive at once.
    solver_arrays, variance_arrays:
        ``M x M`` arrays of the solver and of the predictive variance at their peaks (0: none).
    variance:
        Whether the fit builds the predictive variance's factors.
    learn_rows, learn_arrays:
        Rows of the learning subset and its dense ``r x r`` arrays at the peak (0 rows: no learning).

    Returns
    -------
    FitMemory
    """
    n = _count(n, "n", 1)
    d = _count(d, "d", 1)
    k = _count(k, "k", 1)
    m = _count(n_centers, "n_centers", 1)
    learn_rows = min(_count(learn_rows, "learn_rows"), n)
    for value, name in ((block_buffers, "block_buffers"), (solver_arrays, "solver_arrays")):
        _count(value, name)
    _count(variance_arrays, "variance_arrays")
    _count(learn_arrays, "learn_arrays")
    _count(block_bytes, "block_bytes", 1)
    if kernel_cache not in ("auto", "never"):
        raise ValueError(f"kernel_cache: expected 'auto' or 'never', got {kernel_cache!r}")
    s = _itemsize(dtype, "dtype")
    copies_input = input_dtype is not None and _itemsize(input_dtype, "input_dtype") != s
    if budget is None:
        from .. import settings

        budget = settings.memory_budget.value()
    budget = _count(budget, "budget", 1)

    rows = n * d * s * (int(copies_input) + int(bool(normalize_X))) + n * k * s * (1 + int(bool(normalize_y)))
    standardisation = n * d * s if normalize_X else 0
    block = max(block_bytes, m * s)  # a block holds at least one row of M entries
    kernel_blocks = block_buffers * block
    stored = min(n * m * s, budget) if kernel_cache == "auto" else 0
    return FitMemory(
        rows=rows,
        standardisation=standardisation,
        learning=learn_arrays * learn_rows * learn_rows * s,
        stored_kernel=stored,
        kernel_blocks=kernel_blocks,
        solver_factors=solver_arrays * m * m * s,
        variance=(variance_arrays * m * m * s + kernel_blocks) if variance else 0,
    )


def check_fit_memory(estimate: FitMemory, *, n_centers: int, device: Any = None) -> None:
    """Refuse a fit whose estimated peak exceeds the device's available memory, before it allocates.

    Raises
    ------
    kgp.safeguards.InsufficientMemoryError
        Naming the estimate's parts and the options that lower them (``n_centers``,
        ``kgp.settings.memory_budget``, ``dtype``).
    """
    if estimate.largest_phase == "solve" and estimate.stored_kernel >= estimate.solver_factors:
        remedy = (
            "lower kgp.settings.memory_budget (the stored kernel matrix is at most that), lower n_centers, "
            "or fit in float32 (dtype='float32')"
        )
    else:
        remedy = "lower n_centers (the M x M arrays grow as its square), or fit in float32 (dtype='float32')"
    check_memory(
        estimate.peak,
        what=f"the arrays of a fit with n_centers={n_centers:,} ({estimate.describe()})",
        remedy=remedy,
        device=device,
    )


def largest_fitting_centers(available: int, n: int, d: int, **options: Any) -> int:
    """The largest ``n_centers`` whose :func:`estimate_fit_memory` peak is at most ``available`` bytes (0: none).

    ``options`` are :func:`estimate_fit_memory`'s other keyword arguments. The peak grows with M, so the
    answer is found by bisection over ``1 .. n``.
    """
    available = _count(available, "available")
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_fit_memory(n, d, n_centers=mid, **options).peak <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo
