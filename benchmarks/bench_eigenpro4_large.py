"""EigenPro 4 (`eigenpro4`) at many centers on the large synthetic set, against FALKON and EigenPro 3.0 (`eigenpro`).

One command, one table::

    OMP_NUM_THREADS=2 python benchmarks/bench_eigenpro4_large.py --n 1000000 --centers 100000 --epochs 1 \\
        --falkon-centers 10000 20000 --eigenpro-budget 0
    OMP_NUM_THREADS=2 python benchmarks/bench_eigenpro4_large.py --n 200000 --centers 64000 --epochs 2 \\
        --eigenpro-budget 5

Data: :class:`kgp.datasets.PriorDraw` ``(d, seed, noise_std)`` (d = 8, seed 0, noise std 0.1), the rows of
benchmarks/bench_large.py: the first n rows of the train split, read memory-mapped from the ``.npy`` files that
``bench_large.py`` writes to ``--cache`` (the smallest cached set with at least n rows; generated in memory when
there is none), and the first ``--n-test`` rows of the test split. The best possible test RMSE is the noise std:
the table reports the excess ``sqrt(RMSE^2 - noise_std^2)``.

Model: the generator's own kernel, fixed (nothing learned): ARD RBF with its lengthscales, outputscale 1, noise
variance ``noise_std^2``. The inputs are divided by the lengthscales once, so every solver sees an isotropic RBF
with lengthscale 1 (the same kernel). Float32 inputs (``--dtype``). Centers: uniform training rows, nested (a
seeded permutation's first M rows), so ``eigenpro4`` and ``eigenpro`` at the same M use the same centers.

Runs, back to back in one process:

1. ``eigenpro4`` at ``--centers`` M for ``--epochs`` epochs (``--ep4-options``: more of its options as JSON);
2. ``falkon`` at each of ``--falkon-centers`` (its defaults: 20 CG iterations): the comparison is with the largest
   of them whose fit took no longer than ``eigenpro4``'s (the table marks it). Its kernel blocks take up to
   ``kgp.settings.memory_budget`` (a fifth of the RAM by default); ``--falkon-budget-mib`` sets a smaller one,
   to compare at ``eigenpro4``'s peak memory;
3. ``eigenpro`` at the same M and centers, with a wall budget of ``--eigenpro-budget`` times ``eigenpro4``'s fit
   time (0: not run): it stops at the end of the first epoch whose validation RMSE is at most ``eigenpro4``'s
   final one, or the first past the budget. Its time to reach ``eigenpro4``'s accuracy is read from its
   per-epoch validation RMSE (``--n-val`` test rows, evaluated inside the fit's clock);
4. ``--reference PATH``: the EigenPro 4 reference code (``ep4_reference.py``: its ``gaussian`` kernel of bandwidth 1
   on the same scaled inputs, the same centers, ``--reference-epochs`` (default ``--epochs``), float32, no ridge
   term; its own s = 2,000 / q = 100 preconditioners, batch and period otherwise), its after-epoch test evaluation
   on the ``--n-val`` rows inside its clock; a row ``reference`` in the table, the verdict against ``eigenpro4``
   below it.

Columns: fit wall and CPU seconds, test RMSE and excess, peak RSS of the phase (the high-water mark reset through
``/proc/self/clear_refs`` before each fit where Linux allows it; the training rows are already in memory), the
ratios to ``eigenpro4``, and the load average when the fit ended. ``--device cuda``: the kgp fits run on the
card (the rows are moved there by the estimator), and each JSON line has ``peak_device``, the card's peak
allocated bytes during the fit. Every fit is appended as a JSON line to ``--jsonl`` with the host, load, thread
count and the fit's ``kgp.settings.memory_budget`` (None for the reference).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402
from kgp.datasets import PriorDraw, excess_rmse  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_large  # noqa: E402  (the data cache and the host and memory readings)
import ep4_reference  # noqa: E402

RUNS = HERE / "bench_eigenpro4_runs.jsonl"
CACHE = HERE / "output" / "large_data"  # bench_large.py's default cache


# ---------------------------------------------------------------------- host and memory
def reset_peak() -> None:
    """Reset the RSS high-water mark (Linux; ``bench_large.reset_peak_rss``)."""
    bench_large.reset_peak_rss()


def peak_rss() -> int | None:
    """The RSS high-water mark since the last :func:`reset_peak`, in bytes."""
    return bench_large.peak_rss_bytes()


cpu_model = bench_large.cpu_model


def load_average() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------------- data
def _cached(cache: Path | None, stem: str, split: str, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The first ``rows`` rows of the smallest cached ``split`` set holding at least that many, memory-mapped."""
    if cache is None or not cache.is_dir():
        return None
    best = None
    for path in cache.glob(f"{stem}_{split}*_X.npy"):
        size = path.name[len(f"{stem}_{split}") : -len("_X.npy")]
        if size.isdigit() and int(size) >= rows and path.with_name(path.name[: -len("X.npy")] + "y.npy").is_file():
            best = min(best or int(size), int(size))
    if best is None:
        return None
    X = np.load(cache / f"{stem}_{split}{best}_X.npy", mmap_mode="r")
    y = np.load(cache / f"{stem}_{split}{best}_y.npy", mmap_mode="r")
    return X[:rows], y[:rows]


