"""Solver ``falkon``: Nystrom kernel ridge regression by preconditioned conjugate gradient.

Implements FALKON (Rudi, Carratino, Rosasco, NIPS 2017; arXiv 1705.10958 v3) in the general form
of its Appendix A (Def. 3 and Def. 4): weighted centers (the diagonal matrix D, e.g. from
leverage-score sampling) and a rank-deficient ``K_MM`` are handled by the same code.

Problem (eq. 7-8, kgp's convention ``lambda = noise / n = problem.lam``)::

    H alpha = z,   H = K_nM^T K_nM + lambda n K_MM,   z = K_nM^T y

Unlike the MATLAB code of the paper's Appendix G, D is applied in ``B'``, in ``B'^T`` and in
``alpha`` (the printed code omits it and solves a different problem; see the digest, section 1.5).

Modules:

- :mod:`.solver`: :class:`FalkonSolver` (options, problem checks, ``fit``).
- :mod:`.preconditioner`: ``B'`` of Def. 3 and its constructions (Examples 1.1 and 2, pivoted).
- :mod:`.lapack`: the LAPACK ``?lauum`` / ``?potrf`` / ``?pstrf`` helpers behind it.
- :mod:`.cg`: the conjugate gradient of Def. 4 on the fused kernel pass.
"""

from __future__ import annotations

import kgp

from .solver import FalkonSolver

__all__ = ["FalkonSolver"]


@kgp.hookimpl
def register_solvers(register) -> None:
    register("falkon", FalkonSolver())
