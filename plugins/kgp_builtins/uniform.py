"""Center selector ``uniform``: M training points drawn uniformly without replacement (seeded).

This is FALKON's basic sampling (Rudi et al. 2017, Sec. 3; D = I in Appendix A). Without an
explicit ``n_centers`` it takes ``kgp.plugin.default_n_centers(n)``.

Distributed fits (:mod:`kgp.distributed`): every rank draws the same global row indices from the
shared seed, fills in the selected rows it holds, and one all-reduce of the ``M x d`` centers (zeros
elsewhere, so the sum is exact) gives every rank the centers a single process would select from the
concatenated data. The data are never gathered.
"""

from __future__ import annotations

import torch

import kgp
from kgp.plugin import Centers, SelectionRequest, default_n_centers


class UniformSelector:
    """Uniform sampling without replacement, reproducible through ``request.generator``."""

    option_defaults: dict[str, kgp.Option] = {}  # none: the seed is the model's random_state
    # distributed: the same global row indices on every rank, one exact all-reduce of the centers
    capabilities = kgp.Capabilities(distributed=True)

    def select(self, request: SelectionRequest) -> Centers:
        n = request.n
        m = default_n_centers(n) if request.n_centers is None else request.n_centers
        if not 1 <= m <= n:
            raise ValueError(f"n_centers: expected 1 <= n_centers <= n_samples={n}, got {m}")
        idx = torch.randperm(n, generator=request.generator)[:m].to(request.X.device)
        shard = request.shard
        if shard is None:
            return Centers(points=request.X[idx], weights=None, indices=idx)
        # idx are global row numbers: take the ones this rank holds, sum the rest in from the others
        local = idx - shard.offset
        mine = (local >= 0) & (local < shard.n_local)
        points = torch.zeros(m, request.X.shape[1], dtype=request.X.dtype, device=request.X.device)
        points[mine] = request.X[local[mine]]
        shard.all_reduce_(points)
        return Centers(points=points, weights=None, indices=idx, info={"indices": "global row numbers"})


@kgp.hookimpl
def register_selectors(register):
    register("uniform", UniformSelector())
