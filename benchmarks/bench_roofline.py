"""Roofline of FALKON's building blocks: achieved seconds against the machine's bound, per dtype and M.

Run (one command; on the shared machine take the benchmark lock and fix the thread count)::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE \\
        .venv/bin/python benchmarks/bench_roofline.py [--quick] [--m 2000,5000,10000] [--n 32000] [--d 8] \\
        [--dtypes float32,float64] [--reps 3] [--threads T] [--jsonl PATH] [--ops setup,setup_mixed,...] \\
        [--peers [--peer-python /tmp/falkon-venv/bin/python] [--peer-m 2000,5000] [--peer-dtypes float32,float64]]

With ``--peers`` the peer ratios follow the roofline in the same command: kgp's FALKON against the FALKON
library 0.9 on airline (``bench_falkon_library.py``, in ``--peer-python``, an interpreter where the library
is importable: it builds for the CPU from its public source, see that script) and kgp's EigenPro against
the EigenPro3 reference on letter (``bench_eigenpro_reference.py``).

First the machine is measured, per dtype:

* ``gemm``: flop/s of a square ``torch.mm`` of side ``s = min(4096, max(1024, max M))`` (``2 s^3`` flops);
* ``exp``: elements/s of ``torch.exp`` and ``torch.exp2`` (``out=``) over a kernel-block-sized array
  (``CACHE_PROBE_BYTES``, 8 MB, cache-resident: the exponential's compute rate); the faster of the two
  is the rate (the RBF recipe computes ``exp2``);
* ``dram``: bytes/s of a ``sum`` over, and of a copy of, a 256 MiB float64 array (copy: bytes read plus
  bytes written); the larger is the DRAM rate;
* ``cache``: bytes/s of a ``sum`` over a block-sized (8 MB) array, the rate at which a product reads a
  kernel block that was just written or read.

Then, per dtype and per M, every operation is timed (best of ``--reps`` after one warm-up; once and
without warm-up when its bound exceeds 0.5 s) and printed with its flop count, its bound and the ratio
achieved / bound (1 is the roofline; a ratio below 1 would mean the bound's model is wrong). With
``G = gemm``, ``E = exp``, ``B = dram``, ``C = cache`` rates and ``w`` the item size in bytes, and unless
said otherwise ``bound = max(flops / G, bytes / B)``:

=========================  =====================================  ==============================================
operation                  GFLOP column                           bound
=========================  =====================================  ==============================================
K_MM build                 ``2 M^2 d`` (distance GEMM)            ``max(2 M^2 d / G + M^2 / E, M^2 w / B)``
cholesky_in_place          ``M^3 / 3``                            ``bytes = M^2 w`` (lower triangle read, written)
torch.linalg.cholesky      ``M^3 / 3``                            same (MKL/OpenBLAS ``potrf``, for comparison)
gram_of_lower (L^T L)      ``M^3 / 3``                            ``bytes = M^2 w``
solve_lower_in_place       ``M^2`` (one right-hand side)          ``bytes = M^2 w / 2`` (L's lower triangle)
preconditioner setup       ``2 M^2 d + M^3``                      ``K_MM bound + M^3 / G``
kernel pass (streamed)     ``n M (2 d + 4)``                      ``2 n M d / G + n M / E + 2 n M w / B``
kernel pass (stored K)     ``4 n M``                              ``n M w / B``
Nystrom Gram K^T K         ``n M^2`` (half of ``2 n M^2``)        ``(n M^2 + 2 n M d) / G + n M / E``
=========================  =====================================  ==============================================

Notes on the bounds:

* The preconditioner setup is ``build_preconditioner`` of plugins/kgp_builtins/falkon/preconditioner.py
  with ``factorization="cholesky"`` and ``precond_dtype="input"`` (FALKON's default is float64 for
  every input; "input" gives the dtype's own rate): ``G = K_MM`` (the K_MM build), ``L = chol(G +
  jitter)`` (``M^3 / 3``), ``L^T L`` (``M^3 / 3``, ``gram_of_lower``) and ``chol(L^T L / M + lambda I)``
  (``M^3 / 3``), i.e. ``M^3`` flops after ``K_MM``.
* Kernel pass: FALKON's hot loop ``K^T (K v)``, ``op.fused_matmul(v)`` with ``v`` of shape ``M x 1``.
  Streamed (``kgp.settings.kernel_cache("never")``): each row block of K is formed (distance GEMM
  ``2 n M d`` flops, ``n M`` exponentials) and read twice (``K v``, ``K^T u``: ``4 n M`` flops). A CPU
  block is 64 MiB (``CPU_BLOCK_BYTES``), larger than the cache, so the two reads cost ``2 n M w`` bytes at
  the DRAM rate ``B`` (cache-sized blocks would be charged at the cache rate ``C``; older runs in
  docs/benchmarks/roofline.md used that bound). The ``exp`` rate stays the cache-resident one.
  Stored (``kernel_cache("auto")``, after two warm-up products so that K is kept, only when
  ``(n + block rows) M w`` fits ``kgp.settings.memory_budget``): the native
  stored pass reads each tile of K from DRAM once and again from the cache while the next tile is
  prefetched, so the bound is one read, ``n M w / B``; older runs (docs/benchmarks/) used ``n M w / B + n M w / C``
  (torch's two products, one block of K read from DRAM and again from the cache).
  For float32 a third row times the stored pass with ``accumulate=torch.float64`` (FALKON's default
  sums for float32 inputs), against the same bound.
* Nystrom Gram: ``op.gram()`` (the SGPR/DTC variance's ``K_Mn K_nM``) multiplies only the upper
  triangle of column panels, about ``n M^2`` of the ``2 n M^2`` flops of the full product; the GFLOP
  column counts ``n M^2``, the bound adds the kernel blocks' GEMM and exponentials.
* The elementwise work besides ``exp`` (clamp, scale) is not in any bound: it is overhead.
* The GFLOP column counts useful flops only. ``gram_of_lower`` multiplies whole 256-wide diagonal
  blocks (``kgp.linalg.triangular.GRAM_BLOCK``), zeros included: about 1 + 1.5 * 256 / M times ``M^3 / 3``
  (1.2x at 2,000, 1.08x at 5,000). ``cholesky_in_place`` runs LAPACK's ``potrf`` on a copy up to
  ``kgp.linalg.cholesky.POTRF_MAX`` = 2,048 rows and 384-wide blocks above, so at M = 2,000 its row equals the
  ``torch.linalg.cholesky`` row plus one ``M x M`` copy.

Values that do not change the work (RBF lengthscale 1, outputscale 2, jitter 0.1 of the mean diagonal,
noise 1) are chosen so that float32 factorizations succeed at every M. The float32 / float64 table at
the end gives the time ratio per operation and M (0.5 where float32 runs at twice the rate).

Each result is also appended as one JSON line to ``benchmarks/bench_roofline_runs.jsonl`` (``--jsonl``;
an empty string writes nothing), with the date, load average, thread count and the machine's rates.
Default run: n = 32,000, d = 8, M = 2,000 / 5,000 / 10,000; estimated at 3 to 5 minutes on the 2-core
development machine from the rates and ratios of a one-thread run at M = 1,000 / 2,000, n = 16,000
(the least time the operations of each M can take, the sum of their bounds, is printed first). Peak
memory about 6 GB at M = 10,000 in float64 (K_MM, its factor, a scratch copy, the stored 2.6 GB K).

``--device cuda``: every tensor on that device and every timing waits for it (``torch.cuda.synchronize``).
The exp rate is then measured over a GPU-sized block (``ACCELERATOR_BLOCK_BYTES``, 256 MiB), the DRAM
rates over 2 GiB, and the streamed pass's bound reads its blocks at the DRAM rate (a GPU's blocks do
not fit its L2). The cache row (8 MB) is then an L2 figure and enters no bound.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import gpytorch  # noqa: E402
import torch  # noqa: E402
from kgp_builtins.falkon.preconditioner import build_preconditioner  # noqa: E402

import kgp  # noqa: E402
from kgp import settings  # noqa: E402
from kgp.linalg import cholesky_in_place, gram_of_lower, solve_lower_in_place  # noqa: E402
from kgp.operators.blocks import ACCELERATOR_BLOCK_BYTES, CPU_BLOCK_BYTES  # noqa: E402
from kgp.operators.fused_cpu import native_applies  # noqa: E402
from kgp.operators.fused_gpu import fused_applies  # noqa: E402
from kgp.plugin import Problem  # noqa: E402

DEFAULT_JSONL = Path(__file__).resolve().parent / "bench_roofline_runs.jsonl"
# Above this bound an operation runs once, without warm-up: a second run would only double the wall
# time, and the first-call costs (allocation, page faults) are a small part of it.
SINGLE_RUN_BOUND_S = 0.5
DRAM_BYTES = 256 * 2**20
# Size of the cache-rate and (CPU) exp-rate arrays: a last-level cache holds it.
CACHE_PROBE_BYTES = 8_000_000
# Passes per timing of a block-sized figure: one 8 MB pass is shorter than the timer's noise on a busy host.
BLOCK_PASSES = 10
JITTER = 0.1
NOISE = 1.0
LENGTHSCALE = 1.0
OUTPUTSCALE = 2.0
# Where every tensor lives (``--device``); set once in main.
DEVICE = torch.device("cpu")


def on_accelerator() -> bool:
    """Whether the benchmark runs on a device other than the CPU."""
    return DEVICE.type != "cpu"


def block_bytes() -> int:
    """Bytes of one kernel block as the operator sizes it on DEVICE (blocks.plan_block_rows)."""
    return ACCELERATOR_BLOCK_BYTES if on_accelerator() else CPU_BLOCK_BYTES


def exp_probe_bytes() -> int:
    """Array size of the exp-rate figure: cache-resident on the CPU (its compute rate), a block on a GPU."""
    return ACCELERATOR_BLOCK_BYTES if on_accelerator() else CACHE_PROBE_BYTES


def dram_bytes() -> int:
    """Size of the DRAM-rate arrays: 256 MiB on the CPU, 2 GiB on a GPU (whose L2 holds tens of MB)."""
    return 8 * DRAM_BYTES if on_accelerator() else DRAM_BYTES


def synchronize() -> None:
    """Wait for queued device work, so a host clock read after it covers the work (no-op on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


# Operations of every dtype, in table order (the float32 table has two more, PRECOND_MIXED and STORED_WIDE).
K_MM = "K_MM build"
CHOL = "cholesky_in_place"
CHOL_LAPACK = "torch.linalg.cholesky"
GRAM_LOWER = "gram_of_lower (L^T L)"
SOLVE = "solve_lower_in_place (1 rhs)"
PRECOND = "preconditioner setup"
PASS = "kernel pass (streamed)"
STORED = "kernel pass (stored K)"
GRAM = "Nystrom Gram K^T K"
OPERATIONS = (K_MM, CHOL, CHOL_LAPACK, GRAM_LOWER, SOLVE, PRECOND, PASS, STORED, GRAM)
FUSED = "kernel pass (fused tiles, GPU)"  # only where kgp.operators.fused_gpu runs (a CUDA device, Triton)
NATIVE = "kernel pass (native, CPU)"  # only where kgp.operators.fused_cpu runs (a CPU, a C compiler, RBF)
STORED_WIDE = "kernel pass (stored K, float64 sums)"
PRECOND_MIXED = "preconditioner setup (mixed)"  # float32's default: K_MM in float64, factored in float32


@dataclass
class Machine:
    """Rates measured on this machine: flop/s, exponentials/s (per dtype) and bytes/s.

    Attributes
    ----------
    gemm, exp:
        Per dtype: ``torch.mm`` flop/s and the faster of ``exp`` / ``exp2`` in elements/s.
    exp_only, exp2:
        Per dtype: the two elementwise rates separately (printed; ``exp`` is their maximum).
    dram_read, dram_copy, cache_read:
        Bytes/s of a sum over 256 MiB, of a 256 MiB copy (read + written) and of a sum over 8 MB.
    gemm_side:
        Side of the square GEMM measured.
    """

    gemm: dict[torch.dtype, float] = field(default_factory=dict)
    exp: dict[torch.dtype, float] = field(default_factory=dict)
    exp_only: dict[torch.dtype, float] = field(default_factory=dict)
    exp2: dict[torch.dtype, float] = field(default_factory=dict)
    dram_read: float = 0.0
    dram_copy: float = 0.0
    cache_read: float = 0.0
    gemm_side: int = 0

    @property
    def dram(self) -> float:
        """The DRAM rate of the bounds: the better of the read and the copy figure (bytes/s)."""
        return max(self.dram_read, self.dram_copy)


@dataclass
class Operation:
    """One timed operation and its model.

    Attributes
    ----------
    name:
        Row label.
    run:
        The timed call.
    flops:
        Useful flops (the GFLOP column).
    bound:
        Seconds at the machine's rates (see the module docstring).
    setup:
        Untimed call before every timed one (restores an input that ``run`` overwrites).
    compute_s, memory_s:
        The compute and the memory part of the bound, for the JSON record.
    """

    name: str
    run: Callable[[], object]
    flops: float
    bound: float
    setup: Callable[[], object] | None = None
    compute_s: float = 0.0
    memory_s: float = 0.0


def best_time(
    fn: Callable[[], object], reps: int, *, setup: Callable[[], object] | None = None, warmup: bool = True
) -> float:
    """Best wall time of ``reps`` calls of ``fn`` (the least disturbed on a shared host).

    Parameters
    ----------
    fn:
        The timed call.
    reps:
        Timed calls; the minimum is returned.
    setup:
        Called, untimed, before every call of ``fn`` (warm-up included).
    warmup:
        One untimed call first (buffers allocated, pages touched, caches filled).
    """
    if warmup:
        if setup is not None:
            setup()
        fn()
    best = math.inf
    for _ in range(max(1, reps)):
        if setup is not None:
            setup()
        synchronize()
        t0 = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def measure_machine(dtypes: Sequence[torch.dtype], gemm_side: int, reps: int) -> Machine:
    """GEMM and exponential rates per dtype, DRAM and cache read rates.

    Parameters
    ----------
    dtypes:
        Dtypes whose GEMM and elementwise rates are measured.
    gemm_side:
        Side of the square matrices of the GEMM (``2 gemm_side^3`` flops per product).
    reps:
        Timed repetitions per figure (best of).
    """
    machine = Machine(gemm_side=gemm_side)
    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        a = torch.randn(gemm_side, gemm_side, generator=gen, dtype=dtype).to(DEVICE)
        b = torch.randn(gemm_side, gemm_side, generator=gen, dtype=dtype).to(DEVICE)
        c = torch.empty_like(a)
        t = best_time(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), reps)
        machine.gemm[dtype] = 2.0 * gemm_side**3 / t
        del a, b, c
        elements = exp_probe_bytes() // dtype.itemsize
        # kernel exponents: moderate negative arguments, far from the denormal range
        src = (-20.0 * torch.rand(elements, generator=gen, dtype=dtype)).to(DEVICE)
        dst = torch.empty_like(src)
        t_exp = best_time(lambda s=src, o=dst: [torch.exp(s, out=o) for _ in range(BLOCK_PASSES)], reps)
        t_exp2 = best_time(lambda s=src, o=dst: [torch.exp2(s, out=o) for _ in range(BLOCK_PASSES)], reps)
        machine.exp_only[dtype] = BLOCK_PASSES * elements / t_exp
        machine.exp2[dtype] = BLOCK_PASSES * elements / t_exp2
        machine.exp[dtype] = max(machine.exp_only[dtype], machine.exp2[dtype])
    machine.dram_read, machine.dram_copy, machine.cache_read = memory_rates(reps)
    return machine


