"""Benchmark of the lazy kernel backend: one K^T (K v) pass at n = 1e5, M = 2000, d = 10.

Run (the machine is shared: take the benchmark lock, fix the thread count)::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE \\
        .venv/bin/python benchmarks/bench_backend.py [--quick]

Prints, for float32 and float64, seconds per pass and GFLOP/s of

* ``backend``: ``kgp.kernel_operator(RBFKernel, X, Z).fused_matmul(v)``;
* ``gpytorch-10k``: GPyTorch ``RBFKernel`` forward on 10k-row blocks, ``Kb^T (Kb v)`` per block;
* ``dense``: K materialized once (not timed), then the two GEMVs ``K^T (K v)``;
* ``reference``: an inline augmented-GEMM loop ([-2x, |x|^2, 1] . [z, 1, |z|^2]^T into one reused
  1000-row buffer, in-place clamp / scale / exp), the bar of ../shared/notes/machine.md
  (0.121 s float32 / 0.267 s float64 on a quiet machine),

with ratios to the reference measured in the same run (best of several round-robin repetitions,
which is robust to other jobs on a shared machine). Then: the backend's time against the block
size, stored K (``kernel_cache="auto"``) against recomputation at d = 10 and d = 500, and the effect
of flush-to-zero on a kernel whose values fall into the float32 denormal range.

Useful work per pass: n M (2 d + 4) flops (distances, K v, K^T u), 4.8 GFLOP at the default size.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import gpytorch  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402
from kgp import settings  # noqa: E402
from kgp.operators import blocks as kgp_blocks  # noqa: E402

BAR = {torch.float32: 0.121, torch.float64: 0.267}


def timeit(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls after one warm-up call (the least disturbed on a shared host)."""
    return compare({"f": fn}, reps)["f"]


