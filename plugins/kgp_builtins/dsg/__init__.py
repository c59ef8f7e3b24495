"""Built-in plugin ``dsg``: doubly stochastic functional gradients with random features (Dai et al., NIPS 2014).

Modules: :mod:`.spectra` (per-step seeds, spectral samplers of RBF / Matern kernels),
:mod:`.features` (the seeded random Fourier feature map and the ``random_features`` predictor,
Algorithm 2), :mod:`.solver` (Algorithm 1 and its step-size rule). See docs/solvers/dsg.md.
"""

from __future__ import annotations

from collections.abc import Callable

import kgp

from .features import RandomFeatureExpansion, RandomFeatureMap
from .solver import DSGSolver
from .spectra import SpectralSampler, spectral_sampler, step_seed

__all__ = [
    "DSGSolver",
    "RandomFeatureExpansion",
    "RandomFeatureMap",
    "SpectralSampler",
    "spectral_sampler",
    "step_seed",
]


@kgp.hookimpl
def register_solvers(register: Callable[[str, DSGSolver], None]) -> None:
    register("dsg", DSGSolver())


@kgp.hookimpl
def register_predictors(register: Callable[[str, type[RandomFeatureExpansion]], None]) -> None:
    register(RandomFeatureExpansion.kind, RandomFeatureExpansion)
