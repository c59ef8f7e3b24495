"""The fitted GP as one object: :class:`Posterior` owns the mean and the predictive variance.

A fit ends in a Posterior (:mod:`kgp.fitting`); ``predict`` calls it, and a model file stores it as one
typed, versioned state (:meth:`Posterior.state_dict`, :meth:`Posterior.from_state`). The estimator
classes only translate between scikit-learn conventions and it.

What it computes, for targets scaled by ``normalize_y`` (``y = s * y' + c``, :class:`TargetScaling`) and a
constant mean m in those scaled units:

- the mean: ``c + s * (m + f(x))``, with ``f`` the solver's predictor (a kernel expansion or another
  registered predictor kind) fitted to ``y' - m``;
- the variance and covariance of the latent function, from the variance strategy the fit chose once
  from its solver's target (:mod:`kgp.variance`: exact, Nystrom / DTC, or none), times ``s^2``; the
  noise variance sigma^2 is added on request (the std of a new observation);
- draws of the latent function at a batch of rows (:meth:`Posterior.sample`).

The strategy builds what it needs once, when first asked (or at fit time for a learned GP), and keeps
in a model file the smallest state it can rebuild from (:meth:`kgp.variance.VarianceStrategy.state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gpytorch
import torch
from torch import Tensor

from . import variance as variance_strategies
from .io import to_device
from .posterior_checks import PosteriorStateError, StateChecker, cpu_copy
from .variance import LoadContext, VarianceStrategy

__all__ = [
    "POSTERIOR_VERSION",
    "VARIANCE_KINDS",
    "Posterior",
    "PosteriorStateError",
    "Scaling",
    "TargetScaling",
    "sampling_factor",
]

POSTERIOR_VERSION = 1
VARIANCE_KINDS = variance_strategies.KINDS
"""The variance tags a stored posterior may hold (:data:`kgp.variance.KINDS`)."""


@dataclass(frozen=True)
class Scaling:
    """Columns standardised as ``(v - mean) / std``: targets (``normalize_y``, one value per output) or
    inputs (``normalize_X``, one value per feature). Length 1 broadcasts; the identity has mean 0, std 1.
    """

    mean: Tensor
    std: Tensor

    @classmethod
    def identity(cls, like: Tensor) -> Scaling:
        one = torch.zeros(1, dtype=like.dtype, device=like.device)
        return cls(one, one + 1)

    @property
    def is_identity(self) -> bool:
        return not bool((self.mean != 0).any()) and not bool((self.std != 1).any())

    def to(self, device: torch.device, dtype: torch.dtype) -> Scaling:
        return Scaling(self.mean.to(device=device, dtype=dtype), self.std.to(device=device, dtype=dtype))

    def apply(self, v: Tensor) -> Tensor:
        """``(v - mean) / std``."""
        return (v - self.mean) / self.std

    def undo(self, v: Tensor) -> Tensor:
        """``v * std + mean``."""
        return v * self.std + self.mean


TargetScaling = Scaling  # the name the target scaling had first


class Posterior:
    """The fitted GP posterior: mean and variance at new points, in the targets' units.

    Parameters
    ----------
    kernel:
        The GPyTorch kernel of the fit (learned hyperparameters included).
    predictor:
        The solver's predictor of the centred, scaled targets (``predict(X) -> n x k``).
    noise:
        The noise variance sigma^2 in the scaled units.
    offset:
        The constant mean m per output (length k, or 1 to broadcast), in the scaled units.
    scaling:
        The target scaling of ``normalize_y`` (identity without it).
    variance:
        The variance strategy (:mod:`kgp.variance`), chosen by the fit (:func:`kgp.variance.for_fit`) or
        read from a model file.
    input_scaling:
        The input standardisation of ``normalize_X`` (None without it): the kernel, the predictor and the
        variance's stored points all live in the standardised inputs; :meth:`mean` and :meth:`std` take
        inputs in the user's units and standardise them first.
    """

    def __init__(
        self,
        *,
        kernel: gpytorch.kernels.Kernel,
        predictor: Any,
        noise: float,
        offset: Tensor,
        scaling: Scaling,
        variance: VarianceStrategy,
        input_scaling: Scaling | None = None,
    ):
        if not isinstance(variance, VarianceStrategy):
            raise TypeError(f"variance: expected a kgp.variance.VarianceStrategy, got {type(variance).__name__}")
        self.kernel = kernel
        self.predictor = predictor
        self.noise = float(noise)
        self.offset = offset
        self.scaling = scaling
        self.input_scaling = input_scaling
        self.variance = variance

    # ------------------------------------------------------------------ the mean
    def mean(self, X: Tensor) -> Tensor:
        """Posterior mean at the rows of ``X`` (``n x k``, X in the user's units), in the targets' units."""
        with torch.no_grad():
            out = self.predictor.predict(self.inputs(X))
        if out.dim() == 1:
            out = out.unsqueeze(-1)
        # each step only when it changes something: a model without scaling returns the predictor's values bitwise
        if bool((self.offset != 0).any()):
            out = out + self.offset
        if bool((self.scaling.std != 1).any()):
            out = out * self.scaling.std
        if bool((self.scaling.mean != 0).any()):
            out = out + self.scaling.mean
        return out

    def inputs(self, X: Tensor) -> Tensor:
        """``X`` in the units the kernel works in (standardised with ``normalize_X``)."""
        return X if self.input_scaling is None else self.input_scaling.apply(X)

    # ------------------------------------------------------------------ the variance
    @property
    def variance_kind(self) -> str:
        """The variance strategy's tag (``"exact"``, ``"nystrom"`` or ``"none"``), as a model file stores it."""
        return self.variance.kind

    @property
    def has_variance(self) -> bool:
        return self.variance.has_variance

    def latent_variance(self, X: Tensor) -> Tensor:
        """Variance of the latent f at the rows of ``X`` (length n, X in the user's units), in the scaled units."""
        return self.variance.latent_variance(self.inputs(X))

    def std(self, X: Tensor, include_noise: bool = False) -> Tensor:
        """Predictive standard deviation (``n x k``, k from the scaling) in the targets' units.

        ``include_noise=True`` adds sigma^2: the std of a new observation rather than of the latent f.
        """
        var = self.latent_variance(X)
        if include_noise:
            var = var + self.noise
        return var.sqrt().unsqueeze(-1) * self.scaling.std

    def covariance(self, X: Tensor) -> Tensor:
        """Posterior covariance of the latent f between the rows of ``X`` (``q x q``, scaled units).

        Entry ``(i, j)`` depends on rows i and j only, and the diagonal is the variance :meth:`std` gives
        (:func:`kgp.variance.latent_covariance`). Dense in q: for up to a few thousand rows.
        """
        return self.variance.latent_covariance(self.inputs(X)).to(self.offset.dtype)

    def sample(self, X: Tensor, n_samples: int, generator: torch.Generator) -> Tensor:
        """Draws of the latent f at the rows of ``X`` from the posterior, ``q x k x n_samples``, targets' units.

        The draws are ``mean + A z`` with ``A A^T`` the covariance (:func:`sampling_factor`) and ``z``
        standard normal (float64, from ``generator``).
        """
        mean = self.mean(X)
        factor = sampling_factor(self.variance.latent_covariance(self.inputs(X)))
        z = torch.randn(factor.shape[1], n_samples, generator=generator, dtype=factor.dtype).to(factor.device)
        draws = (factor @ z).to(mean.dtype).unsqueeze(1) * self.scaling.std.reshape(1, -1, 1)
        return mean.unsqueeze(-1) + draws

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (``torch.load(weights_only=True)``), tagged with a version."""
        inputs = {}
        if self.input_scaling is not None:
            inputs = {"x_mean": cpu_copy(self.input_scaling.mean), "x_std": cpu_copy(self.input_scaling.std)}
        return {
            **inputs,
            "version": POSTERIOR_VERSION,
            "noise": self.noise,
            "offset": cpu_copy(self.offset),
            "y_mean": cpu_copy(self.scaling.mean),
            "y_std": cpu_copy(self.scaling.std),
            "predictor_kind": self.predictor.kind,
            "predictor": self.predictor.state_dict(),
            "variance": self.variance.state_dict(),
        }

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, Any],
        kernel: gpytorch.kernels.Kernel,
        predictor_cls: Any,
        *,
        n_features: int,
        n_outputs: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Posterior:
        """Rebuild a Posterior from :meth:`state_dict`, checking every entry before any allocation it sizes.

        Raises
        ------
        PosteriorStateError
            Naming the entry (``posterior.noise``, ``posterior.variance.factors.chol``, ...) and what was
            expected: a wrong type, a non-finite or out-of-range value, a shape that does not fit
            ``n_features`` / ``n_outputs`` or the other entries, an unknown kind.
        """
        check = StateChecker("posterior")
        check.mapping(state, "")
        if state.get("version") != POSTERIOR_VERSION:
            raise PosteriorStateError(f"posterior.version: expected {POSTERIOR_VERSION}, got {state.get('version')!r}")
        noise = check.positive_number(state.get("noise"), "noise")
        outputs_ok = (1, n_outputs)
        offset = check.vector(state.get("offset"), "offset", outputs_ok)
        y_mean = check.vector(state.get("y_mean"), "y_mean", outputs_ok)
        y_std = check.vector(state.get("y_std"), "y_std", outputs_ok)
        if not bool((y_std > 0).all()):
            raise PosteriorStateError("posterior.y_std: expected positive scales (a target std), got a value <= 0")
        input_scaling = None
        if "x_mean" in state or "x_std" in state:
            x_mean = check.vector(state.get("x_mean"), "x_mean", (n_features,))
            x_std = check.vector(state.get("x_std"), "x_std", (n_features,))
            if not bool((x_std > 0).all()):
                raise PosteriorStateError("posterior.x_std: expected positive scales (a feature std), got a value <= 0")
            input_scaling = Scaling(x_mean.to(device=device, dtype=dtype), x_std.to(device=device, dtype=dtype))
        variance_state = check.mapping(state.get("variance"), "variance")
        predictor_state = check.mapping(state.get("predictor"), "predictor")
        predictor = predictor_cls.from_state(to_device(dict(predictor_state), device, dtype), kernel)
        context = LoadContext(
            kernel=kernel,
            noise=noise,
            predictor=predictor,
            predictor_kind=state.get("predictor_kind"),
            n_features=n_features,
            device=device,
            dtype=dtype,
            check=check,
        )
        return cls(
            kernel=kernel,
            predictor=predictor,
            noise=noise,
            offset=offset.to(device=device, dtype=dtype),
            scaling=Scaling(y_mean.to(device=device, dtype=dtype), y_std.to(device=device, dtype=dtype)),
            variance=variance_strategies.from_state(variance_state, context),
            input_scaling=input_scaling,
        )


def sampling_factor(cov: Tensor) -> Tensor:
    """A ``q x q`` float64 matrix ``A`` with ``A A^T`` the covariance ``cov`` made positive semi-definite.

    The covariance is scaled to a correlation matrix first (``D^{-1/2} cov D^{-1/2}``, ``D`` its
    diagonal), so rows whose variances differ by many orders of magnitude (a far row at the prior
    variance beside rows the data pin down) are factored on one scale. Its Cholesky factor is used where
    it exists (O(q^3 / 3)); otherwise (a singular or, by rounding, slightly indefinite matrix: repeated
    rows, rows at the data) its eigendecomposition with the negative eigenvalues set to 0 (no jitter:
    the draws' variances stay the diagonal). Rows of zero variance get zero rows of ``A``.
    """
    C = cov.to(torch.float64)
    scale = C.diagonal().clamp_min(0.0).sqrt()
    positive = scale > 0
    inverse = torch.where(positive, 1.0 / torch.where(positive, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    R = C * inverse.unsqueeze(1) * inverse.unsqueeze(0)
    R = 0.5 * (R + R.mT)
    if bool(positive.all()):
        L, info = torch.linalg.cholesky_ex(R)
        if int(info) == 0 and bool(torch.isfinite(L).all()):
            return scale.unsqueeze(1) * L
    eigenvalues, U = torch.linalg.eigh(R)
    return scale.unsqueeze(1) * (U * eigenvalues.clamp_min(0.0).sqrt())
