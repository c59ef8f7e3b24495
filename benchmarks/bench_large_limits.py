"""What limits the default GP on large data: its centers or its learned hyperparameters?

One command, one table::

    python benchmarks/bench_large_limits.py --n 100000 1000000 --centers 2000 5000 11241

The large-data benchmark's set (``benchmarks/bench_large.py``: :class:`kgp.datasets.PriorDraw`, d = 8, noise
std 0.1, so the Bayes-optimal test RMSE is 0.1), memory-mapped from ``--cache``. For each n and M, FALKON on M
uniform centers:

* ``true``: the generator's own covariance (ARD RBF with its lengthscales, outputscale 1, noise variance
  0.01; inputs and targets as generated), nothing learned: the error of M centers alone;
* ``learned``: the default call with the centers fixed, ``KernelRegressor("rbf", learn="auto",
  n_centers=M)``: the hyperparameters the recipe learns (exact likelihood on 3,000 rows, refined on 5,000).

Where ``learned`` is close to ``true`` the hyperparameters are not the limit; where ``true`` falls with M the
centers are. Reported per line: excess RMSE ``sqrt(RMSE^2 - 0.01)``, NLPD, 95% coverage, fit seconds, and
the learned noise variance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gpytorch  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_large  # noqa: E402

import kgp  # noqa: E402
from kgp.datasets import PriorDraw  # noqa: E402


def true_kernel(draw: PriorDraw) -> gpytorch.kernels.Kernel:
    """The generator's covariance: ARD RBF with its lengthscales, outputscale 1."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=draw.d))
    kernel = kernel.double()
    kernel.base_kernel.lengthscale = torch.as_tensor(draw.lengthscale, dtype=torch.float64).reshape(1, -1)
    kernel.outputscale = 1.0
    return kernel


def fit_one(data: dict, draw: PriorDraw, m: int, hyperparameters: str) -> dict:
    start = time.perf_counter()
    if hyperparameters == "true":
        model = kgp.KernelRegressor(
            true_kernel(draw), noise=draw.noise_std**2, solver="falkon", n_centers=m, random_state=0
        )
    else:
        model = kgp.KernelRegressor("rbf", learn="auto", n_centers=m, random_state=0)
    model.fit(data["X"], data["y"])
    seconds = time.perf_counter() - start
    mean, std = model.predict(data["X_test"], return_std=True, include_noise=True)
    return {
        **bench_large.scores(mean, std, data["y_test"], draw.noise_std),
        "fit_seconds": seconds,
        "noise_learned": float(model.noise_) * float(np.asarray(model._y_train_std).reshape(-1)[0]) ** 2,
        "solver": model.solver_name_,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[100_000])
    parser.add_argument("--centers", type=int, nargs="+", default=[2000, 5000, 11241])
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--n-test", type=int, default=10_000)
    parser.add_argument("--hyperparameters", nargs="+", choices=("true", "learned"), default=["true", "learned"])
    parser.add_argument("--cache", type=Path, default=HERE / "output" / "large_data")
    parser.add_argument("--jsonl", type=Path, default=HERE / "bench_large_limits_runs.jsonl")
    args = parser.parse_args(argv)
    draw = PriorDraw(args.d, seed=0, noise_std=0.1)
    print(f"host: {bench_large.cpu_model()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    lines = [
        "| n | M | hyperparameters | excess | NLPD | cov. 95% | fit s | noise variance | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for n in args.n:
        data = bench_large.cached_data(args.cache, n, args.d, args.n_test, 0, draw.noise_std)
        for m in args.centers:
            for hyper in args.hyperparameters:
                load = os.getloadavg()[0]
                r = {"n": n, "M": m, "hyperparameters": hyper, "load": load, **fit_one(data, draw, m, hyper)}
                rows.append(r)
                lines.append(
                    f"| {n:,} | {m:,} | {hyper} | {r['excess']:.4f} | {r['nlpd']:.3f} | {r['coverage']:.3f} | "
                    f"{r['fit_seconds']:.1f} | {r['noise_learned']:.5f} | {load:.1f} |"
                )
                print(lines[-1], flush=True)
                with Path(args.jsonl).open("a") as fh:
                    fh.write(json.dumps(r) + "\n")
    text = "\n".join(lines)
    print(text)
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()
