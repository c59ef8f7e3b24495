"""The fitted GP as one object: :class:`Posterior` owns the mean and the predictive variance.

A fit ends in a Posterior (:mod:`kgp.fitting`); ``predict`` calls it, and a model file stores it as one
typed, versioned state (:meth:`Posterior.state_dict`, :meth:`Posterior.from_state`). The estimator
classes only translate between scikit-learn conventions and it.

What it computes, for targets scaled by ``normalize_y`` (``y = s * y' + c``, :class:`TargetScaling`) and a
constant mean m in those scaled units:

- the mean: ``c + s * (m + f(x))``, with ``f`` the solver's predictor (a kernel expansion or another
  registered predictor kind) fitted to ``y' - m``;
- the variance of the latent function, in the kind the solver's target implies
  (``kgp.Capabilities.target``, :mod:`kgp.variance`): ``"exact"`` (Rasmussen & Williams 2006, Alg. 2.1)
  on the training rows, ``"nystrom"`` (the DTC / SGPR variance, Titsias 2009 eq. 6) on the centers, or
  ``"none"`` (the solver's form has no variance; asking for one raises with the reason), times ``s^2``;
  the noise variance sigma^2 is added on request (the std of a new observation).

The variance factors are built once, when first needed (or at fit time for a learned GP), from what
the Posterior holds: the training rows for ``"exact"`` (they are the predictor's centers), the centers
and one pass over the training rows for ``"nystrom"``. Its state (what a model file stores) keeps the
smaller of the two sufficient forms: the Nystrom factors (2 M^2 numbers) or the training rows (n d);
never the exact n x n factor, which is rebuilt from the rows on the first std after loading.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gpytorch
import torch
from torch import Tensor

from .io import to_device
from .operators import kernel_operator
from .posterior_checks import PosteriorStateError, _Checker, _cpu, _factors_from_state
from .variance import VarianceFactors, cross_kernel, exact_factors, latent_variance, nystrom_factors

__all__ = ["POSTERIOR_VERSION", "VARIANCE_KINDS", "Posterior", "PosteriorStateError", "Scaling", "TargetScaling"]

POSTERIOR_VERSION = 1
VARIANCE_KINDS = ("exact", "nystrom", "none")


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
    input_scaling:
        The input standardisation of ``normalize_X`` (None without it): the kernel, the predictor, the
        centers and the training rows all live in the standardised inputs; :meth:`mean` and :meth:`std`
        take inputs in the user's units and standardise them first.
    variance_kind:
        One of :data:`VARIANCE_KINDS`.
    centers:
        ``"nystrom"``: the ``M x d`` centers the variance is computed on; ignored otherwise (the exact
        variance uses the predictor's centers, which are the training rows).
    train_X:
        ``"nystrom"``: the training rows, needed to build the factors (dropped once they are built).
    factors:
        Factors already computed (handed on by the fit, or loaded from a file).
    no_variance_reason:
        ``"none"``: why there is no variance, quoted when one is asked for.
    """

    def __init__(
        self,
        *,
        kernel: gpytorch.kernels.Kernel,
        predictor: Any,
        noise: float,
        offset: Tensor,
        scaling: Scaling,
        variance_kind: str,
        input_scaling: Scaling | None = None,
        centers: Tensor | None = None,
        train_X: Tensor | None = None,
        factors: VarianceFactors | None = None,
        no_variance_reason: str = "",
    ):
        if variance_kind not in VARIANCE_KINDS:
            raise ValueError(f"variance_kind: expected one of {VARIANCE_KINDS}, got {variance_kind!r}")
        self.kernel = kernel
        self.predictor = predictor
        self.noise = float(noise)
        self.offset = offset
        self.scaling = scaling
        self.input_scaling = input_scaling
        self.variance_kind = variance_kind
        self.centers = centers
        self._train_X = train_X
        self._factors = factors
        self.no_variance_reason = no_variance_reason

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
    def has_variance(self) -> bool:
        return self.variance_kind != "none"

    @property
    def factors_built(self) -> bool:
        return self._factors is not None

    def hand_on(self, factors: VarianceFactors) -> None:
        """Take the variance factors a solver computed anyway (:class:`kgp.plugin.Solution`)."""
        if factors.kind != self.variance_kind:
            raise ValueError(f"factors of kind {factors.kind!r} for a {self.variance_kind!r} posterior")
        self._factors = factors

    def factors(self) -> VarianceFactors:
        """The variance factors, built on first use (see the module docstring)."""
        if self._factors is not None:
            return self._factors
        if self.variance_kind == "none":
            raise ValueError(f"return_std=True: {self.no_variance_reason}")
        if self.variance_kind == "exact":
            points = self.predictor.centers  # the exact solution is an expansion over the training rows
            self._factors = exact_factors(self.kernel, points, self.noise)
        else:
            if self._train_X is None:
                raise ValueError(
                    "return_std=True: the Nystrom variance needs one pass over the training rows, which this "
                    "posterior no longer holds"
                )
            self._factors = nystrom_factors(self.kernel, self._train_X, self.centers, self.noise)
        return self._factors

    def latent_variance(self, X: Tensor) -> Tensor:
        """Variance of the latent f at the rows of ``X`` (length n, X in the user's units), in the scaled units."""
        return latent_variance(self.kernel, self.inputs(X), self.factors())

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

        ``K_qq - V^T V`` with ``V = L^{-1} K_pq`` (exact), plus ``sigma^2 W^T W`` with ``W = L_s^{-1} K_Mq``
        (Nystrom / DTC): the matrix forms of :meth:`latent_variance`. Dense in q: for a few hundred rows.
        """
        factors = self.factors()
        work = factors.chol.dtype  # float64 for a float32 model's Nystrom factors (kgp.variance)
        Xs = self.inputs(X).to(work)
        dtype = self.offset.dtype
        kernel = self.kernel if work == dtype else copy.deepcopy(self.kernel).to(work)
        with torch.no_grad():
            cov = kernel_operator(kernel, Xs).to_dense().clone()
            # the stored points as the columns: distances centred on them, not on the query batch
            kx = cross_kernel(kernel, Xs, factors.points, cov.diagonal())
            v = torch.linalg.solve_triangular(factors.chol, kx, upper=False)
            cov -= v.T @ v
            if factors.kind == "nystrom":
                w = torch.linalg.solve_triangular(factors.chol_s, kx, upper=False)
                cov += factors.noise * (w.T @ w)
        return (0.5 * (cov + cov.T)).to(dtype)

    def sample(self, X: Tensor, n_samples: int, generator: torch.Generator) -> Tensor:
        """Draws of the latent f at the rows of ``X`` from the posterior, ``q x k x n_samples``, targets' units."""
        mean = self.mean(X)
        cov = self.covariance(X)
        # a relative floor on the diagonal: rounding can leave the covariance a hair indefinite
        jitter = 1e-10 if cov.dtype == torch.float64 else 1e-5
        scale = float(cov.diagonal().abs().max().clamp_min(torch.finfo(cov.dtype).tiny))
        eye = torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
        L = torch.linalg.cholesky(cov + jitter * scale * eye)
        z = torch.randn(cov.shape[0], n_samples, generator=generator, dtype=cov.dtype).to(cov.device)
        draws = (L @ z).unsqueeze(1) * self.scaling.std.reshape(1, -1, 1)
        return mean.unsqueeze(-1) + draws

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (``torch.load(weights_only=True)``), tagged with a version."""
        variance: dict[str, Any] = {"kind": self.variance_kind}
        if self.variance_kind == "nystrom":
            variance["centers"] = _cpu(self.centers)
            # whichever is smaller: the two M x M factors, or the n x d rows they are built from
            factors_size = 2 * self.centers.shape[0] ** 2
            rows_size = math.inf if self._train_X is None else self._train_X.numel()
            if self._factors is not None and factors_size <= rows_size:
                variance["factors"] = {
                    k: (_cpu(v) if torch.is_tensor(v) else v) for k, v in self._factors.state_dict().items()
                }
            elif self._train_X is not None:
                variance["train_X"] = _cpu(self._train_X)
        # the exact factor (n x n) is never stored: the training rows it is built from are the predictor's
        if self.variance_kind == "none":
            variance["reason"] = self.no_variance_reason
        inputs = {}
        if self.input_scaling is not None:
            inputs = {"x_mean": _cpu(self.input_scaling.mean), "x_std": _cpu(self.input_scaling.std)}
        return {
            **inputs,
            "version": POSTERIOR_VERSION,
            "noise": self.noise,
            "offset": _cpu(self.offset),
            "y_mean": _cpu(self.scaling.mean),
            "y_std": _cpu(self.scaling.std),
            "predictor_kind": self.predictor.kind,
            "predictor": self.predictor.state_dict(),
            "variance": variance,
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
        check = _Checker("posterior")
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
        variance = check.mapping(state.get("variance"), "variance")
        kind = variance.get("kind")
        if kind not in VARIANCE_KINDS:
            raise PosteriorStateError(f"posterior.variance.kind: expected one of {VARIANCE_KINDS}, got {kind!r}")
        predictor_state = check.mapping(state.get("predictor"), "predictor")
        predictor = predictor_cls.from_state(to_device(dict(predictor_state), device, dtype), kernel)
        centers = factors = train_X = None
        reason = ""
        if kind == "nystrom":
            centers = check.points(variance.get("centers"), "variance.centers", cols=n_features)
            centers = centers.to(device=device, dtype=dtype)
        if kind == "exact" and getattr(predictor, "centers", None) is None:
            raise PosteriorStateError(
                "posterior.variance.kind: 'exact' needs a predictor over the training rows (with centers); "
                f"predictor kind {state.get('predictor_kind')!r} has none"
            )
        if kind == "none":
            reason = variance.get("reason")
            if not isinstance(reason, str):
                raise PosteriorStateError("posterior.variance.reason: expected a str")
        elif "factors" in variance:
            factors = _factors_from_state(check, variance["factors"], kind, n_features, device, dtype)
            if kind == "nystrom" and factors.points.shape[0] != centers.shape[0]:
                raise PosteriorStateError(
                    "posterior.variance.factors.points: expected the "
                    f"{centers.shape[0]} centers, got {factors.points.shape[0]} rows"
                )
        elif kind == "nystrom" and "train_X" in variance:
            train_X = check.points(variance["train_X"], "variance.train_X", cols=n_features).to(device, dtype)
        return cls(
            kernel=kernel,
            predictor=predictor,
            noise=noise,
            offset=offset.to(device=device, dtype=dtype),
            scaling=Scaling(y_mean.to(device=device, dtype=dtype), y_std.to(device=device, dtype=dtype)),
            variance_kind=kind,
            input_scaling=input_scaling,
            centers=centers,
            train_X=train_X,
            factors=factors,
            no_variance_reason=reason,
        )
