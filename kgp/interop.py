"""GPyTorch interoperability: a trained GPyTorch ``ExactGP`` as a fitted kgp model, and back.

The other direction needs no code: a fitted model's ``kernel_`` is the GPyTorch kernel itself (learned
hyperparameters included), ``noise_`` the Gaussian likelihood's noise and ``mean_`` a constant mean,
so they drop into ``ExactGP`` / ``GaussianLikelihood`` / ``ConstantMean`` unchanged (docs/gp-workflow.md).
"""

from __future__ import annotations

import copy
from typing import Any

import gpytorch
import torch

from .models import KernelRegressor

__all__ = ["from_gpytorch"]


def from_gpytorch(
    model: gpytorch.models.ExactGP, likelihood: gpytorch.likelihoods.GaussianLikelihood | None = None, **params: Any
) -> KernelRegressor:
    """A fitted :class:`kgp.KernelRegressor` with the posterior mean of a GPyTorch ``ExactGP``.

    The kernel (``model.covar_module``, copied), the noise variance (``likelihood.noise``) and the
    constant mean (``ConstantMean`` or ``ZeroMean``) are taken over as they are; the model is fitted on
    ``model.train_inputs`` / ``model.train_targets`` by the solver given in ``params`` (default
    ``"exact"``, which reproduces GPyTorch's posterior mean to rounding; ``solver="falkon"`` with
    centers scales it beyond ``kgp.settings.max_exact_size``).

    Parameters
    ----------
    model:
        A GPyTorch ``ExactGP`` with one output (no batch), a ``ConstantMean`` or ``ZeroMean``.
    likelihood:
        Its ``GaussianLikelihood`` (default: ``model.likelihood``).
    **params:
        Further :class:`kgp.KernelRegressor` parameters (``solver``, ``n_centers``, ``solver_options``,
        ...); ``kernel``, ``noise``, ``learn`` and ``normalize_y`` are set here.

    Raises
    ------
    TypeError
        A model that is not an ``ExactGP``, a likelihood that is not Gaussian, another mean module.
    ValueError
        Training data missing or batched, or ``params`` naming ``kernel`` / ``noise`` / ``learn``.
    """
    if not isinstance(model, gpytorch.models.ExactGP):
        raise TypeError(f"model: expected a gpytorch.models.ExactGP, got {type(model).__name__}")
    likelihood = model.likelihood if likelihood is None else likelihood
    if not isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood):
        raise TypeError(f"likelihood: expected a gpytorch GaussianLikelihood, got {type(likelihood).__name__}")
    taken = sorted(set(params) & {"kernel", "noise", "learn", "normalize_y"})
    if taken:
        raise ValueError(f"from_gpytorch sets {taken} from the GPyTorch model; leave them out of params")
    if model.train_inputs is None or model.train_targets is None:
        raise ValueError("model: the ExactGP has no training data (model.train_inputs is None)")
    X, y = model.train_inputs[0], model.train_targets
    if X.dim() != 2 or y.dim() != 1:
        raise ValueError(
            f"model: expected n x d training inputs and n targets (one output, no batch), got shapes "
            f"{tuple(X.shape)} and {tuple(y.shape)}"
        )
    mean_module = getattr(model, "mean_module", None)
    if isinstance(mean_module, gpytorch.means.ConstantMean):
        constant = mean_module.constant.detach().reshape(-1)
        if constant.numel() != 1:
            raise ValueError(f"model.mean_module: expected one constant, got {constant.numel()}")
    elif isinstance(mean_module, gpytorch.means.ZeroMean):
        constant = torch.zeros(1, dtype=X.dtype, device=X.device)
    else:
        raise TypeError(
            "model.mean_module: expected a gpytorch ConstantMean or ZeroMean (kgp models have a constant mean), "
            f"got {type(mean_module).__name__}"
        )
    noise = float(likelihood.noise.detach().reshape(-1)[0])
    kernel = copy.deepcopy(model.covar_module)
    regressor = KernelRegressor(kernel, noise=noise, **params)
    constant = constant.to(dtype=X.dtype, device=X.device)
    regressor.fit(X.detach(), y.detach() - constant)
    # the GP's constant mean m: the model fitted y - m and predicts m + K(x, X) alpha
    regressor.mean_ = constant.to(dtype=regressor.dtype_, device=regressor.device_).clone()
    return regressor
