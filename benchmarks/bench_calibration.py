"""How well a saved GP's predictive std is calibrated, on many fresh test rows of the data it was fitted to.

One command, one table::

    python benchmarks/bench_calibration.py /tmp/models/kgp_n10000000_d8_s0.kgp --d 8 --rows 100000

The model is a file written by ``benchmarks/bench_large.py --save`` (``kgp.load``), fitted to
``kgp.datasets.PriorDraw(d, seed, noise_std)``; the test rows are rows ``0 .. rows - 1`` of that generator's test
split (the benchmark scores the first ``--n-test``, 10,000, of them), so the interval coverage is estimated with
a standard error of ``sqrt(p (1 - p) / rows)`` instead of the benchmark's. Predictions with
``return_std=True, include_noise=True`` in blocks of 10,000 rows. Columns: coverage of the central 68 / 95 / 99 %
intervals on all rows and on the first 10,000, ``E[z^2]`` of the standardised residuals ``z = (y - mean) / std``
(1 for a calibrated std), NLPD, and the 95 % coverage after scaling the std by ``sqrt(E[z^2])`` (the
calibration a single variance factor would give).

``--train X.npy Y.npy`` (the model's training rows, e.g. ``bench_large.py``'s cache): first measure the
variance's factor on them as a fit ends (:mod:`kgp.variance.calibration`: the fixed draw of
``CALIBRATION_ROWS`` of the n rows, ``NystromVariance.calibrate``), for a model saved before that step, and
score the std both with the formula (factor 1) and with the measured factor.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402
from kgp.datasets import PriorDraw  # noqa: E402
from kgp.variance.calibration import calibration_subset  # noqa: E402

#: two-sided standard normal quantiles of the intervals scored
QUANTILES = {"68%": 0.994458, "95%": 1.959964, "99%": 2.575829}
BLOCK = 10_000


def scores(y: np.ndarray, mean: np.ndarray, std: np.ndarray) -> dict[str, float]:
    """Coverage of each interval, ``E[z^2]``, NLPD and the 95 % coverage of the rescaled std."""
    z = (y - mean) / std
    out = {name: float(np.mean(np.abs(z) <= q)) for name, q in QUANTILES.items()}
    out["E[z^2]"] = float(np.mean(z**2))
    out["nlpd"] = float(np.mean(0.5 * np.log(2 * math.pi * std**2) + 0.5 * z**2))
    out["95% rescaled"] = float(np.mean(np.abs(z) <= QUANTILES["95%"] * math.sqrt(out["E[z^2]"])))
    out["rmse"] = float(np.sqrt(np.mean((y - mean) ** 2)))
    return out


def predict_blocks(model, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std with noise of the rows of ``X``, predicted in blocks of ``BLOCK`` rows."""
    means, stds = [], []
    for start in range(0, X.shape[0], BLOCK):
        m, s = model.predict(X[start : start + BLOCK], return_std=True, include_noise=True)
        means.append(np.asarray(m, dtype=np.float64).ravel())
        stds.append(np.asarray(s, dtype=np.float64).ravel())
    return np.concatenate(means), np.concatenate(stds)


def measure_factor(model, x_path: Path, y_path: Path) -> float:
    """The variance's factor measured on the model's training rows (memory-mapped ``.npy``), as a fit ends."""
    X_train, y_train = np.load(x_path, mmap_mode="r"), np.load(y_path, mmap_mode="r")
    if X_train.ndim != 2 or y_train.shape[0] != X_train.shape[0]:
        raise SystemExit(f"--train: expected an n x d X and n targets, got {X_train.shape} and {y_train.shape}")
    posterior = model.posterior_
    chosen = calibration_subset(X_train.shape[0]).numpy()
    X, y = np.asarray(X_train[chosen]), np.asarray(y_train[chosen], dtype=np.float64).reshape(len(chosen), -1)
    scale = posterior.scaling.std.detach().cpu().numpy().astype(np.float64)
    mean = np.asarray(model.predict(X), dtype=np.float64).reshape(len(chosen), -1)
    residual_square = torch.from_numpy((((y - mean) / scale) ** 2).mean(1))
    inputs = posterior.inputs(torch.as_tensor(X, dtype=posterior.offset.dtype))
    return posterior.variance.calibrate(inputs, residual_square, X_train.shape[0])


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a model file written by bench_large.py --save")
    ap.add_argument("--d", type=int, required=True, help="the generator's input dimension")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise-std", type=float, default=0.1)
    ap.add_argument("--rows", type=int, default=100_000, help="test rows scored")
    ap.add_argument("--train", type=Path, nargs=2, metavar=("X_NPY", "Y_NPY"), help="measure the factor on these rows")
    args = ap.parse_args(argv)
    if args.rows < 1:
        raise SystemExit(f"--rows: expected a positive integer, got {args.rows}")
    t0 = time.perf_counter()
    model = kgp.load(args.model)
    variance = model.posterior_.variance
    factors = {"": getattr(variance, "calibration", 1.0)}
    if args.train is not None:
        factors = {"formula, ": 1.0, f"factor {measure_factor(model, *args.train):.4f}, ": variance.calibration}
    X, y = PriorDraw(args.d, seed=args.seed, noise_std=args.noise_std).sample(args.rows, split="test")
    results = {}
    for label, factor in factors.items():
        if hasattr(variance, "calibration"):
            variance.calibration = factor
        mean, std = predict_blocks(model, X)
        results[f"{label}all {args.rows:,} rows"] = scores(y, mean, std)
        if args.rows > BLOCK:
            results[f"{label}first {BLOCK:,} rows"] = scores(y[:BLOCK], mean[:BLOCK], std[:BLOCK])
    print(
        f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}; model {args.model.name}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print("| rows | RMSE | coverage 68% | 95% | 99% | E[z^2] | NLPD | 95% with std x sqrt(E[z^2]) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        se = math.sqrt(r["95%"] * (1 - r["95%"]) / (args.rows if "all " in name else BLOCK))
        print(
            f"| {name} | {r['rmse']:.4f} | {r['68%']:.4f} | {r['95%']:.4f} (se {se:.4f}) | {r['99%']:.4f} | "
            f"{r['E[z^2]']:.4f} | {r['nlpd']:.4f} | {r['95% rescaled']:.4f} |"
        )
    return results


if __name__ == "__main__":
    main()