def load_data(n: int, n_test: int, d: int, seed: int, noise_std: float, cache: Path | None, dtype) -> dict[str, Any]:
    """Training and test rows of ``PriorDraw(d, seed, noise_std)``, divided by its lengthscales, in ``dtype``.

    Returns a dict with ``X``, ``y``, ``X_test``, ``y_test`` (tensors), ``source`` (the cache or "generated")
    and the generator's ``lengthscale``.
    """
    draw = PriorDraw(d, seed=seed, noise_std=noise_std)
    stem = f"prior_d{d}_s{seed}_noise{noise_std:g}"
    out: dict[str, Any] = {"lengthscale": draw.lengthscale.tolist(), "outputscale": draw.outputscale}
    sources = []
    for split, rows, names in (("train", n, ("X", "y")), ("test", n_test, ("X_test", "y_test"))):
        found = _cached(cache, stem, split, rows)
        if found is None:
            found = draw.sample(rows, split=split)
            sources.append(f"{split}: generated")
        else:
            sources.append(f"{split}: {cache}")
        X = np.asarray(found[0], dtype=np.float64) / draw.lengthscale
        out[names[0]] = torch.as_tensor(X.astype(dtype, copy=False))
        out[names[1]] = torch.as_tensor(np.asarray(found[1], dtype=dtype))
    out["source"] = ", ".join(sources)
    return out


