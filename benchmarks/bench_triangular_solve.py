"""Triangular solves with few right-hand sides: kgp's block-row solver against torch's (LAPACK) solve.

FALKON's CG solves with two ``M x M`` triangular factors four times an iteration, one column per output
(:mod:`kgp.linalg.lower_factor`). For each size, dtype and number of columns this times ``L X = B`` and ``L^T X = B``
with ``torch.linalg.solve_triangular`` (the baseline, MKL in torch's CPU wheels) and with
:class:`kgp.linalg.LowerFactor`, in the same process, and prints the ratio and the residual
``||L X - B||`` of kgp's solve relative to the baseline's. ``L`` is the Cholesky factor of a Gaussian
kernel matrix on random points plus 1e-3 I, as in FALKON's preconditioner.

``--dtypes mixed``: a float32 factor with float64 right-hand sides (FALKON's float32 default), solved by the
native C loop (``LowerFactor.solve``, :mod:`kgp.linalg.lower_factor`) against the same solve on the factor widened to
float64 (the alternative that holds a float64 copy of the factor), with the relative difference of the answers.

How long LAPACK's solve takes depends on how OpenMP threads wait (``OMP_WAIT_POLICY``, read once when the
process starts), so by default the script runs itself twice, with ``PASSIVE`` (what the kgp command, the
Makefile and CI set) and with the variable unset (torch's default in a script), and prints both tables.

Usage::

    .venv/bin/python benchmarks/bench_triangular_solve.py [--sizes 2000,5000,10000,20000] [--columns 1,2,4,8]
        [--dtypes float64,float32,mixed] [--reps 5] [--policy both|PASSIVE|unset]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DTYPES = ("float64", "float32", "mixed")


def child(args: argparse.Namespace) -> None:
    import torch

    from kgp.linalg import LowerFactor

    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(
        f"\nOMP_WAIT_POLICY={policy}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        "| M | dtype | k | torch lower ms | blocks lower ms | ratio | torch upper ms | blocks upper ms | ratio "
        "| resid blocks / torch | kgp runs (lower / upper) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mixed = []
    for M in (int(m) for m in args.sizes.split(",")):
        g = torch.Generator().manual_seed(0)
        X = torch.randn(M, 8, dtype=torch.float64, generator=g)
        K = torch.cdist(X, X).square_().mul_(-0.5).exp_()
        K.diagonal().add_(1e-3)
        L64 = torch.linalg.cholesky(K)
        del K
        for dname in args.dtypes.split(","):
            if dname == "mixed":
                continue
            L = L64.to(getattr(torch, dname))
            factor = LowerFactor(L)
            start = time.perf_counter()
            factor._block_inverses()
            prep = time.perf_counter() - start
            for k in (int(c) for c in args.columns.split(",")):
                print(row(L, factor, torch.randn(M, k, dtype=L.dtype, generator=g), args.reps), flush=True)
            print(f"<!-- M = {M} {dname}: preparing the factor (inverting its diagonal blocks) {prep:.3f} s -->")
        if "mixed" in args.dtypes.split(","):
            mixed.append((M, L64.float().contiguous()))  # rows contiguous, as FALKON keeps its factors
        del L64
    if mixed:
        print(
            "\n| M | k | widened float64 lower ms | native mixed lower ms | ratio | widened upper ms "
            "| native mixed upper ms | ratio | max rel. difference |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for M, L32 in mixed:
            native, widened = LowerFactor(L32), LowerFactor(L32.double())
            for k in (int(c) for c in args.columns.split(",")):
                B = torch.randn(M, k, dtype=torch.float64, generator=g)
                print(mixed_row(native, widened, B, args.reps), flush=True)


def row(L, factor, B, reps: int) -> str:
    """One table row: both directions, LAPACK's solve against the block rows, and the residual ratio."""
    import torch
    from device_timing import best_time

    times, resid = [], []
    for transpose in (False, True):
        op = L.mT if transpose else L
        lapack = best_time(lambda op=op, t=transpose: torch.linalg.solve_triangular(op, B, upper=t), reps, "cpu")
        blocks = best_time(lambda t=transpose: factor._solve_blocks(B, t), reps, "cpu")
        times += [lapack, blocks]
        ours = factor._solve_blocks(B, transpose)
        theirs = torch.linalg.solve_triangular(op, B, upper=transpose)
        resid.append(float((op @ ours - B).norm() / (op @ theirs - B).norm()))
    k = B.shape[1]
    picks = " / ".join("blocks" if factor.uses_blocks(k, transpose=t) else "torch" for t in (False, True))
    return (
        f"| {L.shape[0]} | {str(L.dtype).replace('torch.', '')} | {k} | {1e3 * times[0]:.1f} | {1e3 * times[1]:.1f} "
        f"| {times[1] / times[0]:.2f} | {1e3 * times[2]:.1f} | {1e3 * times[3]:.1f} | {times[3] / times[2]:.2f} "
        f"| {resid[0]:.2f} / {resid[1]:.2f} | {picks} |"
    )


def mixed_row(native, widened, B, reps: int) -> str:
    """Float32 factor, float64 columns: the native solve against the float64 solve on the widened factor."""
    from device_timing import best_time

    times, diff = [], 0.0
    for transpose in (False, True):
        times.append(best_time(lambda t=transpose: widened.solve(B, transpose=t), reps, "cpu"))
        times.append(best_time(lambda t=transpose: native.solve(B, transpose=t), reps, "cpu"))
        a, b = native.solve(B, transpose=transpose), widened.solve(B, transpose=transpose)
        diff = max(diff, float((a - b).norm() / b.norm()))
    M, k = B.shape
    return (
        f"| {M} | {k} | {1e3 * times[0]:.2f} | {1e3 * times[1]:.2f} | {times[1] / times[0]:.2f} "
        f"| {1e3 * times[2]:.2f} | {1e3 * times[3]:.2f} | {times[3] / times[2]:.2f} | {diff:.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2000,5000,10000,20000")
    parser.add_argument("--columns", default="1,2,4,8")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--policy", default="both", choices=("both", "PASSIVE", "unset", "inherit"))
    args = parser.parse_args()
    if args.policy == "inherit":
        child(args)
        return
    for policy in ("PASSIVE", "unset") if args.policy == "both" else (args.policy,):
        env = dict(os.environ)
        env.pop("OMP_WAIT_POLICY", None)
        if policy != "unset":
            env["OMP_WAIT_POLICY"] = policy
        argv = ["--sizes", args.sizes, "--columns", args.columns, "--dtypes", args.dtypes, "--reps", str(args.reps)]
        subprocess.run([sys.executable, __file__, *argv, "--policy", "inherit"], env=env, check=True)


if __name__ == "__main__":
    main()
