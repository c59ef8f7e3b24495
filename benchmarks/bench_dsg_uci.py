"""Benchmark: ``dsg`` with its default options against FALKON on the 15-set UCI sweep.

Protocol (``benchmarks/uci.py``): the seeded 80/20 split, z-scored; learned ARD-RBF hyperparameters
from ``uci_hyperparameters.json``; fit on ``y - mean`` with ``noise``, the mean added back. The
comparison point is FALKON with ``M = min(5000, n_train)`` uniform centers (``random_state=0``):
its float64 test RMSE is the accuracy reference, its fit time in the same dtype the time reference.
Both run in this process, one after the other, so the time ratio is comparable across machines.

Prints one row per set and dtype: RMSE ratio ``dsg / falkon64`` and time ratio ``dsg / falkon``;
the targets are RMSE ratio <= 1.15 within time ratio <= 3.

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 KGP_DISABLE_ENTRYPOINTS=1 \
        .venv/bin/python benchmarks/bench_dsg_uci.py [--sets yacht,energy] [--dtypes float64,float32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from uci import ALL_SETS, cached_hyperparameters, load_split, make_kernel, rmse  # noqa: E402

import kgp  # noqa: E402


def fit_predict(split, hyper, dtype, solver, **kwargs):
    kernel = make_kernel(hyper, dtype)
    X = torch.tensor(split.X_train, dtype=dtype)
    y = torch.tensor(split.y_train - hyper["mean"], dtype=dtype)
    model = kgp.KernelRegressor(kernel, noise=hyper["noise"], solver=solver, random_state=0, dtype=dtype, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        model.fit(X, y)
        wall = time.perf_counter() - start
    pred = model.predict(torch.tensor(split.X_test, dtype=dtype)).double().numpy() + hyper["mean"]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    moved = getattr(model.predictor_, "schedule", {}).get("moved")
    return rmse(pred, split.y_test), wall, messages, moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default=",".join(ALL_SETS))
    ap.add_argument("--dtypes", default="float64,float32")
    ap.add_argument("--dsg-options", default="{}", help="JSON dict of solver_options for dsg (default: none)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    torch.set_flush_denormal(True)
    options = json.loads(args.dsg_options)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}; "
        f"dsg options {options or 'defaults'}"
    )
    hypers = cached_hyperparameters()
    # warm-up: library loading and first-call allocations belong to no method
    warm = load_split("yacht")
    for dtype in (torch.float64, torch.float32):
        fit_predict(warm, hypers["yacht"], dtype, "falkon", n_centers=100)
        fit_predict(warm, hypers["yacht"], dtype, "dsg", solver_options=options)
    rows = []
    print(
        "| set | n | dtype | falkon64 RMSE | dsg RMSE | RMSE ratio | falkon s | dsg s | time ratio | warnings | moved |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.sets.split(","):
        split, hyper = load_split(name), hypers[name]
        M = min(5000, split.n_train)
        ref, _, _, _ = fit_predict(split, hyper, torch.float64, "falkon", n_centers=M)
        for dn in args.dtypes.split(","):
            dtype = getattr(torch, dn)
            _, t_f, _, _ = fit_predict(split, hyper, dtype, "falkon", n_centers=M)
            e, t_d, msgs, moved = fit_predict(split, hyper, dtype, "dsg", solver_options=options)
            row = dict(set=name, n=split.n_train, dtype=dn, falkon=ref, dsg=e, t_falkon=t_f, t_dsg=t_d)
            row.update(warnings=msgs, moved=moved)
            rows.append(row)
            print(
                f"| {name} | {split.n_train} | {dn} | {ref:.4f} | {e:.4f} | {e / ref:.2f} | {t_f:.2f} | {t_d:.2f} | "
                f"{t_d / t_f:.2f} | {len(msgs)} | {moved if moved is None else f'{moved:.3f}'} |",
                flush=True,
            )
    ok = [r for r in rows if r["dsg"] <= 1.15 * r["falkon"] and r["t_dsg"] <= 3 * r["t_falkon"]]
    ratios = np.array([r["dsg"] / r["falkon"] for r in rows])
    print(f"\nwithin 1.15x RMSE and 3x time: {len(ok)} / {len(rows)}; median RMSE ratio {np.median(ratios):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
