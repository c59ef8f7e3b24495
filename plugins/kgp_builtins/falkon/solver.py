"""The ``falkon`` solver: options, problem checks, and ``fit`` (Rudi, Carratino, Rosasco 2017, Def. 4).

Problem (eq. 7-8, kgp's convention ``lambda = noise / n = problem.lam``)::

    H alpha = z,   H = K_nM^T K_nM + lambda n K_MM,   z = K_nM^T y

``fit`` builds the preconditioner ``B'`` of Def. 3 (:mod:`.preconditioner`), runs the conjugate
gradient of Def. 4 on the preconditioned system (:mod:`.cg`) and returns ``alpha = B' beta'`` as a
kernel expansion over the centers.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor

import kgp
from kgp.plugin import KernelExpansion, Problem, merge_options

from .cg import conjugate_gradient
from .preconditioner import build_preconditioner

__all__ = ["FalkonSolver"]

_FACTORIZATIONS = ("auto", "cholesky", "pivoted", "eigh")
_PRECOND_DTYPES = ("float64", "input")


class FalkonSolver:
    """FALKON: Nystrom KRR solved by conjugate gradient with the preconditioner of Def. 3.

    Options (``solver_options``)
    ----------------------------
    maxiter : int, default 20
        CG iterations t. Thm. 3 asks ``t >= log(n)/2 + 5 + 2 log(a + 3 kappa)`` (about 16 at
        n = 2e5 with standardised targets); Fig. 1 (HIGGS) plateaus within about 10 iterations.
    tol : float, default 1e-7
        Early stop when every output's relative residual ``||b' - W' beta'|| / ||b'||`` of the
        preconditioned system is at most ``tol`` (0 disables; the paper runs exactly t steps).
    residual_every : int, default 10
        Replace the recursive CG residual by the true one every this many iterations (0 never).
        Costs no extra kernel pass (extra columns of the fused pass).
    jitter : float or None, default None
        Cholesky path: added to the diagonal of ``D K_MM D``, relative to its mean diagonal
        (it regularises like ``lambda n jitter`` on the coefficients). None: ``M * eps`` of the
        input dtype (the paper's Algorithm 1 uses ``eps * M``); ``M * eps64`` on the float32
        ``"auto"`` path, which must see the spectrum of ``K_MM`` itself.
    factorization : {"auto", "cholesky", "pivoted", "eigh"}, default "auto"
        ``"cholesky"``: Def. 3, Example 1.1 (raises on rank-deficient ``K_MM``); ``"eigh"``:
        Example 2, any rank, eigenvalues at or below ``rcond * max`` dropped; ``"pivoted"``:
        pivoted Cholesky stopped at pivots at or below ``rcond * max eigenvalue``, centers it does
        not keep get ``alpha = 0`` (fast when the numerical rank q is far below M); ``"auto"``:
        float64 inputs Cholesky with ``"eigh"`` as fallback; float32 inputs Cholesky when no
        eigenvalue of ``D K_MM D`` is at or below ``rcond * max`` (then it equals ``"eigh"``),
        else ``"eigh"`` (robust down to lambda = 1e-9). The factorization used and the rank kept
        are reported in each iteration's ``extras`` (``model.history_``).
    precond_dtype : {"float64", "input"}, default "float64"
        Precision of ``K_MM``, its factors and the CG vectors. Kernel passes always use the
        input dtype. ``"input"`` halves the ``O(M^2)`` memory of float32 fits.
    rcond : float or None, default None
        Eigen and pivoted paths (and the float32 ``"auto"`` check): drop eigenvalues (pivots) of
        ``D K_MM D`` at or below ``rcond * max eigenvalue``.
        None: ``M * eps64`` for float64 inputs (the pseudo-inverse convention), ``eps32`` for
        float32 inputs.
    kernel_cache : {"auto", "never"}, default "auto"
        ``"auto"``: keep ``K_nM`` in memory from the second CG pass on when ``n M`` entries fit
        ``kgp.settings.memory_budget`` (a fifth of RAM by default); later passes then read it
        instead of recomputing kernel blocks (4-5x faster per pass at d = 10, docs/backend.md).
        ``"never"``: recompute every pass (memory O(M^2) + one block). Never above the budget.

    Returns a :class:`kgp.KernelExpansion` over ``problem.centers``. Every kernel product goes
    through ``problem.kernel_operator`` (the fused pass ``K_nM^T (K_nM v + w)``); memory is
    ``O(M^2)`` for the factors plus the backend's block budget.
    """

    option_defaults: dict[str, Any] = {
        "maxiter": 20,
        "tol": 1e-7,
        "residual_every": 10,
        "jitter": None,
        "factorization": "auto",
        "precond_dtype": "float64",
        "rcond": None,
        "kernel_cache": "auto",
    }
    uses_centers = True

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_options(options: dict[str, Any]) -> dict[str, Any]:
        # the model merges and checks names (kgp.merge_options); a direct fit(problem) call gets the same check
        opts = merge_options("solver 'falkon'", FalkonSolver.option_defaults, options)
        maxiter = opts["maxiter"]
        if isinstance(maxiter, bool) or not isinstance(maxiter, Integral) or maxiter < 1:
            raise ValueError(f"solver option 'maxiter': expected a positive integer, got {maxiter!r}")
        every = opts["residual_every"]
        if every is None:
            every = 0
        if isinstance(every, bool) or not isinstance(every, Integral) or every < 0:
            raise ValueError(f"solver option 'residual_every': expected an integer >= 0, got {every!r}")
        tol = _check_real(opts["tol"], "tol", allow_zero=True)
        jitter = opts["jitter"]
        if jitter is not None:
            jitter = _check_real(jitter, "jitter", allow_zero=True)
        rcond = opts["rcond"]
        if rcond is not None:
            rcond = _check_real(rcond, "rcond", allow_zero=True)
            if rcond >= 1:
                raise ValueError(f"solver option 'rcond': expected a number in [0, 1), got {rcond!r}")
        if opts["factorization"] not in _FACTORIZATIONS:
            raise ValueError(
                f"solver option 'factorization': expected one of {_FACTORIZATIONS}, got {opts['factorization']!r}"
            )
        if opts["precond_dtype"] not in _PRECOND_DTYPES:
            raise ValueError(
                f"solver option 'precond_dtype': expected one of {_PRECOND_DTYPES}, got {opts['precond_dtype']!r}"
            )
        if opts["kernel_cache"] not in ("auto", "never"):
            raise ValueError(f"solver option 'kernel_cache': expected 'auto' or 'never', got {opts['kernel_cache']!r}")
        return {
            "kernel_cache": opts["kernel_cache"],
            "maxiter": int(maxiter),
            "tol": tol,
            "residual_every": int(every),
            "jitter": jitter,
            "factorization": opts["factorization"],
            "precond_dtype": opts["precond_dtype"],
            "rcond": rcond,
        }

    @staticmethod
    def _check_problem(problem: Problem) -> Tensor | None:
        if problem.centers is None:
            raise ValueError("solver 'falkon' needs Nystrom centers: problem.centers is None")
        Z = problem.centers.points
        if Z.dim() != 2 or Z.shape[1] != problem.X.shape[1]:
            raise ValueError(f"centers: expected shape (M, {problem.X.shape[1]}), got {tuple(Z.shape)}")
        if Z.dtype != problem.X.dtype or Z.device != problem.X.device:
            raise TypeError("centers: expected the dtype and device of X")
        if not problem.X.dtype.is_floating_point:
            raise TypeError(f"X: expected a floating dtype, got {problem.X.dtype}")
        if problem.y.dim() != 2 or problem.y.shape[0] != problem.n:
            raise ValueError(f"y: expected shape ({problem.n}, k), got {tuple(problem.y.shape)}")
        if not (math.isfinite(problem.noise) and problem.noise > 0):
            raise ValueError(f"noise: expected a finite positive number, got {problem.noise!r}")
        w = problem.centers.weights
        if w is None:
            return None
        if w.dim() != 1 or w.shape[0] != Z.shape[0]:
            raise ValueError(f"center_weights: expected shape ({Z.shape[0]},), got {tuple(w.shape)}")
        if not bool(torch.isfinite(w).all()) or not bool((w > 0).all()):
            raise ValueError("center_weights: expected finite, strictly positive weights (the diagonal of D)")
        return w

    # ------------------------------------------------------------------ solve
    def fit(self, problem: Problem) -> KernelExpansion:
        """Run FALKON (Def. 4) on ``problem``; return the kernel expansion over its centers.

        Raises
        ------
        ValueError
            On invalid options, missing centers, bad weights, or a failed factorization with
            ``factorization="cholesky"``.
        """
        opts = self._check_options(problem.options)
        weights = self._check_problem(problem)
        dtype = problem.dtype
        monitor = problem.monitor
        monitor.start(total=opts["maxiter"], desc="falkon")

        with torch.no_grad(), kgp.settings.kernel_cache(opts["kernel_cache"]):
            prec = build_preconditioner(
                problem,
                weights,
                factorization=opts["factorization"],
                precond_dtype=opts["precond_dtype"],
                jitter=opts["jitter"],
                rcond=opts["rcond"],
            )
            Z = problem.centers.points

            def expansion(beta: Tensor) -> KernelExpansion:
                # alpha = B' beta' (Def. 4 with the 1/sqrt(n) folded into the operator)
                return KernelExpansion(problem.kernel, Z, prec.apply(beta).to(dtype))

            beta = conjugate_gradient(
                problem.kernel_operator(problem.X, Z),
                problem.y.to(dtype),
                prec,
                maxiter=opts["maxiter"],
                tol=opts["tol"],
                residual_every=opts["residual_every"],
                monitor=monitor,
                expansion=expansion,
                extras={"factorization": prec.method, "rank": prec.rank},
            )
            return expansion(beta)


def _check_real(value: Any, name: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"solver option {name!r}: expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"solver option {name!r}: expected a finite number >= 0, got {value!r}")
    return value
