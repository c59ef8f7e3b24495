"""Tutorial: the GP workflow on a shared UCI set — learn, predict with uncertainty, check calibration.

Run it with ``python tutorials/gp_workflow.py [OUTPUT_DIR] [SET]`` (default set: airfoil, from
``../shared/data/uci``). It

1. splits the set 80/20 (``numpy.random.default_rng(0).permutation``) and z-scores the features
   with training statistics (the targets stay in their units: ``normalize_y=True`` handles them),
2. learns ARD lengthscales, outputscale, noise and a constant mean with ``learn="sgpr"`` on
   uniform centers, then solves with FALKON on the same centers,
3. predicts the test mean and standard deviation (``return_std=True, include_noise=True``),
4. checks calibration: the share of test targets inside the central 50 / 90 / 95 % predictive
   intervals, and a plot of the observed RMS error against the predicted std (binned); a
   calibrated model lies on the diagonal,
5. hands the learned kernel to GPyTorch unchanged (``model.kernel_``) and compares the means.
"""

from __future__ import annotations

import gzip
import math
import sys
from pathlib import Path

import numpy as np

import kgp

UCI = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "uci"


def load(name: str):
    with gzip.open(UCI / f"{name}.csv.gz", "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    X, y = raw[:, :-1], raw[:, -1]
    perm = np.random.default_rng(0).permutation(len(y))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    return (X[tr] - mu) / sd, y[tr], (X[te] - mu) / sd, y[te]


def run(output_dir: str | Path = "tutorials/output", name: str = "airfoil") -> dict[str, float]:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    X, y, Xt, yt = load(name)

    model = kgp.KernelRegressor(
        "rbf",
        ard=True,
        learn="sgpr",
        learn_options={"optimizer": "lbfgs", "iterations": 60},
        noise=0.1,
        normalize_y=True,
        solver="falkon",
        n_centers=min(400, len(y)),
        solver_options={"maxiter": 50},
        random_state=0,
    )
    model.fit(X, y)
    mean, std = model.predict(Xt, return_std=True, include_noise=True)
    err = yt - mean
    rmse = float(np.sqrt(np.mean(err**2)))
    nlpd = float(np.mean(0.5 * np.log(2 * math.pi * std**2) + err**2 / (2 * std**2)))
    z = np.abs(err) / std
    coverage = {level: float(np.mean(z <= q)) for level, q in ((0.5, 0.6745), (0.9, 1.6449), (0.95, 1.9600))}
    lengthscales = model.kernel_.base_kernel.lengthscale.detach().reshape(-1).numpy()
    print(f"{name}: n_train={len(y)}, d={X.shape[1]}, learned in {len(model.learn_history_)} evaluations")
    print(f"  lengthscales {np.array2string(lengthscales, precision=2)}, noise (normalised units) {model.noise_:.4g}")
    print(f"  test RMSE {rmse:.4f} (mean predictor {np.std(yt):.4f}), NLPD {nlpd:.4f}")
    print(
        "  coverage of the central predictive intervals: " + ", ".join(f"{k:.0%}: {v:.3f}" for k, v in coverage.items())
    )

    # calibration plot: bins of predicted std, observed RMS error per bin
    order = np.argsort(std)
    bins = np.array_split(order, 10)
    predicted = np.array([std[b].mean() for b in bins])
    observed = np.array([np.sqrt(np.mean(err[b] ** 2)) for b in bins])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot(predicted, observed, "o-", label="kgp (sgpr + FALKON)")
    lim = [0, 1.1 * max(predicted.max(), observed.max())]
    ax.plot(lim, lim, "k--", lw=1, label="calibrated")
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.set_xlabel("predicted std (noise included)")
    ax.set_ylabel("observed RMS error")
    ax.set_title(f"{name}: calibration (10 bins of test points)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(output_dir / f"{name}_calibration.png", dpi=100)
    plt.close(fig)

    # the learned kernel is a GPyTorch kernel: an ExactGP with it reproduces kgp's Nystrom mean closely
    import gpytorch
    import torch

    Xtr = torch.from_numpy(X)
    y_mean, y_std = y.mean(), y.std()  # normalize_y: scikit-learn's convention (population std)
    ytr = torch.from_numpy((y - y_mean) / y_std)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = model.noise_

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(Xtr, ytr, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = model.kernel_

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    gp = GP().double()
    gp.mean_module.constant.data.fill_(float(model.mean_[0]))
    gp.eval()
    with torch.no_grad():
        gp_mean = gp(torch.from_numpy(Xt)).mean.numpy() * y_std + y_mean
    gap = float(np.sqrt(np.mean((gp_mean - mean) ** 2)))
    print(f"  RMS difference of kgp's mean and GPyTorch's exact GP with kgp's kernel_: {gap:.4f}")
    return {
        "rmse": rmse,
        "nlpd": nlpd,
        "baseline": float(np.std(yt)),
        "gap": gap,
        **{f"cov{k}": v for k, v in coverage.items()},
    }


if __name__ == "__main__":
    run(*(sys.argv[1:3] if len(sys.argv) > 1 else ()))
