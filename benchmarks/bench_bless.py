"""Benchmark: BLESS / BLESS-R vs uniform center selection (selection time, test error vs M).

One command, three parts, every ratio measured in this process:

1. Leverage-score accuracy on a subsample of the real set (n_small points), against the exact
   scores (O(n^3), the reference): R-ACC = l~ / l quantiles as in Fig. 1 of Rudi et al. (2018).
   "uniform" is eq. 3 with as many uniform columns as BLESS-R selected and A = (|J|/n) I.
2. Real set (UCI protein, 45,730 x 9, seeded 80/20 split, standardised): for each M, selection time
   and test MSE of the Nystrom estimator with uniform, bless and bless-r centers (FALKON if the
   ``falkon`` solver is registered, else a dense M x M Nystrom solve through the kernel backend).
3. ``--scale``: the same on n = 1e6 synthetic inputs with strongly nonuniform density.

Usage::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_bless.py [--quick] [--scale]

Writes docs/img/bless_error_vs_m.png and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from kgp_builtins.bless import estimate_leverage_scores  # noqa: E402
from kgp_builtins.oracles import exact_leverage_scores  # noqa: E402

import kgp  # noqa: E402
from kgp.kernels import make_kernel  # noqa: E402
from kgp.plugin import SelectionRequest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "uci"
METHODS = ("uniform", "bless", "bless-r")


def load_protein(dtype: torch.dtype, seed: int = 0):
    path = DATA / "protein.csv.gz"
    if not path.is_file():
        raise SystemExit(f"{path} not found: the real-data part needs ../shared/data next to the checkout")
    with gzip.open(path, "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(raw.shape[0])
    cut = int(0.8 * raw.shape[0])
    tr, te = raw[perm[:cut]], raw[perm[cut:]]
    mu, sd = tr[:, :-1].mean(0), tr[:, :-1].std(0)
    ym, ys = tr[:, -1].mean(), tr[:, -1].std()

    def prep(a):
        return torch.tensor((a[:, :-1] - mu) / sd, dtype=dtype), torch.tensor((a[:, -1] - ym) / ys, dtype=dtype)

    return (*prep(tr), *prep(te))


def synthetic(n: int, n_test: int, dtype: torch.dtype, seed: int = 0, d: int = 5):
    """90% of the inputs in a tight blob (flat target), 10% uniform in a wide box (varying target)."""
    g = torch.Generator().manual_seed(seed)

    def draw(m, frac_dense):
        dense = int(frac_dense * m)
        x = torch.cat([0.15 * torch.randn(dense, d, generator=g), 6 * torch.rand(m - dense, d, generator=g) - 3])
        return x[torch.randperm(m, generator=g)]

    def f(x):
        return torch.sin(1.5 * x[:, 0]) * torch.cos(1.5 * x[:, 1]) + 0.5 * torch.sin(x[:, 2] + x[:, 3])

    X, Xt = draw(n, 0.9), draw(n_test, 0.5)
    y = f(X) + 0.1 * torch.randn(n, generator=g)
    return X.to(dtype), y.to(dtype), Xt.to(dtype), f(Xt).to(dtype)


def select(name: str, X, m: int, kernel, noise: float, seed: int):
    selector = kgp.get_selector(name)
    opts = {"early_stop": True} if name != "uniform" else {}
    req = SelectionRequest(
        X=X,
        n_centers=m,
        kernel=kernel,
        noise=noise,
        generator=torch.Generator().manual_seed(seed),
        options=kgp.resolve_options(f"selector {name!r}", selector, opts),
    )
    t0 = time.perf_counter()
    centers = selector.select(req)
    return centers, time.perf_counter() - t0


def fit_predict(X, y, Xt, centers, kernel, noise: float, use_falkon: bool, maxiter: int):
    t0 = time.perf_counter()
    if use_falkon:
        solver = kgp.get_solver("falkon")
        problem = kgp.Problem(
            X=X,
            y=y.reshape(-1, 1),
            kernel=kernel,
            noise=noise,
            centers=centers,
            options=kgp.resolve_options("solver 'falkon'", solver, maxiter=maxiter),
        )
        pred = solver.fit(problem).predict(Xt)[:, 0]
    else:  # dense Nystrom: (K_nM^T K_nM + noise K_MM) alpha = K_nM^T y, streamed through the backend
        Z = centers.points.double()
        k64 = copy.deepcopy(kernel).double()
        op = kgp.kernel_operator(k64, X.double(), Z)
        m = Z.shape[0]
        with torch.no_grad():
            H = op.fused_matmul(torch.eye(m, dtype=torch.float64))
            H += noise * kgp.kernel_operator(k64, Z).to_dense()
            rhs = op.T @ y.double().reshape(-1, 1)
            alpha = torch.linalg.lstsq(H, rhs, driver="gelsd").solution
            pred = (kgp.kernel_operator(k64, Xt.double(), Z) @ alpha)[:, 0].to(Xt.dtype)
    return pred, time.perf_counter() - t0


def accuracy_table(X, kernel, noise: float, n_small: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    Xs = X[torch.randperm(X.shape[0], generator=g)[:n_small]].double()
    k64 = copy.deepcopy(kernel).double()
    lam = noise / n_small
    t0 = time.perf_counter()
    exact = exact_leverage_scores(Xs, k64, lam)
    rows = [("exact (reference)", time.perf_counter() - t0, 1.0, 1.0, 1.0, n_small, float(exact.sum()))]
    from kgp_builtins.bless import bless, bless_r

    for name, fn in (("bless", bless), ("bless-r", bless_r)):
        t0 = time.perf_counter()
        res = fn(Xs, k64, lam, generator=seed)
        el = time.perf_counter() - t0
        r = (estimate_leverage_scores(Xs, k64, lam, res.indices, res.a) / exact).numpy()
        rows.append((name, el, r.mean(), *np.quantile(r, [0.05, 0.95]), res.indices.numel(), res.d_eff))
    m_uniform = rows[-1][5]  # as many uniform columns as BLESS-R selected
    J = torch.randperm(n_small, generator=g)[:m_uniform]
    est = estimate_leverage_scores(Xs, k64, lam, J, torch.full((m_uniform,), m_uniform / n_small, dtype=torch.float64))
    r = (est / exact).numpy()
    rows.append(
        (f"uniform |J|={m_uniform}", float("nan"), r.mean(), *np.quantile(r, [0.05, 0.95]), m_uniform, float("nan"))
    )
    print(f"\n### Leverage-score accuracy, protein subsample n={n_small}, noise={noise:g} (lambda = noise/n)\n")
    print("| method | time (s) | mean R-ACC | 5th / 95th pct | centers | d_eff estimate |")
    print("|---|---|---|---|---|---|")
    for name, el, mean, q5, q95, m, de in rows:
        print(f"| {name} | {el:.2f} | {mean:.2f} | {q5:.2f} / {q95:.2f} | {m} | {de:.1f} |")
    return rows


def sweep(label, X, y, Xt, yt, kernel, noise, ms, seeds, use_falkon, maxiter):
    results = {name: {m: [] for m in ms} for name in METHODS}
    for m in ms:
        for name in METHODS:
            for seed in seeds:
                centers, t_sel = select(name, X, m, kernel, noise, seed)
                pred, t_fit = fit_predict(X, y, Xt, centers, kernel, noise, use_falkon, maxiter)
                mse = float(((pred - yt) ** 2).mean())
                lam_sel = centers.info.get("lambda_path", [noise / X.shape[0]])[-1]
                results[name][m].append((t_sel, t_fit, mse, lam_sel * X.shape[0]))
            print(f"  [{label}] M={m} {name}: done", flush=True)
    solver = "FALKON" if use_falkon else "dense Nystrom"
    print(f"\n### {label}: n={X.shape[0]}, test n={Xt.shape[0]}, noise={noise:g}, {solver}, seeds={len(seeds)}\n")
    print("| M | method | selection (s) | fit (s) | test MSE (mean +- sd) | MSE / uniform | final lambda_h * n |")
    print("|---|---|---|---|---|---|---|")
    for m in ms:
        base = np.mean([r[2] for r in results["uniform"][m]])
        for name in METHODS:
            rs = results[name][m]
            mse = np.array([r[2] for r in rs])
            print(
                f"| {m} | {name} | {np.mean([r[0] for r in rs]):.2f} | {np.mean([r[1] for r in rs]):.2f} | "
                f"{mse.mean():.4f} +- {mse.std():.4f} | {mse.mean() / base:.2f} | {np.mean([r[3] for r in rs]):.3g} |"
            )
    return results


def plot(all_results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(all_results), figsize=(5.5 * len(all_results), 7), squeeze=False)
    for col, (label, res) in enumerate(all_results.items()):
        for name in METHODS:
            ms = sorted(res[name])
            mse = [np.mean([r[2] for r in res[name][m]]) for m in ms]
            sd = [np.std([r[2] for r in res[name][m]]) for m in ms]
            tsel = [np.mean([r[0] for r in res[name][m]]) for m in ms]
            axes[0, col].errorbar(ms, mse, yerr=sd, marker="o", label=name, capsize=3)
            axes[1, col].plot(ms, tsel, marker="o", label=name)
        axes[0, col].set(xscale="log", yscale="log", title=label, ylabel="test MSE")
        axes[1, col].set(xscale="log", yscale="log", xlabel="M (centers)", ylabel="selection time (s)")
        axes[0, col].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer M values and seeds")
    parser.add_argument("--scale", action="store_true", help="also run the n = 1e6 synthetic part")
    parser.add_argument("--only-scale", action="store_true", help="run only the synthetic part (implies --scale)")
    parser.add_argument("--only-accuracy", action="store_true", help="run only the leverage-score accuracy table")
    parser.add_argument("--n-scale", type=int, default=1_000_000)
    parser.add_argument("--noise", type=float, default=0.1, help="sigma^2 (lambda = noise / n)")
    parser.add_argument("--lengthscale", type=float, default=1.0)
    parser.add_argument("--maxiter", type=int, default=20, help="FALKON iterations")
    parser.add_argument("--dense", action="store_true", help="dense Nystrom solve even if FALKON exists")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "bless_error_vs_m.png")
    parser.add_argument(
        "--results",
        type=Path,
        default=Path("/tmp/bench_bless_results.json"),
        help="sweep results are merged into this JSON, so that parts run as separate commands share one plot",
    )
    args = parser.parse_args()

    torch.set_flush_denormal(True)
    use_falkon = not args.dense and "falkon" in kgp.registry.registry.names("solver")
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"solver={'falkon' if use_falkon else 'dense Nystrom'}"
    )
    ms = [100, 300, 1000] if args.quick else [100, 300, 1000, 2000]
    seeds = range(2)
    stored = json.loads(args.results.read_text()) if args.results.is_file() else {}
    if not args.only_scale:
        X, y, Xt, yt = load_protein(torch.float64)
        kernel = make_kernel("rbf", args.lengthscale).to(torch.float64)
        accuracy_table(X, kernel, args.noise, n_small=2000 if args.quick else 5000, seed=0)
        if args.only_accuracy:
            return
        res = sweep("protein", X, y, Xt, yt, kernel, args.noise, ms, seeds, use_falkon, args.maxiter)
        stored["protein (UCI, n=36,584)"] = res
    if args.scale or args.only_scale:
        Xs, ys, Xst, yst = synthetic(args.n_scale, 20_000, torch.float32)
        k32 = make_kernel("rbf", args.lengthscale).to(torch.float32)
        ms_scale = [100, 300, 1000] if args.quick else [250, 500, 1000]
        res = sweep("synthetic", Xs, ys, Xst, yst, k32, args.noise, ms_scale, range(1), use_falkon, args.maxiter)
        stored[f"synthetic nonuniform, n={args.n_scale:,}"] = res
    args.results.write_text(json.dumps(stored))
    plot(
        {label: {name: {int(m): v for m, v in r.items()} for name, r in res.items()} for label, res in stored.items()},
        args.out,
    )


if __name__ == "__main__":
    main()