def compare(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Best time of each function, timed round-robin so that contention hits all of them alike."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def make_data(n: int, m: int, d: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype)
    Z = X[torch.randperm(n, generator=gen)[:m]].clone()
    v = torch.randn(m, 1, generator=gen, dtype=torch.float64).to(dtype)
    return X, Z, v


def rbf(lengthscale: float, dtype: torch.dtype) -> gpytorch.kernels.RBFKernel:
    k = gpytorch.kernels.RBFKernel().to(dtype)
    k.lengthscale = lengthscale
    return k


def reference_pass(X: torch.Tensor, Z: torch.Tensor, v: torch.Tensor, lengthscale: float, rows: int = 1000):
    """The machine-notes bar: augmented GEMM into one reused buffer, in-place nonlinearity."""
    x = X / lengthscale
    z = Z / lengthscale
    xa = torch.cat([-2.0 * x, (x * x).sum(1, keepdim=True), torch.ones_like(x[:, :1])], dim=1)
    za = torch.cat([z, torch.ones_like(z[:, :1]), (z * z).sum(1, keepdim=True)], dim=1)
    buf = torch.empty(rows, Z.shape[0], dtype=X.dtype)
    out = torch.zeros(Z.shape[0], v.shape[1], dtype=X.dtype)

    def run():
        out.zero_()
        for lo in range(0, X.shape[0], rows):
            b = min(rows, X.shape[0] - lo)
            blk = buf[:b]
            torch.mm(xa[lo : lo + b], za.T, out=blk)
            blk.clamp_min_(0.0).mul_(-0.5).exp_()
            out.addmm_(blk.T, blk @ v)
        return out

    return run


def gpytorch_pass(kernel, X, Z, v, rows: int = 10_000):
    def run():
        out = torch.zeros(Z.shape[0], v.shape[1], dtype=X.dtype)
        with torch.no_grad():
            for lo in range(0, X.shape[0], rows):
                kb = kernel(X[lo : lo + rows], Z).to_dense()
                out += kb.T @ (kb @ v)
        return out

    return run


def pass_table(n: int, m: int, d: int, dtype: torch.dtype, lengthscale: float, reps: int) -> dict[str, float]:
    """Seconds per K^T (K v) pass of the four ways of computing it, measured round-robin."""
    X, Z, v = make_data(n, m, d, dtype)
    kernel = rbf(lengthscale, dtype)
    op = kgp.kernel_operator(kernel, X, Z)
    K = op.to_dense()  # materialized once, outside the timing
    results = compare(
        {
            "backend (fused_matmul)": lambda: op.fused_matmul(v),
            "reference (aug. GEMM, 1000 rows)": reference_pass(X, Z, v, lengthscale),
            "dense (K stored, 2 GEMVs only)": lambda: K.T @ (K @ v),
        },
        reps,
    )
    results["gpytorch RBFKernel, 10k-row blocks"] = timeit(gpytorch_pass(kernel, X, Z, v), max(1, reps // 2))
    return results


def block_sweep(n: int, m: int, d: int, dtype: torch.dtype, sweep, reps: int) -> dict[int, float]:
    X, Z, v = make_data(n, m, d, dtype)
    op = kgp.kernel_operator(rbf(1.0, dtype), X, Z)

    def with_rows(rows):
        def run():
            with settings.block_rows(rows):
                return op.fused_matmul(v)

        return run

    return compare({rows: with_rows(rows) for rows in sweep}, reps)


def cache_row(n: int, m: int, d: int, reps: int) -> tuple[float, float, float, float]:
    """Float32 RBF (lengthscale sqrt(d)) seconds per pass: recompute ("never") and, with "auto",
    the 1st product (streams), the 2nd (stores K, then reads it) and later ones (read K)."""
    X, Z, v = make_data(n, m, d, torch.float32)
    kernel = rbf(float(d) ** 0.5, torch.float32)
    op = kgp.kernel_operator(kernel, X, Z)
    recompute = timeit(lambda: op.fused_matmul(v), reps)
    with settings.memory_budget(n * m * 4 + 2**26), settings.kernel_cache("auto"):
        op = kgp.kernel_operator(kernel, X, Z)
        firsts = []
        for _ in range(2):
            t0 = time.perf_counter()
            op.fused_matmul(v)
            firsts.append(time.perf_counter() - t0)
        stored = timeit(lambda: op.fused_matmul(v), reps)
    return recompute, firsts[0], firsts[1], stored


def denormal_rows(n: int, m: int, d: int, reps: int) -> tuple[float, dict[str, float]]:
    """A kernel whose values fall into the float32 denormal range: backend (floored exponent) vs reference."""
    X, Z, v = make_data(n, m, d, torch.float32)
    ls = 0.3
    op = kgp.kernel_operator(rbf(ls, torch.float32), X, Z)
    ref = reference_pass(X, Z, v, ls)
    with torch.no_grad():
        x, z = X[:1000] / ls, Z / ls
        expo = -0.5 * torch.cdist(x, z).pow(2)
        frac = ((expo > -103.97) & (expo < -87.34)).float().mean().item()  # exp() lands in the denormal range

    def flushed(fn):
        def run():
            torch.set_flush_denormal(True)
            try:
                return fn()
            finally:
                torch.set_flush_denormal(False)

        return run

    times = compare(
        {
            "backend (exponent floored at -80)": lambda: op.fused_matmul(v),
            "reference": ref,
            "reference + torch.set_flush_denormal(True)": flushed(ref),
        },
        reps,
    )
    return frac, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 20,000 and fewer repetitions (smoke run)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per figure (best of)")
    args = parser.parse_args()
    n, m, d = (20_000, 2000, 10) if args.quick else (100_000, 2000, 10)
    reps = args.reps or (2 if args.quick else 5)
    lengthscale = 1.0
    flops = n * m * (2 * d + 4)

    print("# kgp backend benchmark")
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, loadavg at start={os.getloadavg()[0]:.2f}"
    )
    print(
        f"n={n}, M={m}, d={d}, RBF lengthscale={lengthscale}, {flops / 1e9:.2f} GFLOP per pass, "
        f"best of {reps} (round-robin); memory_budget={settings.memory_budget.value() >> 20} MiB, "
        f"CPU_BLOCK_BYTES={kgp_blocks.CPU_BLOCK_BYTES}"
    )

    print("\n## One K^T (K v) pass")
    print("| method | dtype | s / pass | GFLOP/s | x reference | x backend |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.float64):
        results = pass_table(n, m, d, dtype, lengthscale, reps)
        ref = results["reference (aug. GEMM, 1000 rows)"]
        back = results["backend (fused_matmul)"]
        name_dt = str(dtype).replace("torch.", "")
        for name, t in results.items():
            print(f"| {name} | {name_dt} | {t:.3f} | {flops / t / 1e9:.1f} | {t / ref:.2f} | {t / back:.2f} |")
        print(f"| bar from machine.md (quiet machine) | {name_dt} | {BAR[dtype]:.3f} | {4.8 / BAR[dtype]:.1f} | | |")

    print("\n## Backend time vs rows per block (settings.block_rows)")
    sweep = (250, 500, 1000, 2000, 5000)
    cells = {dt: block_sweep(n, m, d, dt, sweep, reps) for dt in (torch.float32, torch.float64)}
    print("| rows per block | float32 s | float64 s |")
    print("|---|---|---|")
    for rows in sweep:
        print(f"| {rows} | {cells[torch.float32][rows]:.3f} | {cells[torch.float64][rows]:.3f} |")

    print("\n## kernel_cache: stored K ('auto') vs recompute ('never'), float32, lengthscale sqrt(d)")
    print("| d | 'never': s / pass | 'auto' 1st product | 'auto' 2nd (stores K) | 'auto' later | n x M MiB |")
    print("|---|---|---|---|---|---|")
    for dd in (10, 500):
        recompute, first, second, stored = cache_row(n, m, dd, max(1, reps // 2))
        print(f"| {dd} | {recompute:.3f} | {first:.3f} | {second:.3f} | {stored:.3f} | {n * m * 4 / 2**20:.0f} |")

    print("\n## Denormals: float32 RBF, lengthscale 0.3 (many kernel values in the denormal range)")
    frac, times = denormal_rows(n, m, d, max(1, reps // 2))
    print(f"kernel values in the denormal range (first 1000 rows): {frac:.1%}")
    print("| method | s / pass |")
    print("|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t:.3f} |")
    print(f"\nloadavg at end={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
