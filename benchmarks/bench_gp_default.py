"""The GP a user gets by default against the exact GP and GPyTorch's SGPR / SVGP.

One command, one table::

    python benchmarks/bench_gp_default.py                         # the six sets
    python benchmarks/bench_gp_default.py --sets pol,airline      # some sets (airline: the at-scale row)
    python benchmarks/bench_gp_default.py --only b                # only the peer runs (cached)

Per set (``benchmarks/uci.py`` protocol: seeded 80/20 split, z-scored with training statistics):

(a) the exact GP of ``benchmarks/bench_hyperparameters.py`` (GPyTorch ExactGP hyperparameters from
    3,000 rows, exact solve on all rows), read from ``bench_hyperparameters_a.json``;
(b) GPyTorch SGPR: 1,000 inducing points (random training rows), ``ScaleKernel(RBF, ARD)``,
    ``ConstantMean``, 100 Adam steps at lr 0.1 on the collapsed bound, its own predictive mean and
    variance, float64; cached in ``bench_gp_default_b.json`` (``--refresh-b`` recomputes);
(d) the default call ``kgp.KernelRegressor("rbf", learn="auto", random_state=0)`` (what it chose is
    printed from ``recipe_``); predictions with ``return_std=True, include_noise=True``.

airline (``shared/data/airline_nycflights13.npz``, 273,853 rows, seeded 80/20 split, z-scored): (d)
against GPyTorch SVGP (1,000 inducing points, minibatch 1,024, Adam lr 0.01, whitened variational
strategy) given as much time as (d) took, float32 (SVGP's usual precision) .

``--device cuda``: every run on that device (the default call with ``device="cuda"``, GPyTorch's models
moved there); (b) is then computed, not read from its CPU cache. ``KGP_SHARED_DATA`` names the data folder
where ``../shared/data`` is absent (a GPU machine gets a carried copy; benchmarks/gpu_check.sh).

Reported per run: test RMSE, NLPD of y (noise included), 95% interval coverage, total seconds (learning +
solve + test predictions), the host's load when it ran. Every result is appended to
``bench_gp_default_runs.jsonl`` as it lands, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import uci  # noqa: E402

import kgp  # noqa: E402
from kgp.datasets import standardized_split  # noqa: E402

SETS = ("pol", "elevators", "bike", "kin40k", "protein", "keggdirected")
HERE = Path(__file__).resolve().parent
A_JSON = HERE / "bench_hyperparameters_a.json"
B_JSON = HERE / "bench_gp_default_b.json"
RUNS = HERE / "bench_gp_default_runs.jsonl"
AIRLINE = uci.SHARED_DATA / "airline_nycflights13.npz"


def scores(mean: np.ndarray, std: np.ndarray, y: np.ndarray) -> dict:
    mean = np.asarray(mean, dtype=np.float64).reshape(-1)
    var = np.asarray(std, dtype=np.float64).reshape(-1) ** 2
    z = np.abs(y - mean) / np.sqrt(var)
    return {
        "rmse": float(np.sqrt(np.mean((y - mean) ** 2))),
        "nlpd": float(np.mean(0.5 * np.log(2 * math.pi * var) + (y - mean) ** 2 / (2 * var))),
        "coverage": float(np.mean(z <= 1.959964)),
    }


def load(name: str) -> uci.Split:
    if name != "airline":
        return uci.load_split(name)
    if not AIRLINE.is_file():
        raise SystemExit(f"{AIRLINE} not found (the shared data ship beside the checkout)")
    data = np.load(AIRLINE)
    return uci.Split(name, *standardized_split(data["X"].astype(np.float64), data["y"].astype(np.float64)))


def sgpr(
    split: uci.Split, seed: int = 0, m: int = 1000, steps: int = 100, lr: float = 0.1, device: str = "cpu"
) -> dict:
    """(b): GPyTorch SGPR, random inducing rows, Adam on the collapsed bound, its own predictive."""
    import gpytorch

    torch.manual_seed(seed)
    X = torch.from_numpy(split.X_train).to(device)
    y = torch.from_numpy(split.y_train).to(device)
    idx = np.random.default_rng(seed).choice(split.n_train, size=min(m, split.n_train), replace=False)

    class SGPR(gpytorch.models.ExactGP):
        def __init__(self, X, y, likelihood):
            super().__init__(X, y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=X.shape[1]))
            self.covar_module = gpytorch.kernels.InducingPointKernel(
                base, inducing_points=X[idx].clone(), likelihood=likelihood
            )

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    start = time.perf_counter()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double().to(device)
    model = SGPR(X, y, likelihood).double().to(device)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = -mll(model(X), y)
        loss.backward()
        optimizer.step()
    model.eval()
    likelihood.eval()
    means, stds = [], []
    Xq = torch.from_numpy(split.X_test).to(device)
    with torch.no_grad():
        for lo in range(0, Xq.shape[0], 2000):
            pred = likelihood(model(Xq[lo : lo + 2000]))
            means.append(pred.mean.cpu().numpy())
            stds.append(pred.variance.sqrt().cpu().numpy())
    return {
        **scores(np.concatenate(means), np.concatenate(stds), split.y_test),
        "seconds": time.perf_counter() - start,
        "noise": float(likelihood.noise.detach()),
    }


def svgp(
    split: uci.Split,
    seconds: float,
    seed: int = 0,
    m: int = 1000,
    batch: int = 1024,
    lr: float = 0.01,
    device: str = "cpu",
) -> dict:
    """GPyTorch SVGP (whitened variational strategy), minibatch Adam for ``seconds`` of training."""
    import gpytorch

    torch.manual_seed(seed)
    X = torch.from_numpy(split.X_train).float().to(device)
    y = torch.from_numpy(split.y_train).float().to(device)
    idx = np.random.default_rng(seed).choice(split.n_train, size=m, replace=False)

    class SVGP(gpytorch.models.ApproximateGP):
        def __init__(self, Z):
            dist = gpytorch.variational.CholeskyVariationalDistribution(Z.shape[0])
            strategy = gpytorch.variational.VariationalStrategy(self, Z, dist, learn_inducing_locations=True)
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=Z.shape[1]))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    start = time.perf_counter()
    model = SVGP(X[idx].clone()).to(device)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device)
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=X.shape[0])
    gen = torch.Generator().manual_seed(seed)
    epochs = 0.0
    steps = 0
    while time.perf_counter() - start < seconds:
        perm = torch.randperm(X.shape[0], generator=gen).to(device)
        for lo in range(0, X.shape[0], batch):
            b = perm[lo : lo + batch]
            optimizer.zero_grad()
            loss = -mll(model(X[b]), y[b])
            loss.backward()
            optimizer.step()
            steps += 1
            if time.perf_counter() - start >= seconds:
                break
        epochs += min(1.0, (lo + batch) / X.shape[0])
    train_seconds = time.perf_counter() - start
    model.eval()
    likelihood.eval()
    means, stds = [], []
    Xq = torch.from_numpy(split.X_test).float().to(device)
    with torch.no_grad():
        for lo in range(0, Xq.shape[0], 4096):
            pred = likelihood(model(Xq[lo : lo + 4096]))
            means.append(pred.mean.double().cpu().numpy())
            stds.append(pred.variance.double().sqrt().cpu().numpy())
    return {
        **scores(np.concatenate(means), np.concatenate(stds), split.y_test),
        "seconds": time.perf_counter() - start,
        "train_seconds": train_seconds,
        "epochs": round(epochs, 2),
        "steps": steps,
        "noise": float(likelihood.noise.detach()),
    }


def default_call(split: uci.Split, seed: int = 0, device: str = "cpu") -> dict:
    """(d): the recommended call, nothing else set (but ``device`` where it is not the CPU)."""
    start = time.perf_counter()
    options = {} if device == "cpu" else {"device": device}
    model = kgp.KernelRegressor("rbf", learn="auto", random_state=seed, **options).fit(split.X_train, split.y_train)
    fit_seconds = time.perf_counter() - start
    mean, std = model.predict(split.X_test, return_std=True, include_noise=True)
    recipe = model.recipe_
    history = np.asarray(model.learn_history_)
    tail = max(2, len(history) // 4)
    return {
        # how far learning was from converged: the decrease over its last quarter against the whole run's
        "learn_recent_drop": float(history[-tail] - history.min()) if history.size else None,
        "learn_whole_drop": float(history[0] - history.min()) if history.size else None,
        **scores(mean, std, split.y_test),
        "seconds": time.perf_counter() - start,
        "fit_seconds": fit_seconds,
        "noise": float(model.noise_),
        "variance_calibration": getattr(model.posterior_.variance, "calibration", None),
        "chose": {k: v for k, v in recipe.items() if k != "reasons"} if recipe else None,
    }


def record(name: str, run: str, result: dict, device: str = "cpu") -> dict:
    result = {
        **result,
        "set": name,
        "run": run,
        "device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "load": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    with RUNS.open("a") as fh:
        fh.write(json.dumps(result, default=str) + "\n")
    return result


def main(argv=None) -> int:
    global RUNS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS), help="comma-separated; 'airline' adds the at-scale row")
    parser.add_argument("--only", default="", help="comma-separated subset of runs: b (peer), d (default)")
    parser.add_argument("--refresh-b", action="store_true", help="recompute (b) instead of reading its cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peer-seconds",
        type=float,
        default=None,
        help="airline: SVGP's training time (default: the default call's time in the same run, else 900)",
    )
    parser.add_argument(
        "--table", action="store_true", help="only print the table of the latest recorded runs (no fitting)"
    )
    parser.add_argument(
        "--device", default="cpu", help="torch device of every run, e.g. cuda ((b) then runs, not read from its cache)"
    )
    parser.add_argument("--runs", default=str(RUNS), help="JSON-lines log the results are appended to")
    args = parser.parse_args(argv)
    RUNS = Path(args.runs)
    if args.table:
        return print_recorded(args.sets.split(","))
    only = set(filter(None, args.only.split(","))) or {"b", "d"}
    a_cache = json.loads(A_JSON.read_text()) if A_JSON.is_file() else {}
    b_cache = json.loads(B_JSON.read_text()) if B_JSON.is_file() else {}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}", flush=True)
    table = []
    for name in args.sets.split(","):
        split = load(name)
        print(f"{name}: n_train={split.n_train:,}, d={split.d}", flush=True)
        res = {"a": a_cache.get(name)}
        if "d" in only:
            res["d"] = record(name, "d", default_call(split, args.seed, args.device), args.device)
            print(f"  (d) {json.dumps(res['d'], default=str)}", flush=True)
        if "b" in only:
            if name == "airline":
                budget = args.peer_seconds or (res["d"]["seconds"] if res.get("d") else 900.0)
                res["b"] = record(name, "svgp", svgp(split, budget, args.seed, device=args.device), args.device)
            elif args.device != "cpu":
                res["b"] = record(name, "b", sgpr(split, args.seed, device=args.device), args.device)
            elif name in b_cache and not args.refresh_b:
                res["b"] = {**b_cache[name], "cached": True}
            else:
                res["b"] = record(name, "b", sgpr(split, args.seed))
                b_cache = json.loads(B_JSON.read_text()) if B_JSON.is_file() else {}
                b_cache[name] = res["b"]
                B_JSON.write_text(json.dumps(b_cache, indent=1, sort_keys=True) + "\n")
            print(f"  (b) {json.dumps(res['b'], default=str)}", flush=True)
        table.append((name, res))
    print_table(table)
    return 0


def print_recorded(names: list[str]) -> int:
    """The table from ``bench_gp_default_runs.jsonl`` (the latest run per set and kind) and the caches."""
    a_cache = json.loads(A_JSON.read_text()) if A_JSON.is_file() else {}
    runs: dict[tuple[str, str], dict] = {}
    if RUNS.is_file():
        for line in RUNS.read_text().splitlines():
            run = json.loads(line)
            runs[(run["set"], run["run"])] = run
    table = []
    for name in names:
        peer = runs.get((name, "svgp" if name == "airline" else "b"))
        table.append((name, {"a": a_cache.get(name), "b": peer, "d": runs.get((name, "d"))}))
    print_table(table)
    return 0


def print_table(table: list[tuple[str, dict]]) -> None:
    print()
    print("| set | (a) exact RMSE | peer RMSE / NLPD / cov / s | default RMSE (x a) / NLPD / cov / s (x peer) |")
    print("|---|---|---|---|")
    for name, res in table:
        a, b, d = res.get("a"), res.get("b"), res.get("d")
        a_txt = f"{a['rmse']:.4f}" if a else "-"
        b_txt = f"{b['rmse']:.4f} / {b['nlpd']:.3f} / {b['coverage']:.3f} / {b['seconds']:.0f}" if b else "-"
        if d:
            ra = f" ({d['rmse'] / a['rmse']:.2f}x)" if a else ""
            rb = f" ({d['seconds'] / b['seconds']:.2f}x)" if b else ""
            d_txt = f"{d['rmse']:.4f}{ra} / {d['nlpd']:.3f} / {d['coverage']:.3f} / {d['seconds']:.0f}{rb}"
        else:
            d_txt = "-"
        print(f"| {name} | {a_txt} | {b_txt} | {d_txt} |")


if __name__ == "__main__":
    raise SystemExit(main())
