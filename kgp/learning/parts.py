"""The parts the learning loop trains, as GPyTorch modules.

The kernel, a ``GaussianLikelihood`` (the noise, under ``GreaterThan(min_noise)``) and a ``ConstantMean``
(one constant per output) in one module, so that GPyTorch's own ``named_priors()`` gives the priors of
all three and the noise prior (``learn_options['noise_prior']``) is the likelihood's ``noise_prior``.
"""

from __future__ import annotations

import copy
from typing import Any

import gpytorch
import torch
from torch import Tensor

__all__ = ["LearnedParts"]


class LearnedParts(gpytorch.Module):
    """The trained parts as GPyTorch modules: the kernel, a ``GaussianLikelihood`` and a ``ConstantMean``.

    One module so that ``named_priors()`` yields the priors of all three (the kernel's first, in the order
    ``kernel.named_priors()`` gives them). The likelihood's ``GreaterThan(min_noise)`` constraint is the
    softplus parametrisation kgp's loop always used, so the trained raw values are the same numbers.
    The user's noise prior is copied: moving the likelihood to X's dtype must not convert the user's
    object (the estimator's parameters stay as given, scikit-learn's rule).
    """

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel,
        noise: float,
        mean: Tensor | float,
        k: int,
        loop: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        prior = loop["noise_prior"]
        self.covar_module = kernel
        self.likelihood = gpytorch.likelihoods.GaussianLikelihood(
            noise_prior=copy.deepcopy(prior) if prior is not None else None,
            noise_constraint=gpytorch.constraints.GreaterThan(loop["min_noise"]),
        ).to(dtype=dtype, device=device)
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=torch.Size([k])).to(dtype=dtype, device=device)
        with torch.no_grad():
            self.likelihood.noise = torch.tensor(float(noise), dtype=dtype, device=device)
            self.mean_module.constant = torch.as_tensor(mean, dtype=dtype, device=device).reshape(-1).expand(k)
        self.likelihood.raw_noise.requires_grad_(loop["learn_noise"])
        self.mean_module.raw_constant.requires_grad_(loop["learn_mean"])

    def noise(self) -> Tensor:
        """The noise variance as the 0-d tensor objectives receive (the likelihood holds it as ``(1,)``)."""
        return self.likelihood.noise.reshape(())
