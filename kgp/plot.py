"""Figures for a fitted GP: calibration, learning curve, test error and time against the number of centers.

Optional: matplotlib comes with the extra ``pip install "kgp[plot]"``; without it the plotting
functions raise an ImportError naming the extra, while the numbers behind the figures
(:func:`calibration_curve`, :func:`sweep_centers`) need only numpy. Each plotting function draws on
``ax`` (a new figure when None) and returns the axes, as pandas' and scikit-learn's plots do::

    import kgp.plot
    kgp.plot.calibration(model, X_test, y_test)            # is the std right?
    kgp.plot.learning_curve(model)                         # did learning converge?
    results = kgp.plot.sweep_centers(model, X, y, X_test, y_test, [250, 500, 1000, 2000])
    kgp.plot.fit_vs_centers(results)                       # where does a larger M stop paying?
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

__all__ = ["calibration", "calibration_curve", "fit_vs_centers", "learning_curve", "sweep_centers"]

DEFAULT_LEVELS = tuple(np.round(np.arange(0.05, 1.0, 0.05), 2)) + (0.99,)


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            'kgp.plot needs matplotlib: install the extra with pip install "kgp[plot]" (or pip install matplotlib)'
        ) from exc
    return plt


def _axes(ax):
    return _pyplot().subplots()[1] if ax is None else ax


def _as_numpy(values: Any, name: str) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    out = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name}: expected finite numbers, got NaN or inf")
    return out


def calibration_curve(
    y: Any, mean: Any, std: Any, levels: Iterable[float] = DEFAULT_LEVELS
) -> tuple[np.ndarray, np.ndarray]:
    """Nominal against empirical coverage of central Gaussian predictive intervals.

    For each level p the interval is ``mean +- z std`` with ``z = Phi^{-1}((1 + p) / 2)``; its
    empirical coverage is the fraction of ``y`` inside it. A calibrated model gives coverage = p;
    below the diagonal the std is too small (over-confident), above it too large.

    Parameters
    ----------
    y, mean, std:
        Observed targets, predicted means and predictive standard deviations of new observations
        (noise included: ``predict(X, return_std=True, include_noise=True)``), all of one shape.
    levels:
        Nominal coverages, each strictly between 0 and 1.

    Returns
    -------
    nominal, empirical:
        Arrays of ``len(levels)``.
    """
    y, mean, std = _as_numpy(y, "y"), _as_numpy(mean, "mean"), _as_numpy(std, "std")
    if not (y.shape == mean.shape == std.shape) or y.size == 0:
        raise ValueError(f"y, mean, std: expected one non-empty shape, got {y.shape}, {mean.shape}, {std.shape}")
    if np.any(std <= 0):
        raise ValueError("std: expected positive standard deviations (predict(..., include_noise=True))")
    nominal = np.asarray(list(levels), dtype=np.float64)
    if nominal.ndim != 1 or nominal.size == 0 or np.any((nominal <= 0) | (nominal >= 1)):
        raise ValueError(f"levels: expected coverages strictly between 0 and 1, got {list(nominal)}")
    z = np.abs(y - mean).ravel() / std.ravel()
    half_widths = np.array([NormalDist().inv_cdf((1.0 + p) / 2.0) for p in nominal])
    empirical = (z[None, :] <= half_widths[:, None]).mean(axis=1)
    return nominal, empirical


def calibration(
    model: Any = None,
    X: Any = None,
    y: Any = None,
    *,
    mean: Any = None,
    std: Any = None,
    levels: Iterable[float] = DEFAULT_LEVELS,
    ax: Any = None,
    label: str | None = None,
):
    """Calibration plot: empirical against nominal coverage of the central predictive intervals.

    Give a fitted regressor with test data (``calibration(model, X_test, y_test)``: the std of a new
    observation, noise included, from ``model.predict``), or the numbers
    (``calibration(y=y_test, mean=mean, std=std)``). See :func:`calibration_curve`.

    Returns
    -------
    matplotlib.axes.Axes
        Line 0: the calibrated diagonal; line 1: the model's coverage (``ax.lines[1].get_xydata()``).
    """
    if model is not None:
        if mean is not None or std is not None:
            raise ValueError("calibration: give either model with X, y or mean and std, not both")
        if X is None or y is None:
            raise ValueError("calibration: with a model, give the test inputs X and targets y")
        mean, std = model.predict(X, return_std=True, include_noise=True)
    elif mean is None or std is None or y is None:
        raise ValueError("calibration: give a fitted model with X and y, or y, mean and std")
    nominal, empirical = calibration_curve(y, mean, std, levels)
    ax = _axes(ax)
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="calibrated")
    ax.plot(nominal, empirical, "o-", label=label or f"model ({np.asarray(_as_numpy(y, 'y')).size} points)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("nominal coverage of the central interval")
    ax.set_ylabel("fraction of targets inside")
    ax.set_title("calibration (below the diagonal: std too small)")
    ax.legend(loc="upper left")
    return ax


def learning_curve(model: Any, *, ax: Any = None):
    """The learning objective at every step of ``model.learn_history_`` (a model fitted with ``learn=``).

    Returns
    -------
    matplotlib.axes.Axes
        Line 0: step (1, 2, ...) against the objective (``ax.lines[0].get_xydata()``).
    """
    history = list(getattr(model, "learn_history_", None) or [])
    if not history:
        raise ValueError(
            "learning_curve: the model has no learning history; fit it with learn='sgpr', 'exact' or 'holdout'"
        )
    values = _as_numpy(history, "learn_history_")
    ax = _axes(ax)
    ax.plot(np.arange(1, len(values) + 1), values, ".-")
    ax.set_xlabel("step (objective evaluation)")
    ax.set_ylabel(f"objective {getattr(model, 'learn', '')!s} (lower is better)".replace("  ", " "))
    ax.set_title(f"learning: {values[0]:.4g} -> {values[-1]:.4g} in {len(values)} steps")
    return ax


def sweep_centers(
    model: Any, X: Any, y: Any, X_test: Any, y_test: Any, n_centers: Sequence[int]
) -> list[dict[str, float]]:
    """Fit a copy of ``model`` at each number of centers; test RMSE and fit time of each.

    The copies are made with ``get_params`` / ``set_params`` (``model`` itself is not fitted), so
    everything but ``n_centers`` stays as given (solver, seed, learning...).

    Returns
    -------
    list of dict
        ``{"n_centers": M, "rmse": test RMSE, "fit_time": seconds (model.fit_time_)}`` per M, in order.
    """
    sizes = [int(m) for m in n_centers]
    if not sizes or any(m < 1 for m in sizes):
        raise ValueError(f"n_centers: expected positive numbers of centers, got {list(n_centers)}")
    target = _as_numpy(y_test, "y_test")
    results = []
    for m in sizes:
        copy = type(model)(**{**model.get_params(deep=False), "n_centers": m})
        copy.fit(X, y)
        pred = _as_numpy(copy.predict(X_test), "predictions").reshape(target.shape)
        rmse = float(np.sqrt(np.mean((pred - target) ** 2)))
        results.append({"n_centers": m, "rmse": rmse, "fit_time": float(copy.fit_time_)})
    return results


def fit_vs_centers(results: Sequence[Mapping[str, float]], *, error: str = "rmse", axes: Any = None):
    """Test error and fit time against the number of centers M, side by side.

    Parameters
    ----------
    results:
        One mapping per fit with ``"n_centers"``, ``error`` and ``"fit_time"`` (what
        :func:`sweep_centers` returns, or your own measurements).
    error:
        The key of the error in ``results`` (its name labels the axis).
    axes:
        Two matplotlib axes (a new 1 x 2 figure when None).

    Returns
    -------
    (Axes, Axes)
        Error against M (``axes[0].lines[0]``) and time against M (``axes[1].lines[0]``), M sorted.
    """
    rows = sorted(results, key=lambda r: r["n_centers"])
    if not rows:
        raise ValueError("results: expected at least one fit")
    for key in ("n_centers", error, "fit_time"):
        if any(key not in r for r in rows):
            raise ValueError(f"results: every entry needs {key!r}; got keys {sorted(rows[0])}")
    m = _as_numpy([r["n_centers"] for r in rows], "n_centers")
    err = _as_numpy([r[error] for r in rows], error)
    seconds = _as_numpy([r["fit_time"] for r in rows], "fit_time")
    if axes is None:
        axes = _pyplot().subplots(1, 2, figsize=(9, 3.5))[1]
    left, right = axes
    left.plot(m, err, "o-")
    left.set_xscale("log")
    left.set_xlabel("number of centers M")
    left.set_ylabel(f"test {error}")
    left.set_title("error against M")
    right.plot(m, seconds, "o-")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("number of centers M")
    right.set_ylabel("fit time (s)")
    right.set_title("time against M")
    return left, right
