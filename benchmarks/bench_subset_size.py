"""How large the default GP's learning subset should be: accuracy over seeds, against GPyTorch's SGPR.

``learn="auto"`` learns the hyperparameters on the exact marginal likelihood of ``S`` random rows
(``S = 3,000`` today; plugins/kgp_builtins/recipes/rule.py). Which rows are drawn moves the learned GP:
one seed of elevators gave 0.3632 test RMSE, another 0.3606. This benchmark measures, per set, subset
size and seed, the default call with ``learn_options={"subset": S}`` and GPyTorch's SGPR (1,000 random
inducing rows, 100 Adam steps; the peer of docs/benchmarks/gp-default.md) with the same seeds, and
prints the mean and spread of each, so a subset size is chosen from the sets and not from one draw.

Usage::

    python benchmarks/bench_subset_size.py [--sets pol,elevators,...] [--sizes 3000,4000,5000]
        [--seeds 0,1,2] [--device cuda] [--jsonl PATH] [--no-peer]

The recipe's solve (exact, or FALKON on as many centers as ``kgp.settings.memory_budget`` holds) depends
on the budget; to reproduce the 2-core CPU host's choices on a larger machine, set
``KGP_MEMORY_BUDGET`` to that host's default (5,055,302,041 bytes there: M = 11,241 on the three larger
sets). Accuracy does not depend on the device beyond rounding, so the seeds x sizes sweep can run on a GPU
and its time cost be taken from the CPU's per-step figures (benchmarks/bench_learning_candidates.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import uci  # noqa: E402
from bench_gp_default import SETS, scores, sgpr  # noqa: E402

import kgp  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = HERE / "bench_subset_size_runs.jsonl"


def default_with_subset(split: uci.Split, subset: int, seed: int, device: str, extra: dict | None = None) -> dict:
    """The default call with the learning subset set to ``subset`` rows (and ``extra`` learn_options)."""
    start = time.perf_counter()
    options = {} if device == "cpu" else {"device": device}
    learn_options = {"subset": min(subset, split.n_train), **(extra or {})}
    model = kgp.KernelRegressor("rbf", learn="auto", learn_options=learn_options, random_state=seed, **options).fit(
        split.X_train, split.y_train
    )
    mean, std = model.predict(split.X_test, return_std=True, include_noise=True)
    return {
        **scores(np.asarray(mean), np.asarray(std), split.y_test),
        "seconds": time.perf_counter() - start,
        "noise": float(model.noise_),
        "solver": model.recipe_.get("solver") if model.recipe_ else None,
        "n_centers": model.recipe_.get("n_centers") if model.recipe_ else None,
    }


def summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--sizes", default="3000,4000,5000")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jsonl", default=str(RUNS))
    parser.add_argument("--no-peer", action="store_true", help="skip GPyTorch's SGPR")
    parser.add_argument("--learn-options", default="{}", help="more learn_options, JSON (e.g. '{\"iterations\": 200}')")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    where = args.device if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name(args.device)})"
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {where}, "
        f"memory budget {kgp.settings.memory_budget.value():,} bytes, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results: dict[tuple[str, str], list[dict]] = {}

    def log(name: str, run: str, seed: int, result: dict) -> None:
        row = {**result, "set": name, "run": run, "seed": seed, "device": where, "when": time.strftime("%F %T")}
        results.setdefault((name, run), []).append(row)
        with open(args.jsonl, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(
            f"  {name} {run} seed {seed}: RMSE {row['rmse']:.4f} NLPD {row['nlpd']:.3f} {row['seconds']:.1f} s",
            flush=True,
        )

    for name in args.sets.split(","):
        split = uci.load_split(name)
        print(f"{name}: n_train={split.n_train:,}, d={split.d}", flush=True)
        for seed in seeds:
            if not args.no_peer:
                log(name, "sgpr", seed, sgpr(split, seed, device=args.device))
            for size in sizes:
                extra = json.loads(args.learn_options)
                log(name, f"S={size}", seed, default_with_subset(split, size, seed, args.device, extra))

    runs = (["sgpr"] if not args.no_peer else []) + [f"S={s}" for s in sizes]
    print(f"\nmean ± sd over seeds {seeds}: test RMSE / NLPD (seconds, mean); learn_options {args.learn_options}")
    print("| set | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name in args.sets.split(","):
        cells = []
        for run in runs:
            rows = results.get((name, run), [])
            if not rows:
                cells.append("-")
                continue
            cells.append(
                f"{summary([r['rmse'] for r in rows])} / {summary([r['nlpd'] for r in rows])} "
                f"({statistics.mean(r['seconds'] for r in rows):.1f} s)"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
