"""Recipe ``auto``: what ``solver="auto"`` and ``learn="auto"`` run (hook ``register_recipes``).

The rule (:mod:`.rule`) was chosen from measurements on six UCI sets against the exact GP and
GPyTorch's SGPR (docs/benchmarks/gp-default.md; benchmarks/bench_gp_default.py).
"""

from __future__ import annotations

import kgp

from .rule import AutoRecipe

__all__ = ["AutoRecipe"]


@kgp.hookimpl
def register_recipes(register) -> None:
    register("auto", AutoRecipe())
