"""kgp's FALKON against the FALKON library (``falkon`` 0.9.0) in one process on the airline problem.

Target: kgp's FALKON at least 10x faster than the FALKON library 0.9 on the airline problem,
in the same run, at equal test MSE. The problem is the one of ``bench_falkon.py`` (its ``load_airline``
is imported): ../shared/data/airline_nycflights13.npz, seeded 80/20 split, features and target z-scored
with training statistics, Gaussian kernel exp(-||x - z||^2 / (2 sigma^2)) with sigma = 1 in both
libraries, lambda = 1e-6, 20 conjugate-gradient iterations with no early stop, CPU only.

Same problem, term by term:

- Penalty. The library's conjugate gradient applies ``K_nM^T K_nM v / n + penalty K_MM v``, so its
  ``penalty`` is lambda in ``(K_nM^T K_nM + lambda n K_MM) alpha = K_nM^T y``. kgp's ``noise`` is
  sigma^2 = lambda n. So the library gets ``penalty=LAM`` and kgp ``noise=LAM * n_train``.
- Centers. kgp's ``uniform`` selector (seed 0) draws the M centers once; kgp gets them as an array
  (``centers=Z``) and the library through ``falkon.center_selection.FixedSelector(Z)``.
- Iterations. kgp runs ``maxiter=20, tol=0``; the library ``maxiter=20`` with ``cg_tolerance=0`` so that
  its stopping test (squared residual below the tolerance squared) never ends the run early.
- Everything else is each library's default: the library's KeOps path is off (``keops_active="no"``:
  KeOps is not installed and serves only GPUs here) and it recomputes the full gradient every 10
  iterations. The two defaults differ on keeping K_nM: the library keeps it only for d > 1200
  (``store_kernel_d_threshold``), so at d = 8 it recomputes K_nM in every iteration, while kgp
  (``kernel_cache="auto"``) keeps it from the second pass on when it fits ``kgp.settings.memory_budget``.
  ``--library-keeps-knm`` sets the library's threshold to 0 (it then keeps K_nM when free RAM allows),
  so that the comparison of that choice is visible too.

Each fit time is the best of ``--repeats`` (default 2) fits after one warm-up fit of each library;
the timed fits alternate kgp / library so that a change of load on the machine hits both alike. The
test MSE is of the last fit. A missing ``falkon`` package skips the benchmark (exit 0).

Usage (the library's own virtualenv, with kgp installed there too)::

    flock /tmp/kgp-bench.lock env OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE \\
        /tmp/falkon-venv/bin/python benchmarks/bench_falkon_library.py [--m 2000 5000] [--dtype float32 float64]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import warnings
from pathlib import Path

# as in bench_falkon.py, set before torch loads: idle OpenMP threads sleep (the machine is shared), and
# kgp finds its built-in plugins without scanning entry points
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # for bench_falkon's data loading

import torch  # noqa: E402
from bench_falkon import LAM, LENGTHSCALE, MAXITER, SEED, load_airline  # noqa: E402

import kgp  # noqa: E402

try:
    import falkon
    from falkon.center_selection import FixedSelector
except ImportError as err:  # the library is optional: this benchmark then has nothing to compare
    print(f"skipped: the FALKON library is not importable ({err}); see the module docstring to build it")
    sys.exit(0)


def uniform_centers(X: torch.Tensor, M: int) -> torch.Tensor:
    """The M centers both libraries use: kgp's uniform selector with the benchmark's seed.

    Parameters
    ----------
    X : torch.Tensor
        Training features (n x d).
    M : int
        Number of centers.

    Returns
    -------
    torch.Tensor
        M x d centers, rows of ``X``.
    """
    kernel = kgp.kernels.make_kernel("rbf", LENGTHSCALE).to(X.dtype)
    req = kgp.SelectionRequest(
        X=X, n_centers=M, kernel=kernel, noise=LAM * X.shape[0], generator=torch.Generator().manual_seed(SEED)
    )
    return kgp.get_selector("uniform").select(req).points.contiguous()


def fit_kgp(X: torch.Tensor, y: torch.Tensor, Z: torch.Tensor):
    """Fit kgp's FALKON on centers Z; returns the fitted model."""
    model = kgp.KernelRegressor(
        "rbf",
        lengthscale=LENGTHSCALE,
        noise=LAM * X.shape[0],
        solver="falkon",
        centers=Z,
        solver_options={"maxiter": MAXITER, "tol": 0.0},
        random_state=SEED,
    )
    return model.fit(X, y)