# ---------------------------------------------------------------------- fits
def fit_one(
    solver: str,
    data: dict[str, Any],
    Z: torch.Tensor,
    noise_var: float,
    options: dict[str, Any],
    *,
    n_val: int = 0,
    stop_rmse: float | None = None,
    budget: float | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Fit ``solver`` on the centers ``Z``; test RMSE, times, peak RSS and the per-iteration validation curve.

    ``stop_rmse`` / ``budget``: stop at the end of the first iteration whose validation RMSE is at most
    ``stop_rmse``, or whose elapsed seconds reach ``budget`` (``n_val`` > 0 needed for the first).
    """

    def callback(info: kgp.IterationInfo) -> bool:
        if stop_rmse is not None and info.metric is not None and math.sqrt(info.metric) <= stop_rmse:
            return True
        return budget is not None and info.elapsed >= budget

    model = kgp.KernelRegressor(
        "rbf",
        lengthscale=1.0,
        noise=noise_var,
        solver=solver,
        centers=Z,
        solver_options=options,
        dtype=data["X"].dtype,
        device=device,
        random_state=0,
        callback=callback,
    )
    validation = (data["X_test"][:n_val], data["y_test"][:n_val]) if n_val > 0 else None
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak()
    load_start = load_average()
    start, cpu_start = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data["X"], data["y"], validation_data=validation)
    fit_seconds, fit_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = peak_rss()
    peak_device = torch.cuda.max_memory_allocated(device) if on_cuda else None
    mean = model.predict(data["X_test"]).double().cpu().numpy().reshape(-1)
    rmse = float(np.sqrt(np.mean((data["y_test"].double().numpy() - mean) ** 2)))
    history = model.history_ or []
    last = dict(history[-1].extras) if history else {}
    curve = [
        {"iteration": h.iteration, "elapsed": h.elapsed, "val_rmse": math.sqrt(h.metric)}
        for h in history
        if h.metric is not None
    ]
    keep = ("batch_size", "projection_period", "projections", "memory_estimate", "setup_time", "q", "s")
    extras = {k: last[k] for k in keep if isinstance(last.get(k), (int, float, str))}
    for key in ("time_steps", "time_projection"):
        if history and key in last:
            extras[key] = sum(h.extras.get(key, 0.0) for h in history)
    return {
        "solver": solver,
        "M": int(Z.shape[0]),
        "options": options,
        "iterations": len(history),
        "fit_seconds": fit_seconds,
        "fit_cpu_seconds": fit_cpu,
        "rmse": rmse,
        "peak_rss": peak,
        "peak_device": peak_device,
        "memory_budget": kgp.settings.memory_budget.value(device),
        "load_start": load_start,
        "load_end": load_average(),
        "curve": curve,
        "extras": extras,
        "warnings": [f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught],
    }


def fit_reference(path: Path, data: dict[str, Any], Z: torch.Tensor, epochs: int, n_val: int) -> dict[str, Any]:
    """The reference code on the centers ``Z`` (see the module docstring); the keys of :func:`fit_one`'s result."""
    kernel_fn = ep4_reference.kernel(path, "gaussian", 1.0)
    val = max(1, n_val)
    reset_peak()
    load_start = load_average()
    cpu_start = time.process_time()
    predict, seconds = ep4_reference.fit_reference(
        path,
        kernel_fn,
        Z,
        data["X"],
        data["y"].reshape(-1, 1),
        data["X_test"][:val],
        data["y_test"][:val].reshape(-1, 1),
        epochs,
    )
    fit_cpu = time.process_time() - cpu_start
    peak = peak_rss()
    mean = predict(data["X_test"]).double().numpy().reshape(-1)
    rmse = float(np.sqrt(np.mean((data["y_test"].double().numpy() - mean) ** 2)))
    return {
        "solver": "reference",
        "M": int(Z.shape[0]),
        "options": {"epochs": epochs, "s": ep4_reference.SUBSAMPLE, "q": ep4_reference.LEVEL},
        "iterations": epochs,
        "fit_seconds": seconds,
        "fit_cpu_seconds": fit_cpu,
        "rmse": rmse,
        "peak_rss": peak,
        "peak_device": None,
        "memory_budget": None,
        "load_start": load_start,
        "load_end": load_average(),
        "curve": [],
        "extras": {},
        "warnings": [],
    }


def reach_seconds(curve: list[dict[str, float]], target: float) -> float | None:
    """Elapsed seconds of the first iteration whose validation RMSE is at most ``target`` (None: never)."""
    return next((c["elapsed"] for c in curve if c["val_rmse"] <= target), None)


# ---------------------------------------------------------------------- table
def gb(value: int | None) -> str:
    return f"{value / 1e9:.2f}" if value else "-"


def table(results: list[dict[str, Any]], noise_std: float) -> str:
    """The markdown table (one row per fit, ratios to the first ``eigenpro4`` row)."""
    ref = next(r for r in results if r["solver"] == "eigenpro4")
    ref_excess = excess_rmse(ref["rmse"], noise_std)
    lines = [
        "| run | M | iterations | fit s | CPU s | RMSE | excess | peak RSS GB | excess / eigenpro4 | time / eigenpro4 "
        "| load (end) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        excess = excess_rmse(r["rmse"], noise_std)
        mark = " (largest within eigenpro4's time)" if r.get("largest_within_time") else ""
        lines.append(
            f"| {r['solver']}{mark} | {r['M']:,} | {r['iterations']} | {r['fit_seconds']:.1f} | "
            f"{r['fit_cpu_seconds']:.1f} | {r['rmse']:.4f} | {excess:.4f} | {gb(r['peak_rss'])} | "
            f"{excess / ref_excess if ref_excess else float('nan'):.2f} | {r['fit_seconds'] / ref['fit_seconds']:.2f} "
            f"| {r['load_end']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="training rows")
    ap.add_argument("--n-test", type=int, default=10_000, help="test rows")
    ap.add_argument("--n-val", type=int, default=2_000, help="test rows scored after every epoch (the curves)")
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise-std", type=float, default=0.1)
    ap.add_argument("--cache", default=str(CACHE), help="bench_large.py's .npy cache ('' : generate in memory)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--device", default="cpu", help="the kgp fits' device (the reference runs on the CPU only)")
    ap.add_argument("--centers", type=int, default=100_000, help="M of eigenpro4 (and eigenpro)")
    ap.add_argument("--epochs", type=int, default=1, help="eigenpro4's epochs")
    ap.add_argument("--ep4-options", default="{}", help="more eigenpro4 options, as JSON")
    ap.add_argument("--falkon-centers", type=int, nargs="*", default=[], help="M of each falkon fit")
    ap.add_argument("--falkon-options", default="{}", help="falkon options, as JSON")
    ap.add_argument(
        "--falkon-budget-mib", type=float, default=0.0, help="memory_budget of the falkon fits, MiB (0: the default)"
    )
    ap.add_argument("--eigenpro-budget", type=float, default=0.0, help="eigenpro's wall budget / eigenpro4's (0: skip)")
    ap.add_argument("--eigenpro-epochs", type=int, default=20, help="eigenpro's most epochs")
    ap.add_argument("--eigenpro-options", default="{}", help="more eigenpro options, as JSON")
    ap.add_argument("--reference", default=None, help="directory holding the EigenPro 4 reference's eigenpro/")
    ap.add_argument("--reference-epochs", type=int, default=None, help="the reference's epochs (default: --epochs)")
    ap.add_argument("--jsonl", default=str(RUNS), help="JSON lines appended here ('' : none)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the fits of the command line; print the table; return the results (one dict per fit)."""
    args = parse_args(argv)
    dtype = np.float32 if args.dtype == "float32" else np.float64
    t0 = time.perf_counter()
    data = load_data(
        args.n, args.n_test, args.d, args.seed, args.noise_std, Path(args.cache) if args.cache else None, dtype
    )
    n = data["X"].shape[0]
    noise_var = args.noise_std**2
    host = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "device": torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else "cpu",
    }
    print(
        f"host: {host['cpu']}, {host['cores']} cores, torch {host['torch']} with {host['threads']} threads; "
        f"load {load_average():.2f} (start); n = {n:,}, d = {args.d}, {args.dtype}; data ({data['source']}) "
        f"read in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))

    def centers(m: int) -> torch.Tensor:
        return data["X"][order[: min(m, n)]].clone()

    results: list[dict[str, Any]] = []

    def record(result: dict[str, Any]) -> None:
        result.update(n=n, d=args.d, dtype=args.dtype, host=host, excess=excess_rmse(result["rmse"], args.noise_std))
        results.append(result)
        print(
            f"  {result['solver']} M = {result['M']:,}: {result['fit_seconds']:.1f} s, RMSE {result['rmse']:.4f}, "
            f"excess {result['excess']:.4f}, {result['iterations']} iterations, load {result['load_end']:.2f}",
            flush=True,
        )
        if args.jsonl:
            with open(args.jsonl, "a") as fh:
                fh.write(json.dumps(result) + "\n")

    Z = centers(args.centers)
    ep4_options = {"epochs": args.epochs, **json.loads(args.ep4_options)}
    record(fit_one("eigenpro4", data, Z, noise_var, ep4_options, n_val=args.n_val, device=args.device))
    ep4 = results[0]
    ep4_val = ep4["curve"][-1]["val_rmse"] if ep4["curve"] else None

    falkon_options = json.loads(args.falkon_options)
    falkon = []
    for m in args.falkon_centers:
        budget = args.falkon_budget_mib
        with kgp.settings.memory_budget(int(budget * 2**20)) if budget else contextlib.nullcontext():
            record(fit_one("falkon", data, centers(m), noise_var, falkon_options, device=args.device))
        falkon.append(results[-1])
    within = [r for r in falkon if r["fit_seconds"] <= ep4["fit_seconds"]]
    if within:
        max(within, key=lambda r: r["M"])["largest_within_time"] = True

    eigenpro = None
    if args.eigenpro_budget > 0:
        budget = args.eigenpro_budget * ep4["fit_seconds"]
        options = {"epochs": args.eigenpro_epochs, **json.loads(args.eigenpro_options)}
        record(
            fit_one(
                "eigenpro",
                data,
                Z,
                noise_var,
                options,
                n_val=args.n_val,
                stop_rmse=ep4_val,
                budget=budget,
                device=args.device,
            )
        )
        eigenpro = results[-1]

    reference = None
    ref_path = ep4_reference.available(args.reference)
    if ref_path is not None and torch.device(args.device).type != "cpu":
        print(f"SKIP reference: it runs on the CPU here, the kgp fits on {args.device}")
        ref_path = None
    if ref_path is not None:
        record(fit_reference(ref_path, data, Z, args.reference_epochs or args.epochs, args.n_val))
        reference = results[-1]

    print()
    print(table(results, args.noise_std))
    print()
    if falkon:
        best = next((r for r in falkon if r.get("largest_within_time")), None)
        if best is None:
            print(f"falkon: no M of {args.falkon_centers} fitted within eigenpro4's {ep4['fit_seconds']:.1f} s")
        else:
            verdict = "lower" if ep4["rmse"] < best["rmse"] else "not lower"
            print(
                f"eigenpro4 M = {ep4['M']:,} against falkon M = {best['M']:,} (the largest within its time): test "
                f"RMSE {ep4['rmse']:.4f} against {best['rmse']:.4f} ({verdict}), time {ep4['fit_seconds']:.1f} s "
                f"against {best['fit_seconds']:.1f} s"
            )
    if eigenpro is not None and ep4_val is not None:
        reach = reach_seconds(eigenpro["curve"], ep4_val)
        reached = (
            f"reached it after {reach:.1f} s: {reach / ep4['fit_seconds']:.2f}x eigenpro4's fit time"
            if reach is not None
            else f"did not reach it in {eigenpro['fit_seconds']:.1f} s "
            f"(> {eigenpro['fit_seconds'] / ep4['fit_seconds']:.2f}x eigenpro4's fit time)"
        )
        print(
            f"eigenpro4's validation RMSE {ep4_val:.4f} after {ep4['fit_seconds']:.1f} s; eigenpro at the same M "
            f"{reached}; its curve: "
            + ", ".join(f"{c['elapsed']:.0f} s {c['val_rmse']:.4f}" for c in eigenpro["curve"])
        )
    if reference is not None:
        verdict = "lower" if ep4["rmse"] < reference["rmse"] else "not lower"
        print(
            f"eigenpro4 ({args.epochs} epoch(s)) against the reference ({reference['iterations']} epoch(s)) at "
            f"M = {ep4['M']:,}: test RMSE "
            f"{ep4['rmse']:.4f} against {reference['rmse']:.4f} ({verdict}); time {ep4['fit_seconds']:.1f} s against "
            f"{reference['fit_seconds']:.1f} s ({reference['fit_seconds'] / ep4['fit_seconds']:.2f}x)"
        )
    ex = dict(ep4["extras"])
    if "memory_estimate" in ex:
        ex["memory_estimate MiB"] = ex.pop("memory_estimate") / 2**20
    print(
        "eigenpro4: "
        + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in ex.items())
        + f"; load {load_average():.2f} (end)"
    )
    for r in results:
        for w in sorted(set(r["warnings"])):
            print(f"  ({r['solver']} M = {r['M']:,}) {w}")
    return results


if __name__ == "__main__":
    main()
