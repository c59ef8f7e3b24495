"""Options of ``eigenpro`` (EigenPro 3.0) and ``eigenpro2`` (EigenPro 2.0), with their sources.

The measurements behind the defaults are in docs/solvers/eigenpro.md.
"""

from __future__ import annotations

import math
from typing import Any

_COMMON_DEFAULTS: dict[str, Any] = {
    # Passes over the training data. The paper's Fig. 2 trains 50 epochs; with q > 0 the training
    # loss flattens within ~10 on the data sets measured in docs/solvers/eigenpro.md.
    "epochs": 10,
    # None: the critical batch size m* = beta / lambda_top (EigenPro 2.0, Ma & Belkin 2019;
    # EigenPro 3 Sec. 4.5 / reference code), beyond which larger batches stop paying off.
    "batch_size": None,
    # Nystrom subsample size s of the data preconditioner. None: min(n, 2000). The reference code
    # uses 5000 on a GPU; 2000 keeps the s x s eigendecomposition below ~1 s on 2 CPU cores.
    "subsample_size": None,
    # Preconditioner level q. None: s // 10 (the reference code's q = 500 for s = 5000). 0 turns
    # the data preconditioner off (plain projected SGD).
    "q": None,
    # "ridge": minimise ||K_XZ a - y||^2 + sigma^2 a^T K_ZZ a (GP posterior mean on span Z);
    # "none": lambda = 0, the paper's unregularised least squares / interpolation.
    "regularization": "ridge",
    # Stop when the epoch's running training MSE <= tol * mean(y^2) (0 disables).
    "tol": 0.0,
    # Multiplies the step size derived from the eigenvalues (1 = the EigenPro 2.0 rule).
    "lr_scale": 1.0,
    # Return the average of the iterates of the last `average_epochs` epochs (tail Polyak-Ruppert
    # averaging; not in the paper). None: epochs // 2. 0: the last iterate, as in the paper.
    # Constant-step SGD hovers around a non-interpolating optimum (ridge, p << n); averaging removes
    # that noise floor (airline test MSE 0.835 -> 0.734, letter accuracy +0.5-0.8 points; docs).
    "average_epochs": None,
}

EIGENPRO3_DEFAULTS: dict[str, Any] = {
    **_COMMON_DEFAULTS,
    # "projected": theta = proj_Z P_s proj_Z(grad): converges to the minimiser of the chosen
    # objective on span Z. "paper": Algorithm 2 as printed, theta = proj_Z P_s(grad), whose fixed
    # point is an (I - Q)-weighted least-squares solution (Lemma 6) when Z is not the data.
    "correction": "projected",
    # "auto": "cholesky" if the p x p matrix fits kgp.settings.memory_budget, else "eigenpro2".
    "projection": "auto",
    # Inner EigenPro 2.0 epochs per projection (the paper runs 1 epoch in its large experiments).
    "projection_epochs": 1,
    # Model-preconditioner subsample size / level for the inner solver (None: min(p, 2000), s // 10).
    "projection_subsample_size": None,
    "projection_q": None,
}

EIGENPRO2_DEFAULTS: dict[str, Any] = dict(_COMMON_DEFAULTS)

_REGULARIZATIONS = ("ridge", "none")
_CORRECTIONS = ("projected", "paper")
_PROJECTIONS = ("auto", "cholesky", "eigenpro2")


def _check_int(options: dict, name: str, *, minimum: int, allow_none: bool = False) -> None:
    value = options[name]
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"option {name!r}: expected {expected}, got {value!r}")


def _check_choice(options: dict, name: str, choices: tuple[str, ...]) -> None:
    if options[name] not in choices:
        raise ValueError(f"option {name!r}: expected one of {choices}, got {options[name]!r}")


def _check_common(options: dict) -> None:
    _check_int(options, "epochs", minimum=1)
    _check_int(options, "batch_size", minimum=1, allow_none=True)
    _check_int(options, "subsample_size", minimum=1, allow_none=True)
    _check_int(options, "q", minimum=0, allow_none=True)
    _check_choice(options, "regularization", _REGULARIZATIONS)
    _check_int(options, "average_epochs", minimum=0, allow_none=True)
    if options["average_epochs"] is None:
        options["average_epochs"] = options["epochs"] // 2
    if options["average_epochs"] > options["epochs"]:
        raise ValueError(
            f"option 'average_epochs': expected <= epochs={options['epochs']}, got {options['average_epochs']}"
        )
    for name in ("tol", "lr_scale"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"option {name!r}: expected a finite number, got {value!r}")
    if options["tol"] < 0:
        raise ValueError(f"option 'tol': expected >= 0, got {options['tol']!r}")
    if options["lr_scale"] <= 0:
        raise ValueError(f"option 'lr_scale': expected > 0, got {options['lr_scale']!r}")


def _check_ep3(options: dict) -> None:
    _check_common(options)
    _check_choice(options, "correction", _CORRECTIONS)
    _check_choice(options, "projection", _PROJECTIONS)
    _check_int(options, "projection_epochs", minimum=1)
    _check_int(options, "projection_subsample_size", minimum=1, allow_none=True)
    _check_int(options, "projection_q", minimum=0, allow_none=True)


def _resolve_sq(n_points: int, s: int | None, q: int | None, s_name: str, q_name: str) -> tuple[int, int]:
    s = min(n_points, 2000) if s is None else s
    if s > n_points:
        raise ValueError(f"option {s_name!r}: expected <= {n_points} (number of points), got {s}")
    q = s // 10 if q is None else q
    if q >= s:
        raise ValueError(f"option {q_name!r}: expected < {s_name}={s}, got {q}")
    return s, q
