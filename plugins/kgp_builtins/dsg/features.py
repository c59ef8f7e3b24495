"""Random Fourier feature maps regenerated from seeds, and the random-feature expansion predictor.

Step t draws r features ``phi_t(x) = sqrt(2 s / r) cos(omega_t^T x + b_t)`` (Dai et al., NIPS 2014,
Thm. 2, with ``omega_t, b_t`` from :mod:`.spectra`); ``phi_t(x)^T phi_t(x')`` is an unbiased
estimate of ``k(x, x')``. A predictor ``f(x) = sum_t phi_t(x)^T a_t`` (Algorithm 2) keeps only the
coefficients ``a_t`` and one integer seed: every ``omega_t`` is drawn again from
``step_seed(seed, t)`` when it is needed, so the model takes O(T r k) memory whatever the input
dimension. Nothing here depends on the solver: the map is usable on its own (e.g. as a
``LinearOperator`` approximation of ``K(X, X)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import gpytorch
import torch
from linear_operator.operators import LowRankRootLinearOperator
from torch import Tensor

from kgp import settings

from .spectra import SpectralSampler, spectral_sampler, step_seed

__all__ = ["RandomFeatureExpansion", "RandomFeatureMap"]

# Elements of one (rows x features) block of cosines: the cache-friendly size of kgp.operators.blocks.
_BLOCK_ELEMENTS = 1 << 20


class RandomFeatureMap:
    r"""Random Fourier features of steps ``1..n_steps``, regenerated from seeds on every call.

    Block t is ``phi_t(x) = sqrt(2 s / r) cos(omega_t^T x + b_t)`` (r features) with ``omega_t, b_t``
    drawn from :func:`step_seed` ``(seed, t)``; ``phi_t(x)^T phi_t(x')`` is an unbiased estimate of
    ``k(x, x')`` (Dai et al. Thm. 2) with variance O(1/r).

    Parameters
    ----------
    kernel:
        GPyTorch RBF / Matern kernel (hyperparameters are read at every call).
    seed:
        Model seed.
    features_per_step:
        r.
    n_steps:
        Number of steps (blocks) T; the map has ``D = T r`` features.
    shift:
        Optional length-d point subtracted from every input first (the solver passes the training
        mean). The features of ``x - c`` are those of ``x`` with the phases ``b`` moved by
        ``omega^T c``, uniform again, so the kernel estimate is unchanged; the arguments
        ``omega^T (x - c)`` stay small, which keeps their rounding error small for data far from
        the origin (float32 carries about 7 digits of the phase).
    """

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel,
        seed: int,
        features_per_step: int,
        n_steps: int,
        shift: Tensor | None = None,
    ):
        self.kernel = kernel
        self.seed = int(seed)
        self.features_per_step = int(features_per_step)
        self.n_steps = int(n_steps)
        self.shift = None if shift is None else shift.detach().reshape(-1)

    def scaled_inputs(self, X: Tensor, sampler: SpectralSampler | None = None) -> Tensor:
        """``(X - shift) / lengthscale`` in X's dtype: the inputs whose products with z give the phases."""
        sampler = sampler or spectral_sampler(self.kernel)
        if self.shift is not None:
            if self.shift.numel() != X.shape[1]:
                raise ValueError(
                    f"X: expected {self.shift.numel()} features like the training inputs, got {X.shape[1]}"
                )
            X = X - self.shift.to(device=X.device, dtype=X.dtype)
        return sampler.scale_inputs(X)

    @property
    def n_features(self) -> int:
        return self.features_per_step * self.n_steps

    def _groups(self, steps: range, n_rows: int) -> Iterator[range]:
        """Consecutive step groups whose cosine block (rows x features) stays cache-sized."""
        per = max(1, _BLOCK_ELEMENTS // max(1, n_rows * self.features_per_step))
        for start in range(steps.start, steps.stop, per):
            yield range(start, min(start + per, steps.stop))

    def frequencies(self, sampler: SpectralSampler, steps: range, d: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Concatenated ``z`` (d x len(steps) r) and ``b`` for ``steps`` (one generator per step seed)."""
        zs, bs = [], []
        for t in steps:
            z, b = sampler.sample(step_seed(self.seed, t), d, self.features_per_step)
            zs.append(z)
            bs.append(b)
        z = torch.cat(zs, dim=1).to(device=like.device, dtype=like.dtype)
        b = torch.cat(bs).to(device=like.device, dtype=like.dtype)
        return z, b

    def _check_steps(self, steps: range | None) -> range:
        steps = range(1, self.n_steps + 1) if steps is None else steps
        if not isinstance(steps, range) or steps.step != 1 or (len(steps) and (steps.start < 1)):
            raise ValueError(f"steps: expected a contiguous range of 1-based step numbers, got {steps!r}")
        return steps

    def features(self, X: Tensor, steps: range | None = None) -> Tensor:
        """Return ``Phi = [phi_t(X)]_{t in steps}`` (``n x len(steps) r``), built in row and step blocks.

        ``Phi Phi^T / len(steps)`` is an unbiased estimate of ``K(X, X)`` with ``D = len(steps) r``
        features.
        """
        steps = self._check_steps(steps)
        sampler = spectral_sampler(self.kernel)
        n, d = X.shape
        r = self.features_per_step
        out = torch.empty(n, len(steps) * r, dtype=X.dtype, device=X.device)
        amp = math.sqrt(2.0 * sampler.outputscale / r)
        with torch.no_grad():
            U = self.scaled_inputs(X, sampler)
            rows = max(1, min(n, _BLOCK_ELEMENTS // max(1, r)))
            for group in self._groups(steps, rows):
                z, b = self.frequencies(sampler, group, d, X)
                cols = slice((group.start - steps.start) * r, (group.stop - steps.start) * r)
                for i in range(0, n, rows):
                    block = torch.addmm(b, U[i : i + rows], z)
                    out[i : i + rows, cols] = block.cos_().mul_(amp)
        return out

    def operator(self, X: Tensor, steps: range | None = None) -> LowRankRootLinearOperator:
        """The random-feature kernel ``K_hat(X, X) = Phi Phi^T / T`` as a linear_operator ``LinearOperator``.

        Its root ``Phi / sqrt(T)`` (``n x T r``) is computed once, blockwise; it must fit
        ``kgp.settings.memory_budget`` (pass a shorter ``steps`` range otherwise).
        """
        steps = self._check_steps(steps)
        size = X.shape[0] * len(steps) * self.features_per_step * X.element_size()
        budget = settings.memory_budget.value(X.device)
        if size > budget:
            raise ValueError(
                f"steps: the feature matrix would take {size / 2**20:.0f} MiB, above kgp.settings.memory_budget "
                f"({budget / 2**20:.0f} MiB); pass a shorter range of steps or raise the budget"
            )
        root = self.features(X, steps).div_(math.sqrt(max(1, len(steps))))
        return LowRankRootLinearOperator(root)

    def apply(self, X: Tensor, coef: Tensor, first_step: int = 1) -> Tensor:
        """``sum_t phi_t(X) coef[t - first_step]`` (Algorithm 2) for ``coef`` of shape ``T' x r x k``.

        Streams over row blocks of X and groups of steps; nothing of size n x D is allocated.
        """
        n, d = X.shape
        T, r, k = coef.shape
        if r != self.features_per_step:
            raise ValueError(f"coef: expected {self.features_per_step} features per step, got {r}")
        out = torch.zeros(n, k, dtype=X.dtype, device=X.device)
        if T == 0 or n == 0:
            return out
        sampler = spectral_sampler(self.kernel)
        amp = math.sqrt(2.0 * sampler.outputscale / r)
        steps = range(first_step, first_step + T)
        with torch.no_grad():
            U = self.scaled_inputs(X, sampler)
            rows = max(1, min(n, 8192))
            for group in self._groups(steps, rows):
                z, b = self.frequencies(sampler, group, d, X)
                c = coef[group.start - first_step : group.stop - first_step].reshape(-1, k).to(X)
                for i in range(0, n, rows):
                    block = torch.addmm(b, U[i : i + rows], z).cos_()
                    out[i : i + rows].addmm_(block, c, alpha=amp)
        return out


class RandomFeatureExpansion:
    r"""``f(x) = sum_{t=1..T} phi_t(x)^T a_t``: the random-feature expansion of Algorithm 2.

    Parameters
    ----------
    kernel:
        The GPyTorch kernel whose spectral measure generates the features.
    coef:
        ``T x r x k`` coefficient blocks ``a_t`` (a ``T x r`` tensor is taken as k = 1).
    seed:
        Model seed; step t's features come from :func:`step_seed` ``(seed, t)``.
    schedule:
        Plain values needed to continue training (``partial_fit``), e.g. ``update``, ``nu``,
        ``n_seen`` and the step-size constants.
    shift:
        The point subtracted from inputs before the features (:class:`RandomFeatureMap`); None: 0
        (models saved before the shift existed).

    Notes
    -----
    Memory is ``T r k`` numbers plus a seed, independent of the input dimension; predicting
    regenerates ``omega_t`` for every step (O(T r d) work on top of the O(n T r d) products).
    """

    kind: ClassVar[str] = "random_features"

    def __init__(
        self,
        kernel: gpytorch.kernels.Kernel,
        coef: Tensor,
        seed: int,
        schedule: Mapping[str, Any] | None = None,
        shift: Tensor | None = None,
    ):
        if coef.dim() == 2:
            coef = coef.unsqueeze(-1)
        if coef.dim() != 3:
            raise ValueError(f"RandomFeatureExpansion: coef must be T x r x k, got shape {tuple(coef.shape)}")
        self.kernel = kernel
        self.coef = coef
        self.seed = int(seed)
        self.schedule = dict(schedule or {})
        self.shift = None if shift is None else shift.detach().reshape(-1)
        self.feature_map = RandomFeatureMap(kernel, self.seed, coef.shape[1], coef.shape[0], self.shift)

    @property
    def n_steps(self) -> int:
        return self.coef.shape[0]

    @property
    def features_per_step(self) -> int:
        return self.coef.shape[1]

    @property
    def n_features(self) -> int:
        """Total number of random features D = T r."""
        return self.coef.shape[0] * self.coef.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of model state (the coefficients; the seed and schedule are a few plain numbers)."""
        return self.coef.numel() * self.coef.element_size()

    def predict(self, X: Tensor) -> Tensor:
        """Return ``f(X)`` (``n x k``) by regenerating every step's features (Algorithm 2)."""
        return self.feature_map.apply(X, self.coef.to(X))

    def features(self, X: Tensor, steps: range | None = None) -> Tensor:
        """Feature matrix ``Phi`` (``n x D``); ``predict(X) == Phi @ coef.reshape(D, k)``."""
        return self.feature_map.features(X, steps)

    def kernel_operator(self, X: Tensor, steps: range | None = None) -> LowRankRootLinearOperator:
        """Random-feature approximation ``Phi Phi^T / T`` of ``K(X, X)`` as a ``LinearOperator``."""
        return self.feature_map.operator(X, steps)

    def state_dict(self) -> dict[str, Any]:
        state = {"coef": self.coef.detach().cpu(), "seed": self.seed, "schedule": dict(self.schedule)}
        if self.shift is not None:
            state["shift"] = self.shift.cpu()
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any], kernel: gpytorch.kernels.Kernel) -> RandomFeatureExpansion:
        return cls(kernel, state["coef"], int(state["seed"]), state.get("schedule"), state.get("shift"))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> RandomFeatureExpansion:
        """A copy with the coefficients on ``device`` / in ``dtype``, with the same seed, schedule and shift."""
        shift = None if self.shift is None else self.shift.to(device=device, dtype=dtype)
        coef = self.coef.to(device=device, dtype=dtype)
        return RandomFeatureExpansion(self.kernel, coef, self.seed, self.schedule, shift)

    def __repr__(self) -> str:
        T, r, k = self.coef.shape
        return f"RandomFeatureExpansion(steps={T}, features_per_step={r}, features={T * r}, outputs={k})"
