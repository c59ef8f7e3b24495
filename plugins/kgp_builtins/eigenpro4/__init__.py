"""Solver ``eigenpro4``: EigenPro 4, preconditioned SGD with delayed projections onto the centers.

Abedsoltan, Ma, Pandit & Belkin, "Fast training of large kernel models with delayed projections"
(NeurIPS 2025). The package follows the algorithm's seams:

- :mod:`.options`: the declared options and the rules between them and against the data;
- :mod:`.memory`: the memory the fit holds, estimated before any work, and the refusal above the budget;
- :mod:`.state`: the iterate between projections, the model on Z plus its temporary centers;
- :mod:`.projection`: the delayed projection ``K(Z, Z) v = h`` by inner EigenPro 2.0 epochs;
- :mod:`.solver`: the fit loop (solver ``eigenpro4``).

The data preconditioner, the curvature estimates and the step rule are EigenPro 2.0 / 3.0's, shared
with :mod:`kgp_builtins.eigenpro`. Derivations and measurements: docs/solvers/eigenpro4.md.
"""

from __future__ import annotations

import kgp

from .options import EIGENPRO4_DEFAULTS
from .solver import EigenPro4Solver

__all__ = ["EIGENPRO4_DEFAULTS", "EigenPro4Solver", "register_solvers"]


@kgp.hookimpl
def register_solvers(register) -> None:
    register("eigenpro4", EigenPro4Solver())
