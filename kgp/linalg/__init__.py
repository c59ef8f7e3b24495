"""Dense linear algebra that several solvers need, with one failure behaviour.

Public API for plugin authors (the built-ins use nothing else), by submodule:

- :mod:`~kgp.linalg.cholesky`: :func:`psd_cholesky` (Cholesky with growing diagonal jitter, through
  linear_operator's ``psd_safe_cholesky``), :func:`psd_cholesky_in_place` (the same jitter rule, the factor written
  over its input) and :func:`cholesky_in_place` (the factor written over its input, no jitter);
  every not-positive-definite failure raises linear_operator's :class:`NotPSDError` naming the matrix and a
  remedy.
- :mod:`~kgp.linalg.eigen`: :func:`largest_eigenvalue` and :func:`smallest_eigenvalue_from_cholesky`, Ritz
  estimates in ``O(M^2 b)`` per step instead of ``O(M^3)``.
- :mod:`~kgp.linalg.triangular`: :func:`solve_lower_in_place`, :func:`solve_lower_wide`, :func:`gram_of_lower`,
  :func:`inverse_of_lower`, :func:`inverse_from_cholesky`, :func:`mirror_lower`, :func:`mirror_upper`: blocked
  algebra with a lower factor, in GEMMs on views of it, written in place where asked.
- :mod:`~kgp.linalg.lower_factor`: :class:`LowerFactor`, a factor prepared for many solves with a few
  right-hand sides (an iterative solver's preconditioner), float32 factors solved in float64 by native code.
- :mod:`~kgp.linalg.subnormal`: :func:`tiny_fraction`, :func:`flush_for_cholesky`, :func:`flush_below_scale`,
  :func:`zero_small_entries` (subnormal numbers kept out of a factorization's GEMMs) and
  ``flush_denormals`` (the CPU's flush-to-zero mode in every thread torch computes on).

Internal: :mod:`~kgp.linalg.lapack` (LAPACK's ``potrf`` on a tensor's own memory) and
:mod:`~kgp.linalg.native_build` (kgp's C sources compiled on first use into a sealed cache).
"""

from __future__ import annotations

from .cholesky import NotPSDError, cholesky_in_place, psd_cholesky, psd_cholesky_in_place
from .eigen import largest_eigenvalue, smallest_eigenvalue_from_cholesky
from .lower_factor import LowerFactor
from .subnormal import flush_below_scale, flush_for_cholesky, tiny_fraction, zero_small_entries
from .triangular import (
    gram_of_lower,
    inverse_from_cholesky,
    inverse_of_lower,
    mirror_lower,
    mirror_upper,
    solve_lower_in_place,
    solve_lower_wide,
)

__all__ = [
    "LowerFactor",
    "NotPSDError",
    "cholesky_in_place",
    "flush_below_scale",
    "flush_for_cholesky",
    "gram_of_lower",
    "inverse_from_cholesky",
    "inverse_of_lower",
    "largest_eigenvalue",
    "mirror_lower",
    "mirror_upper",
    "psd_cholesky",
    "psd_cholesky_in_place",
    "smallest_eigenvalue_from_cholesky",
    "solve_lower_in_place",
    "solve_lower_wide",
    "tiny_fraction",
    "zero_small_entries",
]
