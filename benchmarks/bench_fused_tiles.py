"""Tile shapes of the fused GPU kernels' tensor-core form, each timed on its own (one card, float32).

For each shape (n x M x d) and kernel family, ``rows_pass`` (``K v + w``) and ``cols_pass`` (``K^T u``),
in their tensor-core form (``DOT=True``), are launched with every candidate tile shape of
:data:`kgp.operators.triton_kernels.DOT_SHAPES` and timed with ``triton.testing.do_bench`` (median, L2
flushed between runs). Prints each shape's time against the best for that problem, and the worst such
ratio of each tile shape over all problems: the fixed shape that the default ``fused_kernels("auto")``
uses (no tuning on first use) is the one whose worst ratio is smallest.

Usage::

    python benchmarks/bench_fused_tiles.py [--shapes 200000x2000x8,200000x10000x8,1000000x10000x28]
        [--families rbf,matern52]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import kgp
from kgp.operators import fused_gpu
from kgp.operators import triton_kernels as tk


def _launcher(name: str, cfg: tuple[int, int, int], c: dict):
    """A call that launches ``rows_pass`` or ``cols_pass`` (tensor-core form), tile shape ``cfg``, problem ``c``."""
    bn, bm, warps = cfg
    tiles = dict(BLOCK_N=bn, BLOCK_M=bm, num_warps=warps, FAMILY=c["code"], LOW=c["low"], HIGH=c["high"], **c["dims"])
    if name == "rows":
        grid = (triton.cdiv(c["n"], bn),)
        args = (c["rows_t"], c["cols_t"], c["v"], c["u"], c["u"], c["n"], c["m"])
        return lambda: tk.rows_pass[grid](*args, HAS_W=True, **tiles)
    grid = (triton.cdiv(c["m"], bm), c["splits"])
    args = (c["rows_t"], c["cols_t"], c["u"], c["part"], c["n"], c["m"], c["splits_rows"])
    return lambda: tk.cols_pass[grid](*args, out_dtype=tl.float32, **tiles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", default="200000x2000x8,200000x10000x8,200000x20000x8,200000x10000x20,1000000x10000x28"
    )
    parser.add_argument("--families", default="rbf,matern52")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    worst: dict[tuple, float] = {}
    print("| n x M x d | family | kernel | " + " | ".join(f"{bn}x{bm}/{w}" for bn, bm, w in tk.DOT_SHAPES) + " |")
    print("|---" * (3 + len(tk.DOT_SHAPES)) + "|")
    for shape in args.shapes.split(","):
        n, m, d = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        X = torch.randn(n, d, generator=g).to(device)
        Z = X[torch.randperm(n, generator=g)[:m].to(device)]
        v = torch.randn(m, device=device)
        for family in args.families.split(","):
            k = kgp.kernels.make_kernel(family, float(d) ** 0.5).to(device, torch.float32).requires_grad_(False)
            with torch.no_grad():
                op = kgp.kernel_operator(k, X, Z)
                rows_t, cols_t = fused_gpu._prepared(op.workspace)
            low, high = fused_gpu._bounds(family, torch.float32)
            dims = fused_gpu._dims(rows_t.shape[0], "dot")
            code = fused_gpu._FAMILIES[family]
            u = torch.empty(n, device=device)
            splits_rows = fused_gpu._rows_per_split(n, m, device)
            splits = -(-n // splits_rows)
            part = torch.empty(splits, m, dtype=torch.float64, device=device)
            ctx = dict(rows_t=rows_t, cols_t=cols_t, v=v, u=u, part=part, n=n, m=m, splits=splits)
            ctx.update(splits_rows=splits_rows, code=code, low=low, high=high, dims=dims)
            for name in ("rows", "cols"):
                times = [do_bench(_launcher(name, cfg, ctx), warmup=5, rep=40) for cfg in tk.DOT_SHAPES]
                best = min(times)
                for shape_cfg, t in zip(tk.DOT_SHAPES, times):
                    key = (name, shape_cfg)
                    worst[key] = max(worst.get(key, 0.0), t / best)
                cells = " | ".join(f"{t:.3f}" + (" *" if t == best else "") for t in times)
                print(f"| {n:,} x {m:,} x {d} | {family} | {name} | {cells} |", flush=True)
    print("\nworst time / best over all problems, per tile shape (ms ratios):")
    for name in ("rows", "cols"):
        print(
            f"  {name}: " + ", ".join(f"{bn}x{bm}/{w} {worst[(name, (bn, bm, w))]:.2f}" for bn, bm, w in tk.DOT_SHAPES)
        )


if __name__ == "__main__":
    main()
