"""EigenPro 3.0 (`eigenpro`) vs FALKON at the same centers: accuracy, time per epoch, convergence.

The EigenPro 3 paper's kind of benchmark, scaled to a 2-core machine:

1. One-vs-all classification ({-1, +1} targets, argmax) on ../shared/data/letter.npz (26 classes,
   seeded 80/20 split, z-scored) and mnist_5k.npz (10 classes, 80/20, pixels / 255), Laplacian and
   Gaussian kernels, p in (100, 1000, max) uniform training points as centers, the same centers
   for eigenpro and falkon. Reports test accuracy, eigenpro's time per epoch and its per-iteration
   breakdown (gradient K(Z, X_m) g / preconditioner correction / projection K(Z, Z)^{-1} h).
2. Airline regression (airline_nycflights13.npz, n_train = 219,082, z-scored, Gaussian kernel with
   lengthscale 1, lambda = 1e-6, i.e. noise sigma^2 = lambda n), p = 2000 uniform centers: test MSE
   against wall time for eigenpro (last iterate and tail-averaged) and falkon (CG iterations).
3. A convergence figure: docs/img/eigenpro_convergence.png.

If no solver "falkon" is registered, its columns are skipped with a note. Everything runs in one
process (ratios are measured in the same run); the machine is shared, so absolute times are noisy.

Usage::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_eigenpro.py [--quick]

``--quick``: letter and airline only, fewer epochs, p in (100, 1000).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
SEED = 0

# Lengthscales picked once for standardised letter (d = 16) and [0, 1]-scaled MNIST (d = 784,
# typical pairwise distance ~10); the same kernel and noise go to both solvers.
KERNELS = {
    "letter": {"laplacian": 4.0, "rbf": 2.0},
    "mnist_5k": {"laplacian": 10.0, "rbf": 5.0},
}
NOISE_CLS = 1e-3


def split(X, y, seed=SEED, frac=0.8):
    perm = np.random.default_rng(seed).permutation(X.shape[0])
    k = int(frac * X.shape[0])
    return X[perm[:k]], y[perm[:k]], X[perm[k:]], y[perm[k:]]


def load_cls(name):
    z = np.load(DATA / f"{name}.npz")
    X, y = z["X"].astype(np.float32), z["y"]
    if name == "mnist_5k":
        X = X / 255.0
    Xtr, ytr, Xte, yte = split(X, y)
    if name == "letter":
        mu, sd = Xtr.mean(0), Xtr.std(0)
        Xtr, Xte = (Xtr - mu) / sd, (Xte - mu) / sd
    return Xtr, ytr, Xte, yte


def solver_names():
    return {info.name for info in kgp.list_plugins() if info.kind == "solver"}


def classification(quick: bool, has_falkon: bool, rows: list, curves: dict):
    sets = ["letter"] if quick else ["letter", "mnist_5k"]
    epochs = 3 if quick else 5
    falkon_acc = {}
    for name in sets:
        Xtr, ytr, Xte, yte = load_cls(name)
        n = Xtr.shape[0]
        p_values = [100, 1000] if quick else [100, 1000, min(n, 4000)]
        variants = [(kname, ls, p, "projected") for kname, ls in KERNELS[name].items() for p in p_values]
        if name == "letter":
            variants += [(kname, ls, 1000, "paper") for kname, ls in KERNELS[name].items()]
        for kname, ls, p, correction in variants:
            idx = torch.randperm(n, generator=torch.Generator().manual_seed(SEED))[:p]
            Z = torch.as_tensor(Xtr[idx.numpy()])
            errs = []

            def record(info, errs=errs):
                errs.append((info.iteration, info.elapsed, info.metric))

            t0 = time.perf_counter()
            clf = kgp.KernelClassifier(
                kname,
                lengthscale=ls,
                noise=NOISE_CLS,
                solver="eigenpro",
                centers=Z,
                solver_options={"epochs": epochs, "correction": correction},
                random_state=SEED,
                callback=record,
            ).fit(Xtr, ytr, validation_data=(Xte, yte) if (name == "letter" and p == 1000) else None)
            t_ep = time.perf_counter() - t0
            acc_ep = clf.score(Xte, yte)
            h = clf.history_
            ex = h[-1].extras
            steps = sum(int(np.ceil(n / e.extras["batch_size"])) for e in h)
            # solver work per epoch (gradient + correction + projection), validation excluded
            per_epoch = sum(
                e.extras["time_gradient"] + e.extras["time_correction"] + e.extras["time_projection"] for e in h
            ) / len(h)
            grad = sum(e.extras["time_gradient"] for e in h) / steps * 1e3
            corr = sum(e.extras["time_correction"] for e in h) / steps * 1e3
            proj = sum(e.extras["time_projection"] for e in h) / steps * 1e3
            if name == "letter" and p == 1000:
                curves[f"letter {kname} p=1000 eigenpro ({correction})"] = [(i, m) for i, _, m in errs]
            row = {
                "data": name,
                "kernel": kname + (" (paper order)" if correction == "paper" else ""),
                "p": p,
                "ep_acc": acc_ep,
                "ep_fit": t_ep,
                "ep_setup": ex["setup_time"],
                "ep_epoch": per_epoch,
                "batch": ex["batch_size"],
                "q": ex["q"],
                "ms_grad": grad,
                "ms_corr": corr,
                "ms_proj": proj,
                "proj": ex["projection"],
            }
            if has_falkon and correction == "projected":
                t0 = time.perf_counter()
                fk = kgp.KernelClassifier(
                    kname, lengthscale=ls, noise=NOISE_CLS, solver="falkon", centers=Z, random_state=SEED
                ).fit(Xtr, ytr)
                row["fk_fit"] = time.perf_counter() - t0
                row["fk_acc"] = fk.score(Xte, yte)
                falkon_acc[(name, kname, p)] = (row["fk_acc"], row["fk_fit"])
            elif has_falkon:
                row["fk_acc"], row["fk_fit"] = falkon_acc[(name, kname, p)]
            rows.append(row)
            print(_fmt_row(row, has_falkon), flush=True)


def _fmt_row(r, has_falkon):
    s = (
        f"| {r['data']} | {r['kernel']} | {r['p']} | {100 * r['ep_acc']:.2f} | {r['ep_fit']:.1f} | "
        f"{r['ep_setup']:.1f} | {r['ep_epoch']:.2f} | {r['batch']} | {r['ms_grad']:.1f} / {r['ms_corr']:.1f} / "
        f"{r['ms_proj']:.1f} |"
    )
    if has_falkon:
        s += f" {100 * r['fk_acc']:.2f} | {r['fk_fit']:.1f} |"
    else:
        s += " n/a | n/a |"
    return s


def airline(quick: bool, has_falkon: bool, curves: dict):
    z = np.load(DATA / "airline_nycflights13.npz")
    X, y = z["X"].astype(np.float64), z["y"].astype(np.float64)
    Xtr, ytr, Xte, yte = split(X, y)
    mu, sd = Xtr.mean(0), Xtr.std(0)
    Xtr, Xte = (Xtr - mu) / sd, (Xte - mu) / sd
    ym, ys = ytr.mean(), ytr.std()
    ytr, yte = (ytr - ym) / ys, (yte - ym) / ys
    Xtr, Xte = Xtr.astype(np.float32), Xte.astype(np.float32)
    ytr, yte = ytr.astype(np.float32), yte.astype(np.float32)
    n = Xtr.shape[0]
    noise = 1e-6 * n
    p = 2000
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(SEED))[:p]
    Z = torch.as_tensor(Xtr[idx.numpy()])
    results = []
    epochs = 2 if quick else 4
    # default: tail averaging over the last epochs // 2 epochs; "last iterate" is the paper's output
    runs = [("eigenpro", {"epochs": epochs})]
    if not quick:
        runs.append(("eigenpro last iterate", {"epochs": epochs, "average_epochs": 0}))
    for label, opts in runs:
        trace = []
        t0 = time.perf_counter()
        model = kgp.KernelRegressor(
            "rbf",
            lengthscale=1.0,
            noise=noise,
            solver="eigenpro",
            centers=Z,
            solver_options=opts,
            random_state=SEED,
            callback=lambda info, trace=trace: trace.append((info.elapsed, info.metric)),
        ).fit(Xtr, ytr, validation_data=(Xte, yte))
        total = time.perf_counter() - t0
        mse = float(np.mean((model.predict(Xte) - yte) ** 2))
        h = model.history_
        ex = h[-1].extras
        curves[f"airline {label}"] = trace
        per = sum(e.extras["time_gradient"] + e.extras["time_correction"] + e.extras["time_projection"] for e in h)
        per /= len(h)
        results.append((label, mse, total, ex["setup_time"], per, ex["batch_size"]))
        print(f"airline {label}: test MSE {mse:.4f} fit {total:.1f} s, per epoch {per:.2f} s", flush=True)
    if has_falkon:
        trace = []
        t0 = time.perf_counter()
        model = kgp.KernelRegressor(
            "rbf",
            lengthscale=1.0,
            noise=noise,
            solver="falkon",
            centers=Z,
            solver_options={"maxiter": 10 if quick else 20},
            random_state=SEED,
            callback=lambda info, trace=trace: trace.append((info.elapsed, info.metric)),
        ).fit(Xtr, ytr, validation_data=(Xte, yte))
        total = time.perf_counter() - t0
        mse = float(np.mean((model.predict(Xte) - yte) ** 2))
        curves["airline falkon"] = trace
        results.append(("falkon", mse, total, float("nan"), total / max(1, len(model.history_)), None))
        print(f"airline falkon: test MSE {mse:.4f} fit {total:.1f} s", flush=True)
    return results


def plot(curves: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for label, trace in curves.items():
        if label.startswith("airline") and trace:
            t, m = zip(*[(a, b) for a, b in trace if b is not None])
            ax.plot(t, m, marker="o", label=label.replace("airline ", ""))
    ax.set_xlabel("wall time of fit (s, setup included)")
    ax.set_ylabel("test MSE (standardised)")
    ax.set_title("airline, n=219k, Gaussian, p=2000")
    ax.legend()
    ax = axes[1]
    for label, trace in curves.items():
        if label.startswith("letter") and trace:
            it, m = zip(*[(a, b) for a, b in trace if b is not None])
            ax.plot(it, [100 * v for v in m], marker="o", label=label.replace("letter ", ""))
    ax.set_xlabel("epoch")
    ax.set_ylabel("test error (%)")
    ax.set_title("letter, 26 classes, p=1000")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="letter + airline only, fewer epochs")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    has_falkon = "falkon" in solver_names()
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}"
    )
    if not has_falkon:
        print("note: solver 'falkon' is not registered; its columns are skipped")
    rows, curves = [], {}
    print(
        "| data | kernel | p | eigenpro acc % | fit s | setup s | s / epoch | batch m | ms per iteration: "
        "gradient / correction / projection | falkon acc % | falkon fit s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    classification(args.quick, has_falkon, rows, curves)
    res = airline(args.quick, has_falkon, curves)
    print("\n| airline (p = 2000) | test MSE | fit s | setup s | s / epoch or iteration | batch |")
    print("|---|---|---|---|---|---|")
    for label, mse, total, setup, per, batch in res:
        print(f"| {label} | {mse:.4f} | {total:.1f} | {setup:.1f} | {per:.2f} | {batch if batch else '-'} |")
    if not args.no_plot:
        plot(curves, DOCS_IMG / "eigenpro_convergence.png")


if __name__ == "__main__":
    main()
