"""torch threads on a busy host: learning and FALKON with 1 thread against torch's default, beside competitors.

One command: ``python benchmarks/bench_threads.py [--competitors 0 1 2] [--repeats 3]``.

For each number of competing processes (each a pure-Python busy loop holding one core, the way
another user's job does), the same seeded work runs with ``torch.set_num_threads(1)`` and with
torch's default, alternating, in this one process; the table gives the median times and their ratio.
Workloads: ``learn="sgpr"`` (10 Adam steps, M = 500) and a FALKON solve (M = 1,000, 20 CG iterations)
on n = 20,000 synthetic rows, d = 8, float64. Run it with ``OMP_WAIT_POLICY`` unset and with
``OMP_WAIT_POLICY=PASSIVE`` to see both behaviours of torch's OpenMP threads (8.7 vs 2.6 s a
learning step on a loaded 2-core host). Figures: docs/guarantees.md, "Threads".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import warnings

import numpy as np
import torch

import kgp


def _busy(stop) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


def _data(n=20_000, d=8, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    y = np.sin(X @ np.linspace(1.0, 0.3, d)) + 0.1 * rng.standard_normal(n)
    return X, y


WORKLOADS = {
    "sgpr learning (10 Adam steps, M=500)": dict(
        lengthscale=2.0,
        noise=0.1,
        solver="falkon",
        n_centers=500,
        learn="sgpr",
        learn_options={"iterations": 10},
        solver_options={"maxiter": 1},
        random_state=0,
    ),
    "FALKON (M=1000, 20 CG iterations)": dict(
        lengthscale=2.0,
        noise=0.1,
        solver="falkon",
        n_centers=1000,
        solver_options={"maxiter": 20, "tol": 0.0},
        random_state=0,
    ),
}


def _time(params, X, y, threads) -> float:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kgp.ConvergenceWarning)  # the learning workload stops FALKON at once
        kgp.KernelRegressor("rbf", **params).fit(X, y)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--competitors", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    X, y = _data()
    print(
        f"torch {torch.__version__}, default threads {default_threads}, cores {os.cpu_count()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load {os.getloadavg()[0]:.2f}"
    )
    many_label = f"{default_threads} threads (s)"
    print(f"{'competitors':>11}  {'workload':<38}{'1 thread (s)':>13}{many_label:>15}{'ratio':>8}")
    for competitors in args.competitors:
        stop = mp.Event()
        procs = [mp.Process(target=_busy, args=(stop,), daemon=True) for _ in range(competitors)]
        for p in procs:
            p.start()
        time.sleep(1.0)
        try:
            for name, params in WORKLOADS.items():
                _time(params, X[:2000], y[:2000], default_threads)  # warm-up
                one, many = [], []
                for _ in range(args.repeats):
                    one.append(_time(params, X, y, 1))
                    many.append(_time(params, X, y, default_threads))
                a, b = statistics.median(one), statistics.median(many)
                print(f"{competitors:>11}  {name:<38}{a:>13.2f}{b:>15.2f}{b / a:>8.2f}", flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join()
        torch.set_num_threads(default_threads)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
