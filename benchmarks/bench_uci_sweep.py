"""The float32 / float64 sweep of every built-in solver on the 15 shared UCI sets.

Protocol (``benchmarks/uci.py``): seeded 80/20 split, z-scored with training statistics; ARD RBF
hyperparameters learned once per set (a GPyTorch ``ExactGP`` on a 3,000-point subset, cached in
``benchmarks/uci_hyperparameters.json``, see ``benchmarks/uci.py``). Every solver fits
``y - mean`` with the learned noise, in float32 and float64, with default options:

- ``exact`` where n_train <= 15,000;
- ``falkon`` and ``eigenpro`` on the same M = min(5,000, n_train) uniform centers (seed 0);
- ``dsg`` (no centers).

One table per run: test RMSE, fit time, iterations / epochs, and what the solver reported
(factorization, rank, jitter, distance and accumulation dtypes; batch and step size; features).
Ratios are taken against FALKON float64 on the same set, measured in the same process. With
``--write`` the table goes to ``docs/benchmarks/uci_sweep.md`` (between markers, the prose there is
kept).

Usage::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 .venv/bin/python \\
        benchmarks/bench_uci_sweep.py [--sets pol,bike] [--solvers falkon,eigenpro] [--dtypes float32] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import uci  # noqa: E402

import kgp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks" / "uci_sweep.md"
BEGIN, END = "<!-- sweep table: begin -->", "<!-- sweep table: end -->"
M_MAX = 5000
EXACT_MAX = 15_000
SOLVERS = ("exact", "falkon", "eigenpro", "dsg")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
REPORTED = (
    "factorization",
    "rank",
    "jitter",
    "distances",
    "accumulate",
    "batch_size",
    "step_size",
    "q",
    "n_features",
    "gamma",
)


def describe(extras: dict) -> str:
    parts = []
    for key in REPORTED:
        if key in extras:
            value = extras[key]
            parts.append(f"{key}={value:.2g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


def run_one(
    split: uci.Split,
    hyper: dict,
    solver: str,
    dtype: torch.dtype,
    centers: np.ndarray | None,
    solver_options: dict | None = None,
) -> dict:
    kernel = uci.make_kernel(hyper, dtype)
    params = dict(noise=hyper["noise"], solver=solver, random_state=0, dtype=dtype, solver_options=solver_options)
    if solver in ("falkon", "eigenpro"):
        params["centers"] = centers
    model = kgp.KernelRegressor(kernel, **params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        model.fit(split.X_train, split.y_train - hyper["mean"])
        fit_time = time.perf_counter() - start
    pred = np.asarray(model.predict(split.X_test), dtype=np.float64) + hyper["mean"]
    extras = model.history_[-1].extras if model.history_ else {}
    notes = sorted({type(w.message).__name__ for w in caught if issubclass(w.category, Warning)})
    # where the time goes: everything up to the end of the first iteration (setup included), then per step
    times = [info.elapsed for info in model.history_]
    per_step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return {
        "first_s": times[0] if times else float("nan"),
        "per_step_s": per_step,
        "rmse": uci.rmse(pred, split.y_test),
        "fit_s": fit_time,
        "steps": len(model.history_),
        "reported": describe(extras),
        "warnings": ",".join(n for n in notes if n in ("ConvergenceWarning", "RuntimeWarning")),
    }


def sweep(sets, solvers, dtypes, hypers: dict, solver_options: dict | None = None, m_max: int = M_MAX) -> list[dict]:
    rows = []
    for name in sets:
        split = uci.load_split(name)
        hyper = hypers[name]
        m = min(m_max, split.n_train)
        idx = torch.randperm(split.n_train, generator=torch.Generator().manual_seed(0))[:m].numpy()
        centers = split.X_train[idx]
        for solver in solvers:
            if solver == "exact" and split.n_train > EXACT_MAX:
                continue
            for dname in dtypes:
                row = {"set": name, "n": split.n_train, "d": split.d, "M": m, "solver": solver, "dtype": dname}
                try:
                    with kgp.settings.max_exact_size(EXACT_MAX):
                        row.update(run_one(split, hyper, solver, DTYPES[dname], centers, solver_options))
                except Exception as exc:  # a failure is a result of the sweep, not the end of it
                    row.update(rmse=float("nan"), fit_s=float("nan"), steps=0, reported=f"{type(exc).__name__}: {exc}")
                    traceback.print_exc()
                row["load"] = os.getloadavg()[0]
                rows.append(row)
                print(
                    f"  {name:13s} {solver:9s} {dname:8s} rmse {row['rmse']:.4f} fit {row['fit_s']:7.2f} s "
                    f"steps {row['steps']:3d} {row['reported']} {row.get('warnings', '')}",
                    flush=True,
                )
    return rows


def table(rows: list[dict]) -> str:
    falkon = {(r["set"], r["dtype"]): r for r in rows if r["solver"] == "falkon" and np.isfinite(r["rmse"])}
    lines = [
        "| set | n | d | M | solver | dtype | test RMSE | RMSE / falkon f64 | fit s | time / falkon f64 | "
        "time / falkon same dtype | iters | to 1st iter s | s / iter | reported | warnings | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = falkon.get((r["set"], "float64"))
        same = falkon.get((r["set"], r["dtype"]))
        rr = r["rmse"] / base["rmse"] if base else float("nan")
        tr = r["fit_s"] / base["fit_s"] if base else float("nan")
        ts = r["fit_s"] / same["fit_s"] if same else float("nan")
        load = f"{r['load']:.1f}" if "load" in r else ""
        lines.append(
            f"| {r['set']} | {r['n']} | {r['d']} | {r['M']} | {r['solver']} | {r['dtype']} | {r['rmse']:.4f} | "
            f"{rr:.3f} | {r['fit_s']:.2f} | {tr:.2f} | {ts:.2f} | {r['steps']} | "
            f"{r.get('first_s', float('nan')):.2f} | {r.get('per_step_s', float('nan')):.3f} | {r['reported']} | "
            f"{r.get('warnings', '')} | {load} |"
        )
    return "\n".join(lines)


def write_doc(text: str, header: str) -> None:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    body = f"{BEGIN}\n{header}\n\n{text}\n{END}"
    if DOC.is_file():
        old = DOC.read_text()
        if BEGIN in old and END in old:
            new = old[: old.index(BEGIN)] + body + old[old.index(END) + len(END) :]
            DOC.write_text(new)
            return
        DOC.write_text(old.rstrip() + "\n\n" + body + "\n")
        return
    DOC.write_text(f"# UCI sweep\n\n{body}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(uci.ALL_SETS))
    ap.add_argument("--solvers", default=",".join(SOLVERS))
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument(
        "--solver-options",
        type=json.loads,
        default=None,
        help='JSON object passed as solver_options to every fit, e.g. \'{"precond_dtype": "input"}\' (one solver)',
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="build the table from rows written by earlier --json runs instead of fitting; a later file's row "
        "replaces an earlier one for the same set, solver and dtype (to re-run one solver after a change)",
    )
    ap.add_argument(
        "--centers",
        type=int,
        default=M_MAX,
        help=f"M, the uniform centers of falkon and eigenpro (at most n_train; default {M_MAX:,}; the large-M row: "
        "--sets kin40k --solvers falkon --centers 20000)",
    )
    ap.add_argument("--header", default="", help="with --combine: the line written above the table")
    ap.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(ROOT)}")
    args = ap.parse_args()
    if args.combine:
        combined: dict = {}
        for path in args.combine:
            for row in json.loads(Path(path).read_text()):
                combined[(row["set"], row["solver"], row["dtype"])] = row
        order = {name: i for i, name in enumerate(uci.ALL_SETS)}
        solver_order = {name: i for i, name in enumerate(SOLVERS)}
        rows = sorted(
            combined.values(), key=lambda r: (order.get(r["set"], 99), solver_order.get(r["solver"], 99), r["dtype"])
        )
        text = table(rows)
        print(text)
        if args.write:
            write_doc(text, args.header or f"combined from {', '.join(Path(p).name for p in args.combine)}")
        return
    sets = [s for s in args.sets.split(",") if s]
    hypers = uci.cached_hyperparameters(sets)
    header = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}, "
        f"learned GPyTorch hyperparameters, load average at start {os.getloadavg()[0]:.2f}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(header)
    rows = sweep(sets, args.solvers.split(","), args.dtypes.split(","), hypers, args.solver_options, args.centers)
    text = table(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write:
        write_doc(text, header)


if __name__ == "__main__":
    main()
