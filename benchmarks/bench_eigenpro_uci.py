"""``eigenpro`` with default options against FALKON at the same centers on the 15 shared UCI sets.

Protocol (:mod:`uci`): the seeded 80/20 z-scored split, the cached GPyTorch ExactGP
ARD-RBF hyperparameters (``uci_hyperparameters.json``), targets ``y - mean`` with ``noise``, the
mean added back to predictions. FALKON (defaults) picks ``M = min(5000, n_train)`` uniform centers
(``random_state=0``); eigenpro (defaults) gets the same centers (``centers=falkon.centers_``).

Per set and dtype the table prints the test RMSE of eigenpro, its ratio to float64 FALKON's RMSE
(the accuracy reference), eigenpro's fit time and its ratio to FALKON's fit time in the same dtype,
both measured in this process one after the other (the machine is shared: read the ratios), plus
what eigenpro chose (batch, Nystrom q, epochs run) and whether it warned. Targets: RMSE ratio <= 1.05,
time ratio <= 2.

Usage (one command)::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_eigenpro_uci.py [--sets pol,bike] [--dtypes float32]
        [--options '{"epochs": 20}'] [--json out.json] [--solver eigenpro4]

``--solver eigenpro4`` compares ``eigenpro4`` (defaults) in the same way.
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
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from uci import ALL_SETS, cached_hyperparameters, load_split, make_kernel, rmse  # noqa: E402

import kgp  # noqa: E402

MAX_CENTERS = 5000


def fit(split, hyper, solver, dtype, centers=None, options=None):
    """Fit one model; return (model, seconds, test RMSE, warnings, error)."""
    kernel = make_kernel(hyper, dtype)
    where = {"centers": centers} if centers is not None else {"n_centers": min(MAX_CENTERS, split.n_train)}
    model = kgp.KernelRegressor(
        kernel,
        noise=hyper["noise"],
        solver=solver,
        random_state=0,
        dtype=dtype,
        solver_options=options or {},
        **where,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kgp.ConvergenceWarning)
        start = time.perf_counter()
        try:
            model.fit(split.X_train, split.y_train - hyper["mean"])
        except Exception as exc:  # noqa: BLE001 - reported in the table, the sweep goes on
            return model, time.perf_counter() - start, float("nan"), caught, exc
        seconds = time.perf_counter() - start
    pred = np.asarray(model.predict(split.X_test), dtype=np.float64).reshape(-1) + hyper["mean"]
    return model, seconds, rmse(pred, split.y_test), caught, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(ALL_SETS), help="comma-separated UCI set names")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--options", default="{}", help="eigenpro solver_options as JSON (default: none)")
    parser.add_argument(
        "--solver", default="eigenpro", choices=("eigenpro", "eigenpro4"), help="the EigenPro solver compared"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_flush_denormal(True)  # denormal kernel values slow float32 LAPACK (shared/notes/machine.md)
    options = json.loads(args.options)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}, "
        f"{args.solver} options {options or 'defaults'}"
    )
    names = [s for s in args.sets.split(",") if s]
    hypers = cached_hyperparameters(names)
    rows = []
    header = (
        f"| set | n | d | M | dtype | falkon64 RMSE | {args.solver} RMSE | RMSE ratio | falkon s | {args.solver} s "
        "| time ratio | batch | q | epochs | note |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in names:
        split, hyper = load_split(name), hypers[name]
        ref, ref_s, ref_rmse, _, ref_err = fit(split, hyper, "falkon", torch.float64)
        if ref_err is not None:
            print(f"| {name} | falkon float64 failed: {ref_err} |")
            continue
        for dt in args.dtypes.split(","):
            dtype = getattr(torch, dt)
            if dtype == torch.float64:
                fk_s = ref_s
            else:
                _, fk_s, _, _, _ = fit(split, hyper, "falkon", dtype)
            model, ep_s, ep_rmse, caught, err = fit(
                split, hyper, args.solver, dtype, centers=ref.centers_.to(dtype), options=options
            )
            hist = getattr(model, "history_", None) or []
            extras = hist[-1].extras if hist else {}
            note = f"{type(err).__name__}" if err is not None else ""
            if caught:
                note += (
                    " ConvergenceWarning" if any(issubclass(w.category, kgp.ConvergenceWarning) for w in caught) else ""
                )
            row = {
                "set": name,
                "n": split.n_train,
                "d": split.d,
                "M": int(ref.centers_.shape[0]),
                "dtype": dt,
                "falkon64_rmse": ref_rmse,
                "eigenpro_rmse": ep_rmse,
                "rmse_ratio": ep_rmse / ref_rmse,
                "falkon_s": fk_s,
                "eigenpro_s": ep_s,
                "time_ratio": ep_s / fk_s,
                "batch": extras.get("batch_size"),
                "q": extras.get("q"),
                "epochs": len(hist),
                "note": note.strip(),
                "messages": [str(w.message) for w in caught] + ([str(err)] if err is not None else []),
            }
            rows.append(row)
            print(
                f"| {name} | {row['n']} | {row['d']} | {row['M']} | {dt} | {ref_rmse:.4f} | {ep_rmse:.4f} "
                f"| {row['rmse_ratio']:.3f} | {fk_s:.1f} | {ep_s:.1f} | {row['time_ratio']:.2f} | {row['batch']} "
                f"| {row['q']} | {row['epochs']} | {row['note']} |",
                flush=True,
            )
    ok = [r for r in rows if r["rmse_ratio"] <= 1.05 and r["time_ratio"] <= 2.0]
    print(f"\n{len(ok)} of {len(rows)} rows meet both targets (RMSE ratio <= 1.05, time ratio <= 2)")
    for r in rows:
        for message in r["messages"]:
            print(f"  {r['set']} {r['dtype']}: {message}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
