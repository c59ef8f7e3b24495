"""The ``falkon`` solver: options, problem checks, and ``fit`` (Rudi, Carratino, Rosasco 2017, Def. 4).

Problem (eq. 7-8, kgp's convention ``lambda = noise / n = problem.lam``)::

    H alpha = z,   H = K_nM^T K_nM + lambda n K_MM,   z = K_nM^T y

``fit`` builds the preconditioner ``B'`` of Def. 3 (:mod:`.preconditioner`), runs the conjugate
gradient of Def. 4 on the preconditioned system (:mod:`.cg`) and returns ``alpha = B' beta'`` as a
kernel expansion over the centers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

import kgp
from kgp.options import Option
from kgp.plugin import KernelExpansion, Problem

from ..resolution import warn_if_under_resolved
from .cg import conjugate_gradient
from .precision import DISTANCE_SWITCH, float32_jitter, kernel_resolution
from .preconditioner import build_preconditioner
from .sizes import check_factor_memory

__all__ = ["AUTO_PRECOND_DTYPE", "FalkonSolver"]

AUTO_PRECOND_DTYPE = {True: "mixed", False: "float64"}
"""``precond_dtype="auto"``: keyed by "the input is float32"."""


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
    residual_every : int or None, default 10
        Replace the recursive CG residual by the true one every this many iterations (0 or None: never).
        Costs no extra kernel pass (extra columns of the fused pass).
    jitter : float or None, default None
        Cholesky path: ``T^T T = D K_MM D + jitter * mean(diag) * I``; the regulariser of ``W``
        takes it out of the problem again, so it only changes the conditioning. None: 1e-3 for
        float64 inputs (:data:`.preconditioner.DEFAULT_JITTER`, measured), ``max(1e-3, 100 x the
        measured float32 kernel error)`` for float32 inputs (:func:`.precision.float32_jitter`).
        0 gives the paper's exact ``B`` (oracle O1: ``M = n`` converges in one step).
    factorization : {"auto", "cholesky", "pivoted", "eigh"}, default "auto"
        ``"cholesky"``: Def. 3, Example 1.1 (raises NotPSDError on rank-deficient ``K_MM``); ``"eigh"``:
        Example 2, any rank, eigenvalues at or below ``rcond * max`` dropped; ``"pivoted"``:
        pivoted Cholesky stopped at pivots at or below ``rcond * max eigenvalue``, centers it does
        not keep get ``alpha = 0`` (fast when the numerical rank q is far below M); ``"auto"``:
        Cholesky with the jitter above, ``"eigh"`` only if that fails. What was used (factorization,
        rank, jitter, distances, accumulate, kernel_error) is reported in each iteration's
        ``extras`` (``model.history_``).
    precond_dtype : {"auto", "float64", "mixed", "input"}, default "auto"
        Precision of ``K_MM``, its factors and the CG vectors. Kernel passes always use the
        input dtype. ``"mixed"`` (Cholesky path; eigh and pivoted run in float64): the ``M^3``
        factorizations in float32, the factors kept in float32 and every solve and CG vector in float64
        arithmetic (:func:`.preconditioner.mixed_cholesky`; Def. 3 / Example 1.1 need ``B`` to be one fixed
        invertible map, not an accurate one). ``"auto"``: ``"mixed"`` for float32 inputs (test RMSE within
        0.5% of the float64 preconditioner on the 15 UCI sets, setup about 0.6x), ``"float64"`` otherwise
        (mixed solves the problem only to float32 accuracy, eps32 ``||K_MM|| / noise``). ``"input"``
        halves the ``O(M^2)`` memory of float32 fits but is wrong on 10 of 15 UCI sets
        (docs/solvers/falkon.md, "float32").
    rcond : float or None, default None
        Eigen and pivoted paths: drop eigenvalues (pivots) of
        ``D K_MM D`` at or below ``rcond * max eigenvalue``.
        None: ``M * eps64`` for float64 inputs (the pseudo-inverse convention), ``eps32`` for
        float32 inputs.
    kernel_cache : {"auto", "never"}, default "auto"
        ``"auto"``: keep ``K_nM`` in memory from the second CG pass on when ``n M`` entries fit
        ``kgp.settings.memory_budget`` (a fifth of RAM by default, on a GPU at most a fifth of its memory);
        later passes then read it instead of recomputing kernel blocks (4-5x faster per pass at d = 10,
        docs/backend.md); where only part of it fits, the native CPU pass keeps the leading rows that fit
        and forms the rest.
        ``"never"``: recompute every pass (memory O(M^2) + one block). Never above the budget.
    accumulate : {"auto", "input", "float64"}, default "auto"
        dtype of the sums ``K_nM^T u``; "auto": float64 for float32 inputs (:mod:`.precision`).
    distances : {"auto", "input", "float64"}, default "auto"
        dtype of the kernel's distance GEMM in the passes and the predictor; "auto": float64 when
        the float32 kernel values err by more than 1e-4 on the centers (:mod:`.precision`).

    Returns a :class:`kgp.KernelExpansion` over ``problem.centers``. Every kernel product goes
    through ``problem.kernel_operator`` (the fused pass ``K_nM^T (K_nM v + w)``); memory is
    ``O(M^2)`` for the factors plus the backend's block budget.
    """

    option_defaults: dict[str, Option] = {
        "maxiter": Option.integer(
            20, minimum=1, help="CG iterations t (Thm. 3 asks t >= log(n)/2 + 5 + 2 log(a + 3 kappa))"
        ),
        "tol": Option.number(
            1e-7,
            minimum=0.0,
            help="stop once every output's relative preconditioned residual is <= tol (0: run all maxiter)",
        ),
        "residual_every": Option.integer(
            10,
            minimum=0,
            allow_none=True,
            help="replace the recursive CG residual by the true one every this many iterations (0 or None: never)",
        ),
        "jitter": Option.number(
            None,
            minimum=0.0,
            allow_none=True,
            help="Cholesky of D K_MM D: diagonal shift relative to its mean diagonal (None: M eps)",
        ),
        "factorization": Option.choice(
            "auto",
            ("auto", "cholesky", "pivoted", "eigh"),
            help="preconditioner of Def. 3: Cholesky (Ex. 1.1), eigh (Ex. 2), pivoted Cholesky, or auto",
        ),
        "precond_dtype": Option.choice(
            "auto",
            ("auto", "float64", "mixed", "input"),
            help="precision of K_MM, its factors and the CG vectors (auto: mixed for float32 inputs, else float64)",
        ),
        "rcond": Option.number(
            None,
            minimum=0.0,
            maximum=1.0,
            exclusive_maximum=True,
            allow_none=True,
            help="eigh / pivoted: drop eigenvalues (pivots) <= rcond * max (None: M eps64, or eps32 for float32)",
        ),
        "kernel_cache": Option.choice(
            "auto",
            ("auto", "never"),
            help="keep K_nM (or the leading rows that fit) in memory from the second pass, within the budget",
        ),
        "accumulate": Option.choice(
            "auto",
            ("auto", "input", "float64"),
            help="dtype of the sums K_nM^T u (auto: float64 for float32 inputs with precond_dtype float64)",
        ),
        "distances": Option.choice(
            "auto",
            ("auto", "input", "float64"),
            help="dtype of the kernel's distance GEMM (auto: float64 when float32 values err > 1e-5 on the centers)",
        ),
    }
    # the Nystrom estimator on the centers; data-parallel (kgp.distributed): the passes sum over ranks
    # through the sharded operator, the M x M preconditioner is built on every rank (replicated) and
    # checked to be identical
    capabilities = kgp.Capabilities(uses_centers=True, target="nystrom", distributed=True)

    # ------------------------------------------------------------------ checks
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
        if problem.y.dim() != 2 or problem.y.shape[0] != problem.n_local:
            raise ValueError(f"y: expected shape ({problem.n_local}, k), got {tuple(problem.y.shape)}")
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

        ``problem.options`` are the resolved options (:func:`kgp.resolve_options`; the model resolves
        them before any work, a direct call builds them the same way).

        Raises
        ------
        ValueError
            On missing centers or bad weights.
        kgp.InsufficientMemoryError
            (a MemoryError and ValueError) If the preconditioner's ``M x M`` factors need more memory than
            the device has available (:mod:`.sizes`), before any of them is allocated.
        NotPSDError
            (:class:`kgp.linalg.NotPSDError`) If a factorization that must succeed fails, e.g.
            ``factorization="cholesky"`` on a rank-deficient ``K_MM``.
        FloatingPointError
            If the CG residual becomes non-finite (divergence).
        """
        opts = problem.options  # resolved by the core (kgp.resolve_options): validated, defaults filled in
        weights = self._check_problem(problem)
        dtype = problem.dtype
        # the M x M factors are the one allocation no budget bounds: refused here, before any of them
        check_factor_memory(problem.centers.points.shape[0], dtype, problem.device, opts)
        monitor = problem.monitor
        monitor.start(total=opts["maxiter"], desc="falkon")

        with torch.no_grad(), kgp.settings.kernel_cache(opts["kernel_cache"]):
            facts, distance_dtype, jitter = self._precision(problem, opts)
            precond_dtype = opts["precond_dtype"]
            if precond_dtype == "auto":
                precond_dtype = AUTO_PRECOND_DTYPE[dtype == torch.float32]
            prec = build_preconditioner(
                problem,
                weights,
                factorization=opts["factorization"],
                precond_dtype=precond_dtype,
                jitter=jitter,
                rcond=opts["rcond"],
            )
            if problem.shard is not None:
                # replicated M x M work is bitwise identical on identical hardware and threads; if not,
                # every rank takes rank 0's factors so that all ranks run the same CG (one checksum
                # all-gather; a broadcast of the factors only when they differ)
                factors = (prec.T, prec.A, prec.Q, prec.t_diag, prec.a_diag)
                problem.shard.replicate_([t for t in factors if t is not None])
            warn_if_under_resolved("solver 'falkon'", problem, problem.centers.points, _whitening(prec))
            facts = {"factorization": prec.method, "rank": prec.rank, **facts}
            facts["precond_dtype"] = prec.precision or str(prec.dtype).replace("torch.", "")
            if prec.shift:
                facts["jitter"] = prec.jitter
            accumulate = opts["accumulate"]
            if accumulate == "auto":
                accumulate = "float64" if dtype == torch.float32 and prec.dtype == torch.float64 else "input"
            facts["accumulate"] = accumulate if accumulate == "float64" else str(dtype).replace("torch.", "")
            Z = problem.centers.points

            def expansion(beta: Tensor) -> KernelExpansion:
                # alpha = B' beta' (Def. 4 with the 1/sqrt(n) folded into the operator)
                return KernelExpansion(problem.kernel, Z, prec.apply(beta).to(dtype), distance_dtype)

            beta = conjugate_gradient(
                kgp.kernel_operator(problem.kernel, problem.X, Z, distance_dtype=distance_dtype, shard=problem.shard),
                problem.y.to(dtype),
                prec,
                accumulate=torch.float64 if accumulate == "float64" else None,
                maxiter=opts["maxiter"],
                tol=opts["tol"],
                residual_every=opts["residual_every"] or 0,  # None: never, as 0
                monitor=monitor,
                expansion=expansion,
                extras=facts,
                n_total=problem.n,
            )
            return expansion(beta)

    @staticmethod
    def _precision(problem: Problem, opts: dict) -> tuple[dict, torch.dtype | None, float | None]:
        """Distance dtype and jitter for this problem, and what was measured (:mod:`.precision`).

        float64 inputs keep the paper's choices. float32 inputs: the kernel values on the centers are
        compared with float64 ones; the distances go float64 above ``DISTANCE_SWITCH`` (``distances=
        "auto"``) and the float64 Cholesky of ``K_MM`` gets a jitter above the remaining error.
        """
        distances = opts["distances"]
        distance_dtype = torch.float64 if distances == "float64" else None
        if problem.dtype != torch.float32:
            return {}, distance_dtype, opts["jitter"]
        resolution = kernel_resolution(problem, distance_dtype)
        if distances == "auto" and resolution > DISTANCE_SWITCH:
            distance_dtype = torch.float64
            resolution = kernel_resolution(problem, distance_dtype)
        jitter = opts["jitter"]
        if jitter is None and opts["factorization"] in ("auto", "cholesky"):
            jitter = float32_jitter(resolution)
        facts = {"distances": "float64" if distance_dtype is not None else "float32", "kernel_error": resolution}
        return facts, distance_dtype, jitter


def _whitening(prec) -> Callable[[Tensor], Tensor]:
    """``K_Mr -> T^{-T} Q^T D K_Mr``: with ``T^T T = D K_MM D + shift I`` its squared column norms are the
    Nystrom approximation ``k_xM K_MM^{-1} k_Mx`` of the kernel's diagonal (:mod:`..resolution`)."""

    def whiten(k_mr: Tensor) -> Tensor:
        v = k_mr if prec.d is None else k_mr * prec.d.to(k_mr.dtype).unsqueeze(-1)
        if prec.T is None:  # eigen path: Q diag(t) is the factor
            return (prec.Q.to(v.dtype).mT @ v) / prec.t_diag.to(v.dtype).unsqueeze(-1)
        if prec.keep is not None:
            v = v[prec.keep]
        return prec._solve("T", v.to(prec.dtype), upper=False)

    return whiten
