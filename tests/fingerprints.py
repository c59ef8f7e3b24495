"""Seeded fits of every built-in solver, objective and selector, recorded once and compared after changes.

The guard for refactors of the fit path: the predictions (and the predictive std where the fit gives
one) of these fits are recorded (``tests/data/fingerprints.npz``) and ``tests/test_fingerprints.py``
compares them to 1e-10 relative in float64. A change that is meant to alter numbers (a numerical fix)
re-records the entries it moves, and its commit says which and why::

    python tests/fingerprints.py --record           # every case
    python tests/fingerprints.py --record falkon    # cases whose name contains 'falkon'

The problems are small and well conditioned (noise >= 0.05, lengthscales of the data's scale, few
Adam steps, FALKON run to convergence). Direct solves then agree to about 1e-13 across BLAS code paths
(MKL_CBWR=COMPATIBLE / AVX2 / SSE4_2, one or two threads). Cases that end at an argmin or a random
decision do not: a one-dimensional minimum is determined only to about sqrt(eps) of its flat objective
(the refit), and a rejection-sampling draw (BLESS-R) may flip when a score moves in its last digit;
measured across those code paths: up to 2.4e-5 relative. :data:`SENSITIVE` names them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402

import kgp  # noqa: E402

RECORD = Path(__file__).resolve().parent / "data" / "fingerprints.npz"


def data(n: int = 240, d: int = 3, seed: int = 0, outputs: int = 1):
    """Smooth targets with noise, and query points partly outside the training range."""
    rng = np.random.RandomState(seed)
    X = rng.uniform(-2.0, 2.0, size=(n, d))
    f = np.sin(X @ np.linspace(1.0, 0.4, d)) + 0.3 * np.cos(2 * X[:, 0])
    Y = np.stack([f * (1 + 0.5 * k) + 0.1 * rng.randn(n) for k in range(outputs)], axis=1)
    Xq = rng.uniform(-2.5, 2.5, size=(60, d))
    return X, (Y[:, 0] if outputs == 1 else Y), Xq


# FALKON run to convergence: a stop at a residual tolerance would move with the rounding of another host
_CG = {"tol": 0.0, "maxiter": 60}

# name -> (constructor parameters, whether predict gives a std, data parameters)
CASES: dict[str, tuple[dict, bool, dict]] = {
    "exact": (dict(solver="exact", lengthscale=1.2, noise=0.1), True, {}),
    "exact_multi": (dict(solver="exact", lengthscale=1.0, noise=0.05), True, {"outputs": 2}),
    "exact_matern52": (dict(kernel="matern52", solver="exact", lengthscale=1.5, noise=0.1), True, {}),
    "falkon_uniform": (
        dict(solver="falkon", n_centers=60, lengthscale=1.2, noise=0.1, random_state=3, solver_options=_CG),
        True,
        {},
    ),
    "falkon_bless": (
        dict(
            solver="falkon",
            centers="bless",
            n_centers=50,
            lengthscale=1.2,
            noise=0.1,
            random_state=4,
            solver_options=_CG,
        ),
        True,
        {},
    ),
    "falkon_bless_r": (
        dict(solver="falkon", centers="bless-r", lengthscale=1.2, noise=0.1, random_state=5, solver_options=_CG),
        True,
        {},
    ),
    "eigenpro": (
        dict(solver="eigenpro", n_centers=80, lengthscale=1.2, noise=0.1, random_state=6),
        True,
        {},
    ),
    "eigenpro2": (dict(solver="eigenpro2", lengthscale=1.2, noise=0.1, random_state=7), False, {}),
    "dsg": (
        dict(solver="dsg", lengthscale=1.2, noise=0.1, random_state=8, solver_options={"passes": 3}),
        False,
        {},
    ),
    "learn_exact": (
        dict(
            solver="exact",
            ard=True,
            learn="exact",
            normalize_y=True,
            normalize_X=False,
            random_state=9,
            learn_options={"iterations": 15},
        ),
        True,
        {},
    ),
    "learn_exact_subset_refit": (
        dict(
            solver="falkon",
            n_centers=70,
            solver_options=_CG,
            learn="exact",
            ard=False,
            normalize_y=False,
            normalize_X=False,
            random_state=10,
            learn_options={"iterations": 12, "subset": 150, "refit_subset": 120},
        ),
        True,
        {},
    ),
    "learn_sgpr": (
        dict(
            solver="falkon",
            n_centers=40,
            solver_options=_CG,
            ard=True,
            learn="sgpr",
            normalize_y=True,
            normalize_X=False,
            random_state=11,
            learn_options={"iterations": 12, "optimizer": "adam"},
        ),
        True,
        {},
    ),
    "learn_holdout": (
        dict(
            solver="falkon",
            n_centers=40,
            solver_options=_CG,
            learn="holdout",
            ard=False,
            normalize_y=False,
            normalize_X=False,
            random_state=12,
            learn_options={"iterations": 10, "optimizer": "adam"},
        ),
        True,
        {},
    ),
    # the GP defaults: ARD, normalize_y and normalize_X on when learning
    "learn_exact_gp_defaults": (
        dict(solver="exact", learn="exact", random_state=13, learn_options={"iterations": 15}),
        True,
        {},
    ),
    # the loop's other branches (the noise and mean as GPyTorch's GaussianLikelihood and ConstantMean):
    # L-BFGS flattens the trained tensors in order, two outputs
    "learn_lbfgs_multi": (
        dict(
            solver="exact",
            learn="exact",
            normalize_y=False,
            random_state=14,
            learn_options={"iterations": 25, "optimizer": "lbfgs"},
        ),
        True,
        {"outputs": 2},
    ),
    "learn_lbfgs_fixed_noise_mean": (
        dict(
            solver="exact",
            learn="exact",
            noise=0.05,
            random_state=15,
            learn_options={"iterations": 20, "optimizer": "lbfgs", "learn_noise": False, "learn_mean": False},
        ),
        True,
        {},
    ),
    "learn_auto": (dict(learn="auto", random_state=16), True, {}),
}


# cases whose result moves by more than rounding on another BLAS code path (see the module docstring)
SENSITIVE = frozenset(
    {
        "falkon_bless_r",
        "learn_exact",
        "learn_exact_gp_defaults",
        "learn_lbfgs_multi",
        "learn_lbfgs_fixed_noise_mean",
        "learn_auto",
        "learn_exact_subset_refit",
        "learn_sgpr",
        "learn_holdout",
        "eigenpro",
        "dsg",
    }
)


def host_signature() -> str:
    """What decides the rounding of a fit here: CPU, its vector code path, BLAS settings, threads, torch."""
    import platform

    import torch

    model = platform.processor()
    try:
        # the model name alone ("AMD EPYC") spans CPU generations whose MKL kernels round differently (the
        # refit case moved by 1.6e-8 between two "AMD EPYC|AVX512" hosts): family, model and stepping too
        fields = {}
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
        model = fields.get("model name", model)
        if "cpu family" in fields:
            model += f" (family {fields['cpu family']}, model {fields.get('model')}, stepping {fields.get('stepping')})"
    except OSError:
        pass
    env = ",".join(f"{k}={os.environ.get(k, '')}" for k in ("MKL_CBWR", "MKL_NUM_THREADS", "OMP_NUM_THREADS"))
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{model}|{capability}|{env}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def run(name: str) -> dict[str, np.ndarray]:
    """Fit case ``name`` in float64 and return its predictions (and std) at the query points."""
    params, has_std, shape = CASES[name]
    X, y, Xq = data(**shape)
    model = kgp.KernelRegressor(**{"dtype": "float64", **params}).fit(X, y)
    out = {}
    if has_std:
        mean, std = model.predict(Xq, return_std=True)
        out["std"] = np.asarray(std, dtype=np.float64)
    else:
        mean = model.predict(Xq)
    out["mean"] = np.asarray(mean, dtype=np.float64)
    return out


def classifier() -> dict[str, np.ndarray]:
    X, y, Xq = data()
    labels = np.where(y > 0.2, "hi", "lo")
    model = kgp.KernelClassifier("rbf", lengthscale=1.0, noise=0.1, solver="exact", dtype="float64").fit(X, labels)
    return {"decision": np.asarray(model.decision_function(Xq), dtype=np.float64)}


def run_all(only: str | None = None) -> dict[str, np.ndarray]:
    results: dict[str, np.ndarray] = {}
    names = [n for n in CASES if only is None or only in n]
    for name in names:
        for key, value in run(name).items():
            results[f"{name}/{key}"] = value
    if only is None or only in "classifier":
        for key, value in classifier().items():
            results[f"classifier/{key}"] = value
    return results


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--record":
        print(__doc__)
        return 2
    only = argv[1] if len(argv) > 1 else None
    results = run_all(only)
    old = dict(np.load(RECORD)) if RECORD.is_file() else {}
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    # each recorded case carries the host configuration that wrote it (``__host__/<case>``); the file-wide
    # ``__host__`` stays that of the first record, the default for cases recorded before per-case stamps
    signature = np.array(host_signature())
    for case in {key.split("/")[0] for key in results}:
        results[f"__host__/{case}"] = signature
    if "__host__" not in old:
        results["__host__"] = signature
    np.savez(RECORD, **{**old, **results})
    for key in sorted(results):
        print(f"recorded {key} {results[key].shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
