"""Declared options of ``eigenpro`` (EigenPro 3.0) and ``eigenpro2`` (EigenPro 2.0), and the rules between them.

Each option is a :class:`kgp.Option` in a plain table (:data:`EIGENPRO3_DEFAULTS`,
:data:`EIGENPRO2_DEFAULTS`); :func:`kgp.resolve_options` validates and normalises them once, before
any work, with kgp's one message format. Rules between options (``average_epochs <= epochs``,
``q < subsample_size`` and ``projection_q < projection_subsample_size`` when both are given) are
:func:`check_options`, which the solvers' ``check_options`` methods run inside that same
resolution. Only the bounds that depend on the data (``subsample_size <= n``, the level below a
subsample size chosen from n, ``projection_subsample_size <= p``) are checked in ``fit``
(:func:`resolve_subsample`), raising :class:`kgp.options.InvalidOptionError` in that same format.
The measurements behind the defaults are in docs/solvers/eigenpro.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kgp.options import InvalidOptionError, Option

from .budget import budget_side

__all__ = [
    "EIGENPRO2_DEFAULTS",
    "EIGENPRO3_DEFAULTS",
    "check_options",
    "invalid_option",
    "resolve_subsample",
]

#: Largest default Nystrom subsample: the reference code uses 5000 on a GPU; 2000 keeps the s x s
#: eigendecomposition below ~1 s on 2 CPU cores.
DEFAULT_MAX_SUBSAMPLE = 2000

_COMMON: dict[str, Option] = {
    # The paper's Fig. 2 trains 50 epochs; with q > 0 the training loss flattens within ~10 on the
    # data sets measured in docs/solvers/eigenpro.md.
    "epochs": Option.integer(10, minimum=1, help="passes over the training data"),
    # The critical batch m* = beta / lambda_top of EigenPro 2.0 (Ma & Belkin 2019; EigenPro 3 Sec. 4.5 /
    # reference code) is where larger batches stop paying off.
    "batch_size": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help="minibatch size m; None: the critical batch m* = beta / lambda_top (eigenpro: at least M / 16)",
    ),
    "subsample_size": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help=f"Nystrom subsample s of the preconditioner (<= n); None: min(n, {DEFAULT_MAX_SUBSAMPLE}, budget side)",
    ),
    # s // 10 is the reference code's q = 500 for s = 5000; s - 1 when s = n (resolve_subsample).
    "q": Option.integer(
        None,
        minimum=0,
        allow_none=True,
        help="preconditioner level (< s); None: s - 1 if s = n, else s // 10; 0: no preconditioner",
    ),
    # "ridge": minimise ||K_XZ a - y||^2 + sigma^2 a^T K_ZZ a (GP posterior mean on span Z);
    # "none": lambda = 0, the paper's unregularised least squares / interpolation.
    "regularization": Option.choice(
        "ridge", ("ridge", "none"), help="'ridge': GP posterior mean (lambda = noise); 'none': least squares"
    ),
    "tol": Option.number(
        0.0, minimum=0.0, help="stop when the epoch's running training MSE <= tol * mean(y^2); 0: never"
    ),
    "lr_scale": Option.number(
        1.0, minimum=0.0, exclusive_minimum=True, help="multiplies the step size of the EigenPro 2.0 rule"
    ),
    # Tail Polyak-Ruppert averaging, not in the paper. Constant-step SGD hovers around a
    # non-interpolating optimum (ridge, p << n); averaging removes that noise floor (airline test MSE
    # 0.835 -> 0.734, letter accuracy +0.5-0.8 points; docs).
    "average_epochs": Option.integer(
        None,
        minimum=0,
        allow_none=True,
        help="return the mean iterate of the last k epochs (<= epochs); None: epochs // 2; 0: the last iterate",
    ),
}

#: Options of ``eigenpro`` (EigenPro 3.0, Algorithm 2).
EIGENPRO3_DEFAULTS: dict[str, Option] = {
    **_COMMON,
    # "projected": theta = proj_Z P_s proj_Z(grad): converges to the minimiser of the chosen
    # objective on span Z. "paper": Algorithm 2 as printed, theta = proj_Z P_s(grad), whose fixed
    # point is an (I - Q)-weighted least-squares solution (Lemma 6) when Z is not the data.
    "correction": Option.choice(
        "projected",
        ("projected", "paper"),
        help="'projected': proj_Z P_s proj_Z (converges to the objective's minimiser); 'paper': Algorithm 2's order",
    ),
    "projection": Option.choice(
        "auto",
        ("auto", "cholesky", "eigenpro2"),
        help="K(Z,Z)^-1 by 'cholesky' (exact) or inner 'eigenpro2' epochs (eq. 32); 'auto': cholesky if p^2 fits",
    ),
    # The paper runs 1 inner epoch in its large experiments.
    "projection_epochs": Option.integer(1, minimum=1, help="inner EigenPro 2.0 epochs per projection"),
    "projection_subsample_size": Option.integer(
        None,
        minimum=1,
        allow_none=True,
        help=f"subsample of the inner solver's model preconditioner (<= p); None: min(p, {DEFAULT_MAX_SUBSAMPLE})",
    ),
    "projection_q": Option.integer(
        None, minimum=0, allow_none=True, help="level of the model preconditioner (< its subsample); None: s // 10"
    ),
    # Phi = K(X, Z) L^{-T} (n x p) in memory: a step is two products with its rows instead of a kernel block
    # and two triangular solves (features.py; letter p = 4,000: docs/solvers/eigenpro.md)
    "kernel_cache": Option.choice(
        "auto",
        ("auto", "never"),
        help="keep K(X, Z) L^-T when it fits the budget and 2 epochs max(k, 25) >= batch (Cholesky, 'projected')",
    ),
}

#: Options of ``eigenpro2`` (EigenPro 2.0): the common ones, no projection.
EIGENPRO2_DEFAULTS: dict[str, Option] = dict(_COMMON)


def invalid_option(owner: str, name: str, expected: str, value: Any) -> InvalidOptionError:
    """The error of a cross-option rule, in :meth:`kgp.Option.parse`'s format."""
    return InvalidOptionError(f"{owner} option {name!r}: expected {expected}, got {value!r}")


