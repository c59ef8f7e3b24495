"""Shared UCI protocol of the sweep and hyperparameter benchmarks.

Data: ``../shared/data/uci/NAME.csv.gz`` (no header, target last). Split
``numpy.random.default_rng(0).permutation(n)``, first 80% train; features and target z-scored with
training statistics (constant columns keep scale 1).

Reference hyperparameters ("what a GPyTorch user does today"): a GPyTorch ``ExactGP``
(``ConstantMean``, ``ScaleKernel(RBFKernel(ard_num_dims=d))``, ``GaussianLikelihood``) trained with
Adam (lr 0.1, 100 steps) on the exact marginal likelihood of a random 3,000-point training subset, in
float64. :func:`gpytorch_hyperparameters` runs it; :func:`cached_hyperparameters` keeps the result
in ``benchmarks/uci_hyperparameters.json`` so that every benchmark uses the same values.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kgp.datasets import standardized_split

# the shared data beside the checkout; KGP_SHARED_DATA names another copy (a GPU machine gets one carried)
SHARED_DATA = Path(os.environ.get("KGP_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
UCI = SHARED_DATA / "uci"
CACHE = Path(__file__).resolve().parent / "uci_hyperparameters.json"
ALL_SETS = (
    "yacht",
    "housing",
    "energy",
    "airfoil",
    "skillcraft",
    "sml",
    "parkinsons",
    "pumadyn32nm",
    "pol",
    "elevators",
    "bike",
    "kin40k",
    "protein",
    "keggdirected",
    "tamielectric",
)
SUBSET = 3000
STEPS = 100
LR = 0.1


@dataclass
class Split:
    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_train(self) -> int:
        return self.X_train.shape[0]

    @property
    def d(self) -> int:
        return self.X_train.shape[1]


def load_split(name: str) -> Split:
    """The seeded 80/20 split of one UCI set, z-scored with training statistics (float64)."""
    path = UCI / f"{name}.csv.gz"
    if not path.is_file():
        raise SystemExit(f"{path} not found (the shared data ship beside the checkout)")
    with gzip.open(path, "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    return Split(name, *standardized_split(raw[:, :-1], raw[:, -1]))


def gpytorch_hyperparameters(split: Split, seed: int = 0) -> dict:
    """Train the reference ExactGP on a random 3,000-point subset; return its hyperparameters."""
    import gpytorch

    g = np.random.default_rng(seed)
    idx = g.choice(split.n_train, size=min(SUBSET, split.n_train), replace=False)
    X = torch.from_numpy(split.X_train[idx])
    y = torch.from_numpy(split.y_train[idx])

    class GP(gpytorch.models.ExactGP):
        def __init__(self, X, y, likelihood):
            super().__init__(X, y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=X.shape[1]))

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    torch.manual_seed(seed)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = GP(X, y, likelihood).double()
    model.train()
    likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    start = time.perf_counter()
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = -mll(model(X), y)
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    return {
        "lengthscale": model.covar_module.base_kernel.lengthscale.detach().reshape(-1).tolist(),
        "outputscale": float(model.covar_module.outputscale.detach()),
        "noise": float(likelihood.noise.detach()),
        "mean": float(model.mean_module.constant.detach()),
        "train_seconds": elapsed,
        "final_loss": float(loss.detach()),
    }


def cached_hyperparameters(names=ALL_SETS, refresh: bool = False) -> dict[str, dict]:
    """Reference hyperparameters per set, computed once and kept in ``uci_hyperparameters.json``."""
    cache = json.loads(CACHE.read_text()) if CACHE.is_file() and not refresh else {}
    changed = False
    for name in names:
        if name not in cache:
            print(f"  learning reference hyperparameters of {name} (GPyTorch ExactGP, 3,000-point subset) ...")
            cache[name] = gpytorch_hyperparameters(load_split(name))
            changed = True
    if changed:
        CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    return {name: cache[name] for name in names}


def make_kernel(hyper: dict, dtype: torch.dtype = torch.float64):
    """``ScaleKernel(RBFKernel(ARD))`` with the given hyperparameters."""
    import gpytorch

    ls = torch.tensor(hyper["lengthscale"], dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=ls.numel())).double()
    kernel.base_kernel.lengthscale = ls.reshape(1, -1)
    kernel.outputscale = hyper["outputscale"]
    return kernel.to(dtype)


def rmse(pred, y) -> float:
    pred = np.asarray(pred, dtype=np.float64).reshape(-1)
    return float(np.sqrt(np.mean((pred - y) ** 2)))
