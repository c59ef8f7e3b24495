"""Center selector ``kmeans++``: k-means++ seeding (D^2 sampling), by default in the kernel's feature space.

k-means++ (Arthur & Vassilvitskii 2007) picks the first center uniformly, then each next one with
probability proportional to ``D(x)^2``, the squared distance from ``x`` to its closest center so
far. With ``metric="kernel"`` the distance is the one of the kernel's feature map,

    D(x)^2 = min_j k(x, x) + k(z_j, z_j) - 2 k(x, z_j),

so the centers spread over the data as the kernel sees it. Its final value summed over the data,
the k-means potential, bounds the Nystrom approximation error: projecting ``phi(x_i)`` onto
``span{phi(z_j)}`` is at least as close as the nearest single center, hence
``trace(K - K_nM K_MM^+ K_Mn) <= sum_i D(x_i)^2`` (reported as ``info["potential"]``).

``n_local_trials > 1`` is the greedy variant: draw that many candidates per step and keep the one
that lowers the potential most.

All draws come from ``request.generator`` (uniforms on the CPU, mapped to indices on the data's
device by inverting the cumulative distribution), so results depend only on the seed.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kgp
from kgp.plugin import Centers, SelectionRequest, default_n_centers

__all__ = ["KMeansPPSelector"]


class KMeansPPSelector:
    """k-means++ seeding of ``n_centers`` training points (default ``min(n, max(100, 5 sqrt(n)))``).

    Its options are declared with :class:`kgp.Option` (``kgp plugins --options kmeans++`` prints
    them): kgp resolves them once before ``select`` and reports a bad value as
    ``selector 'kmeans++' option 'metric': expected one of 'kernel', 'euclidean', got 'cosine'``.
    """

    # one process: the D^2 draws need every row's distance (not distributed); no autograd
    capabilities = kgp.Capabilities()
    option_defaults = {
        "metric": kgp.Option.choice(
            "kernel", ("kernel", "euclidean"), help="distance for D^2 sampling: the kernel's feature space or R^d"
        ),
        "n_local_trials": kgp.Option.integer(
            1, minimum=1, help="candidates per step; > 1 keeps the one lowering the potential most (greedy)"
        ),
    }

    def select(self, request: SelectionRequest) -> Centers:
        metric, trials = request.options["metric"], request.options["n_local_trials"]  # resolved by kgp
        X = request.X
        n = request.n
        m = default_n_centers(n) if request.n_centers is None else int(request.n_centers)
        if not 1 <= m <= n:
            raise ValueError(f"n_centers: expected 1 <= n_centers <= n_samples={n}, got {m}")
        gen = request.generator
        with torch.no_grad():
            if metric == "kernel":
                self_sim = request.kernel_operator(X).diagonal()

                def dist2(idx: Tensor) -> Tensor:
                    cross = request.kernel_operator(X, X[idx]).to_dense()
                    return (self_sim.unsqueeze(1) + self_sim[idx].unsqueeze(0) - 2 * cross).clamp_min_(0)

            else:
                sq = (X * X).sum(1)

                def dist2(idx: Tensor) -> Tensor:
                    return (sq.unsqueeze(1) + sq[idx].unsqueeze(0) - 2 * X @ X[idx].T).clamp_min_(0)

            chosen = torch.empty(m, dtype=torch.long, device=X.device)
            first = torch.randint(n, (1,), generator=gen).to(X.device)
            chosen[0] = first[0]
            closest = dist2(first)[:, 0]
            closest[first] = 0
            for j in range(1, m):
                total = closest.sum()
                if not bool(total > 0):
                    # Fewer distinct points than centers: continue uniformly among unchosen points.
                    free = torch.ones(n, dtype=torch.bool, device=X.device)
                    free[chosen[:j]] = False
                    pool = free.nonzero()[:, 0]
                    cand = pool[torch.randint(pool.numel(), (1,), generator=gen).to(X.device)]
                    chosen[j] = cand[0]
                    continue
                u = torch.rand(trials, generator=gen, dtype=torch.float64).to(X.device)
                cdf = torch.cumsum(closest.to(torch.float64), 0)
                cand = torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max_(n - 1)
                new = torch.minimum(closest.unsqueeze(1), dist2(cand))
                best = int(torch.argmin(new.sum(0))) if trials > 1 else 0
                chosen[j] = cand[best]
                closest = new[:, best]
                closest[cand[best]] = 0
        return Centers(
            points=X[chosen],
            weights=None,
            indices=chosen,
            info={"potential": float(closest.sum()), "metric": metric},
        )


@kgp.hookimpl
def register_selectors(register) -> None:
    register("kmeans++", KMeansPPSelector())
