"""The default GP on millions of rows with a known noise floor, against GPyTorch SVGP given the same time.

One command, one table::

    python benchmarks/bench_large.py --n 100000 1000000 --d 8          # the sizes of docs/benchmarks/large-data.md
    python benchmarks/bench_large.py --quick                          # 20,000 rows, d = 8: the plumbing

Data: :class:`kgp.datasets.PriorDraw` (``seed``, ``d``): an ARD RBF GP prior draw (8,192 random Fourier
feature pairs), standard normal inputs, noise of std ``--noise`` (0.1): the best possible test RMSE is the
noise std and the table reports the *excess* ``sqrt(RMSE^2 - sigma^2)``. The training rows are written once
to ``--cache`` as ``.npy`` files and read back memory-mapped (``numpy.load(..., mmap_mode="r")``), so the
fit reads them from disk; the test set is ``--n-test`` rows of the test split (the same f).

Per (n, d), in one process:

- kgp: ``KernelRegressor("rbf", learn="auto", random_state=seed).fit(X, y)`` on the memory-mapped rows,
  then ``predict(X_test, return_std=True, include_noise=True)``; M is the number of fitted centers (the
  recipe's ``n_centers``);
- SVGP: GPyTorch ``ApproximateGP`` with a whitened variational strategy, 1,000 inducing points (random
  training rows, learned), ``ScaleKernel(RBF, ARD)``, ``ConstantMean``, Gaussian likelihood, minibatches of
  1,024, Adam (lr 0.01), float32, trained for as long as kgp's fit took (``--svgp-seconds`` overrides). On a
  host that other work keeps busy, ``--svgp-clock cpu`` gives it kgp's CPU seconds instead of its wall
  seconds, ``--svgp-checkpoints`` scores it at several budgets in one run, and ``--no-kgp`` runs it alone.

``--save DIR`` also writes each kgp model to DIR and times, in a fresh process, ``kgp.load`` of it and the std
of 1,000 test rows (recorded under ``served`` in the JSON line, with the file's size).

Columns: fit seconds, test RMSE, excess RMSE, NLPD of y (noise included), 95% interval coverage, peak RSS
of the phase (the high-water mark is reset through ``/proc/self/clear_refs`` before each phase where Linux
allows it, otherwise it is the process's peak so far), and the ratios kgp / SVGP. Every result is appended to
``--jsonl`` (default ``benchmarks/bench_large_runs.jsonl``) with the host, its load and the thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402
from kgp.datasets import PriorDraw, excess_rmse  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = HERE / "bench_large_runs.jsonl"
QUICK_N = 20000


# ---------------------------------------------------------------------- host and memory
def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark (VmHWM) since the last reset, in bytes."""
    peak = _status("VmHWM")
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def rss_bytes() -> int | None:
    """The process's resident memory now (VmRSS), in bytes; None off Linux."""
    return _status("VmRSS")


# ---------------------------------------------------------------------- data
def cached_data(cache: Path, n: int, d: int, n_test: int, seed: int, noise: float) -> dict:
    """Training rows (memory-mapped from ``cache``) and the test rows of one (n, d) set; written once."""
    cache.mkdir(parents=True, exist_ok=True)
    draw = PriorDraw(d, seed=seed, noise_std=noise)
    stem = f"prior_d{d}_s{seed}_noise{noise:g}"
    paths = {}
    start = time.perf_counter()
    for split, rows in (("train", n), ("test", n_test)):
        X_path, y_path = cache / f"{stem}_{split}{rows}_X.npy", cache / f"{stem}_{split}{rows}_y.npy"
        if not (X_path.is_file() and y_path.is_file()):
            # written under temporary names first: an interrupted run leaves no half-written cache
            X_tmp, y_tmp = X_path.with_suffix(".tmp.npy"), y_path.with_suffix(".tmp.npy")
            X_mem, y_mem = draw.sample(rows, split=split, X_out=X_tmp, y_out=y_tmp)
            del X_mem, y_mem
            os.replace(X_tmp, X_path)
            os.replace(y_tmp, y_path)
        paths[split] = (X_path, y_path)
    X, y = (np.load(p, mmap_mode="r") for p in paths["train"])
    X_test, y_test = (np.load(p) for p in paths["test"])
    return {"X": X, "y": y, "X_test": X_test, "y_test": y_test, "generate_seconds": time.perf_counter() - start}


