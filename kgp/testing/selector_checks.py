"""Center-selector checks: the returned :class:`kgp.Centers`, distinct centers, rows of the data, seeds,
devices, options, memory under a budget and a fit on the centers.

``select`` is called as the model calls it: with options resolved by :func:`kgp.resolve_options`
and under ``torch.no_grad()`` unless the selector declares ``needs_grad``.

Why distinct centers: a center repeated makes two rows of ``K_MM`` equal, so the Nystrom system
``(K_nM^T K_nM + sigma^2 K_MM) a = K_nM^T y`` is singular and the repeat buys no accuracy; a selector
that samples with replacement merges the repeats (into a weight, or fewer centers) before returning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import settings
from ..options import resolve_options
from ..plugin import Centers, SelectionRequest
from .memory import MEMORY_BUDGET, MEMORY_EXACT_SIZE, MEMORY_SPEC, LargestTensor
from .oracles import DEFAULT_SPEC, OracleData, OracleSpec, dense_nystrom_mean, make_oracle_data
from .solver_checks import solver_model
from .support import GlobalRngGuard, check_close, options_for, plugin_info, plugin_work, reproduces, run_all, skip

__all__ = [
    "SELECTOR_CHECKS",
    "check_selector",
    "check_selector_contract",
    "check_selector_data_rows",
    "check_selector_device",
    "check_selector_distinct",
    "check_selector_in_model",
    "check_selector_invalid_options",
    "check_selector_memory",
    "check_selector_seed",
    "check_selector_unknown_option",
]


def _select(name: str, data: OracleData, n_centers: int | None, seed: int, selector_options) -> Centers:
    info = plugin_info("selector", name)
    request = SelectionRequest(
        X=data.X,
        n_centers=n_centers,
        kernel=data.spec.make_kernel(data.X.dtype, data.X.device),
        noise=data.spec.noise,
        generator=torch.Generator().manual_seed(seed),
        options=options_for("selector", name, selector_options),
    )
    with plugin_work(info.capabilities):
        return info.obj.select(request)


def _validate_centers(name: str, centers: Any, data: OracleData, n_centers: int | None, exact_count: bool) -> int:
    if not isinstance(centers, Centers):
        raise AssertionError(f"selector {name!r}: select() returned {type(centers).__name__}, expected kgp.Centers")
    X = data.X
    pts = centers.points
    if not isinstance(pts, Tensor) or pts.dim() != 2 or pts.shape[1] != X.shape[1]:
        raise AssertionError(
            f"selector {name!r}: points must be an M x {X.shape[1]} tensor, got "
            f"{tuple(pts.shape) if isinstance(pts, Tensor) else type(pts).__name__}"
        )
    m = pts.shape[0]
    if n_centers is not None:
        if exact_count and m != n_centers:
            raise AssertionError(f"selector {name!r}: asked for {n_centers} centers, got {m}")
        if not 1 <= m <= n_centers:
            raise AssertionError(f"selector {name!r}: asked for at most {n_centers} centers, got {m}")
    elif not 1 <= m <= X.shape[0]:
        raise AssertionError(f"selector {name!r}: chose {m} centers for n={X.shape[0]}")
    if pts.dtype != X.dtype or pts.device != X.device:
        raise AssertionError(f"selector {name!r}: points are {pts.dtype} on {pts.device}, X is {X.dtype} on {X.device}")
    if not bool(torch.isfinite(pts).all()):
        raise AssertionError(f"selector {name!r}: points contain NaN / inf")
    w = centers.weights
    if w is not None:
        if not isinstance(w, Tensor) or tuple(w.shape) != (m,):
            raise AssertionError(
                f"selector {name!r}: weights must be None or shape ({m},), got "
                f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}"
            )
        if w.dtype != X.dtype or w.device != X.device:
            raise AssertionError(
                f"selector {name!r}: weights are {w.dtype} on {w.device}, X is {X.dtype} on {X.device}"
            )
        if not bool((torch.isfinite(w) & (w > 0)).all()):
            raise AssertionError(f"selector {name!r}: weights must be finite and positive")
    idx = centers.indices
    if idx is not None:
        if not isinstance(idx, Tensor) or tuple(idx.shape) != (m,) or idx.is_floating_point():
            raise AssertionError(f"selector {name!r}: indices must be None or an integer tensor of shape ({m},)")
        if int(idx.min()) < 0 or int(idx.max()) >= X.shape[0]:
            raise AssertionError(f"selector {name!r}: indices out of range [0, {X.shape[0]})")
        if not torch.equal(X[idx.to(X.device)], pts):
            raise AssertionError(f"selector {name!r}: X[indices] differs from points")
    if not isinstance(centers.info, dict):
        raise AssertionError(f"selector {name!r}: Centers.info must be a dict")
    return m


def _same_centers(a: Centers, b: Centers) -> bool:
    def eq(u, v):
        return (u is None and v is None) or (u is not None and v is not None and reproduces(u, v))

    return eq(a.points, b.points) and eq(a.weights, b.weights) and eq(a.indices, b.indices)


def check_selector_contract(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    exact_count: bool = True,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """Shapes, dtypes, weights and indices for float32 / float64 inputs, and ``n_centers=None``."""
    base = make_oracle_data(spec)
    sizes = {}
    for dtype in (torch.float32, torch.float64):
        data = base.cast(dtype)
        chosen = _select(name, data, n_centers, 0, selector_options)
        sizes[str(dtype).replace("torch.", "")] = _validate_centers(name, chosen, data, n_centers, exact_count)
    auto = _select(name, base, None, 0, selector_options)
    sizes["auto"] = _validate_centers(name, auto, base, None, exact_count)
    return {"n_centers": sizes}


def _duplicates(points: Tensor) -> tuple[int, list[int]]:
    """The number of distinct rows of ``points`` and the positions of the first two equal rows (or [])."""
    distinct, inverse, counts = torch.unique(points, dim=0, return_inverse=True, return_counts=True)
    if distinct.shape[0] == points.shape[0]:
        return distinct.shape[0], []
    group = int(torch.argmax(counts))
    return distinct.shape[0], (inverse == group).nonzero()[:2, 0].tolist()


def check_selector_distinct(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """No center is returned twice (the kit's data has distinct rows), for ``n_centers`` and ``None``.

    A repeated center makes ``K_MM`` singular and adds nothing to the Nystrom space; a sampler drawing
    with replacement merges repeats into one center (a weight, or fewer than ``n_centers`` with
    ``exact_count=False``).
    """
    data = make_oracle_data(spec)
    sizes = {}
    for asked in (n_centers, None):
        points = _select(name, data, asked, 0, selector_options).points
        m = points.shape[0]
        distinct, first = _duplicates(points)
        if distinct == 1 and m > 1:
            raise AssertionError(
                f"selector {name!r}: returned the same center {m} times (n_centers={asked}); every center must be "
                "a different point"
            )
        if first:
            raise AssertionError(
                f"selector {name!r}: returned duplicate centers ({m - distinct} of {m} repeat an earlier one; points "
                f"{first[0]} and {first[1]} are equal, n_centers={asked}): a repeated center makes K_MM singular; "
                "draw without replacement or merge repeats"
            )
        sizes["auto" if asked is None else "requested"] = m
    return {"n_centers": sizes}


def check_selector_data_rows(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    spec: OracleSpec = DEFAULT_SPEC,
    data_rows: bool = False,
    **_: Any,
) -> dict[str, Any]:
    """With ``data_rows=True`` (the selector promises rows of ``X``, as uniform sampling and leverage-score
    sampling do): every center equals a training row exactly, in float32 and float64."""
    if not data_rows:
        skip("data_rows=False: the selector may return points that are not rows of X")
    base = make_oracle_data(spec)
    for dtype in (torch.float32, torch.float64):
        data = base.cast(dtype)
        points = _select(name, data, n_centers, 0, selector_options).points
        outside = [i for i in range(points.shape[0]) if not bool((data.X == points[i]).all(dim=1).any())]
        if outside:
            i = outside[0]
            nearest = float(((data.X - points[i]) ** 2).sum(dim=1).min().sqrt())
            raise AssertionError(
                f"selector {name!r}: {len(outside)} of {points.shape[0]} centers are not rows of X ({dtype}; "
                f"center {i} is {nearest:.3e} from the nearest row), but the selector promises data rows "
                "(data_rows=True)"
            )
    return {}


def check_selector_seed(
    name: str, *, selector_options=None, n_centers: int = 40, spec: OracleSpec = DEFAULT_SPEC, **_: Any
) -> dict[str, Any]:
    """The same generator seed gives identical centers, whatever the global torch / numpy RNG state."""
    data = make_oracle_data(spec)
    results = []
    with GlobalRngGuard():
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            np.random.seed(global_seed)
            results.append(_select(name, data, n_centers, 5, selector_options))
    if not _same_centers(results[0], results[1]):
        raise AssertionError(
            f"selector {name!r}: two calls with the same generator seed chose different centers; draw every "
            "random number from request.generator"
        )
    return {}


def check_selector_device(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    exact_count: bool = True,
    spec: OracleSpec = DEFAULT_SPEC,
    device: str | torch.device | None = None,
    **_: Any,
) -> dict[str, Any]:
    """Inputs on ``device`` (default CUDA when available) give centers on that device."""
    if device is None:
        if not torch.cuda.is_available():
            skip("no CUDA device available")
        device = "cuda"
    data = make_oracle_data(spec).cast(torch.float32, device)
    m = _validate_centers(name, _select(name, data, n_centers, 0, selector_options), data, n_centers, exact_count)
    return {"n_centers": m}


def check_selector_unknown_option(name: str, *, spec: OracleSpec = DEFAULT_SPEC, **_: Any) -> dict[str, Any]:
    """An unknown selector option fails with ValueError naming it and listing the valid ones."""
    selector = plugin_info("selector", name).obj
    bogus = "no_such_option_xyz"
    try:
        resolve_options(f"selector {name!r}", selector, {bogus: 1})
    except ValueError as exc:
        missing = [opt for opt in [bogus, *selector.option_defaults] if opt not in str(exc)]
        if missing:
            raise AssertionError(f"selector {name!r}: the unknown-option error does not mention {missing}") from None
    else:
        raise AssertionError(f"selector {name!r}: option_defaults accepted an unknown option")
    return {}


def check_selector_invalid_options(
    name: str,
    *,
    selector_options=None,
    invalid_options: tuple[Mapping[str, Any], ...] = (),
    n_centers: int = 40,
    spec: OracleSpec = DEFAULT_SPEC,
    **_: Any,
) -> dict[str, Any]:
    """Each dict in ``invalid_options`` (merged over ``selector_options``) raises ValueError / TypeError naming
    an option in it, when resolved or at the latest in ``select``."""
    if not invalid_options:
        skip("no invalid_options given")
    data = make_oracle_data(spec)
    for bad in invalid_options:
        try:
            _select(name, data, n_centers, 0, {**dict(selector_options or {}), **dict(bad)})
        except (ValueError, TypeError) as exc:
            if not any(key in str(exc) for key in bad):
                raise AssertionError(
                    f"selector {name!r}: the error for {dict(bad)} names none of {list(bad)}: {exc}"
                ) from None
        else:
            raise AssertionError(f"selector {name!r}: invalid options {dict(bad)} were accepted")
    return {"cases": len(invalid_options)}


def check_selector_memory(
    name: str, *, selector_options=None, memory_spec: OracleSpec = MEMORY_SPEC, **_: Any
) -> dict[str, Any]:
    """Under ``kgp.settings.max_exact_size`` = :data:`~kgp.testing.memory.MEMORY_EXACT_SIZE` and ``memory_budget``
    = :data:`~kgp.testing.memory.MEMORY_BUDGET`: ``select`` forms no n x n tensor, and none larger than
    ``max(budget, max_exact_size^2, M^2, n x d)`` entries (an ``n x M`` kernel block must be streamed).

    Measured by :class:`~kgp.testing.memory.LargestTensor` on ``memory_spec`` (n = 2000, M = 20).
    """
    data = make_oracle_data(memory_spec)
    n, m, d = memory_spec.n, memory_spec.n_centers, memory_spec.d
    with settings.max_exact_size(MEMORY_EXACT_SIZE), settings.memory_budget(MEMORY_BUDGET):
        with LargestTensor() as probe:
            _select(name, data, m, 0, selector_options)
    bound = max(MEMORY_BUDGET // data.X.element_size(), MEMORY_EXACT_SIZE**2, m * m, n * d)
    if probe.largest >= n * n:
        raise AssertionError(
            f"selector {name!r}: formed a {probe.shape} tensor ({probe.op}) at n={n}: never form the n x n kernel "
            "matrix; stream K(X, Z) over row blocks (request.kernel_operator) under kgp.settings.memory_budget"
        )
    if probe.largest > bound:
        raise AssertionError(
            f"selector {name!r}: formed a {probe.shape} tensor ({probe.op}), {probe.largest} entries, above "
            f"max(memory_budget={MEMORY_BUDGET} bytes, max_exact_size^2, M^2, n x d) = {bound} at n={n}, M={m}: "
            "stream n x M products over row blocks under kgp.settings.memory_budget"
        )
    return {"largest": probe.largest, "shape": probe.shape, "bound": bound}


def check_selector_in_model(
    name: str,
    *,
    selector_options=None,
    n_centers: int = 40,
    spec: OracleSpec = DEFAULT_SPEC,
    solver: str | None = None,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    **_: Any,
) -> dict[str, Any]:
    """``KernelRegressor(solver=solver, centers=name, solver_options=...)`` fits the Nystrom solution at the
    chosen centers within ``rtol``."""
    if solver is None:
        skip("no solver given to fit with the selected centers")
    data = make_oracle_data(spec)
    model = solver_model(
        solver,
        data,
        solver_options,
        centers=name,
        n_centers=n_centers,
        selector_options=dict(selector_options or {}),
    ).fit(data.X, data.y[:, 0])
    ref = dense_nystrom_mean(data, centers=model.centers_)[:, 0]
    err = check_close(f"selector {name!r} with solver {solver!r}", model.predict(data.X_test), ref, rtol)
    return {"rel_error": err}


SELECTOR_CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "contract": check_selector_contract,
    "distinct": check_selector_distinct,
    "data_rows": check_selector_data_rows,
    "seed": check_selector_seed,
    "device": check_selector_device,
    "unknown_option": check_selector_unknown_option,
    "invalid_options": check_selector_invalid_options,
    "memory": check_selector_memory,
    "in_model": check_selector_in_model,
}
"""Every selector check by name, in the order :func:`check_selector` runs them."""


def check_selector(
    name: str,
    *,
    selector_options: Mapping[str, Any] | None = None,
    n_centers: int = 40,
    exact_count: bool = True,
    data_rows: bool = False,
    invalid_options: tuple[Mapping[str, Any], ...] = (),
    spec: OracleSpec = DEFAULT_SPEC,
    memory_spec: OracleSpec = MEMORY_SPEC,
    device: str | torch.device | None = None,
    solver: str | None = None,
    solver_options: Mapping[str, Any] | None = None,
    rtol: float = 1e-6,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run every selector check and return what each measured.

    Parameters
    ----------
    name:
        Registered selector name.
    selector_options:
        Options for every call.
    n_centers:
        Number of centers requested.
    exact_count:
        Whether exactly ``n_centers`` must come back (False: between 1 and ``n_centers``, e.g.
        for samplers that merge duplicates).
    data_rows:
        Whether the selector promises rows of ``X`` (uniform, leverage-score and k-means++ sampling do);
        then every center must equal a training row. False skips the ``data_rows`` check.
    invalid_options:
        Option dicts the selector must refuse (ValueError / TypeError naming an option in the dict), e.g.
        ``({"q": 1.0},)`` for an option declared ``> 1``. Empty skips the ``invalid_options`` check.
    spec:
        The oracle problem the centers are chosen from.
    memory_spec:
        The larger problem of the ``memory`` check (n x n must not fit under its budget).
    device:
        Extra device for the device check (default: CUDA when available).
    solver:
        A solver targeting the Nystrom estimator to run ``KernelRegressor(solver=solver, centers=name)``
        with; its predictions must match the dense Nystrom solution at the selected centers within
        ``rtol``. None skips this check.
    solver_options:
        Options of that fit: an iterative solver needs enough iterations to meet ``rtol`` (FALKON's
        default 20 iterations reach 7e-6 on the kit's problem, 50 reach 1.4e-7).
    rtol:
        Largest relative error of the in-model fit against the dense Nystrom solution.
    skip:
        Names of checks not to run (keys of :data:`SELECTOR_CHECKS`).

    Raises
    ------
    AssertionError
        Listing every failed check.
    """
    return run_all(
        SELECTOR_CHECKS,
        skip,
        f"selector {name!r}",
        name=name,
        selector_options=selector_options,
        n_centers=n_centers,
        exact_count=exact_count,
        data_rows=data_rows,
        invalid_options=tuple(invalid_options),
        spec=spec,
        memory_spec=memory_spec,
        device=device,
        solver=solver,
        solver_options=solver_options,
        rtol=rtol,
    )
