"""Matern 1/2 (Laplacian) kernel pass: kgp's near-zero recomputation against two simpler ones.

A Matern 1/2 block recomputes the squared distances that cancellation spoiled (``_exact_near_zero`` in
kgp/kernels/formulas.py). kgp finds the rows that can hold such a pair from each row's minimum; a float32 block
then recomputes those rows with a float64 GEMM, a float64 block recomputes the pairs that pass the pair test
from their differences. Two baselines are written out below and patched in for their runs: the row minima with
the pair test in float32 too, and the whole-block scan (a comparison of every entry with one threshold, then
``nonzero``). Each shape times one streamed FALKON pass ``K^T (K v)`` (``kernel_cache("never")``) with each,
and with no test at all (the floor), all in this process, and prints the largest difference between kgp's pass
and the pair test's, relative to the pass's largest entry (0 where both run the same code: float64, and the
whole-block scan against the pair test). The centers are rows of the data, as with kgp's center selectors, so
every center's own row holds a zero distance. A shape ending in ``far`` scales 0.5% of the rows by 20 first: a
few points of large norm, as in UCI protein's standardised inputs, make one threshold for the whole block pass
most of its entries.

Usage::

    .venv/bin/python benchmarks/bench_matern12_pass.py [--device cpu] [--shapes 32000x5000,200000x2000,32000x5000far]
        [--d 8] [--dtypes float32,float64] [--reps 3]
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from device_timing import best_time  # noqa: E402

import kgp  # noqa: E402
from kgp import settings  # noqa: E402
from kgp.kernels import formulas  # noqa: E402


def whole_block_scan(rows: torch.Tensor, cols: torch.Tensor, sq_dist: torch.Tensor) -> None:
    """The baseline: every entry compared with the coarse threshold, then the same refinement as kgp's."""
    if not (rows.shape[0] and cols.shape[0]):
        return
    d = rows.shape[1] - 2
    sq_u, sq_v = rows[:, d], cols[:, d + 1]
    coarse = formulas._NEAR * float(sq_u.max() + sq_v.max())
    i, j = (sq_dist < coarse).nonzero(as_tuple=True)
    close = sq_dist[i, j] < formulas._NEAR * (sq_u[i] + sq_v[j])
    i, j = i[close], j[close]
    if i.numel():
        diff = rows[i, :d] + 0.5 * cols[j, :d]
        sq_dist[i, j] = diff.square().sum(dim=1).to(sq_dist.dtype)


def row_minima_pair_test(rows: torch.Tensor, cols: torch.Tensor, sq_dist: torch.Tensor) -> None:
    """Baseline: the candidate rows from the row minima, then the pair test in every dtype (float32 included)."""
    if not (rows.shape[0] and cols.shape[0]):
        return
    d = rows.shape[1] - 2
    mins = sq_dist.amin(dim=1)
    candidates = ((mins < 1.01 * formulas._NEAR * (rows[:, d] + cols[:, d + 1].max())) | mins.isnan()).nonzero()
    if candidates.numel():
        formulas._exact_pairs(rows, cols, sq_dist, candidates.squeeze(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="32000x5000,200000x2000,32000x5000far", help="n x M pairs, comma-separated")
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    kgp_test = formulas._exact_near_zero
    variants = {
        "kgp": kgp_test,
        "pair test": row_minima_pair_test,
        "whole-block scan": whole_block_scan,
        "no test (floor)": None,
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, d = {args.d}")
    print("| n | M | dtype | kgp s | pair test s | whole-block scan s | no test s | pair test / kgp | kgp - pairs |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        far = shape.endswith("far")
        n, m = (int(s) for s in shape.removesuffix("far").split("x"))
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            X = torch.randn(n, args.d, generator=g, dtype=torch.float64)
            if far:
                X[torch.randperm(n, generator=g)[: n // 200]] *= 20.0
            X = X.to(device=device, dtype=dtype)
            Z = X[torch.randperm(n, generator=g)[:m].to(device)].clone()
            kernel = kgp.kernels.make_kernel("laplacian", 2.0).to(device=device, dtype=dtype).requires_grad_(False)
            v = torch.randn(m, 1, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
            op = kgp.kernel_operator(kernel, X, Z)
            seconds, results = {}, {}
            try:
                for label, test in variants.items():
                    formulas._exact_near_zero = test if test is not None else (lambda *a: None)
                    with settings.kernel_cache("never"), settings.fused_kernels("never"):
                        one_pass = functools.partial(op.fused_matmul, v)
                        results[label] = one_pass()
                        seconds[label] = best_time(one_pass, args.reps, device)
            finally:
                formulas._exact_near_zero = kgp_test
            ours, pairs, scan, floor = (seconds[k] for k in variants)
            a, b = results["kgp"].double(), results["pair test"].double()
            gap = float((a - b).abs().max() / b.abs().max())
            label = f"{m:,}" + (" far" if far else "")
            print(
                f"| {n:,} | {label} | {name} | {ours:.3f} | {pairs:.3f} | {scan:.3f} | {floor:.3f} | "
                f"{pairs / ours:.2f} | {gap:.1e} |"
            )


if __name__ == "__main__":
    main()