def scores(mean, std, y: np.ndarray, noise: float) -> dict:
    mean = np.asarray(mean, dtype=np.float64).reshape(-1)
    var = np.asarray(std, dtype=np.float64).reshape(-1) ** 2
    rmse = float(np.sqrt(np.mean((y - mean) ** 2)))
    return {
        "rmse": rmse,
        "excess": excess_rmse(rmse, noise),
        "nlpd": float(np.mean(0.5 * np.log(2 * math.pi * var) + (y - mean) ** 2 / (2 * var))),
        "coverage": float(np.mean(np.abs(y - mean) <= 1.959964 * np.sqrt(var))),
    }


# ---------------------------------------------------------------------- the two fits
LOAD_SCRIPT = """
import sys, time
start = time.perf_counter()
import numpy as np, kgp
imported = time.perf_counter()
model = kgp.load(sys.argv[1])
loaded = time.perf_counter()
mean, std = model.predict(np.load(sys.argv[2]), return_std=True)
done = time.perf_counter()
if len(sys.argv) > 3:  # a file for the std (benchmarks/bench_model_file.py compares two versions' std)
    np.save(sys.argv[3], std)
print(kgp.__file__)
print(imported - start, loaded - imported, done - loaded)
"""


def time_served_std(model, path: Path, X_query: np.ndarray) -> dict:
    """Save the model, then in a fresh process: ``kgp.load`` and ``predict(return_std=True)`` of ``X_query``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model.save(path)
    save_seconds = time.perf_counter() - start
    query = path.with_suffix(".query.npy")
    np.save(query, X_query)
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(path), str(query)], capture_output=True, text=True, check=True
    ).stdout.split()
    import_s, load_s, std_s = (float(v) for v in out[-3:])
    return {
        "file_bytes": path.stat().st_size,
        "save_seconds": save_seconds,
        "import_seconds": import_s,
        "load_seconds": load_s,
        "std_seconds": std_s,
        "query_rows": X_query.shape[0],
    }


def fit_kgp(data: dict, noise: float, seed: int, options: dict | None = None, save: Path | None = None) -> dict:
    """The default call on the memory-mapped rows; ``options`` (tests only) adds constructor arguments;
    ``save``: a model file to write, then load and query in a fresh process (:func:`time_served_std`)."""
    reset_peak_rss()
    rss_before = rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    model = kgp.KernelRegressor("rbf", learn="auto", random_state=seed, **(options or {}))
    model.fit(data["X"], data["y"])
    fit_seconds = time.perf_counter() - start
    fit_cpu_seconds = time.process_time() - cpu_start
    mean, std = model.predict(data["X_test"], return_std=True, include_noise=True)
    recipe = model.recipe_ or {}
    # the exact solver's "centers" are all training rows
    m = model.centers_.shape[0] if model.centers_ is not None else recipe.get("n_centers", data["X"].shape[0])
    return {
        **scores(mean, std, data["y_test"], noise),
        "fit_seconds": fit_seconds,
        "fit_cpu_seconds": fit_cpu_seconds,
        "seconds": time.perf_counter() - start,
        "M": m,
        "solver": model.solver_name_,
        "peak_rss": peak_rss_bytes(),
        "rss_before": rss_before,
        "noise_learned": float(model.noise_),
        "variance_calibration": getattr(model.posterior_.variance, "calibration", None),
        "recipe": {k: v for k, v in recipe.items() if k != "reasons"},
        **({"served": time_served_std(model, save, data["X_test"][:1000])} if save is not None else {}),
    }


def fit_svgp(
    data: dict,
    noise: float,
    seconds: float,
    seed: int,
    m: int = 1000,
    batch: int = 1024,
    lr: float = 0.01,
    clock: str = "wall",
    checkpoints: tuple[float, ...] = (),
    wall_limit: float | None = None,
) -> dict:
    """GPyTorch SVGP (whitened), minibatch Adam for ``seconds`` of training, float32, on the CPU.

    ``clock="cpu"`` counts this process's CPU seconds instead of wall seconds (a fair share on a host that
    other work keeps busy); at each of ``checkpoints`` (seconds of that clock) the test scores are recorded,
    so that one run gives SVGP's scores at several budgets; ``wall_limit`` stops training after that many
    wall seconds whatever the clock says.
    """
    import gpytorch

    reset_peak_rss()
    rss_before = rss_bytes()
    torch.manual_seed(seed)
    start = time.perf_counter()
    read_clock = time.process_time if clock == "cpu" else time.perf_counter
    clock_start = read_clock()
    # SVGP reads its minibatches from memory: one float32 copy of the rows, counted in its peak
    X = torch.from_numpy(np.asarray(data["X"], dtype=np.float32))
    y = torch.from_numpy(np.asarray(data["y"], dtype=np.float32))
    n = X.shape[0]
    idx = np.random.default_rng(seed).choice(n, size=min(m, n), replace=False)

    class SVGP(gpytorch.models.ApproximateGP):
        def __init__(self, Z):
            dist = gpytorch.variational.CholeskyVariationalDistribution(Z.shape[0])
            strategy = gpytorch.variational.VariationalStrategy(self, Z, dist, learn_inducing_locations=True)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=Z.shape[1]))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model = SVGP(X[torch.from_numpy(idx)].clone())
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=n)
    gen = torch.Generator().manual_seed(seed)
    Xq = torch.from_numpy(data["X_test"]).float()

    def evaluate() -> dict:
        model.eval()
        likelihood.eval()
        means, stds = [], []
        with torch.no_grad():
            for lo in range(0, Xq.shape[0], 4096):
                pred = likelihood(model(Xq[lo : lo + 4096]))
                means.append(pred.mean.double().numpy())
                stds.append(pred.variance.double().sqrt().numpy())
        model.train()
        likelihood.train()
        return scores(np.concatenate(means), np.concatenate(stds), data["y_test"], noise)

    pending = sorted(c for c in checkpoints if c < seconds)
    curve = []
    steps, seen, done = 0, 0, False
    while not done:
        perm = torch.randperm(n, generator=gen)
        for lo in range(0, n, batch):
            b = perm[lo : lo + batch]
            optimizer.zero_grad()
            loss = -mll(model(X[b]), y[b])
            loss.backward()
            optimizer.step()
            steps += 1
            seen += b.shape[0]
            used = read_clock() - clock_start
            if pending and used >= pending[0]:
                curve.append({"clock_seconds": used, "wall_seconds": time.perf_counter() - start, **evaluate()})
                print(f"  svgp at {clock} {used:.0f} s: {json.dumps(curve[-1])}", flush=True)
                while pending and used >= pending[0]:
                    pending.pop(0)
            if used >= seconds or (wall_limit is not None and time.perf_counter() - start >= wall_limit):
                done = True
                break
    train_seconds = time.perf_counter() - start
    train_clock = read_clock() - clock_start
    final = evaluate()
    return {
        **final,
        "clock": clock,
        "train_clock_seconds": train_clock,
        "curve": curve,
        "fit_seconds": train_seconds,
        "seconds": time.perf_counter() - start,
        "M": min(m, n),
        "steps": steps,
        "epochs": round(seen / n, 2),
        "peak_rss": peak_rss_bytes(),
        "rss_before": rss_before,
        "noise_learned": float(likelihood.noise.detach()),
    }


# ---------------------------------------------------------------------- table
def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b not in (None, 0) else "-"


def _served_cells(served: dict | None) -> str:
    """`` file GB | load + std s |`` of a saved model (``--save``: :func:`time_served_std`), else blank cells."""
    if served is None:
        return " | |"
    return f" {served['file_bytes'] / 1e9:.2f} | {served['load_seconds'] + served['std_seconds']:.2f} |"


def table(rows: list[dict]) -> str:
    head = (
        "| n | d | run | M | fit s | CPU s | RMSE | excess | NLPD | cov. 95% | peak RSS GB | "
        "excess / SVGP | RMSE / SVGP | NLPD - SVGP | time / SVGP | file GB | load + std s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        base = row.get("svgp")
        for run in ("kgp", "svgp"):
            r = row.get(run)
            if r is None:
                continue
            mine = run == "kgp" and base is not None
            cpu = r.get("fit_cpu_seconds", r["train_clock_seconds"] if r.get("clock") == "cpu" else None)
            cpu = "-" if cpu is None else f"{cpu:.1f}"
            lines.append(
                f"| {row['n']:,} | {row['d']} | {run} | {r['M']:,} | {r['fit_seconds']:.1f} | {cpu} | "
                f"{r['rmse']:.4f} | {r['excess']:.4f} | {r['nlpd']:.3f} | {r['coverage']:.3f} | "
                f"{r['peak_rss'] / 1e9:.2f} | "
                + (
                    f"{ratio(r['excess'], base['excess'])} | {ratio(r['rmse'], base['rmse'])} | "
                    f"{r['nlpd'] - base['nlpd']:+.3f} | {ratio(r['fit_seconds'], base['fit_seconds'])} |"
                    if mine
                    else "| | | |"
                )
                + _served_cells(r.get("served"))
            )
    return head + "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[100000], help="training rows (several: one row each)")
    parser.add_argument("--d", type=int, nargs="+", default=[8], help="input dimensions (8, 28)")
    parser.add_argument("--n-test", type=int, default=10000, help="test rows (the test split of the same f)")
    parser.add_argument("--noise", type=float, default=0.1, help="noise std: the Bayes-optimal test RMSE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=HERE / "output" / "large_data", help="cached .npy data")
    parser.add_argument("--quick", action="store_true", help=f"n = {QUICK_N:,} only (the plumbing)")
    parser.add_argument("--no-svgp", action="store_true", help="kgp only")
    parser.add_argument("--svgp-seconds", type=float, default=None, help="SVGP's training time (default: kgp's)")
    parser.add_argument("--svgp-clock", choices=("wall", "cpu"), default="wall", help="the clock SVGP's time is on")
    parser.add_argument("--svgp-checkpoints", type=float, nargs="*", default=(), help="record SVGP's scores at")
    parser.add_argument("--svgp-wall-limit", type=float, default=None, help="stop SVGP after this many wall s")
    parser.add_argument("--no-kgp", action="store_true", help="SVGP only (needs --svgp-seconds)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--save", type=Path, default=None, help="folder: save each kgp model there, time load + std in a new process"
    )
    parser.add_argument("--jsonl", type=Path, default=RUNS, help="file the results are appended to")
    args = parser.parse_args(argv)
    if args.quick:
        args.n = [QUICK_N]
    for name in ("n", "d"):
        if any(v < 1 for v in getattr(args, name)):
            parser.error(f"--{name}: expected positive integers, got {getattr(args, name)}")
    if args.n_test < 1 or not (args.noise >= 0):
        parser.error("--n-test: expected >= 1; --noise: expected >= 0")
    if args.no_kgp and args.svgp_seconds is None:
        parser.error("--no-kgp: give SVGP's time with --svgp-seconds")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    host = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "peak_reset": reset_peak_rss(),
    }
    print(f"host: {host['cpu']}, {host['threads']} threads, torch {host['torch']}, load {os.getloadavg()[0]:.2f}")
    rows = []
    for d in args.d:
        for n in args.n:
            data = cached_data(args.cache, n, d, args.n_test, args.seed, args.noise)
            row = {"n": n, "d": d, "noise": args.noise, "seed": args.seed, "n_test": args.n_test, **host}
            row["generate_seconds"] = data["generate_seconds"]
            row["load_before"] = os.getloadavg()[0]
            if not args.no_kgp:
                save = None if args.save is None else args.save / f"kgp_n{n}_d{d}_s{args.seed}.kgp"
                row["kgp"] = fit_kgp(data, args.noise, args.seed, save=save)
                print(f"n={n:,} d={d} kgp: {json.dumps(row['kgp'], default=str)}", flush=True)
            if not args.no_svgp:
                seconds = args.svgp_seconds
                if seconds is None:
                    seconds = row["kgp"]["fit_cpu_seconds" if args.svgp_clock == "cpu" else "fit_seconds"]
                row["svgp"] = fit_svgp(
                    data,
                    args.noise,
                    seconds,
                    args.seed,
                    clock=args.svgp_clock,
                    checkpoints=tuple(args.svgp_checkpoints),
                    wall_limit=args.svgp_wall_limit,
                )
                print(f"n={n:,} d={d} svgp: {json.dumps(row['svgp'], default=str)}", flush=True)
            row["load_after"] = os.getloadavg()[0]
            row["when"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            with Path(args.jsonl).open("a") as fh:
                fh.write(json.dumps(row, default=str) + "\n")
            rows.append(row)
    text = table(rows)
    print(text)
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()
