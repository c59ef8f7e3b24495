"""The kit's small problem and its dense float64 oracles, independent of kgp's block backend.

Every kernel matrix here comes from GPyTorch's own dense evaluation (``kernel(A, B).to_dense()``),
never from :class:`kgp.KernelOperator`, so a bug in kgp's backend cannot hide in the oracle.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..capabilities import TARGETS
from ..kernels import make_kernel

__all__ = [
    "DEFAULT_SPEC",
    "OracleData",
    "OracleSpec",
    "dense_dtc_covariance",
    "dense_exact_covariance",
    "dense_kernel",
    "dense_nystrom_mean",
    "dense_pairs",
    "dense_posterior_mean",
    "make_oracle_data",
    "relative_error",
    "target_oracle",
]


@dataclass(frozen=True)
class OracleSpec:
    """The small regression problem every check fits.

    Attributes
    ----------
    n, n_test, d:
        Training points, held-out points, features. Inputs are uniform on ``[-2, 2]^d``.
    n_centers:
        Number of explicit centers given to plugins that use centers (drawn from the training
        points with a fixed seed).
    noise:
        GP noise variance sigma^2 (the model's ``noise``).
    kernel:
        Kernel shortcut name (e.g. ``"rbf"``) or a GPyTorch kernel object.
    lengthscale:
        Lengthscale for a shortcut kernel.
    seed:
        Seed of the data draw.
    """

    n: int = 150
    n_test: int = 60
    d: int = 3
    n_centers: int = 40
    noise: float = 1e-2
    kernel: Any = "rbf"
    lengthscale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n", "n_test", "d", "n_centers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OracleSpec.{name}: expected a positive integer, got {value!r}")
        if self.n_centers > self.n:
            raise ValueError(f"OracleSpec.n_centers: expected at most n={self.n}, got {self.n_centers}")
        if not (isinstance(self.noise, (int, float)) and self.noise > 0):
            raise ValueError(f"OracleSpec.noise: expected a positive number, got {self.noise!r}")

    def make_kernel(self, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"):
        """A fresh GPyTorch kernel object on ``device`` / ``dtype``."""
        if isinstance(self.kernel, str):
            kernel = make_kernel(self.kernel, self.lengthscale)
        else:
            kernel = copy.deepcopy(self.kernel)
        return kernel.to(device=device, dtype=dtype)


DEFAULT_SPEC = OracleSpec()
"""The kit's default problem (n = 150, 60 held-out points, d = 3, 40 centers, sigma^2 = 1e-2, RBF l = 1)."""


@dataclass
class OracleData:
    """Tensors of one oracle problem (float64, CPU); ``cast`` converts them."""

    X: Tensor
    y: Tensor
    X_test: Tensor
    centers: Tensor
    center_indices: Tensor
    spec: OracleSpec = field(repr=False)

    def cast(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> OracleData:
        conv = {"dtype": dtype, "device": device}
        return OracleData(
            self.X.to(**conv),
            self.y.to(**conv),
            self.X_test.to(**conv),
            self.centers.to(**conv),
            self.center_indices.to(device),
            self.spec,
        )


def make_oracle_data(spec: OracleSpec = DEFAULT_SPEC, n_outputs: int = 1) -> OracleData:
    """Draw the oracle problem: ``y`` is an ``n x n_outputs`` smooth function plus 5% noise.

    Parameters
    ----------
    spec:
        Problem sizes, kernel and noise.
    n_outputs:
        Number of target columns (each a different smooth function of the inputs).
    """
    g = torch.Generator().manual_seed(spec.seed)
    X = torch.rand(spec.n, spec.d, generator=g, dtype=torch.float64) * 4 - 2
    X_test = torch.rand(spec.n_test, spec.d, generator=g, dtype=torch.float64) * 4 - 2
    cols = []
    for j in range(n_outputs):
        x0 = X[:, 0]
        x1 = X[:, 1 % spec.d]
        x2 = X[:, 2 % spec.d]
        cols.append(torch.sin((1.0 + 0.5 * j) * x0 + j) + 0.5 * torch.cos(x1) * x2 - 0.2 * j * x1)
    y = torch.stack(cols, dim=1)
    y = y + 0.05 * torch.randn(y.shape, generator=g, dtype=torch.float64)
    idx = torch.randperm(spec.n, generator=g)[: spec.n_centers]
    return OracleData(X, y, X_test, X[idx].clone(), idx, spec)


def dense_kernel(kernel: Any, A: Tensor, B: Tensor) -> Tensor:
    """``K(A, B)`` in float64 on the CPU by GPyTorch's own dense evaluation (a copy of ``kernel``)."""
    kernel = copy.deepcopy(kernel).to(torch.float64).cpu()
    with torch.no_grad():
        return kernel(A.detach().double().cpu(), B.detach().double().cpu()).to_dense()


def dense_posterior_mean(data: OracleData, X_eval: Tensor | None = None) -> Tensor:
    """``K(X_eval, X) (K(X, X) + sigma^2 I)^-1 y`` by a float64 Cholesky (the ``exact`` target)."""
    X_eval = data.X_test if X_eval is None else X_eval
    X, y = data.X.double().cpu(), data.y.double().cpu()
    kernel = data.spec.make_kernel(torch.float64)
    K = dense_kernel(kernel, X, X)
    K.diagonal().add_(data.spec.noise)
    alpha = torch.cholesky_solve(y, torch.linalg.cholesky(K))
    return dense_kernel(kernel, X_eval, X) @ alpha


def dense_nystrom_mean(data: OracleData, X_eval: Tensor | None = None, centers: Tensor | None = None) -> Tensor:
    """Nystrom solution ``K(X_eval, Z) a`` with ``(K_nM^T K_nM + sigma^2 K_MM) a = K_nM^T y``, float64.

    The M x M system is solved by SVD-based least squares, so duplicate or nearly dependent
    centers (a singular ``K_MM``) still give the minimum-norm solution, whose predictions are the
    Nystrom estimator's (Rudi et al. 2017, eq. 8 with ``lambda n = sigma^2``).
    """
    X_eval = data.X_test if X_eval is None else X_eval
    Z = (data.centers if centers is None else centers).double().cpu()
    X, y = data.X.double().cpu(), data.y.double().cpu()
    kernel = data.spec.make_kernel(torch.float64)
    KnM = dense_kernel(kernel, X, Z)
    H = KnM.T @ KnM + data.spec.noise * dense_kernel(kernel, Z, Z)
    alpha = torch.linalg.lstsq(H, KnM.T @ y, driver="gelsd").solution
    return dense_kernel(kernel, X_eval, Z) @ alpha


def dense_pairs(kernel: Any, A: Tensor, B: Tensor) -> Tensor:
    """``K(A, B)`` in float64 on the CPU, each entry from its own pair of rows.

    GPyTorch's ``diag=True`` evaluation of the ``a * b`` pairs: its dense evaluation centres the squared
    distances on the rows' mean, which a far row among them moves (losing the other entries to rounding);
    the pairs' differences are exact.
    """
    kernel = copy.deepcopy(kernel).to(torch.float64).cpu()
    A, B = A.detach().double().cpu(), B.detach().double().cpu()
    left, right = A.repeat_interleave(B.shape[0], dim=0), B.repeat(A.shape[0], 1)
    with torch.no_grad():
        return torch.as_tensor(kernel(left, right, diag=True)).reshape(A.shape[0], B.shape[0])


def dense_exact_covariance(kernel: Any, X: Tensor, noise: float, X_eval: Tensor) -> Tensor:
    """The exact GP's latent covariance at ``X_eval``, float64 (Rasmussen & Williams 2006, eq. 2.24).

    ``K_ee - K_eX (K_XX + sigma^2 I)^{-1} K_Xe`` by a dense LU solve (:func:`dense_pairs` entries).
    """
    K = dense_pairs(kernel, X, X)
    K.diagonal().add_(noise)
    K_xe = dense_pairs(kernel, X, X_eval)
    return dense_pairs(kernel, X_eval, X_eval) - K_xe.T @ torch.linalg.solve(K, K_xe)


def dense_dtc_covariance(kernel: Any, X: Tensor, Z: Tensor, noise: float, X_eval: Tensor) -> Tensor:
    """The DTC / SGPR latent covariance at ``X_eval`` on centers ``Z``, float64.

    ``K_ee - K_eZ K_ZZ^{-1} K_Ze + sigma^2 K_eZ (sigma^2 K_ZZ + K_ZX K_XZ)^{-1} K_Ze`` (Titsias 2009,
    eq. 6; Quinonero-Candela & Rasmussen 2005, eq. 20b), by dense LU solves (:func:`dense_pairs` entries).
    """
    K_zz = dense_pairs(kernel, Z, Z)
    K_xz = dense_pairs(kernel, X, Z)
    K_ze = dense_pairs(kernel, Z, X_eval)
    S = noise * K_zz + K_xz.T @ K_xz
    Q = K_ze.T @ torch.linalg.solve(K_zz, K_ze)
    return dense_pairs(kernel, X_eval, X_eval) - Q + noise * K_ze.T @ torch.linalg.solve(S, K_ze)


# the exact posterior mean also for a solver that uses centers only to precondition (target "exact")
_MEAN_ORACLES = {"exact": dense_posterior_mean, "mean_only": dense_posterior_mean, "nystrom": dense_nystrom_mean}


def target_oracle(target: str, data: OracleData, X_eval: Tensor | None = None) -> Tensor:
    """The oracle of a solver's declared ``Capabilities.target``.

    ``"exact"`` and ``"mean_only"``: the exact posterior mean (:func:`dense_posterior_mean`), also
    for a solver that uses centers only to precondition; ``"nystrom"``: the Nystrom estimator on the
    same centers (:func:`dense_nystrom_mean`).
    """
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {TARGETS}, got {target!r}")
    return _MEAN_ORACLES[target](data, X_eval)


def relative_error(pred: Tensor | np.ndarray, ref: Tensor | np.ndarray) -> float:
    """``||pred - ref||_F / ||ref||_F`` computed in float64 on the CPU."""
    p = torch.as_tensor(np.asarray(pred.detach().cpu() if isinstance(pred, Tensor) else pred), dtype=torch.float64)
    r = torch.as_tensor(np.asarray(ref.detach().cpu() if isinstance(ref, Tensor) else ref), dtype=torch.float64)
    p = p.reshape(r.shape)
    return float(torch.linalg.norm(p - r) / torch.linalg.norm(r))
