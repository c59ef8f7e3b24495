"""One EigenPro 2.0 epoch (``kgp_builtins.eigenpro.ep2.ep2_epoch``) at two commits, paired in one process.

One command, one table::

    OMP_NUM_THREADS=2 python benchmarks/bench_ep2_epoch.py --before ab98acd --centers 20000 64000 --d 8 28

The epoch is the inexact projection of ``eigenpro`` (one epoch per projection at large M: every step at M = 64,000)
and of ``eigenpro4`` (``projection="eigenpro2"``), and the ``eigenpro2`` solver's iteration. For each M and d: M
standard normal points in d dimensions, an RBF kernel of lengthscale sqrt(d), float32, a random right-hand side,
the same preconditioner (s = min(M, 2,000), q = s / 10 asked) and batch (its critical batch) for both commits;
``--before``'s ``ep2.py`` is read from git into a temporary module
(``at_commit.load_module``; everything it imports is this checkout's). Each epoch runs from the same generator state,
alternating which commit runs first, ``--repeats`` times; the table gives the best wall and CPU seconds of each,
their ratio, and the largest difference of the two epochs' iterates relative to its norm (the same arithmetic up to
the order of the sums).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import torch  # noqa: E402
from kgp_builtins.eigenpro import ep2 as ep2_now  # noqa: E402

import kgp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from at_commit import load_module, unload  # noqa: E402  (the 'before' package)

MODULE = "plugins/kgp_builtins/eigenpro/ep2.py"


def one_epoch(module: Any, kop, state, h: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """Wall and CPU seconds of one epoch from zero, and its iterate."""
    theta = torch.zeros_like(h)
    t0, c0 = time.perf_counter(), time.process_time()
    module.ep2_epoch(kop, state, theta, h, torch.Generator().manual_seed(2))
    return time.perf_counter() - t0, time.process_time() - c0, theta


def measure(before: Any, M: int, d: int, repeats: int) -> dict[str, Any]:
    """Paired epochs of both commits on one problem (module docstring)."""
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(M, d, generator=g)
    h = torch.randn(M, 1, generator=g)
    kernel = kgp.kernels.make_kernel("rbf", float(d) ** 0.5).requires_grad_(False)
    kop = functools.partial(kgp.kernel_operator, kernel)
    runs: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    s = min(M, 2000)
    with torch.no_grad():
        states = {
            name: module.ep2_setup(kop, Z, s, s // 10, 0.0, None, 1.0, torch.Generator().manual_seed(1))
            for name, module in (("before", before), ("after", ep2_now))
        }
        thetas = {}
        for rep in range(repeats):
            order = [("before", before), ("after", ep2_now)]
            for name, module in order if rep % 2 == 0 else order[::-1]:
                wall, cpu, thetas[name] = one_epoch(module, kop, states[name], h)
                runs[name].append((wall, cpu))
    best = {name: (min(w for w, _ in r), min(c for _, c in r)) for name, r in runs.items()}
    diff = float((thetas["after"] - thetas["before"]).norm() / thetas["before"].norm())
    return {"M": M, "d": d, "batch": states["after"].batch, "q": states["after"].pre.q, "best": best, "diff": diff}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="commit whose ep2.py is 'before'")
    ap.add_argument("--centers", type=int, nargs="+", default=[20_000])
    ap.add_argument("--d", type=int, nargs="+", default=[8])
    ap.add_argument("--repeats", type=int, default=2, help="epochs per commit, alternating which runs first")
    args = ap.parse_args(argv)
    print(
        f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f} (start); before = {args.before}"
    )
    print("| M | d | batch / q | before wall s | after wall s | wall before / after | before CPU s | after CPU s | "
          "iterate rel. diff. |")  # fmt: skip
    print("|---" * 9 + "|")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        before = load_module(args.before, MODULE, "kgp_builtins.eigenpro", Path(tmp))
        try:
            for M in args.centers:
                for d in args.d:
                    r = measure(before, M, d, args.repeats)
                    (wb, cb), (wa, ca) = r["best"]["before"], r["best"]["after"]
                    print(
                        f"| {M:,} | {d} | {r['batch']} / {r['q']} | {wb:.2f} | {wa:.2f} | {wb / wa:.2f}x | "
                        f"{cb:.2f} | {ca:.2f} | {r['diff']:.1e} |",
                        flush=True,
                    )
                    results.append(r)
        finally:
            unload(before)
    print(f"load {os.getloadavg()[0]:.2f} (end)")
    return results


if __name__ == "__main__":
    main()
