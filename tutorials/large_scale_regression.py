"""Tutorial (a): large-scale regression on UCI kin40k — a solver swap, and how to choose M.

Run it with ``python tutorials/large_scale_regression.py [OUTPUT_DIR]`` (about 10 minutes on two CPU
cores; the test suite runs it on a 3,000-row subsample). It needs ``uci/kin40k.csv.gz`` from the shared
data (beside the checkout, or ``KGP_SHARED_DATA``). Figures measured with it are in
``tutorials/large_scale_regression.md``.

1. Load kin40k (32,000 training / 8,000 test rows, 8 features) with the seeded split of
   ``benchmarks/uci.py``.
2. Fit FALKON (Nystrom + preconditioned CG) for a range of M (``n_centers``) with two sets of
   hyperparameters: the README's isotropic RBF (lengthscale 1, noise 1e-2) and the ARD
   hyperparameters learned by a GPyTorch ExactGP on a 3,000-point subset
   (``benchmarks/uci_hyperparameters.json``). Only ``n_centers`` and the kernel change.
3. Swap the solver: the same model with ``solver="eigenpro"`` (EigenPro 3) — one name changes.
4. Plot test RMSE against M (``kin40k_rmse_vs_m.png``) and print a table.

The exact GP mean needs the 32,000 x 32,000 kernel matrix (8.2 GB in float64, above
``kgp.settings.max_exact_size``); with ``n_train`` at most 20,000 the tutorial fits it too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import gpytorch
import numpy as np
import torch

import kgp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import pyplot, uci_split  # noqa: E402

HYPERPARAMETERS = Path(__file__).resolve().parents[1] / "benchmarks" / "uci_hyperparameters.json"


def learned_kernel() -> tuple[gpytorch.kernels.Kernel, float]:
    """ScaleKernel(RBF with ARD) and the noise learned for kin40k (benchmarks/uci.py protocol)."""
    hyper = json.loads(HYPERPARAMETERS.read_text())["kin40k"]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=len(hyper["lengthscale"])))
    kernel = kernel.double()
    kernel.base_kernel.lengthscale = torch.tensor(hyper["lengthscale"], dtype=torch.float64).reshape(1, -1)
    kernel.outputscale = hyper["outputscale"]
    return kernel, float(hyper["noise"])


def run(
    output_dir: str | Path = "tutorials/output",
    *,
    n_train: int | None = None,
    m_values: tuple[int, ...] = (500, 1000, 2000, 4000, 8000),
    swap_m: int = 2000,
    maxiter: int = 20,
    eigenpro_epochs: int = 5,
) -> dict[str, dict[int, float]]:
    """Fit, print and plot; return ``{setting: {M: test RMSE}}`` (standardised units)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    X, y, X_test, y_test = uci_split("kin40k")
    if n_train is not None:
        X, y = X[:n_train], y[:n_train]  # the split is already shuffled: a prefix is a random subset
    settings = {
        "README: rbf, lengthscale 1, noise 1e-2": (gpytorch.kernels.RBFKernel().double(), 1e-2, 1.0),
        "learned ARD (uci_hyperparameters.json)": (*learned_kernel(), None),
    }

    def rmse(model) -> float:
        return float(np.sqrt(np.mean((model.predict(X_test) - y_test) ** 2)))

    results: dict[str, dict[int, float]] = {}
    for label, (kernel, noise, lengthscale) in settings.items():
        results[label] = {}
        for m in m_values:
            if m > len(y):
                continue
            model = kgp.KernelRegressor(
                kernel,
                lengthscale=lengthscale,
                noise=noise,
                solver="falkon",
                centers="uniform",
                n_centers=m,
                solver_options={"maxiter": maxiter},
                random_state=0,
            )
            start = time.perf_counter()
            model.fit(X, y)
            results[label][m] = rmse(model)
            seconds = time.perf_counter() - start
            print(f"falkon  M={m:>5}  {label:<40} test RMSE {results[label][m]:.4f}  ({seconds:.1f} s)")

    # the solver swap: the same model (learned hyperparameters, M = swap_m), EigenPro 3 instead of FALKON
    kernel, noise, _ = settings["learned ARD (uci_hyperparameters.json)"]
    swap: dict[str, float] = {}
    for solver, options in (("falkon", {"maxiter": maxiter}), ("eigenpro", {"epochs": eigenpro_epochs})):
        model = kgp.KernelRegressor(
            kernel, noise=noise, solver=solver, n_centers=min(swap_m, len(y)), solver_options=options, random_state=0
        )
        start = time.perf_counter()
        model.fit(X, y)
        swap[solver] = rmse(model)
        seconds = time.perf_counter() - start
        print(f"swap    {solver:<9} M={min(swap_m, len(y))}: test RMSE {swap[solver]:.4f} ({seconds:.1f} s)")
    results["swap"] = swap  # type: ignore[assignment]

    if len(y) <= kgp.settings.max_exact_size.value():
        exact = {}
        for label, (kernel, noise, lengthscale) in settings.items():
            model = kgp.KernelRegressor(kernel, lengthscale=lengthscale, noise=noise, solver="exact").fit(X, y)
            exact[label] = rmse(model)
            print(f"exact   n={len(y)}  {label:<40} test RMSE {exact[label]:.4f}")
        results["exact"] = exact  # type: ignore[assignment]

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, curve), marker in zip(((k, results[k]) for k in settings), "os"):
        ms = sorted(curve)
        line = ax.plot(ms, [curve[m] for m in ms], marker=marker, label=f"FALKON, {label}")[0]
        if "exact" in results:
            ax.axhline(results["exact"][label], color=line.get_color(), ls="--", lw=1, label=f"exact GP mean, {label}")
    ax.set_xscale("log")
    ax.set_xticks(m_values, [f"{m:,}" for m in m_values])  # plain labels: log minor ticks overlap
    ax.minorticks_off()
    ax.set_xlabel("M (n_centers, uniform)")
    ax.set_ylabel("test RMSE (standardised target)")
    ax.set_title(f"kin40k, n_train = {len(y):,}: FALKON test RMSE against M")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output_dir / "kin40k_rmse_vs_m.png", dpi=120)
    plt.close(fig)
    return results


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "tutorials/output")
