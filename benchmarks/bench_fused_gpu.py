"""The fused GPU pass against the blocked pass and the stored K, in one process on one card.

For each shape (n x M x d) and kernel family, in float32: one FALKON pass ``K^T (K v + w)``
(``op.fused_matmul``), timed three ways in the same process:

* fused: the Triton kernels of :mod:`kgp.operators.fused_gpu` (tiles in registers), with the distance
  part on the tensor cores (3xTF32, the default on compute capability 8.0 and up);
* FMA loop: the same kernels with the distance part as an FMA loop on the CUDA cores
  (``fused_gpu.TENSOR_CORES = False``, what ``fused_kernels("always")`` runs on older cards);
* blocked: ``kgp.settings.fused_kernels("never")``, 256 MiB blocks;
* stored: ``kernel_cache("auto")`` with K kept on the card, where it fits the card's free memory
  (the pass is then two reads of K).

Also printed: the distance GEMM's time at the card's measured ``torch.mm`` rate (``2 n M (d + 2)``
flops; the GEMM bound), the fused pass against it, and the largest relative
difference between the fused and the blocked result. The first call of each configuration (Triton's
tuning and compilation) is excluded from the timing and reported separately.

Usage::

    python benchmarks/bench_fused_gpu.py [--shapes 200000x10000x8,1000000x10000x28] [--families rbf,matern52]
        [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from device_timing import best_time, synchronize

import kgp
from kgp import settings
from kgp.operators import fused_gpu
from kgp.operators.fused_gpu import fused_applies

# float32 only: the fused path refuses float64, where it measured slower (kgp.operators.fused_gpu)
DTYPES = {"float32": torch.float32}


def kernel(family: str, d: int, dtype: torch.dtype):
    k = kgp.kernels.make_kernel(family, float(d) ** 0.5)
    return k.to(dtype).requires_grad_(False)


def gemm_rate(dtype: torch.dtype, device: str, side: int = 8192) -> float:
    a = torch.randn(side, side, dtype=dtype, device=device)
    b = torch.randn(side, side, dtype=dtype, device=device)
    seconds = best_time(lambda: a @ b, 3, device)
    return 2 * side**3 / seconds


def pass_time(op, v: torch.Tensor, w: torch.Tensor, reps: int, device: str) -> float:
    """Best of ``reps`` passes ``K^T (K v + w)`` (after one untimed call), under the caller's settings."""
    return best_time(lambda: op.fused_matmul(v, w), reps, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="200000x2000x8,200000x10000x8,200000x20000x8,1000000x10000x28")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--families", default="rbf,matern52")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    device = args.device
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("bench_fused_gpu: needs a CUDA device (the fused kernels run on GPUs only)")
    print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    rates = {name: gemm_rate(DTYPES[name], device) for name in args.dtypes.split(",")}
    print("GEMM rate (torch.mm 8192^2): " + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in rates.items()))
    header = (
        "| n x M x d | family | dtype | fused ms | first call s | FMA loop ms | first call s | blocked ms"
        " | stored ms | blocked / fused | FMA loop / fused | fused / GEMM bound | max rel diff | FMA max rel diff |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for shape in args.shapes.split(","):
        n, m, d = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        X64 = torch.randn(n, d, generator=g, dtype=torch.float64)
        Z64 = X64[torch.randperm(n, generator=g)[:m]]
        v64 = torch.randn(m, 1, generator=g, dtype=torch.float64)
        w64 = torch.randn(n, 1, generator=g, dtype=torch.float64)
        for family in args.families.split(","):
            for name in args.dtypes.split(","):
                dtype = DTYPES[name]
                X, Z, v, w = (t.to(device, dtype) for t in (X64, Z64, v64, w64))
                k = kernel(family, d, dtype).to(device)
                with torch.no_grad(), settings.kernel_cache("never"), settings.fused_kernels("auto"):
                    runs = {}
                    for form in (True, False):
                        fused_gpu.TENSOR_CORES = form
                        op = kgp.kernel_operator(k, X, Z)
                        assert fused_applies(op.workspace, 1), "the fused kernels do not apply (is Triton installed?)"
                        synchronize(device)
                        t0 = time.perf_counter()
                        out = op.fused_matmul(v, w)
                        synchronize(device)
                        first = time.perf_counter() - t0
                        runs[form] = (out, first, pass_time(op, v, w, args.reps, device))
                        del op
                    fused_gpu.TENSOR_CORES = True
                    (fused_out, first, fused), (fma_out, fma_first, fma) = runs[True], runs[False]
                    with settings.fused_kernels("never"):
                        blocked_op = kgp.kernel_operator(k, X, Z)
                        blocked_out = blocked_op.fused_matmul(v, w)
                        blocked = pass_time(blocked_op, v, w, args.reps, device)
                    del blocked_op
                diff = float((fused_out - blocked_out).abs().max() / blocked_out.abs().max())
                fma_diff = float((fma_out - blocked_out).abs().max() / blocked_out.abs().max())
                stored = float("nan")
                free, _ = torch.cuda.mem_get_info(device)
                if n * m * dtype.itemsize < 0.6 * free:
                    with torch.no_grad(), settings.kernel_cache("auto"), settings.memory_budget(int(0.7 * free)):
                        stored_op = kgp.kernel_operator(k, X, Z)
                        stored_op.fused_matmul(v, w)
                        stored_op.fused_matmul(v, w)  # kept from the second product on
                        stored = pass_time(stored_op, v, w, args.reps, device)
                    del stored_op
                torch.cuda.empty_cache()
                bound = 2 * n * m * (d + 2) / rates[name]
                print(
                    f"| {n:,} x {m:,} x {d} | {family} | {name} | {fused * 1e3:.2f} | {first:.1f} | "
                    f"{fma * 1e3:.2f} | {fma_first:.1f} | {blocked * 1e3:.2f} | {stored * 1e3:.2f} | "
                    f"{blocked / fused:.2f} | {fma / fused:.2f} | {fused / bound:.2f} | {diff:.1e} | {fma_diff:.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
