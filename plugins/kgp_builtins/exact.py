"""Solver ``exact``: the dense oracle, alpha = (K + sigma^2 I)^{-1} y by Cholesky.

O(n^2) memory and O(n^3) time, so it refuses n above ``kgp.settings.max_exact_size``
(default 20,000; env ``KGP_MAX_EXACT_SIZE``). Its predictor is the kernel expansion over all
training points: exactly the GP posterior mean with fixed noise, or kernel ridge regression with
sklearn's ``alpha = sigma^2`` (FALKON's ``lambda = sigma^2 / n``).
"""

from __future__ import annotations

import torch

import kgp
from kgp import settings
from kgp.linalg import psd_cholesky
from kgp.plugin import KernelExpansion, Problem


class ExactSolver:
    """Cholesky solve of ``(K(X, X) + noise I) alpha = y`` (all outputs at once)."""

    option_defaults: dict[str, kgp.Option] = {}  # none: the oracle has nothing to tune
    uses_centers = False
    exact_posterior = True  # predict(return_std=True) gives the exact GP posterior variance

    def fit(self, problem: Problem) -> KernelExpansion:
        kgp.merge_options("solver 'exact'", self.option_defaults, problem.options)
        n = problem.n
        limit = settings.max_exact_size.value()
        if n > limit:
            raise ValueError(
                f"solver 'exact' builds the dense {n} x {n} kernel matrix; n={n} exceeds "
                f"kgp.settings.max_exact_size={limit}. Use an iterative solver (e.g. solver='falkon') "
                f"or raise the limit with kgp.settings.max_exact_size({n})."
            )
        problem.monitor.start(total=1, desc="exact")
        with torch.no_grad():
            K = problem.kernel_operator(problem.X).to_dense()
            K.diagonal().add_(problem.noise)
            # no jitter: the oracle must solve the problem it was given, or say it cannot
            chol = psd_cholesky(
                K,
                max_tries=0,
                what=f"solver 'exact': K + noise*I with noise={problem.noise:g}",
                remedy="increase noise or use float64",
            )
            alpha = torch.cholesky_solve(problem.y, chol)
        predictor = KernelExpansion(problem.kernel, problem.X, alpha)
        problem.monitor.step(1, predictor)
        return predictor


@kgp.hookimpl
def register_solvers(register):
    register("exact", ExactSolver())
