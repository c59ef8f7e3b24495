"""Center selector ``uniform``: M training points drawn uniformly without replacement (seeded).

This is FALKON's basic sampling (Rudi et al. 2017, Sec. 3; D = I in Appendix A). Without an
explicit ``n_centers`` it takes ``kgp.plugin.default_n_centers(n)``.
"""

from __future__ import annotations

import torch

import kgp
from kgp.plugin import Centers, SelectionRequest, default_n_centers


class UniformSelector:
    """Uniform sampling without replacement, reproducible through ``request.generator``."""

    option_defaults: dict[str, kgp.Option] = {}  # none: the seed is the model's random_state

    def select(self, request: SelectionRequest) -> Centers:
        n = request.n
        m = default_n_centers(n) if request.n_centers is None else request.n_centers
        if not 1 <= m <= n:
            raise ValueError(f"n_centers: expected 1 <= n_centers <= n_samples={n}, got {m}")
        idx = torch.randperm(n, generator=request.generator)[:m].to(request.X.device)
        return Centers(points=request.X[idx], weights=None, indices=idx)


@kgp.hookimpl
def register_selectors(register):
    register("uniform", UniformSelector())
