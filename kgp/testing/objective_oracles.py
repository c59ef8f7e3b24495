"""Dense float64 oracles of what an objective computes; the problem the objective checks prepare and how
they evaluate its loss.

An oracle is a function ``oracle(problem, noise, mean) -> float``: the value the objective's
``loss(noise, mean)`` must return on the :class:`kgp.learning.LearningProblem` ``problem``, at the
kernel's current hyperparameters. ``problem.generator`` is seeded as the one ``prepare`` got, so an
oracle can draw the same random rows. Two are built in, by name:

- ``"exact_nll"``: the negative exact log marginal likelihood per data point,
  ``-sum_j log N(y_j | m_j 1, K + sigma^2 I) / (n k)`` (Rasmussen & Williams 2006, eq. 2.30), by
  GPyTorch's ``MultivariateNormal.log_prob`` on the dense kernel matrix;
- ``"sgpr_bound"``: the negative collapsed variational bound of Titsias (2009, eq. 9) per data point,
  ``-sum_j [log N(y_j - m_j | 0, Q + sigma^2 I) - tr(K - Q) / (2 sigma^2)] / (n k)`` with
  ``Q = K_nM K_MM^+ K_Mn`` on the problem's centers, also through ``MultivariateNormal.log_prob``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import gpytorch
import torch
from torch import Tensor

from ..learning import LearningProblem
from ..plugin import Centers
from .oracles import OracleData, dense_kernel
from .support import capabilities_of, options_for, plugin_info

__all__ = [
    "LOSS_POINTS",
    "OBJECTIVE_ORACLES",
    "ObjectiveOracle",
    "evaluate_loss",
    "exact_nll",
    "objective_problem",
    "prepare_loss",
    "set_hyperparameters",
    "sgpr_bound",
]

ObjectiveOracle = Callable[[LearningProblem, Tensor, Tensor], Any]


def _gaussian_nll(residual: Tensor, covariance: Tensor) -> Tensor:
    """``-sum_j log N(residual[:, j] | 0, covariance)`` by GPyTorch's own MultivariateNormal."""
    zeros = torch.zeros(residual.shape[0], dtype=torch.float64)
    # Cholesky at every size (GPyTorch switches to iterative estimates above 800 rows by default)
    with gpytorch.settings.max_cholesky_size(10**9), torch.no_grad():
        mvn = gpytorch.distributions.MultivariateNormal(zeros, covariance)
        return -sum(mvn.log_prob(residual[:, j]) for j in range(residual.shape[1]))


def _dense(problem: LearningProblem, noise: Tensor, mean: Tensor) -> tuple[Any, Tensor, Tensor, float]:
    kernel = copy.deepcopy(problem.kernel).to(torch.float64).cpu()
    X = problem.X.detach().double().cpu()
    residual = problem.y.detach().double().cpu() - torch.as_tensor(mean).detach().double().cpu()
    return kernel, X, residual, float(noise)


def exact_nll(problem: LearningProblem, noise: Tensor, mean: Tensor) -> float:
    """Negative exact log marginal likelihood per data point (module docstring)."""
    kernel, X, residual, sigma2 = _dense(problem, noise, mean)
    K = dense_kernel(kernel, X, X)
    K.diagonal().add_(sigma2)
    return float(_gaussian_nll(residual, K) / residual.numel())


def sgpr_bound(problem: LearningProblem, noise: Tensor, mean: Tensor) -> float:
    """Negative Titsias bound per data point on ``problem.centers`` (module docstring)."""
    if problem.centers is None:
        raise ValueError("sgpr_bound: the problem has no centers")
    kernel, X, residual, sigma2 = _dense(problem, noise, mean)
    Z = problem.centers.points.detach().double().cpu()
    K = dense_kernel(kernel, X, X)
    KnM = dense_kernel(kernel, X, Z)
    Q = KnM @ torch.linalg.lstsq(dense_kernel(kernel, Z, Z), KnM.T, driver="gelsd").solution
    Q = 0.5 * (Q + Q.T)
    covariance = Q + sigma2 * torch.eye(X.shape[0], dtype=torch.float64)
    trace = residual.shape[1] * float(torch.trace(K - Q)) / (2 * sigma2)
    return float((_gaussian_nll(residual, covariance) + trace) / residual.numel())


OBJECTIVE_ORACLES: dict[str, ObjectiveOracle] = {"exact_nll": exact_nll, "sgpr_bound": sgpr_bound}
"""The built-in oracles by name (what an objective may declare it computes)."""


def objective_problem(
    name: str,
    data: OracleData,
    options: Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
) -> LearningProblem:
    """The :class:`kgp.learning.LearningProblem` the checks give the registered objective ``name``.

    The kernel is ``ScaleKernel`` of the spec's kernel (outputscale 1), every parameter trainable;
    centers (the spec's explicit ones) only for objectives declaring ``uses_centers``; the options
    resolved as the model resolves them.
    """
    kernel = gpytorch.kernels.ScaleKernel(data.spec.make_kernel(dtype, device)).to(dtype=dtype, device=device)
    kernel.outputscale = 1.0
    uses_centers = capabilities_of("objective", name).uses_centers
    return LearningProblem(
        X=data.X.to(dtype=dtype, device=device),
        y=data.y.to(dtype=dtype, device=device),
        kernel=kernel,
        centers=Centers(points=data.centers.to(dtype=dtype, device=device)) if uses_centers else None,
        options=options_for("objective", name, options),
        generator=torch.Generator().manual_seed(seed),
    )


def set_hyperparameters(problem: LearningProblem, lengthscale: float, outputscale: float) -> None:
    """Move the problem's kernel to other hyperparameters (the loss reads them at every call)."""
    with torch.no_grad():
        problem.kernel.base_kernel.lengthscale = lengthscale
        problem.kernel.outputscale = outputscale


LOSS_POINTS = ((1.0, 1.0, 1e-2, 0.0), (0.6, 2.0, 0.3, 0.4))
"""``(lengthscale, outputscale, noise, mean)`` at which the checks evaluate a loss."""


def evaluate_loss(
    loss: Callable, problem: LearningProblem, noise: float, mean: float, grad: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """``loss(noise, mean)`` as the learning loop calls it: a 0-d noise and one mean per output (tensors)."""
    like = {"dtype": problem.dtype, "device": problem.device}
    noise_t = torch.tensor(noise, **like, requires_grad=grad)
    mean_t = torch.full((problem.n_outputs,), mean, **like, requires_grad=grad)
    return loss(noise_t, mean_t), noise_t, mean_t


def prepare_loss(name: str, problem: LearningProblem) -> Callable:
    """``prepare(problem)`` of the registered objective ``name``; AssertionError unless it returns a callable."""
    loss = plugin_info("objective", name).obj.prepare(problem)
    if not callable(loss):
        raise AssertionError(
            f"objective {name!r}: prepare(problem) returned {type(loss).__name__}, not loss(noise, mean)"
        )
    return loss
