"""Solvers ``eigenpro`` (EigenPro 3.0) and ``eigenpro2`` (EigenPro 2.0, centers = training set).

EigenPro 3.0 (Abedsoltan, Belkin & Pandit, "Toward large kernel models", ICML 2023, Algorithm 2)
fits ``f(x) = sum_j alpha_j k(x, z_j)`` on centers Z that need not be training points, by
projected, preconditioned minibatch SGD in the RKHS (eq. 27); EigenPro 2.0 (Ma & Belkin 2019) is
its special case Z = X. The package follows the algorithm's seams:

- :mod:`.options`: the declared options of both solvers and their cross-option rules;
- :mod:`.nystrom`: the Nystrom data / model preconditioner (eq. 29-30, Lemma 5), the held-out top
  eigenvalue and the critical batch and step rule of EigenPro 2.0;
- :mod:`.projection`: ``proj_Z`` in coefficients, exact (Cholesky) or by inner EigenPro 2.0 epochs (eq. 32);
- :mod:`.ep3`: EigenPro 3.0, Algorithm 2 (solver ``eigenpro``);
- :mod:`.ep2`: EigenPro 2.0 epochs and the solver ``eigenpro2``;
- :mod:`.iterates`: tail averaging and the divergence check shared by both.

Derivations and measurements: docs/solvers/eigenpro.md.
"""

from __future__ import annotations

import kgp

from .ep2 import EigenPro2Solver
from .ep3 import EigenPro3Solver
from .nystrom import (
    NystromPreconditioner,
    critical_batch_and_step,
    draw_subsamples,
    heldout_curvature,
    nystrom_preconditioner,
)
from .options import EIGENPRO2_DEFAULTS, EIGENPRO3_DEFAULTS

__all__ = [
    "EIGENPRO2_DEFAULTS",
    "EIGENPRO3_DEFAULTS",
    "EigenPro2Solver",
    "EigenPro3Solver",
    "NystromPreconditioner",
    "critical_batch_and_step",
    "draw_subsamples",
    "heldout_curvature",
    "nystrom_preconditioner",
    "register_solvers",
]


@kgp.hookimpl
def register_solvers(register) -> None:
    register("eigenpro", EigenPro3Solver())
    register("eigenpro2", EigenPro2Solver())