def fit_library(X: torch.Tensor, y: torch.Tensor, Z: torch.Tensor, keep_knm: bool = False):
    """Fit the library's ``falkon.Falkon`` on centers Z; returns the fitted model.

    Parameters
    ----------
    X, y : torch.Tensor
        Training features (n x d) and targets (n).
    Z : torch.Tensor
        M x d centers.
    keep_knm : bool
        Let the library keep K_nM in memory at any d (its default keeps it only for d > 1200).
    """
    threshold = 0 if keep_knm else falkon.FalkonOptions().store_kernel_d_threshold
    options = falkon.FalkonOptions(
        use_cpu=True, keops_active="no", cg_tolerance=0.0, store_kernel_d_threshold=threshold
    )
    model = falkon.Falkon(
        kernel=falkon.kernels.GaussianKernel(sigma=LENGTHSCALE, opt=options),
        penalty=LAM,
        M=Z.shape[0],
        center_selection=FixedSelector(Z),
        maxiter=MAXITER,
        seed=SEED,
        options=options,
    )
    return model.fit(X, y.unsqueeze(-1))  # the library takes n x t targets


def timed(fit, *args) -> tuple[float, object]:
    """Wall time of one fit and the fitted model."""
    t0 = time.perf_counter()
    model = fit(*args)
    return time.perf_counter() - t0, model


def mse(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float(((pred.reshape(-1) - y) ** 2).mean())


def run_row(dtype: torch.dtype, M: int, repeats: int, keep_knm: bool) -> dict:
    """Warm up both, then alternate timed fits; best time of each and test MSE of its last fit."""
    Xtr, ytr, Xte, yte = load_airline(dtype)
    Z = uniform_centers(Xtr, M)
    fit_kgp(Xtr, ytr, Z)  # warm-up: first-call costs (kernel code paths, allocator) of each
    fit_library(Xtr, ytr, Z, keep_knm)
    t_kgp, t_lib = [], []
    for _ in range(repeats):
        s, m_kgp = timed(fit_kgp, Xtr, ytr, Z)
        t_kgp.append(s)
        s, m_lib = timed(fit_library, Xtr, ytr, Z, keep_knm)
        t_lib.append(s)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "n": Xtr.shape[0],
        "M": M,
        "kgp_s": min(t_kgp),
        "lib_s": min(t_lib),
        "kgp_mse": mse(m_kgp.predict(Xte), yte),
        "lib_mse": mse(m_lib.predict(Xte), yte),
    }


def load_line() -> str:
    return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[2000, 5000], help="numbers of centers")
    parser.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=2, help="timed fits of each (best is kept)")
    parser.add_argument("--library-keeps-knm", action="store_true", help="library keeps K_nM at d = 8 too")
    args = parser.parse_args()
    # the library warns about its own optional parts (KeOps, CUDA) on every fit; the table says what runs
    warnings.filterwarnings("ignore", module="falkon")

    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}, start {load_line()}")
    print(
        f"torch {torch.__version__}, falkon {falkon.__version__}, kgp {kgp.__version__}, "
        f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}"
    )
    knm = "keeps K_nM (--library-keeps-knm)" if args.library_keeps_knm else "default K_nM handling"
    print(f"kgp memory budget {kgp.settings.memory_budget.value() / 2**30:.1f} GiB, library: {knm}")
    print(f"\nairline, lambda {LAM:g}, sigma {LENGTHSCALE:g}, {MAXITER} iterations, best of {args.repeats}\n")
    print("| dtype | n | M | kgp fit s | library fit s | library / kgp | kgp test MSE | library test MSE |")
    print("|---|---|---|---|---|---|---|---|")
    for M in args.m:
        for name in args.dtype:
            r = run_row(getattr(torch, name), M, args.repeats, args.library_keeps_knm)
            print(
                f"| {r['dtype']} | {r['n']} | {r['M']} | {r['kgp_s']:.2f} | {r['lib_s']:.2f} "
                f"| {r['lib_s'] / r['kgp_s']:.1f}x | {r['kgp_mse']:.4f} | {r['lib_mse']:.4f} |",
                flush=True,
            )
    print(f"\nend {load_line()}")


if __name__ == "__main__":
    main()
