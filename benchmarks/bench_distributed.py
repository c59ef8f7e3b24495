"""Data-parallel FALKON on torch.distributed: 2 ranks x 1 thread against 1 rank x 2 threads.

Airline data (../shared/data/airline_nycflights13.npz, the split and scaling of bench_falkon.py:
seeded 80/20, z-scored, RBF lengthscale 1, lambda = 1e-6, uniform centers), float32, ``kernel_cache=
"never"`` so that every CG iteration recomputes its kernel pass (the regime of data that outgrow
memory, which is what distributing is for). Each configuration runs in its own processes:

* ``1x2``: one process, 2 threads, an ordinary (local) fit;
* ``2x1``: two processes (gloo on localhost), 1 thread each, ``fit(X_local, y_local, distributed=True)``
  on halves of the training rows.

Reported per configuration: time per CG iteration (median of the gaps between the callback's calls),
the payload all-reduced per iteration (every ``Shard.all_reduce_`` counted between the first and the
last iteration: the M x k float64 pass sums and the 8-byte stop flag; the setup's all-reduces, the
M x d centers and K^T y, are in the JSON total), peak RSS per rank during the fit (VmHWM reset after
loading the data; the resident data included), the replicated
preconditioner's build time, and micro-benchmarks of the collectives at this M: all-reduce of the
M x 1 float64 pass sum, and the broadcast of the two M x M float64 factors that the "build on rank
0 and broadcast" alternative would need. Whether the two fits agree is printed too (max |alpha|
difference relative to max |alpha|).

``--solver eigenpro``: EigenPro 3 with its defaults on M uniform centers, one epoch per "iteration"
(``--maxiter`` epochs, other options at their defaults); per batch each rank
computes its rows' part of ``K(Z, X_m) g`` and the ``M x 1`` sums are all-reduced (float64) before
the replicated projection step. The printed bytes per batch are the epoch's all-reduced bytes
divided by its batches (the per-epoch training-MSE sum and stop flag included).

``--solver dsg``: DSG with its defaults (least squares, 512 features and all rows per step), one
step per "iteration" (``--maxiter`` steps); per step each rank computes its rows' features and the
``512 x 512`` normal-equation sums, which are all-reduced (2 MiB in float64) before the replicated
solve. ``--m`` is then unused and the printed "alpha" is the feature coefficients.

Usage::

    flock /tmp/kgp-bench.lock env OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_distributed.py \
        [--n 60000] [--m 1000] [--maxiter 8] [--solver falkon|dsg|eigenpro]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_falkon import LAM, LENGTHSCALE, load_airline  # noqa: E402

import kgp  # noqa: E402
from kgp import distributed as kdist  # noqa: E402


def _peak_rss_mb() -> float:
    """Peak resident memory since the last :func:`_reset_peak` (Linux VmHWM), else since the start."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _reset_peak() -> None:
    """Reset the peak-RSS counter (Linux: writing 5 to /proc/self/clear_refs), so the fit's own peak shows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _worker(rank: int, world: int, threads: int, port: int, args: dict, out: str) -> None:
    torch.set_num_threads(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    X, y, _, _ = load_airline(torch.float32)
    X, y = X[: args["n"]], y[: args["n"]]
    n = X.shape[0]
    lo, hi = rank * n // world, (rank + 1) * n // world
    X_local, y_local = X[lo:hi].clone(), y[lo:hi].clone()
    del X, y
    gc.collect()
    _reset_peak()
    rss_data = _peak_rss_mb()
    sent = {"bytes": 0, "calls": 0}
    at_step = []  # (time, bytes all-reduced so far) at each CG iteration

    def callback(info):
        at_step.append((time.perf_counter(), sent["bytes"]))

    record = {}
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
        original = kdist.Shard.all_reduce_

        def counting(self, t):
            sent["bytes"] += t.numel() * t.element_size()
            sent["calls"] += 1
            return original(self, t)

        kdist.Shard.all_reduce_ = counting
    # what differs between the solvers; everything else is one constructor call
    per_solver = {
        "eigenpro": ({"centers": "uniform", "n_centers": args["m"]}, {"epochs": args["maxiter"]}),
        "dsg": ({}, {"passes": args["maxiter"]}),
        "falkon": (
            {"centers": "uniform", "n_centers": args["m"]},
            {"maxiter": args["maxiter"], "tol": 0.0, "kernel_cache": "never", "residual_every": 0},
        ),
    }
    centers, options = per_solver[args["solver"]]
    model = kgp.KernelRegressor(
        "rbf",
        lengthscale=LENGTHSCALE,
        noise=LAM * n,
        solver=args["solver"],
        random_state=0,
        callback=callback,
        solver_options=options,
        **centers,
    )
    start = time.perf_counter()
    model.fit(X_local, y_local, distributed=world > 1)
    total = time.perf_counter() - start
    steps = [b[0] - a[0] for a, b in zip(at_step[:-1], at_step[1:])]
    iter_bytes = (at_step[-1][1] - at_step[0][1]) / max(1, len(at_step) - 1)
    record.update(
        rank=rank,
        world=world,
        threads=threads,
        n_local=hi - lo,
        fit_s=total,
        # centers, precision probe, preconditioner, right-hand side K^T y: before the first iteration
        setup_s=at_step[0][0] - start - statistics.median(steps),
        iter_s=statistics.median(steps),
        iterations=len(at_step),
        allreduce_bytes_total=sent["bytes"],
        allreduce_bytes_per_iter=iter_bytes,
        allreduce_calls=sent["calls"],
        batch_size=model.history_[0].extras.get("batch_size"),
        # eigenpro: the last epoch's split (gradient includes the batch all-reduce; projection is replicated)
        epoch_split={k: v for k, v in model.history_[-1].extras.items() if k.startswith("time_")},
        rss_data_mb=rss_data,
        rss_peak_mb=_peak_rss_mb(),
        alpha=(model.predictor_.coef if args["solver"] == "dsg" else model.predictor_.alpha)
        .double()
        .flatten()
        .tolist(),
    )
    if world > 1:
        m = args["m"]
        # the collectives themselves, at this M (after the fit: same connections, warm)
        v = torch.zeros(m, 1, dtype=torch.float64)
        reps = 50
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(v)
        record["allreduce_mx1_s"] = (time.perf_counter() - t0) / reps
        factors = torch.zeros(2, m, m, dtype=torch.float64)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(3):
            dist.broadcast(factors, src=0)
        record["broadcast_factors_s"] = (time.perf_counter() - t0) / 3
        dist.barrier()
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, threads: int, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, threads, port, args, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"rank exited with {p.exitcode}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=60_000, help="training rows used (of 219,082)")
    parser.add_argument("--m", type=int, default=1000, help="centers")
    parser.add_argument("--maxiter", type=int, default=8, help="CG iterations (falkon) or steps (dsg)")
    parser.add_argument("--solver", choices=("falkon", "dsg", "eigenpro"), default="falkon")
    args = vars(parser.parse_args())
    print(f"torch {torch.__version__}, cores {os.cpu_count()}, load average {os.getloadavg()}")
    if args["solver"] == "eigenpro":
        print(f"airline float32, n = {args['n']}, M = {args['m']}, eigenpro defaults, {args['maxiter']} epochs")
    elif args["solver"] == "dsg":
        steps = args["maxiter"]
        print(f"airline float32, n = {args['n']}, dsg defaults (512 features, all rows per step), {steps} steps")
    else:
        print(f"airline float32, n = {args['n']}, M = {args['m']}, {args['maxiter']} CG iterations, kernel_cache never")
    single = run(1, 2, args)
    double = run(2, 1, args)
    print(f"load average after: {os.getloadavg()}")
    rows = single + double
    header = (
        "| config | rank | n_local | s / iteration | setup s | fit s | all-reduced B / iter "
        "| peak RSS MiB (after loading) |"
    )

    print(header)
    print("|---" * 8 + "|")
    for r in rows:
        per_iter = r["allreduce_bytes_per_iter"]
        config = f"{r['world']}x{r['threads']}"
        print(
            f"| {config} | {r['rank']} | {r['n_local']} | {r['iter_s']:.3f} | {r['setup_s']:.2f} | {r['fit_s']:.2f} "
            f"| {per_iter:.0f} | {r['rss_peak_mb']:.0f} ({r['rss_data_mb']:.0f}) |"
        )
    a1 = torch.tensor(single[0]["alpha"])
    a2 = torch.tensor(double[0]["alpha"])
    if args["solver"] == "eigenpro":
        d0 = double[0]
        batches = -(-args["n"] // d0["batch_size"])
        print(
            f"eigenpro: batch {d0['batch_size']} rows, {batches} batches per epoch; all-reduced per batch "
            f"{d0['allreduce_bytes_per_iter'] / batches:.0f} B (of which M x 1 float64 = {args['m'] * 8} B)"
        )
        for r in rows:
            split = " / ".join(f"{k[5:]} {v:.3f}" for k, v in r["epoch_split"].items())
            print(f"last epoch, {r['world']}x{r['threads']} rank {r['rank']}: s {split}")
    print(f"speed-up of 2x1 over 1x2 per iteration: {single[0]['iter_s'] / max(r['iter_s'] for r in double):.2f}")
    print(f"max |alpha_2x1 - alpha_1x2| / max |alpha|: {float((a1 - a2).abs().max() / a1.abs().max()):.2e}")
    d0 = double[0]
    print(f"all-reduce of M x 1 float64 ({args['m'] * 8} B), 2 ranks: {d0['allreduce_mx1_s'] * 1e3:.3f} ms")
    print(
        f"broadcast of the two M x M float64 factors ({2 * args['m'] ** 2 * 8 / 2**20:.0f} MiB): "
        f"{d0['broadcast_factors_s']:.3f} s; replicated setup (centers + preconditioner + K^T y): "
        f"{d0['setup_s']:.2f} s"
    )
    print(json.dumps({"args": args, "runs": [{k: v for k, v in r.items() if k != "alpha"} for r in rows]}))


if __name__ == "__main__":
    main()
