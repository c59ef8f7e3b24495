"""The options of solver ``dsg``: one plain :class:`kgp.Option` table (``kgp plugins --options dsg``).

Every option computed from the data when not given defaults to None; ``t0`` and ``gamma_max`` also
accept the alias ``"auto"``, which :meth:`.solver.DSGSolver.check_options` turns into
None. docs/solvers/dsg.md explains each option and the measurements behind the defaults. Notes on
the less obvious ones:

``t0`` / ``gamma_max`` (None, or the alias "auto")
    ``gamma_t = theta / (t + t0)``; t0 None is ``max(0, theta / gamma_max - 1)``, so that the first
    step is ``gamma_max``; gamma_max None is ``min(1 / (lambda_1 + s / m), r m / (n s))`` (not in
    the paper; see :meth:`.solver.DSGSolver._gamma_max`).
``train_predictions`` ("auto")
    How f_t(x_j) is evaluated: "recompute" (Algorithm 1 as printed: regenerate all earlier features
    for the batch, O(t r d m) per step), "cache" (keep f_t on the training points up to date,
    O(n r d) per step; identical values), "auto" (the cheaper of the two for this call).
"""

from __future__ import annotations

from kgp.options import Option

__all__ = [
    "DSG_OPTIONS",
    "GRADIENT_BATCH",
    "GRADIENT_FEATURES",
    "LS_FEATURES",
    "LS_FEATURES_PER_POINT",
    "LS_POINTS_CAP",
]

# Defaults of the None options (measured on the UCI sweep; docs/solvers/dsg.md, "Defaults"):
# least_squares draws 512 features per step on all n points and 20 min(n, 5000) features in all;
# gradient takes 64 features, batches of 256 and 10 passes (the plain step's own defaults).
LS_FEATURES = 512
LS_FEATURES_PER_POINT = 20
LS_POINTS_CAP = 5000
GRADIENT_FEATURES = 64
GRADIENT_BATCH = 256

_POSITIVE_OR_NONE = {"minimum": 0.0, "exclusive_minimum": True, "allow_none": True}

DSG_OPTIONS: dict[str, Option] = {
    "update": Option.choice(
        "least_squares",
        ("least_squares", "gradient"),
        help="step rule: ridge least-squares fit of the residual by the step's features, or the plain eq. 6 step",
    ),
    "features_per_step": Option.integer(
        None, minimum=1, allow_none=True, help="r, random features drawn per step; None: 512 (least_squares), 64"
    ),
    "batch_size": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="m, data points per step (capped at n); None: all n (least_squares), 256 (gradient)",
    ),
    "passes": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="passes over the data in fit; None: 20 min(n, 5000) / r features' worth (least_squares), 10",
    ),
    "partial_fit_passes": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="passes over each chunk in partial_fit; None: as passes (least_squares), 1 (gradient)",
    ),
    "max_steps": Option.integer(None, minimum=1, allow_none=True, help="cap on the steps of one call; None: no cap"),
    "nu": Option.number(
        None, **_POSITIVE_OR_NONE, help="the paper's regulariser nu; None: noise / n_seen (= problem.lam in fit)"
    ),
    "ridge": Option.number(
        None,
        minimum=0.0,
        allow_none=True,
        help="least_squares: ridge rho of each block fit; None: nu T (T = steps after the call)",
    ),
    "shrink": Option.number(
        1.0,
        minimum=0.0,
        exclusive_minimum=True,
        maximum=1.0,
        help="least_squares: fraction of each block fit that is taken (1: all); 0.2 for points isolated at the "
        "lengthscale (rounded / discrete features)",
    ),
    "gram_rows": Option.integer(
        2048,
        minimum=1,
        help="least_squares: batches up to this size are solved directly, larger ones by CG preconditioned "
        "with this many rows",
    ),
    "theta": Option.number(
        None,
        **_POSITIVE_OR_NONE,
        help="gradient: step-size constant in gamma_t = theta / (t + t0); None: 1 / nu (Thm. 4)",
    ),
    "t0": Option.number(
        None,
        minimum=0.0,
        allow_none=True,
        keywords=("auto",),
        help="gradient: clock offset in gamma_t = theta / (t + t0); None ('auto'): first step gamma_max; "
        "0: the paper's",
    ),
    "gamma_max": Option.number(
        None,
        **_POSITIVE_OR_NONE,
        keywords=("auto",),
        help="gradient: first step for t0 None; None ('auto'): min(1 / (lambda_1 + s / m), r m / (n s))",
    ),
    "seed": Option.integer(
        None, minimum=0, allow_none=True, help="model seed of the random features; None: from random_state"
    ),
    "train_predictions": Option.choice(
        "auto",
        ("auto", "cache", "recompute"),
        help="how f_t(x_j) is evaluated: cache f_t on X, recompute from seeds, or the cheaper (auto); "
        "least_squares always caches",
    ),
    "report_every": Option.integer(
        None, minimum=1, allow_none=True, help="steps between monitor reports; None: once per pass"
    ),
}
"""Options of :class:`.solver.DSGSolver` (``solver_options`` of ``KernelRegressor(solver="dsg")``)."""
