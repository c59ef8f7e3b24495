"""FALKON on the airline data: fit time, time per iteration, test MSE and peak memory.

Setting (the reference FALKON library takes 41.8 s, test MSE 0.737, float32, M = 2000 on a 2-core
machine): ../shared/data/airline_nycflights13.npz, seeded 80/20 split (n_train = 219,082,
d = 8), features and target z-scored with training statistics, Gaussian kernel with lengthscale 1,
lambda = 1e-6 (noise sigma^2 = lambda * n_train), uniform centers, 20 CG iterations.

Each configuration runs in its own subprocess so that its peak RSS (``resource.getrusage``) is its
own; the baseline RSS after loading torch and the data is printed next to it. The direct Nystrom
solution (dense float64 solve of ``(K_nM^T K_nM + lambda n K_MM) alpha = K_nM^T y``, K_nM^T K_nM
accumulated over the backend's row blocks) gives the reference test MSE at each M. One fused kernel
pass ``K_nM^T (K_nM v)`` is timed alone, so the share of the backend in each iteration is visible.

Usage::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_falkon.py [--quick] [--scale]

``--quick``: M = 2000 only (``--m 5000``: the chosen M only). ``--scale``: adds the synthetic
n = 1,000,000, d = 28, M = 10,000 float32 row (several minutes). ``--only-scale``: that row alone.
``--device cuda``: every fit on that device (data moved there before the clock starts; the times
wait for the device to finish; the memory columns then report the device's peak allocation, not RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from device_timing import best_time, synchronize  # noqa: E402

import kgp  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "airline_nycflights13.npz"
LAM = 1e-6
LENGTHSCALE = 1.0
MAXITER = 20
SEED = 0


def peak_rss_mb(device: str = "cpu") -> float:
    """Peak resident memory of this process (CPU), or the device's peak allocation (elsewhere), in MB."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def load_airline(dtype: torch.dtype):
    """Seeded 80/20 split, z-scored with training statistics (features and target)."""
    if not DATA.is_file():
        raise SystemExit(f"data file {DATA} not found (it ships in ../shared/data next to the checkout)")
    z = np.load(DATA)
    X, y = z["X"].astype(np.float64), z["y"].astype(np.float64)
    perm = np.random.default_rng(SEED).permutation(X.shape[0])
    n_train = int(0.8 * X.shape[0])
    tr, te = perm[:n_train], perm[n_train:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    ymu, ysd = y[tr].mean(), y[tr].std()
    Xs, ys = (X - mu) / sd, (y - ymu) / ysd

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    return t(Xs[tr]), t(ys[tr]), t(Xs[te]), t(ys[te])


def synthetic_higgs_like(n: int, n_test: int, d: int = 28):
    """HIGGS-sized regression data: standard normal features, smooth target plus noise (float32)."""
    g = torch.Generator().manual_seed(SEED)
    X = torch.randn(n + n_test, d, generator=g)
    w1 = torch.randn(d, generator=g) / d**0.5
    w2 = torch.randn(d, generator=g) / d**0.5
    y = torch.sin(2 * X @ w1) + 0.5 * torch.cos(3 * X @ w2) + 0.3 * torch.randn(n + n_test, generator=g)
    return X[:n], y[:n], X[n:], y[n:]


def time_one_pass(kernel, X, Z, repeats: int = 2) -> float:
    op = kgp.kernel_operator(kernel, X, Z)
    v = torch.randn(Z.shape[0], 1, dtype=X.dtype, device=X.device)
    return best_time(lambda: op.fused_matmul(v), repeats, X.device)  # warm-up: buffers, prepared columns


def run_falkon(cfg: dict) -> dict:
    """One FALKON fit (runs inside a fresh subprocess)."""
    dtype = torch.float32 if cfg["dtype"] == "float32" else torch.float64
    if cfg["data"] == "airline":
        Xtr, ytr, Xte, yte = load_airline(dtype)
        lengthscale = LENGTHSCALE
    else:
        Xtr, ytr, Xte, yte = synthetic_higgs_like(cfg["n"], 100_000)
        Xtr, ytr, Xte, yte = (a.to(dtype) for a in (Xtr, ytr, Xte, yte))
        lengthscale = cfg["lengthscale"]
    device = cfg.get("device", "cpu")
    Xtr, ytr, Xte, yte = (a.to(device) for a in (Xtr, ytr, Xte, yte))
    base_rss = peak_rss_mb(device)
    n = Xtr.shape[0]
    model = kgp.KernelRegressor(
        "rbf",
        lengthscale=lengthscale,
        noise=LAM * n,
        solver="falkon",
        centers="uniform",
        n_centers=cfg["M"],
        solver_options={"maxiter": MAXITER, "tol": 0.0},
        random_state=SEED,
    )
    synchronize(device)
    t0 = time.perf_counter()
    model.fit(Xtr, ytr)
    synchronize(device)
    fit_s = time.perf_counter() - t0
    fit_rss = peak_rss_mb(device)
    hist = model.history_
    iters = len(hist)
    per_iter = (hist[-1].elapsed - hist[0].elapsed) / max(iters - 1, 1)
    mse = float(((model.predict(Xte) - yte) ** 2).mean())
    pass_s = time_one_pass(model.kernel_, Xtr, model.centers_) if cfg.get("time_pass", True) else float("nan")
    return {
        **cfg,
        "n": n,
        "fit_s": fit_s,
        "iters": iters,
        "per_iter_s": per_iter,
        "setup_s": hist[0].elapsed - per_iter,
        "pass_s": pass_s,
        "test_mse": mse,
        "base_rss_mb": base_rss,
        "peak_rss_mb": fit_rss,
        "residual": hist[-1].extras.get("residual"),
        "factorization": f"{hist[0].extras.get('factorization')}/{hist[0].extras.get('rank')}",
    }


def run_direct(cfg: dict) -> dict:
    """Direct Nystrom solve in float64 at the same centers (the uniform selector with the same seed)."""
    Xtr, ytr, Xte, yte = load_airline(torch.float64)
    n = Xtr.shape[0]
    kernel = kgp.kernels.make_kernel("rbf", LENGTHSCALE).to(torch.float64)
    selector = kgp.get_selector("uniform")
    req = kgp.SelectionRequest(
        X=Xtr, n_centers=cfg["M"], kernel=kernel, noise=LAM * n, generator=torch.Generator().manual_seed(SEED)
    )
    Z = selector.select(req).points
    t0 = time.perf_counter()
    with torch.no_grad():
        op = kgp.kernel_operator(kernel, Xtr, Z)
        M = Z.shape[0]
        KtK = torch.zeros(M, M, dtype=torch.float64)
        Kty = torch.zeros(M, 1, dtype=torch.float64)
        # RBF without outputscale: the backend's unscaled blocks are the kernel values
        for rows, block in op.blocks():
            KtK.addmm_(block.T, block)
            Kty.addmm_(block.T, ytr[rows].unsqueeze(-1))
        Kmm = kgp.kernel_operator(kernel, Z, Z).to_dense()
        H = KtK + LAM * n * Kmm
        alpha = torch.linalg.solve(H, Kty)
        pred = kgp.KernelExpansion(kernel, Z, alpha).predict(Xte)[:, 0]
    return {**cfg, "direct_s": time.perf_counter() - t0, "direct_mse": float(((pred - yte) ** 2).mean())}


def in_subprocess(kind: str, cfg: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, json.dumps(cfg)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="M = 2000 only")
    parser.add_argument("--scale", action="store_true", help="add the n = 1e6, d = 28, M = 10k float32 row")
    parser.add_argument("--only-scale", action="store_true", help="run only the scale row")
    parser.add_argument("--m", type=int, nargs="+", help="airline rows for these M only (default 2000 5000)")
    parser.add_argument("--device", default="cpu", help="torch device of every fit, e.g. cuda (default cpu)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, cfg = args.child[0], json.loads(args.child[1])
        result = run_falkon(cfg) if kind == "falkon" else run_direct(cfg)
        print(json.dumps(result))
        return

    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}, "
        f"memory budget {kgp.settings.memory_budget.value() / 2**20:.0f} MiB, device {args.device}, "
        f"fused kernels {kgp.settings.fused_kernels.value()}"
        + (f" ({torch.cuda.get_device_name(args.device)})" if torch.device(args.device).type == "cuda" else "")
    )
    rows = []
    if not args.only_scale:
        Ms = args.m or ((2000,) if args.quick else (2000, 5000))
        for M in Ms:
            direct = in_subprocess("direct", {"M": M})
            for dtype in ("float32", "float64"):
                r = in_subprocess("falkon", {"data": "airline", "M": M, "dtype": dtype, "device": args.device})
                r["direct_mse"] = direct["direct_mse"]
                rows.append(r)
                print_row(r, header=len(rows) == 1)
    if args.scale or args.only_scale:
        r = in_subprocess(
            "falkon",
            {
                "data": "synthetic",
                "n": 1_000_000,
                "M": 10_000,
                "dtype": "float32",
                "lengthscale": 5.0,
                "device": args.device,
            },
        )
        r["direct_mse"] = float("nan")
        print_row(r, header=not rows)
        rows.append(r)
    print("\nreference library (same machine, f32, M=2000, from ../shared/notes/machine.md): 41.8 s, test MSE 0.737")
    for r in rows:
        if r["data"] == "airline" and r["M"] == 2000 and r["dtype"] == "float32":
            print(f"speed-up of kgp falkon f32 M=2000 vs reference: {41.8 / r['fit_s']:.1f}x")


def print_row(r: dict, header: bool) -> None:
    if header:
        print(
            f"{'data':>9} {'n':>8} {'M':>6} {'dtype':>8} {'fit s':>7} {'setup s':>8} {'s/iter':>7} {'1 pass s':>8} "
            f"{'iters':>5} {'test MSE':>9} {'direct MSE':>10} {'base RSS MB':>11} {'peak RSS MB':>11}"
            f" {'factor/rank':>16}"
        )
    print(
        f"{r['data']:>9} {r['n']:>8} {r['M']:>6} {r['dtype']:>8} {r['fit_s']:>7.2f} {r['setup_s']:>8.2f} "
        f"{r['per_iter_s']:>7.3f} {r['pass_s']:>8.3f} {r['iters']:>5} {r['test_mse']:>9.4f} {r['direct_mse']:>10.4f} "
        f"{r['base_rss_mb']:>11.0f} {r['peak_rss_mb']:>11.0f} {r['factorization']:>16}",
        flush=True,
    )


if __name__ == "__main__":
    main()
