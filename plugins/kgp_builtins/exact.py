"""Solver ``exact``: the dense oracle, alpha = (K + sigma^2 I)^{-1} y by Cholesky.

O(n^3) time and one n x n matrix of memory: the kernel matrix is factored and solved in place
(LAPACK ``?potrf`` / ``?potrs`` through scipy on the CPU), so the peak is the kernel matrix itself
(measured in docs/solvers/exact.md). It refuses n above ``kgp.settings.max_exact_size`` (default
20,000; env ``KGP_MAX_EXACT_SIZE``) and a kernel matrix larger than ``kgp.settings.memory_budget``.
Its predictor is the kernel expansion over all training points: exactly the GP posterior mean with
fixed noise, or kernel ridge regression with sklearn's ``alpha = sigma^2`` (FALKON's ``lambda = sigma^2 / n``).
"""

from __future__ import annotations

import torch
from scipy.linalg import lapack
from torch import Tensor

import kgp
from kgp import settings
from kgp.linalg import NotPSDError
from kgp.plugin import KernelExpansion, Problem, Solution
from kgp.variance import VarianceFactors


class ExactSolver:
    """Cholesky solve of ``(K(X, X) + noise I) alpha = y`` (all outputs at once)."""

    option_defaults: dict[str, kgp.Option] = {}  # none: the oracle has nothing to tune
    # the exact GP posterior mean (and, in predict(return_std=True), its exact variance); one process only
    capabilities = kgp.Capabilities(target="exact")
    # legacy flag: read by kgp/models until the fit plan lands
    uses_centers = False
    # legacy flag: read by kgp/models until the fit plan lands
    exact_posterior = True

    def fit(self, problem: Problem) -> KernelExpansion:
        if problem.shard is not None and problem.shard.world_size > 1:
            raise ValueError(
                f"solver 'exact' cannot fit row-sharded data ({problem.shard.world_size} ranks): it factors "
                "the dense n x n kernel matrix of all rows in one process. Use solver='falkon' for a "
                "distributed fit, or fit without distributed=True on one process holding all rows."
            )
        n = problem.n
        limit = settings.max_exact_size.value()
        if n > limit:
            gigabytes = n * n * problem.X.element_size() / 1e9
            raise ValueError(
                f"solver 'exact' builds the dense {n} x {n} kernel matrix ({gigabytes:.1f} GB); n={n} exceeds "
                f"kgp.settings.max_exact_size={limit}. Use an iterative solver (solver='falkon'; "
                f"command line: --solver falkon) or raise the limit with kgp.settings.max_exact_size({n}) "
                f"(environment: KGP_MAX_EXACT_SIZE={n})."
            )
        budget = settings.memory_budget.value()
        matrix_bytes = n * n * problem.X.element_size()
        if matrix_bytes > budget:
            raise ValueError(
                f"solver 'exact' needs the dense {n} x {n} kernel matrix ({matrix_bytes / 2**20:,.0f} MiB), more "
                f"than kgp.settings.memory_budget={budget:,} bytes ({budget / 2**20:,.0f} MiB): it cannot stream "
                "the matrix in blocks, it factors it whole. Raise the budget (kgp.settings.memory_budget(bytes); "
                "environment: KGP_MEMORY_BUDGET) or use an iterative solver (solver='falkon'; command line: "
                "--solver falkon)."
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
        return Solution(predictor, VarianceFactors("exact", problem.X, L, None, problem.noise))


def _solve_in_place(A: Tensor, y: Tensor, *, noise: float) -> tuple[Tensor, Tensor]:
    """``A^{-1} y`` for a symmetric positive definite ``A``, overwriting ``A`` with its Cholesky factor.

    Returns the solution and the lower Cholesky factor ``L`` (only its lower triangle is meaningful;
    it is ``A``'s memory when LAPACK could factor in place).

    On the CPU the C-ordered ``A`` is handed to LAPACK as its (Fortran-ordered) transpose, which is
    the same matrix because ``A`` is symmetric: ``?potrf`` with ``overwrite_a`` factors it where it
    lies and ``?potrs`` solves from the factor, so no second n x n array exists (``torch.linalg.cholesky``
    returns a new factor and copies its input once more: 3x the matrix at the peak). On other devices
    ``torch.linalg.cholesky_ex(out=)`` writes the factor into ``A`` (the backend may still copy once).

    Raises
    ------
    NotPSDError
        If ``A`` is not numerically positive definite (``A`` is then partly overwritten).
    """
    n = A.shape[0]
    alpha = L = None
    if A.device.type == "cpu":
        potrf, potrs = lapack.get_lapack_funcs(("potrf", "potrs"), (A.numpy(),))
        fortran = A.numpy().T  # a view: the transpose of a symmetric matrix is the matrix
        # if scipy could not use the buffer it would copy (2x peak), never give a wrong answer
        factor, info = potrf(fortran, lower=0, overwrite_a=1, clean=0)
        if info == 0:
            solution, info_solve = potrs(factor, y.detach().numpy(), lower=0)
            if info_solve != 0:
                raise ValueError(f"solver 'exact': LAPACK ?potrs failed with info={info_solve}")
            alpha = torch.from_numpy(solution).to(y.dtype).reshape(y.shape).contiguous()  # LAPACK's is Fortran-ordered
            L = torch.from_numpy(factor.T)  # the Fortran upper factor read in C order: the lower L
    else:
        info_t = torch.empty((), dtype=torch.int32, device=A.device)
        torch.linalg.cholesky_ex(A, out=(A, info_t))
        info = int(info_t)
        if info == 0:
            alpha = torch.cholesky_solve(y, A)
            L = A
    if info < 0:
        raise ValueError(f"solver 'exact': LAPACK ?potrf rejected argument {-info}")
    # LAPACK does not always stop at a NaN pivot: a non-finite kernel matrix shows in the solution
    non_finite = alpha is not None and not bool(torch.isfinite(alpha).all())
    if alpha is None or non_finite:
        raise NotPSDError(
            f"solver 'exact': K + noise*I with noise={noise:g} ({n} x {n}, {A.dtype}) is not positive definite"
            + (" or holds NaN / inf (check the scale of X against the lengthscale)" if non_finite else "")
            + "; increase noise or use float64"
        )
    return alpha, L


@kgp.hookimpl
def register_solvers(register):
    register("exact", ExactSolver())
