"""EigenPro 4 (`eigenpro4`) vs EigenPro 3.0 (`eigenpro`) in kgp at the same centers: accuracy and time.

One-vs-all classification ({-1, +1} targets, argmax) on ../shared/data/letter.npz (26 classes, seeded
80/20 split, z-scored) and mnist_5k.npz (10 classes, 80/20, pixels / 255), Laplacian kernel, M uniform
training points as centers, the same centers, kernel, noise and epochs for both solvers, run back to back
in one process. Prints one markdown table (accuracy, fit time, the time ratio) and the host's load.

Usage::

    env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_eigenpro4.py [--quick] [--epochs E] [--centers M ...]

``--quick``: letter only, M = 1000.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SEED = 0
#: the lengthscales of benchmarks/bench_eigenpro.py (picked once for these inputs)
LENGTHSCALE = {"letter": 4.0, "mnist_5k": 10.0}
NOISE = 1e-3


def load(name):
    z = np.load(DATA / f"{name}.npz")
    X, y = z["X"].astype(np.float32), z["y"]
    if name == "mnist_5k":
        X = X / 255.0
    perm = np.random.default_rng(SEED).permutation(X.shape[0])
    k = int(0.8 * X.shape[0])
    Xtr, ytr, Xte, yte = X[perm[:k]], y[perm[:k]], X[perm[k:]], y[perm[k:]]
    if name == "letter":
        mu, sd = Xtr.mean(0), Xtr.std(0)
        Xtr, Xte = (Xtr - mu) / sd, (Xte - mu) / sd
    return Xtr, ytr, Xte, yte


def fit(solver, name, Z, Xtr, ytr, Xte, yte, epochs, options=None):
    t0 = time.perf_counter()
    clf = kgp.KernelClassifier(
        "laplacian",
        lengthscale=LENGTHSCALE[name],
        noise=NOISE,
        solver=solver,
        centers=Z,
        solver_options={"epochs": epochs, **(options or {})},
        random_state=SEED,
    ).fit(Xtr, ytr)
    return clf.score(Xte, yte), time.perf_counter() - t0, clf.history_[-1].extras


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--centers", type=int, nargs="*", default=None)
    args = ap.parse_args()
    sets = ["letter"] if args.quick else ["letter", "mnist_5k"]
    centers = args.centers or ([1000] if args.quick else [1000, 4000])
    print(
        f"host: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.2f} (start); epochs {args.epochs}"
    )
    print("| data | M | eigenpro acc | eigenpro s | eigenpro4 acc | eigenpro4 s | time ratio | eigenpro4 batch / T |")
    print("|---|---|---|---|---|---|---|---|")
    for name in sets:
        Xtr, ytr, Xte, yte = load(name)
        n = Xtr.shape[0]
        for M in centers:
            M = min(M, n)
            idx = torch.randperm(n, generator=torch.Generator().manual_seed(SEED))[:M]
            Z = torch.as_tensor(Xtr[idx.numpy()])
            acc3, t3, _ = fit("eigenpro", name, Z, Xtr, ytr, Xte, yte, args.epochs)
            acc4, t4, ex = fit("eigenpro4", name, Z, Xtr, ytr, Xte, yte, args.epochs)
            print(
                f"| {name} | {M} | {100 * acc3:.2f} | {t3:.1f} | {100 * acc4:.2f} | {t4:.1f} | {t3 / t4:.2f}x | "
                f"{ex['batch_size']} / {ex['projection_period']} |",
                flush=True,
            )
    print(f"load {os.getloadavg()[0]:.2f} (end)")


if __name__ == "__main__":
    main()
