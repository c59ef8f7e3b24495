"""Solver ``exact``: the dense oracle, alpha = (K + sigma^2 I)^{-1} y by Cholesky.

O(n^3) time and one n x n matrix of memory: the kernel matrix is factored and solved in place (blocked
Cholesky of :mod:`kgp.linalg`, on any device), so the peak is the kernel matrix itself
(measured in docs/solvers/exact.md). It refuses n above ``kgp.settings.max_exact_size`` (default
20,000; env ``KGP_MAX_EXACT_SIZE``) and a kernel matrix larger than ``kgp.settings.memory_budget``
(:func:`kgp.variance.check_dense_size`). The factor is handed on to the exact variance strategy
(:class:`kgp.variance.ExactVariance`): ``predict(return_std=True)`` solves with it instead of factoring
the same matrix again, and the fitted model holds it (n x n, like scikit-learn's
``GaussianProcessRegressor.L_``).
Its predictor is the kernel expansion over all training points: exactly the GP posterior mean with
fixed noise, or kernel ridge regression with sklearn's ``alpha = sigma^2`` (FALKON's ``lambda = sigma^2 / n``).
"""

from __future__ import annotations

import torch
from torch import Tensor

import kgp
from kgp.linalg import NotPSDError, cholesky_in_place, flush_for_cholesky, solve_lower_in_place
from kgp.plugin import KernelExpansion, Problem, Solution
from kgp.variance import ExactFactors, check_dense_size


class ExactSolver:
    """Cholesky solve of ``(K(X, X) + noise I) alpha = y`` (all outputs at once)."""

    option_defaults: dict[str, kgp.Option] = {}  # none: the oracle has nothing to tune
    # the exact GP posterior mean (and, in predict(return_std=True), its exact variance); one process only
    capabilities = kgp.Capabilities(target="exact")

    def fit(self, problem: Problem) -> KernelExpansion | Solution:
        if problem.shard is not None and problem.shard.world_size > 1:
            raise ValueError(
                f"solver 'exact' cannot fit row-sharded data ({problem.shard.world_size} ranks): it factors "
                "the dense n x n kernel matrix of all rows in one process. Use solver='falkon' for a "
                "distributed fit, or fit without distributed=True on one process holding all rows."
            )
        # it cannot stream the matrix in blocks: it factors it whole
        check_dense_size(
            problem.n,
            problem.X.element_size(),
            "solver 'exact'",
            problem.device,
            instead="use an iterative solver (solver='falkon'; command line: --solver falkon)",
        )
        problem.monitor.start(total=1, desc="exact")
        with torch.no_grad():
            K = problem.kernel_operator(problem.X).to_dense().detach()
            if not K.is_contiguous():
                K = K.contiguous()
            K.diagonal().add_(problem.noise)
            # no jitter: the oracle must solve the problem it was given, or say it cannot
            alpha, L = _solve_in_place(K, problem.y, noise=problem.noise)
            del K
        predictor = KernelExpansion(problem.kernel, problem.X, alpha)
        problem.monitor.step(1, predictor)
        if not problem.want_variance:
            return predictor
        # the exact variance needs this very factor (Rasmussen & Williams 2006, Alg. 2.1): hand it on
        return Solution(predictor, ExactFactors(problem.X, L, problem.noise))


def _solve_in_place(A: Tensor, y: Tensor, *, noise: float) -> tuple[Tensor, Tensor]:
    """``A^{-1} y`` for a symmetric positive definite ``A``, overwriting ``A`` with its Cholesky factor.

    Returns the solution and the lower Cholesky factor ``L``, which is ``A``'s memory: the blocked
    factorisation and substitutions of :mod:`kgp.linalg` allocate one ``n x 1024`` panel at most, so no
    second ``n x n`` array exists (``torch.linalg.cholesky`` copies its input even with ``out=``, and
    scipy's bundled OpenBLAS ``?potrf`` crashed the process at n = 32,000 on the development host).

    Raises
    ------
    NotPSDError
        If ``A`` is not numerically positive definite or not finite (``A`` is then partly overwritten).
    """
    n = A.shape[0]
    remedy = "increase noise" if A.dtype == torch.float64 else "increase noise or use float64"
    what = f"solver 'exact': K + noise*I with noise={noise:g}"
    # entries below 2^-511 (float64) of the scale are set to 0, in the matrix and as the factor is formed:
    # their products in the Cholesky's GEMMs are subnormal, 35x slower on an Intel host (UCI parkinsons,
    # kgp.linalg.tiny_fraction); the oracle's answer moves by far less than float64's rounding
    L = cholesky_in_place(A, what=what, remedy=remedy, flush_below=flush_for_cholesky(A))
    B = y.detach().reshape(n, -1).to(A.dtype).clone()
    alpha = solve_lower_in_place(L, solve_lower_in_place(L, B), transpose=True).reshape(y.shape)
    # a non-finite kernel matrix can pass the pivots (inf - inf) and show only in the solution
    if not bool(torch.isfinite(alpha).all()):
        raise NotPSDError(
            f"{what} ({n} x {n}, {A.dtype}) is not positive definite or holds NaN / inf (check the scale of X "
            f"against the lengthscale); {remedy}"
        )
    return alpha, L


@kgp.hookimpl
def register_solvers(register):
    register("exact", ExactSolver())
