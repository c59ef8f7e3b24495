"""``eigenpro4``'s step and projection at two commits, paired in one process: where one epoch's seconds go.

One command, one table::

    OMP_NUM_THREADS=1 python benchmarks/bench_eigenpro4_fused.py --n 100000 --centers 20000 --before 0d00187

Runs ``eigenpro4`` (``--epochs`` epochs, default options) on the data of benchmarks/bench_eigenpro4_large.py (the
generator's kernel, fixed, on ``kgp.datasets.PriorDraw(8, seed=0, noise_std=0.1)``; uniform nested centers), once
with the solver's code at ``--before`` (its ``plugins/kgp_builtins/eigenpro4`` read from git into a temporary
package; everything else, ``kgp.operators`` included, is this checkout's) and once with this checkout's, the two
alternating ``--repeats`` times on the same data, centers and seed. For each fit: wall and CPU seconds, and the
CPU seconds and kernel entries of its parts:

- steps (``DelayedState.step``): ``m (M + e + temporaries)`` entries per step;
- projections (``DelayedProjection.solve``): ``M^2`` per inner epoch (none for the exact solve);
- absorb (``DelayedState.absorb`` and ``DelayedProjection.residual``): the carried residual's ``K(Z, Z) v``
  (``M^2``, none after the exact solve) and ``f(X_s)`` (``s M`` where it is formed, not kept);
- the rest (setup: preconditioners and curvature estimates).

Entries are the algorithm's (the same count for both commits), so entries per CPU second compare the two
implementations directly. In the same process FALKON's pass ``K^T (K v)`` (float64 sums, as FALKON runs it) on
``K(X, Z)`` is timed for reference: ``n M`` entries per pass. Ratios are of the paired runs (before / after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402
from kgp import settings  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_eigenpro4_large as large  # noqa: E402  (data, centers, one fit)
from at_commit import load_package, unload  # noqa: E402

PACKAGE = "plugins/kgp_builtins/eigenpro4"


class Meter:
    """CPU seconds and kernel entries of the parts of a fit, by wrapping the state's and projection's methods."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {}
        self.patched: list[tuple[type, str, Any]] = []

    def add(self, part: str, cpu: float, entries: float) -> None:
        seconds, count = self.parts.get(part, [0.0, 0.0])
        self.parts[part] = [seconds + cpu, count + entries]

    def wrap(self, cls: type, method: str, part: str, entries) -> None:
        original = getattr(cls, method)
        meter = self

        def timed(self, *args, **kwargs):
            count = entries(self, *args)
            c0 = time.process_time()
            out = original(self, *args, **kwargs)
            meter.add(part, time.process_time() - c0, count)
            return out

        self.patched.append((cls, method, original))
        setattr(cls, method, timed)

    def restore(self) -> None:
        """Put the wrapped methods back."""
        for cls, method, original in reversed(self.patched):
            setattr(cls, method, original)
        self.patched = []


def _solve_entries(pr: Any, h: torch.Tensor) -> int:
    """Kernel entries of one projection: ``epochs M^2`` for the inner epochs, none for the exact solve."""
    inner = getattr(pr, "inner", None)
    return 0 if inner is None else inner.epochs * inner.Z.shape[0] ** 2


def _absorb_entries(st: Any, v: torch.Tensor, carry: Any) -> int:
    """Kernel entries of one ``absorb``. Solvers whose ``absorb`` takes ``carry: bool`` form the residual's
    ``K(Z, Z) v`` there (``M^2``) and ``f(X_s)`` (``s M``); those that take the residual itself (formed by
    ``DelayedProjection.residual``, metered apart) form ``f(X_s)`` only where it is not kept (``f_z``)."""
    s = st.pre.points.shape[0]
    if isinstance(carry, bool):
        return st.M * (st.M * carry + s)
    kept = getattr(st, "f_z", None) is not None and carry is not None
    return 0 if kept else st.M * s


def _residual_entries(pr: Any, v: torch.Tensor, h: torch.Tensor) -> int:
    """Kernel entries of ``DelayedProjection.residual``: ``M^2`` after the inner epochs, none after the exact one."""
    return 0 if getattr(pr, "inner", None) is None else pr.Z.shape[0] ** 2


def instrument(package: Any, meter: Meter) -> None:
    """Wrap ``package``'s step, projection and absorb with ``meter`` (entries as the module docstring counts them)."""
    state, projection = package.state.DelayedState, package.projection.DelayedProjection
    meter.wrap(state, "step", "steps", lambda st, Xb, *a: Xb.shape[0] * st.used)
    meter.wrap(projection, "solve", "projections", _solve_entries)
    meter.wrap(state, "absorb", "absorb", _absorb_entries)
    if hasattr(projection, "residual"):
        meter.wrap(projection, "residual", "absorb", _residual_entries)


