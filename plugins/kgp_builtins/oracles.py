"""Dense reference implementations, for tests and teaching: O(n^2) memory, O(n^3) time.

Nothing here is used by a solver or selector; each function is the closed form or the plain
dense iteration that a test compares the scalable implementation with:

- :func:`lemma6_fixed_point`, :func:`eigenpro_exact_projection`: EigenPro 3.0 Algorithm 1 and its
  limit (Abedsoltan, Belkin & Pandit, ICML 2023, Lemma 4 and Lemma 6);
- :func:`exact_leverage_scores`: ridge leverage scores (Rudi et al., NeurIPS 2018, eq. 1).
"""

from __future__ import annotations

import gpytorch
import torch
from torch import Tensor

from kgp import kernel_operator, settings
from kgp.linalg import psd_cholesky

__all__ = ["eigenpro_exact_projection", "exact_leverage_scores", "lemma6_fixed_point"]


def _top_q_Q(K_XX: Tensor, q: int) -> tuple[Tensor, float]:
    """``Q = E (I - lambda_{q+1} Lambda^-1) E^T`` (eq. 24) and lambda_{q+1} from a dense K(X, X)."""
    evals, evecs = torch.linalg.eigh(K_XX)
    evals, evecs = evals.flip(0), evecs.flip(1)
    lam_next = float(evals[q])
    E, lam = evecs[:, :q], evals[:q]
    Q = (E * (1.0 - lam_next / lam)) @ E.T
    return Q, lam_next


def lemma6_fixed_point(K_XX: Tensor, K_XZ: Tensor, y: Tensor, q: int) -> Tensor:
    r"""Closed-form limit of Algorithm 1 (EigenPro 3 Lemma 6).

    :math:`\alpha_\infty = (K_{ZX}(I-Q)K_{XZ})^{-1} K_{ZX}(I-Q) y`, an (I - Q)-weighted least-squares
    solution (plain least squares when q = 0).
    """
    Q, _ = _top_q_Q(K_XX, q)
    W = torch.eye(K_XX.shape[0], dtype=K_XX.dtype, device=K_XX.device) - Q
    A = K_XZ.T @ W
    return torch.linalg.solve(A @ K_XZ, A @ y)


def eigenpro_exact_projection(
    K_XX: Tensor,
    K_XZ: Tensor,
    K_ZZ: Tensor,
    y: Tensor,
    q: int,
    eta: float | None = None,
    iterations: int = 1000,
) -> Tensor:
    r"""EigenPro 3.0 Exact-Projection (Algorithm 1, Lemma 4), dense: for small problems and tests.

    Iterates :math:`\alpha \leftarrow \alpha - \eta K_{ZZ}^{-1} K_{ZX}(I-Q)(K_{XZ}\alpha - y)` from 0,
    with ``Q`` from the top-q eigensystem of K(X, X) (eq. 24; lambda_i in the denominator, the
    paper's eq. 23 prints lambda_q). ``eta`` defaults to ``1 / lambda_{q+1}(K(X, X))``, inside the
    stability region ``eta < 2 / lambda_max(K_ZZ^{-1} K_ZX (I - Q) K_XZ)`` (the latter is at most
    lambda_{q+1}).
    """
    Q, lam_next = _top_q_Q(K_XX, q)
    eta = 1.0 / lam_next if eta is None else eta
    W = torch.eye(K_XX.shape[0], dtype=K_XX.dtype, device=K_XX.device) - Q
    L = torch.linalg.cholesky(K_ZZ)
    y2 = y.unsqueeze(-1) if y.dim() == 1 else y
    alpha = torch.zeros(K_XZ.shape[1], y2.shape[1], dtype=K_XX.dtype, device=K_XX.device)
    for _ in range(iterations):
        h = K_XZ.T @ (W @ (K_XZ @ alpha - y2))
        alpha = alpha - eta * torch.cholesky_solve(h, L)
    return alpha if y.dim() > 1 else alpha.squeeze(-1)


def exact_leverage_scores(X: Tensor, kernel: gpytorch.kernels.Kernel, lam: float) -> Tensor:
    """Exact ridge leverage scores ``l(i, lam) = (K (K + lam n I)^{-1})_ii`` (BLESS eq. 1).

    Uses ``K (K + lam n I)^{-1} = I - lam n (K + lam n I)^{-1}``, so that
    ``l_i = 1 - lam n ||L^{-1} e_i||^2`` with ``L L^T = K + lam n I`` (float64). Their sum is
    ``d_eff(lam) = Tr(K (K + lam n I)^{-1})``.

    O(n^2) memory and O(n^3) time: for tests and diagnostics only.

    Raises
    ------
    ValueError
        If n exceeds ``kgp.settings.max_exact_size``.
    """
    if not (isinstance(X, Tensor) and X.dim() == 2 and X.dtype in (torch.float32, torch.float64)):
        raise TypeError("X: expected a 2-D float32 / float64 tensor")
    if not isinstance(kernel, gpytorch.kernels.Kernel):
        raise TypeError(f"kernel: expected a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
    if not (isinstance(lam, (int, float)) and not isinstance(lam, bool) and lam > 0):
        raise ValueError(f"lam: expected a positive number, got {lam!r}")
    n = X.shape[0]
    limit = settings.max_exact_size.value()
    if n > limit:
        raise ValueError(
            f"exact_leverage_scores builds the dense {n} x {n} kernel matrix; n={n} exceeds "
            f"kgp.settings.max_exact_size={limit}. Use bless() / bless_r() for approximate scores, or raise "
            f"the limit with kgp.settings.max_exact_size({n})."
        )
    with torch.no_grad():
        k = kernel_operator(kernel, X).to_dense().to(torch.float64)
        lam_n = lam * n
        k.diagonal().add_(lam_n)
        chol = psd_cholesky(k, max_tries=0, what=f"K + lam n I (lam={lam:g})")
        del k
        eye = torch.eye(n, dtype=torch.float64, device=X.device)
        inv_l = torch.linalg.solve_triangular(chol, eye, upper=False)
        scores = 1.0 - lam_n * inv_l.pow(2).sum(0)
        return scores.clamp_min(0.0).to(X.dtype)
