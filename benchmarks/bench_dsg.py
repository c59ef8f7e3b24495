"""Benchmark: doubly stochastic gradients (``dsg``) vs FALKON vs fixed random-feature ridge regression.

Data: UCI protein (../shared/data/uci/protein.csv.gz), standardised with training statistics, a
seeded train/test split. Kernel: RBF, lengthscale 1 on standardised inputs, noise sigma^2 = 0.3
(so ``nu = lambda = sigma^2 / n``).

Reported, all in one process:

- ``dsg``: test RMSE after every pass vs wall time (validation time excluded) and vs the number of
  random features so far (t r); the model's memory (its coefficients: t r numbers and one seed);
- ``falkon`` (if installed): test RMSE and fit time for several numbers of centers M;
- fixed random-feature ridge regression with D features (closed form, computed here:
  ``(Phi^T Phi + sigma^2 I) w = Phi^T y``, Phi from the same spectral sampler), for several D.

Writes a table to stdout and a PNG (``--png``, default docs/img/dsg_protein.png). ``--quick`` runs a
smaller version (n_train 4,000, fewer settings).

Run it alone (the machine has 2 cores)::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dsg.py
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402
from kgp.monitor import Monitor  # noqa: E402
from kgp.options import resolve_options  # noqa: E402
from kgp.plugin import Problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


class _Timed(Monitor):
    """A monitor whose reported times leave out the time spent computing the validation metric."""

    def __init__(self, validation):
        super().__init__(validation=validation)
        self.excluded = 0.0
        self.points: list[tuple[float, int, float]] = []

    def step(self, iteration, predictor=None, **extras):
        t = time.perf_counter()
        stop = super().step(iteration, predictor, **extras)
        spent = time.perf_counter() - t
        info = self.history[-1]
        self.excluded += spent
        self.points.append((info.elapsed - self.excluded, int(extras.get("n_features", 0)), math.sqrt(info.metric)))
        return stop


def load(n_train: int, n_test: int, seed: int = 0):
    with gzip.open(SHARED / "uci" / "protein.csv.gz", "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    perm = np.random.default_rng(seed).permutation(raw.shape[0])
    raw = raw[perm[: n_train + n_test]]
    X, y = raw[:, :-1], raw[:, -1]
    mu, sd = X[:n_train].mean(0), X[:n_train].std(0)
    X = (X - mu) / np.where(sd > 0, sd, 1.0)
    y = (y - y[:n_train].mean()) / y[:n_train].std()
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    return t(X[:n_train]), t(y[:n_train]), t(X[n_train:]), t(y[n_train:])


def rmse(pred, y) -> float:
    return float((pred.reshape(-1) - y).square().mean().sqrt())


def run_dsg(X, y, Xt, yt, kernel, noise, options):
    solver = kgp.get_solver("dsg")
    monitor = _Timed((Xt, yt[:, None]))
    problem = Problem(
        X=X,
        y=y[:, None],
        kernel=kernel,
        noise=noise,
        options=resolve_options("solver 'dsg'", solver, options),
        generator=torch.Generator().manual_seed(1),
        monitor=monitor,
    )
    start = time.perf_counter()
    pred = solver.fit(problem)
    wall = time.perf_counter() - start - monitor.excluded
    return pred, monitor.points, wall


def run_rf_ridge(X, y, Xt, yt, kernel, noise, D, seed=0):
    """Closed-form ridge on D fixed random features: (Phi^T Phi + sigma^2 I) w = Phi^T y."""
    from kgp_builtins.dsg import RandomFeatureMap

    start = time.perf_counter()
    fmap = RandomFeatureMap(kernel, seed, D, 1)
    A = torch.zeros(D, D, dtype=X.dtype)
    b = torch.zeros(D, 1, dtype=X.dtype)
    rows = max(1, 2**22 // D)
    for i in range(0, X.shape[0], rows):
        Phi = fmap.features(X[i : i + rows])
        A.addmm_(Phi.T, Phi)
        b.addmm_(Phi.T, y[i : i + rows, None])
    A.diagonal().add_(noise)
    w = torch.cholesky_solve(b, torch.linalg.cholesky(A))
    pred = torch.cat([fmap.features(Xt[i : i + rows]) @ w for i in range(0, Xt.shape[0], rows)])
    wall = time.perf_counter() - start
    # a fixed-feature model must keep omega (D x d) and b (D), or regenerate them from a seed as dsg does
    return rmse(pred, yt), wall, D * 8


def run_falkon(X, y, Xt, yt, kernel, noise, M):
    start = time.perf_counter()
    model = kgp.KernelRegressor(kernel, noise=noise, solver="falkon", n_centers=M, random_state=0).fit(X, y)
    wall = time.perf_counter() - start
    return rmse(model.predict(Xt), yt), wall, M * (X.shape[1] + 1) * 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small version (n_train 4,000)")
    ap.add_argument("--n-train", type=int, default=None)
    ap.add_argument("--n-test", type=int, default=None)
    ap.add_argument("--passes", type=int, default=None)
    ap.add_argument("--png", default=str(ROOT / "docs" / "img" / "dsg_protein.png"))
    args = ap.parse_args()
    n_train = args.n_train or (4000 if args.quick else 20000)
    n_test = args.n_test or (1000 if args.quick else 2000)
    passes = args.passes or (4 if args.quick else 8)
    torch.set_flush_denormal(True)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}; float64; protein n_train={n_train} n_test={n_test}"
    )
    X, y, Xt, yt = load(n_train, n_test)
    noise = 0.3
    kernel = kgp.kernels.make_kernel("rbf", 1.0).to(torch.float64)
    print(f"kernel RBF l=1, sigma^2={noise} (nu = lambda = {noise / n_train:.2e}); std(y_test)={float(yt.std()):.3f}")

    # warm-up (first-call allocations and library loading are not part of any method's time)
    run_dsg(X[:500], y[:500], Xt[:50], yt[:50], kernel, noise, dict(passes=1, seed=0))
    run_rf_ridge(X[:500], y[:500], Xt[:50], yt[:50], kernel, noise, 100)
    if "falkon" in kgp.registry.registry.names("solver"):
        run_falkon(X[:500], y[:500], Xt[:50], yt[:50], kernel, noise, 100)

    rows = []
    dsg_runs = {}
    configs = [(256, 64), (64, 256)]
    for m, r in configs:
        opts = dict(passes=passes, batch_size=m, features_per_step=r, seed=0, update="gradient")
        pred, points, wall = run_dsg(X, y, Xt, yt, kernel, noise, opts)
        label = f"dsg m={m} r={r}"
        dsg_runs[label] = points
        rows.append((label, f"{passes} passes", points[-1][1], points[-1][2], wall, pred.nbytes))
        print(
            f"  {label}: per pass (s, features, rmse): " + ", ".join(f"({t:.1f}, {f}, {e:.4f})" for t, f, e in points)
        )

    rf_D = [500, 1000, 2000, 4000] if args.quick else [1000, 2000, 4000, 8000]
    rf = []
    for D in rf_D:
        e, wall, mem = run_rf_ridge(X, y, Xt, yt, kernel, noise, D)
        rf.append((D, wall, e))
        rows.append(("RF ridge", f"D={D}", D, e, wall, mem))

    falkon = []
    if "falkon" in kgp.registry.registry.names("solver"):
        for M in [250, 500, 1000, 2000] if args.quick else [500, 1000, 2000, 4000]:
            e, wall, mem = run_falkon(X, y, Xt, yt, kernel, noise, M)
            falkon.append((M, wall, e))
            rows.append(("falkon", f"M={M}", M, e, wall, mem))
    else:
        print("  solver 'falkon' is not installed: skipped")

    ref = min(e for _, _, e in falkon) if falkon else min(e for _, _, e in rf)
    ref_name = "best falkon" if falkon else "best RF ridge"
    print()
    print(f"| method | setting | features / centers | test RMSE | RMSE / {ref_name} | fit time (s) | model memory |")
    print("|---|---|---|---|---|---|---|")
    for name, setting, feats, e, wall, mem in rows:
        print(f"| {name} | {setting} | {feats:,} | {e:.4f} | {e / ref:.3f} | {wall:.1f} | {mem / 1024:.0f} KiB |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in dsg_runs.items():
        t, f, e = zip(*points)
        axes[0].plot(t, e, "o-", label=label)
        axes[1].plot(f, e, "o-", label=label)
    for data, label, marker in ((rf, "RF ridge (closed form)", "s--"), (falkon, "falkon (M centers)", "^--")):
        if data:
            k, t, e = zip(*data)
            axes[0].plot(t, e, marker, label=label)
            axes[1].plot(k, e, marker, label=label)
    axes[0].set_xlabel("wall time (s)")
    axes[1].set_xlabel("random features (dsg: t r; RF: D) / centers (falkon: M)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_ylabel("test RMSE (standardised)")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"UCI protein, n_train={n_train}, RBF l=1, sigma^2={noise} (2-core shared machine)")
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
