"""EigenPro 4 (`eigenpro4`) vs EigenPro 3.0 (`eigenpro`) in kgp at the same centers: accuracy and time.

One-vs-all classification ({-1, +1} targets, argmax) on ../shared/data/letter.npz (26 classes, seeded
80/20 split, z-scored) and mnist_5k.npz (10 classes, 80/20, pixels / 255), Laplacian kernel, M uniform
training points as centers, the same centers, kernel, noise and epochs for both solvers, run back to back
in one process. Prints one markdown table (accuracy, fit time, the time ratio) and the host's load.

Usage::

    env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_eigenpro4.py [--quick] [--epochs E] [--centers M ...]
    env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_eigenpro4.py --centers 4000 --periods 2x 16 --repeats 3

``--quick``: letter only, M = 1000.

``--periods SPEC ...``: only ``eigenpro4``, once per projection period, with the default options otherwise
(the default period ``T = M // m`` first, whatever is listed): ``default``, an integer T, or ``Nx``
(``T = N M // m``, N times as many temporary centers per period as the default). Prints one table with
accuracy, fit seconds, CPU seconds and the number of projections per period; ``--repeats R`` fits each
R times with seeds 0 .. R-1 (its batch order and subsamples; the same centers).

``--inexact``: also ``eigenpro4`` with ``projection="eigenpro2"`` (the paper's inexact projection by inner EigenPro
2.0 epochs; the default ``"auto"`` takes the exact Cholesky projection wherever its factor fits the memory
budget, as at these M), right after the default fit, for the paired ratio.

``--reference PATH``: also run the EigenPro 4 reference code (``ep4_reference.py``: the package directory
``eigenpro/`` under PATH; nothing of it is committed) in the same process, right after kgp's fits, with the same
centers, kernel (its ``laplacian`` with bandwidth = kgp's lengthscale), epochs (``--reference-epochs``: its own)
and float32; its own settings otherwise (one-hot {0, 1} targets, no ridge term, the example's s = 2,000 / q = 100
preconditioners). Its time includes its own per-epoch test evaluation.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep4_reference  # noqa: E402

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


def problems(sets, centers):
    """Each (data set, M) of a table: ``(name, M, Z, (Xtr, ytr, Xte, yte))`` with M uniform training rows as
    the centers every solver shares (M capped at n)."""
    for name in sets:
        data = load(name)
        n = data[0].shape[0]
        for M in centers:
            M = min(M, n)
            idx = torch.randperm(n, generator=torch.Generator().manual_seed(SEED))[:M]
            yield name, M, torch.as_tensor(data[0][idx.numpy()]), data


def fit(solver, name, Z, Xtr, ytr, Xte, yte, epochs, options=None, seed=SEED):
    t0, cpu0 = time.perf_counter(), time.process_time()
    clf = kgp.KernelClassifier(
        "laplacian",
        lengthscale=LENGTHSCALE[name],
        noise=NOISE,
        solver=solver,
        centers=Z,
        solver_options={"epochs": epochs, **(options or {})},
        random_state=seed,
    ).fit(Xtr, ytr)
    extras = dict(clf.history_[-1].extras)
    extras["cpu_seconds"] = time.process_time() - cpu0
    # eigenpro4's whole-fit split (its extras are per epoch)
    for key in ("time_steps", "time_projection"):
        if key in extras:
            extras[key] = sum(h.extras[key] for h in clf.history_)
    return clf.score(Xte, yte), time.perf_counter() - t0, extras


def run_reference(path, name, Z, Xtr, ytr, Xte, yte, epochs):
    """Fit the reference code (:mod:`ep4_reference`, its ``laplacian`` at kgp's lengthscale, one-hot {0, 1}
    targets, no ridge term); returns (accuracy, seconds)."""
    classes = np.unique(ytr)
    X, x = torch.as_tensor(Xtr), torch.as_tensor(Xte)
    Y = torch.as_tensor((ytr[:, None] == classes[None, :]).astype(np.float32))
    yt = torch.as_tensor((yte[:, None] == classes[None, :]).astype(np.float32))
    kernel_fn = ep4_reference.kernel(path, "laplacian", LENGTHSCALE[name])
    predict, seconds = ep4_reference.fit_reference(path, kernel_fn, Z, X, Y, x, yt, epochs, seed=SEED)
    pred = predict(x).argmax(1).numpy()
    return float((classes[pred] == yte).mean()), seconds


def period_table(sets, centers, epochs, specs, repeats):
    """``eigenpro4`` per projection period (``--periods``, see the module docstring); prints one table."""
    specs = ["default"] + [p for p in specs if p != "default"]
    print(
        "| data | M | period | batch / T per seed | accuracy, mean (per seed) | projections | fit s (mean) "
        "| CPU s (mean) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, M, Z, (Xtr, ytr, Xte, yte) in problems(sets, centers):
        rows = {spec: {"acc": [], "s": [], "cpu": [], "T": [], "proj": [], "m": []} for spec in specs}
        for seed in range(repeats):
            batch = None  # the default's batch for this seed (its subsample sets the curvature)
            for spec in specs:
                options = {}
                if spec != "default":
                    factor = int(spec[:-1]) if spec.endswith("x") else None
                    options["projection_period"] = max(1, factor * M // batch) if factor else int(spec)
                acc, seconds, ex = fit("eigenpro4", name, Z, Xtr, ytr, Xte, yte, epochs, options, seed=seed)
                batch = batch or ex["batch_size"]
                row = rows[spec]
                row["acc"].append(100 * acc)
                row["s"].append(seconds)
                row["cpu"].append(ex["cpu_seconds"])
                row["T"].append(ex["projection_period"])
                row["proj"].append(ex["projections"])
                row["m"].append(ex["batch_size"])
        for spec, row in rows.items():
            print(
                f"| {name} | {M} | {spec} | {'/'.join(map(str, row['m']))} / {'/'.join(map(str, row['T']))} | "
                f"{np.mean(row['acc']):.2f} ({', '.join(f'{a:.2f}' for a in row['acc'])}) | "
                f"{'/'.join(map(str, row['proj']))} | {np.mean(row['s']):.1f} | {np.mean(row['cpu']):.1f} |",
                flush=True,
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--centers", type=int, nargs="*", default=None)
    ap.add_argument("--reference", default=None, help="directory holding the reference's eigenpro/ package")
    ap.add_argument("--reference-epochs", type=int, default=None, help="the reference's epochs (default: --epochs)")
    ap.add_argument("--data", nargs="*", choices=sorted(LENGTHSCALE), default=None, help="data sets (default: both)")
    ap.add_argument("--periods", nargs="*", default=None, help="eigenpro4 per period: default, T, or Nx")
    ap.add_argument("--repeats", type=int, default=1, help="seeds per fit with --periods")
    ap.add_argument("--inexact", action="store_true", help="also eigenpro4 with projection='eigenpro2'")
    args = ap.parse_args()
    sets = args.data or (["letter"] if args.quick else ["letter", "mnist_5k"])
    centers = args.centers or ([1000] if args.quick else [1000, 4000])
    print(
        f"host: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.2f} (start); epochs {args.epochs}"
    )
    if args.periods is not None:
        period_table(sets, centers, args.epochs, args.periods, args.repeats)
        print(f"load {os.getloadavg()[0]:.2f} (end)")
        return
    ref = ep4_reference.available(args.reference)
    extra = " eigenpro4 inexact acc | eigenpro4 inexact s | inexact s / eigenpro4 s |" if args.inexact else ""
    extra += " reference acc | reference s | reference s / eigenpro4 s |" if ref else ""
    print(
        "| data | M | eigenpro acc | eigenpro s | eigenpro4 acc | eigenpro4 s | eigenpro s / eigenpro4 s |"
        " eigenpro4 projection / batch / T |" + extra
    )
    print("|---" * (8 + (3 if ref else 0) + (3 if args.inexact else 0)) + "|")
    splits = []
    for name, M, Z, (Xtr, ytr, Xte, yte) in problems(sets, centers):
        acc3, t3, _ = fit("eigenpro", name, Z, Xtr, ytr, Xte, yte, args.epochs)
        acc4, t4, ex = fit("eigenpro4", name, Z, Xtr, ytr, Xte, yte, args.epochs)
        row = (
            f"| {name} | {M} | {100 * acc3:.2f} | {t3:.1f} | {100 * acc4:.2f} | {t4:.1f} | {t3 / t4:.2f}x | "
            f"{ex['projection']} / {ex['batch_size']} / {ex['projection_period']} |"
        )
        if args.inexact:
            acc_i, t_i, ex_i = fit("eigenpro4", name, Z, Xtr, ytr, Xte, yte, args.epochs, {"projection": "eigenpro2"})
            row += f" {100 * acc_i:.2f} | {t_i:.1f} | {t_i / t4:.2f}x |"
            splits.append(
                f"| {name} (inexact) | {M} | {ex_i['setup_time']:.1f} | {ex_i['time_steps']:.1f} | "
                f"{ex_i['time_projection']:.1f} | {ex_i['projections']} | {ex_i['memory_estimate'] / 2**20:.1f} |"
            )
        if ref is not None:
            accr, tr = run_reference(ref, name, Z, Xtr, ytr, Xte, yte, args.reference_epochs or args.epochs)
            row += f" {100 * accr:.2f} | {tr:.1f} | {tr / t4:.2f}x |"
        splits.append(
            f"| {name} | {M} | {ex['setup_time']:.1f} | {ex['time_steps']:.1f} | {ex['time_projection']:.1f} | "
            f"{ex['projections']} | {ex['memory_estimate'] / 2**20:.1f} |"
        )
        print(row, flush=True)
    print("\neigenpro4's time: setup (preconditioner, curvature, projection setup), steps, projections (the solves")
    print("and the residuals); the memory estimate it logged")
    print("| data | M | setup s | steps s | projections s | projections | memory estimate MiB |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(splits))
    print(f"load {os.getloadavg()[0]:.2f} (end)")


if __name__ == "__main__":
    main()