def falkon_pass(X: torch.Tensor, Z: torch.Tensor, repeats: int = 2) -> float:
    """Entries per CPU second of FALKON's pass ``K(X, Z)^T (K(X, Z) v)`` with float64 sums (best of ``repeats``)."""
    kernel = kgp.kernels.make_kernel("rbf", 1.0).to(X.dtype).requires_grad_(False)
    v = torch.randn(Z.shape[0], 1, generator=torch.Generator().manual_seed(0)).to(X.dtype)
    best = float("inf")
    with torch.no_grad(), settings.kernel_cache("never"):
        for _ in range(repeats):
            op = kgp.kernel_operator(kernel, X, Z)
            c0 = time.process_time()
            op.fused_matmul(v, accumulate=torch.float64)
            best = min(best, time.process_time() - c0)
    return X.shape[0] * Z.shape[0] / best


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", PACKAGE, "kgp/operators"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="training rows")
    ap.add_argument("--centers", type=int, default=20_000, help="M")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--n-test", type=int, default=10_000)
    ap.add_argument("--before", required=True, help="commit whose plugins/kgp_builtins/eigenpro4 is 'before'")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of fits, alternating which runs first")
    ap.add_argument("--cache", default=str(large.CACHE), help="bench_large.py's .npy cache ('' : generate)")
    ap.add_argument("--ep4-options", default="{}", help="more eigenpro4 options, as JSON")
    ap.add_argument("--jsonl", default="", help="append every fit as a JSON line here ('' : none)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    data = large.load_data(args.n, args.n_test, 8, 0, 0.1, Path(args.cache) if args.cache else None, np.float32)
    n = data["X"].shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    Z = data["X"][order[: args.centers]].clone()
    host = f"{large.cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    print(f"host: {host}; commit {git_commit()}; load {os.getloadavg()[0]:.2f}; n = {n:,}, M = {args.centers:,}")

    import kgp_builtins.eigenpro4 as after

    solver_cls = after.solver.EigenPro4Solver
    fits = {"after": solver_cls.fit}
    with tempfile.TemporaryDirectory() as tmp:
        before = load_package(args.before, PACKAGE, Path(tmp))
        fits["before"] = before.solver.EigenPro4Solver.fit
        meters = {"before": Meter(), "after": Meter()}
        instrument(before, meters["before"])
        instrument(after, meters["after"])
        results = []
        try:
            run_pairs(args, data, Z, solver_cls, fits, meters, host, results)
        finally:
            for meter in meters.values():
                meter.restore()
            unload(before)
    rate = falkon_pass(data["X"], Z)
    print(f"FALKON's pass on K(X, Z), same process: {rate:.3g} entries per CPU second")
    print()
    print(table(results, rate))
    return results


def run_pairs(args, data, Z, solver_cls, fits, meters, host, results) -> None:
    """The fits, ``before`` and ``after`` alternating which runs first; each appended to ``results``."""
    n = data["X"].shape[0]
    options = {"epochs": args.epochs, **json.loads(args.ep4_options)}
    for rep in range(args.repeats):
        for variant in ("before", "after") if rep % 2 == 0 else ("after", "before"):
            meter = meters[variant]
            meter.parts = {}
            solver_cls.fit = fits[variant]
            try:
                r = large.fit_one("eigenpro4", data, Z, 0.01, options)
            finally:
                solver_cls.fit = fits["after"]
            r.update(variant=variant, repeat=rep, parts=dict(meter.parts), load=os.getloadavg()[0], host=host)
            results.append(r)
            print(
                f"  {variant} (repeat {rep}): {r['fit_seconds']:.1f} s, CPU {r['fit_cpu_seconds']:.1f} s, "
                f"RMSE {r['rmse']:.6f}, load {r['load']:.2f}",
                flush=True,
            )
            if args.jsonl:
                with open(args.jsonl, "a") as fh:
                    fh.write(json.dumps({**r, "n": n, "before": args.before}) + "\n")


def table(results: list[dict[str, Any]], falkon_rate: float) -> str:
    """One row per part: CPU seconds and entries per CPU second before and after (means over the repeats)."""

    def mean(variant: str, key) -> float:
        values = [key(r) for r in results if r["variant"] == variant]
        return sum(values) / len(values)

    lines = [
        "| part | entries | before CPU s | after CPU s | before / after | before entries/CPU s | after entries/CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for part in ("steps", "projections", "absorb"):
        entries = mean("after", lambda r, p=part: r["parts"].get(p, [0, 0])[1])
        b = mean("before", lambda r, p=part: r["parts"].get(p, [0, 0])[0])
        a = mean("after", lambda r, p=part: r["parts"].get(p, [0, 0])[0])
        lines.append(
            f"| {part} | {entries:.3g} | {b:.2f} | {a:.2f} | {b / a:.2f} | {entries / b:.3g} | {entries / a:.3g} |"
        )

    def rest(r):
        return r["fit_cpu_seconds"] - sum(v[0] for v in r["parts"].values())

    b, a = mean("before", rest), mean("after", rest)
    lines.append(f"| rest (setup) | | {b:.2f} | {a:.2f} | {b / a:.2f} | | |")
    for key, label in (("fit_cpu_seconds", "fit, CPU s"), ("fit_seconds", "fit, wall s")):
        b, a = mean("before", lambda r, k=key: r[k]), mean("after", lambda r, k=key: r[k])
        lines.append(f"| **{label}** | | {b:.2f} | {a:.2f} | **{b / a:.2f}** | | |")
    rb, ra = mean("before", lambda r: r["rmse"]), mean("after", lambda r: r["rmse"])
    lines.append(f"| test RMSE | | {rb:.6f} | {ra:.6f} | | | |")
    lines.append(f"| FALKON's pass (same process) | | | | | | {falkon_rate:.3g} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