def memory_rates(reps: int) -> tuple[float, float, float]:
    """Bytes/s of a sum over 256 MiB, of a 256 MiB copy (read + written) and of a sum over one 8 MB block.

    Parameters
    ----------
    reps:
        Timed repetitions per figure (best of).
    """
    size = dram_bytes()
    # filled: no page faults in the timing
    big = torch.empty(size // 8, dtype=torch.float64, device=DEVICE).fill_(1.0)
    out = torch.empty_like(big)
    read = size / best_time(lambda: big.sum(), reps)
    copy = 2 * size / best_time(lambda: out.copy_(big), reps)
    # 8 MB: a CPU's kernel block, and a part of a GPU's L2
    block = torch.ones(CACHE_PROBE_BYTES // 8, dtype=torch.float64, device=DEVICE)
    cache = BLOCK_PASSES * CACHE_PROBE_BYTES / best_time(lambda: [block.sum() for _ in range(BLOCK_PASSES)], reps)
    return read, copy, cache


def rbf(dtype: torch.dtype) -> gpytorch.kernels.ScaleKernel:
    """The benchmark's kernel: ScaleKernel(RBFKernel), lengthscale 1, outputscale 2."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    kernel.base_kernel.lengthscale = LENGTHSCALE
    kernel.outputscale = OUTPUTSCALE
    return kernel.to(DEVICE)


def make_data(n: int, m: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Gaussian inputs ``X`` (n x d), centers ``Z`` drawn from them (m x d), targets ``y`` and ``v`` (m x 1)."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype)
    Z = X[torch.randperm(n, generator=gen)[:m]].clone()
    y = torch.randn(n, 1, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(m, 1, generator=gen, dtype=torch.float64).to(dtype)
    return X.to(DEVICE), Z.to(DEVICE), y.to(DEVICE), v.to(DEVICE)


OP_KEYS = {
    "kmm": K_MM,
    "chol": CHOL,
    "chol_lapack": CHOL_LAPACK,
    "gram_lower": GRAM_LOWER,
    "solve": SOLVE,
    "setup": PRECOND,
    "setup_mixed": PRECOND_MIXED,
    "pass": PASS,
    "native": NATIVE,
    "fused": FUSED,
    "stored": STORED,
    "stored_wide": STORED_WIDE,
    "gram": GRAM,
}
"""``--ops`` keys: the operations to run (default all). At M = 30,000 the Cholesky rows alone hold three
``M x M`` float64 arrays (21.6 GB); ``--ops setup,setup_mixed`` holds the setup's own arrays only."""


def operations(
    n: int, m: int, d: int, dtype: torch.dtype, machine: Machine, only: set[str] | None = None
) -> list[Operation]:
    """The timed operations at one size and dtype, with their flops and bounds (module docstring).

    Parameters
    ----------
    n, m, d:
        Rows of the kernel pass, centers, features.
    dtype:
        float32 or float64.
    machine:
        The measured rates.
    only:
        Operation names (values of :data:`OP_KEYS`) to build and time; None: all. Arrays that only the
        others need are not allocated.
    """

    def want(*names: str) -> bool:
        return only is None or any(name in only for name in names)

    if m > n:
        raise ValueError(f"M = {m} exceeds n = {n}: the centers are drawn from the rows")
    X, Z, y, v = make_data(n, m, d, dtype)
    kernel = rbf(dtype)
    w = dtype.itemsize
    G_rate, E_rate, B_rate, C_rate = machine.gemm[dtype], machine.exp[dtype], machine.dram, machine.cache_read
    # the streamed pass's blocks exceed the cache (64 MiB on a CPU, 256 MiB on a GPU): its re-reads come from
    # DRAM; the stored pass keeps the cache rate for its second read, as before
    block_rate = B_rate if block_bytes() > CACHE_PROBE_BYTES else C_rate
    ops: list[Operation] = []

    def add(name, run, flops, compute_s, memory_s, *, setup=None, bound=None):
        bound = max(compute_s, memory_s) if bound is None else bound
        ops.append(Operation(name, run, flops, bound, setup, compute_s, memory_s))

    kmm_compute = 2 * m * m * d / G_rate + m * m / E_rate
    kmm_memory = m * m * w / B_rate
    if want(K_MM):
        add(K_MM, lambda: kgp.kernel_operator(kernel, Z).to_dense(), 2 * m * m * d, kmm_compute, kmm_memory)

    cubic = m**3 / 3
    tri_bytes = m * m * w
    if want(CHOL, CHOL_LAPACK, GRAM_LOWER, SOLVE):
        # the matrix FALKON factors: K_MM plus a jitter on the diagonal
        spd = kgp.kernel_operator(kernel, Z).to_dense()
        spd.diagonal().add_(JITTER * float(spd.diagonal().mean()))
        work = torch.empty_like(spd)
        if want(CHOL):
            add(
                CHOL,
                lambda: cholesky_in_place(work),
                cubic,
                cubic / G_rate,
                tri_bytes / B_rate,
                setup=lambda: work.copy_(spd),
            )
        if want(CHOL_LAPACK):
            add(CHOL_LAPACK, lambda: torch.linalg.cholesky(spd), cubic, cubic / G_rate, tri_bytes / B_rate)
        L = torch.linalg.cholesky(spd)  # lower, strict upper triangle zero, as gram_of_lower requires
        # written into the Cholesky's scratch array: one M x M array less at the peak (800 MB at M = 10,000)
        if want(GRAM_LOWER):
            add(GRAM_LOWER, lambda: gram_of_lower(L, out=work), cubic, cubic / G_rate, tri_bytes / B_rate)
        rhs = torch.empty_like(v)
        if want(SOLVE):
            add(
                SOLVE,
                lambda: solve_lower_in_place(L, rhs),
                m * m,
                m * m / G_rate,
                tri_bytes / 2 / B_rate,
                setup=lambda: rhs.copy_(v),
            )
    problem = Problem(X=X, y=y, kernel=kernel, noise=NOISE, centers=Z)

    def setup(precond_dtype: str):
        return lambda: build_preconditioner(
            problem, None, factorization="cholesky", precond_dtype=precond_dtype, jitter=JITTER, rcond=None
        )

    if want(PRECOND):
        add(
            PRECOND,
            setup("input"),
            2 * m * m * d + m**3,
            kmm_compute + m**3 / G_rate,
            2.5 * m * m * w / B_rate,  # K_MM written, then three triangles
            bound=max(kmm_compute, kmm_memory) + m**3 / G_rate,
        )

    if dtype == torch.float32 and want(PRECOND_MIXED):
        # what a float32 FALKON fit runs by default (precond_dtype="auto" -> "mixed", mixed_cholesky): K_MM
        # evaluated in float64, the three M^3 / 3 steps in float32 (the CG reads the float32 factors)
        kmm64 = 2 * m * m * d / machine.gemm[torch.float64] + m * m / machine.exp[torch.float64]
        add(
            PRECOND_MIXED,
            setup("mixed"),
            2 * m * m * d + m**3,
            kmm64 + m**3 / G_rate,
            (m * m * 8 + 2 * m * m * w) / B_rate,  # K_MM in float64 blocks, the two float32 factors
            bound=kmm64 + m**3 / G_rate,
        )

    nm = n * m
    pass_compute = 2 * nm * d / G_rate + nm / E_rate
    pass_memory = 2 * nm * w / block_rate
    streamed = kgp.kernel_operator(kernel, X, Z)

    def streamed_pass():
        with settings.kernel_cache("never"), settings.fused_kernels("never"):
            return streamed.fused_matmul(v)

    if want(PASS):
        add(PASS, streamed_pass, nm * (2 * d + 4), pass_compute, pass_memory, bound=pass_compute + pass_memory)
    # the fused kernels (a GPU's Triton tiles, or the CPU's native pass) keep tiles in registers or the cache:
    # no block traffic, so the bound is the compute part alone (the distance GEMM at the GEMM rate plus the
    # exponentials); the GPU forms each tile twice, once per product (target: within 1.5x on a CPU)
    with settings.fused_kernels("auto"), settings.kernel_cache("never"):
        fast = (
            FUSED if fused_applies(streamed.workspace, 1) else NATIVE if native_applies(streamed.workspace, 1) else None
        )
    if fast is not None and want(fast):

        def fast_pass():
            with settings.kernel_cache("never"), settings.fused_kernels("auto"):
                return streamed.fused_matmul(v)

        add(fast, fast_pass, nm * (2 * d + 4), pass_compute, 0.0, bound=pass_compute)

    stored_op = kgp.kernel_operator(kernel, X, Z)
    if want(STORED, STORED_WIDE) and (n + stored_op.block_rows()) * m * w <= settings.memory_budget.value():
        stored_memory = nm * w / B_rate  # one read: the native stored pass (module docstring)

        def stored_pass(accumulate=None):
            with settings.kernel_cache("auto"):
                return stored_op.fused_matmul(v, accumulate=accumulate)

        # the operator keeps K from its second product on: both before the timing, which may skip its warm-up
        stored_pass()
        stored_pass()
        if want(STORED):
            add(STORED, stored_pass, 4 * nm, 4 * nm / G_rate, stored_memory, bound=stored_memory)
        if dtype == torch.float32 and want(STORED_WIDE):
            add(
                STORED_WIDE,
                lambda: stored_pass(torch.float64),
                4 * nm,
                4 * nm / G_rate,
                stored_memory,
                bound=stored_memory,
            )

    gram_op = kgp.kernel_operator(kernel, X, Z)

    def gram():
        with settings.kernel_cache("never"):
            return gram_op.gram()

    gram_compute = (nm * m + 2 * nm * d) / G_rate + nm / E_rate
    if want(GRAM):
        add(GRAM, gram, nm * m, gram_compute, 0.0)
    return ops


def load1() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def parse_list(text: str, cast: Callable[[str], object]) -> list:
    """Comma-separated values, each through ``cast``."""
    return [cast(item.strip()) for item in text.split(",") if item.strip()]


def parse_dtype(name: str) -> torch.dtype:
    """``float32`` / ``float64`` to the torch dtype."""
    dtypes = {"float32": torch.float32, "float64": torch.float64}
    if name not in dtypes:
        raise argparse.ArgumentTypeError(f"expected float32 or float64, got {name!r}")
    return dtypes[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).replace("torch.", "")


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", default=None, help="comma-separated numbers of centers M (default 2000,5000,10000)")
    parser.add_argument("--n", type=int, default=None, help="rows of the kernel pass and the Gram (default 32000)")
    parser.add_argument("--d", type=int, default=8, help="features (default 8)")
    parser.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions of small operations (best of)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="M = 200,400, n = 2000, reps 2: a smoke run")
    parser.add_argument("--jsonl", default=str(DEFAULT_JSONL), help="JSON-lines log to append to ('' for none)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    parser.add_argument(
        "--ops", default="", help=f"comma-separated operations to run (default all): {', '.join(OP_KEYS)}"
    )
    parser.add_argument(
        "--peers", action="store_true", help="then run the peer benchmarks (the FALKON library, EigenPro3)"
    )
    parser.add_argument(
        "--peer-python",
        default=sys.executable,
        help="interpreter for the peer benchmarks: one where the FALKON library is importable (default: this one)",
    )
    parser.add_argument("--peer-m", default="2000,5000", help="numbers of centers of the FALKON library run")
    parser.add_argument("--peer-dtypes", default="float32,float64", help="dtypes of the FALKON library run")
    return parser


def peer_commands(python: str, ms: Sequence[int], dtypes: Sequence[str]) -> list[list[str]]:
    """The peer benchmarks ``--peers`` runs after the roofline, each one command of its own: kgp's FALKON
    against the FALKON library 0.9 on airline (target 10x; it prints "skipped" where ``python`` cannot
    import the library) and kgp's EigenPro against the EigenPro3 reference on letter (target 5; the
    reference's rows are skipped without its checkout, see that script)."""
    here = Path(__file__).resolve().parent
    return [
        [python, str(here / "bench_falkon_library.py"), "--m", *map(str, ms), "--dtype", *dtypes],
        [python, str(here / "bench_eigenpro_reference.py"), "--repeats", "2"],
    ]


def run_peers(args: argparse.Namespace) -> None:
    """Run :func:`peer_commands` in turn, their output printed as it comes."""
    plugins = str(Path(__file__).resolve().parents[1] / "plugins")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [plugins, os.environ.get("PYTHONPATH")])))
    for command in peer_commands(args.peer_python, parse_list(args.peer_m, int), parse_list(args.peer_dtypes, str)):
        print(f"\n## Peers: {Path(command[1]).name}", flush=True)
        done = subprocess.run(command, env=env, check=False)
        if done.returncode:
            print(f"({Path(command[1]).name} exited with status {done.returncode})")