def check_options(owner: str, options: dict[str, Any], *, projection: bool) -> dict[str, Any]:
    """The rules between the options of ``eigenpro`` (``projection=True``) or ``eigenpro2``.

    ``average_epochs`` at most ``epochs`` (None resolved to ``epochs // 2``); a level below its
    subsample size when both are given (``q < subsample_size``; for ``eigenpro`` also
    ``projection_q < projection_subsample_size``). Idempotent: options it returned pass again.

    Raises
    ------
    kgp.options.InvalidOptionError
        Naming the option, what it accepts given the other, and the value.
    """
    epochs, average = options["epochs"], options["average_epochs"]
    if average is None:
        options["average_epochs"] = epochs // 2
    elif average > epochs:
        raise invalid_option(owner, "average_epochs", f"an integer <= epochs={epochs}", average)
    _check_level(owner, options, "subsample_size", "q")
    if projection:
        _check_level(owner, options, "projection_subsample_size", "projection_q")
    return options


def _check_level(owner: str, options: Mapping[str, Any], s_name: str, q_name: str) -> None:
    s, q = options[s_name], options[q_name]
    if s is not None and q is not None and q >= s:
        raise invalid_option(owner, q_name, f"an integer < {s_name}={s} or None", q)


def resolve_subsample(
    owner: str,
    n_points: int,
    s: int | None,
    q: int | None,
    *,
    s_name: str = "subsample_size",
    q_name: str = "q",
    points: str = "training points",
    model_spans_points: bool = True,
    device: torch.device | None = None,
) -> tuple[int, int]:
    """Nystrom subsample size ``s <= n_points`` and level ``q < s``.

    ``s`` None: ``min(n_points, 2000)``, and at most the side of a square float64 block within
    ``kgp.settings.memory_budget`` (on ``device``). ``q`` None: ``s - 1`` when the subsample is every point and
    ``model_spans_points`` (EigenPro 2.0; EigenPro 3.0 with at least as many centers as points): the
    Nystrom eigensystem is then exact and the level rule of :func:`.nystrom.nystrom_preconditioner`
    damps each direction whose curvature exceeds the level (energy 1.16x -> 1.03x FALKON's test
    RMSE, airfoil without its ConvergenceWarning; docs). Else ``s // 10`` (the reference code's
    q = 500 at s = 5000): the curvature left outside the subsample's span bounds the level, and with
    fewer centers than points the damping computed for the data directions is wrong for their
    projections on the centers (500 points, 200 centers: test R^2 0.83 at q = 148 against 0.987 at
    q = 49).
    """
    if s is None:
        s = min(n_points, DEFAULT_MAX_SUBSAMPLE, budget_side(device))
    elif s > n_points:
        raise invalid_option(owner, s_name, f"an integer <= {n_points} (the number of {points}) or None", s)
    if q is None:
        q = s - 1 if s == n_points and model_spans_points else s // 10
    elif q >= s:
        raise invalid_option(owner, q_name, f"an integer < {s_name}={s} or None", q)
    return s, q
