"""Kernel-pass time against the block size, on the CPU or a GPU: is the operator's default block right?

One streamed FALKON pass ``K^T (K v)`` (``op.fused_matmul(v)`` under ``kernel_cache("never")``) on
Gaussian data, timed for several block sizes forced with ``kgp.settings.block_rows``; the default
(``kgp.operators.blocks.plan_block_rows``: ``CPU_BLOCK_BYTES`` on the CPU,
``ACCELERATOR_BLOCK_BYTES`` elsewhere) is timed in the same run, and each size is printed as a ratio
to it (below 1: that size is faster than the default).

Usage::

    .venv/bin/python benchmarks/bench_block_size.py [--device cuda] [--n 1000000] [--m 10000] [--d 28]
        [--dtypes float32,float64] [--mib 2,8,32,128,256,1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gpytorch  # noqa: E402
import torch  # noqa: E402
from device_timing import best_time  # noqa: E402

import kgp  # noqa: E402
from kgp import settings  # noqa: E402


def time_pass(op, v: torch.Tensor, reps: int, rows: int | None) -> float:
    """Best of ``reps`` streamed passes after one warm-up, with ``rows`` rows a block (None: the default)."""
    # the blocked pass: on a GPU the fused kernels (which have no blocks) would run otherwise
    with settings.kernel_cache("never"), settings.block_rows(rows), settings.fused_kernels("never"):
        return best_time(lambda: op.fused_matmul(v), reps, v.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--m", type=int, default=5_000)
    parser.add_argument("--d", type=int, default=28)
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--mib", default="2,8,32,128,256,1024", help="block sizes to force, in MiB")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"# kernel pass against block size: n={args.n}, M={args.m}, d={args.d}, device {device} ({name}), "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, budget "
        f"{settings.memory_budget.value() / 2**20:.0f} MiB"
    )
    print("| dtype | block | rows | seconds | vs default |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        X = torch.randn(args.n, args.d, generator=gen, dtype=dtype).to(device)
        Z = X[: args.m].clone()
        v = torch.randn(args.m, 1, generator=gen, dtype=dtype).to(device)
        kernel = gpytorch.kernels.RBFKernel().to(device=device, dtype=dtype)
        kernel.lengthscale = float(args.d) ** 0.5
        with torch.no_grad():
            op = kgp.kernel_operator(kernel, X, Z)
            default_rows = op.block_rows()
            t_default = time_pass(op, v, args.reps, None)
            print(f"| {dtype_name} | default | {default_rows} | {t_default:.4g} | 1.00 |", flush=True)
            for mib in (float(x) for x in args.mib.split(",")):
                rows = max(1, int(mib * 2**20 // (args.m * dtype.itemsize)))
                if rows > args.n:
                    continue
                t = time_pass(op, v, args.reps, rows)
                print(f"| {dtype_name} | {mib:g} MiB | {rows} | {t:.4g} | {t / t_default:.2f} |", flush=True)
        del X, Z, v, op


if __name__ == "__main__":
    main()