def main(argv: Sequence[str] | None = None) -> dict:
    """Measure the machine, time every operation, print the tables and append the JSON lines.

    Parameters
    ----------
    argv:
        Command-line arguments (None: ``sys.argv[1:]``).

    Returns
    -------
    dict
        ``{"machine": Machine, "rows": [one dict per result, as written to the JSON log]}``.
    """
    global DEVICE
    args = build_parser().parse_args(argv)
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and DEVICE.index is None:
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ms = parse_list(args.m, int) if args.m else ([200, 400] if args.quick else [2000, 5000, 10000])
    n = args.n or (2000 if args.quick else 32000)
    d = args.d
    dtypes = parse_list(args.dtypes, parse_dtype)
    reps = args.reps or (2 if args.quick else 3)
    only = None
    if args.ops:
        unknown = [key for key in parse_list(args.ops, str) if key not in OP_KEYS]
        if unknown:
            raise SystemExit(f"--ops: unknown {unknown}; expected some of {', '.join(OP_KEYS)}")
        only = {OP_KEYS[key] for key in parse_list(args.ops, str)}
    gemm_side = min(4096, max(1024, max(ms)))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    threads = torch.get_num_threads()
    cpu = cpu_model()
    if DEVICE.type == "cuda":
        cpu = f"{torch.cuda.get_device_name(DEVICE)} (host CPU: {cpu})"

    print("# kgp roofline: FALKON's building blocks against the machine's bounds")
    print(
        f"{date}, torch {torch.__version__}, threads={threads}, CPU: {cpu}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, loadavg (1 min) at start={load1():.2f}"
    )
    print(f"n={n}, d={d}, M={ms}, reps={reps} (1 without warm-up where the bound exceeds {SINGLE_RUN_BOUND_S} s)")

    with torch.no_grad():
        # float32's mixed setup evaluates K_MM in float64: its bound needs the float64 rates too
        rated = list(dtypes) + ([torch.float64] if torch.float32 in dtypes and torch.float64 not in dtypes else [])
        machine = measure_machine(rated, gemm_side, reps)
    print("\n## Machine")
    print(f"| dtype | GEMM GFLOP/s ({gemm_side}^2) | exp G elem/s | exp2 G elem/s |")
    print("|---|---|---|---|")
    for dtype in dtypes:
        print(
            f"| {dtype_name(dtype)} | {machine.gemm[dtype] / 1e9:.1f} | {machine.exp_only[dtype] / 1e9:.2f} "
            f"| {machine.exp2[dtype] / 1e9:.2f} |"
        )
    print(
        f"\nDRAM: sum {machine.dram_read / 1e9:.1f} GB/s, copy {machine.dram_copy / 1e9:.1f} GB/s "
        f"(bound: {machine.dram / 1e9:.1f}); cache (8 MB sum): {machine.cache_read / 1e9:.1f} GB/s"
    )

    rows: list[dict] = []
    jsonl = Path(args.jsonl) if args.jsonl else None
    seconds: dict[tuple[str, str, int], float] = {}
    for dtype in dtypes:
        name_dt = dtype_name(dtype)
        print(f"\n## {name_dt}")
        print("| operation | M | seconds | GFLOP | bound s | achieved/bound |")
        print("|---|---|---|---|---|---|")
        for m in ms:
            with torch.no_grad():
                ops = operations(n, m, d, dtype, machine, only)
                estimate = sum(op.bound * (1 if op.bound > SINGLE_RUN_BOUND_S else reps + 1) for op in ops)
                print(f"| *M = {m}: at least {estimate:.2g} s at the bounds* | | | | | |", flush=True)
                for op in ops:
                    single = op.bound > SINGLE_RUN_BOUND_S
                    t = best_time(op.run, 1 if single else reps, setup=op.setup, warmup=not single)
                    ratio = t / op.bound
                    seconds[(op.name, name_dt, m)] = t
                    print(
                        f"| {op.name} | {m} | {t:.3g} | {op.flops / 1e9:.3g} | {op.bound:.3g} | {ratio:.2f} |",
                        flush=True,
                    )
                    row = {
                        "date": date,
                        "operation": op.name,
                        "dtype": name_dt,
                        "M": m,
                        "n": n,
                        "d": d,
                        "seconds": t,
                        "gflop": op.flops / 1e9,
                        "bound_s": op.bound,
                        "compute_s": op.compute_s,
                        "memory_s": op.memory_s,
                        "ratio": ratio,
                        "reps": 1 if single else reps,
                        "load": load1(),
                        "threads": threads,
                        "torch": torch.__version__,
                        "cpu": cpu,
                        "quick": bool(args.quick),
                        "gemm_gflops": machine.gemm[dtype] / 1e9,
                        "exp_gelems": machine.exp[dtype] / 1e9,
                        "dram_gbs": machine.dram / 1e9,
                        "cache_gbs": machine.cache_read / 1e9,
                    }
                    rows.append(row)
                    if jsonl is not None:
                        with jsonl.open("a") as fh:
                            fh.write(json.dumps(row) + "\n")
                del ops

    if len(dtypes) > 1:
        first, second = dtype_name(dtypes[0]), dtype_name(dtypes[1])
        print(f"\n## {first} / {second} time ratio")
        print("| operation | " + " | ".join(f"M={m}" for m in ms) + " |")
        print("|---|" + "---|" * len(ms))
        every = (*OPERATIONS, PRECOND_MIXED, FUSED, NATIVE, STORED_WIDE)
        names = [name for name in every if any(key[0] == name for key in seconds)]
        for name in names:
            cells = []
            for m in ms:
                a, b = seconds.get((name, first, m)), seconds.get((name, second, m))
                cells.append(f"{a / b:.2f}" if a is not None and b is not None else "")
            if any(cells):
                print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nloadavg (1 min) at end={load1():.2f}", flush=True)
    if args.peers:
        run_peers(args)
    return {"machine": machine, "rows": rows}


if __name__ == "__main__":
    main()
