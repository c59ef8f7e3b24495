"""Objective ``exact``: the exact negative log marginal likelihood per data point.

For targets ``r = y - m`` (constant mean m) and ``C = K + sigma^2 I`` (Rasmussen & Williams 2006,
eq. 2.30)::

    -log p(y) = 1/2 r^T C^{-1} r + 1/2 log|C| + n/2 log(2 pi),

divided by the number of points and outputs. O(s^2) memory and O(s^3) time on s rows, so the whole
training set is used only up to ``kgp.settings.max_exact_size``; beyond it give ``subset`` (rows
drawn once per learning run, without replacement, from ``problem.generator``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import kgp
from kgp import settings
from kgp.learning import LearningProblem, ObjectiveLoss
from kgp.safeguards import InsufficientMemoryError, check_memory

from .gaussian_nll import gaussian_nll


class ExactObjective:
    """Exact GP negative log marginal likelihood by Cholesky (GPyTorch's ``ExactMarginalLogLikelihood``)."""

    option_defaults = {
        "subset": kgp.Option.integer(
            None,
            minimum=2,
            allow_none=True,
            help="rows drawn at random for the likelihood (None: all, up to kgp.settings.max_exact_size)",
        ),
    }
    # likelihood: the value is -log p(y) per point and output (the loop compares it with the white-noise
    # model's to tell an unconverged run); distributed only with ``subset``, whose rows every rank
    # gathers (it never holds all n rows)
    capabilities = kgp.Capabilities(likelihood=True, distributed=True)

    def prepare(self, problem: LearningProblem) -> ObjectiveLoss:
        options = problem.options  # resolved once by the model (kgp.options.resolve_options)
        n, subset = problem.n, options["subset"]
        if problem.shard is not None and subset is None:
            raise ValueError(
                "objective 'exact' in a distributed fit needs learn_options={'subset': S}: it factors a dense "
                "S x S kernel matrix of rows gathered on every rank, and the n rows of all ranks are never gathered; "
                "or use learn='sgpr', whose sums are spread over the ranks"
            )
        limit = settings.max_exact_size.value()
        size = n if subset is None else min(subset, n)
        if size > limit:
            where = f"n={n}" if subset is None else f"subset={subset}"
            raise ValueError(
                f"objective 'exact' builds a dense {size} x {size} kernel matrix; {where} exceeds "
                f"kgp.settings.max_exact_size={limit}: pass learn_options={{'subset': {min(limit, 3000)}}}, use "
                f"learn='sgpr', or raise the limit with kgp.settings.max_exact_size({size})"
            )
        if size < n or problem.shard is not None:
            rows = torch.randperm(n, generator=problem.generator)[:size].to(problem.device)
            if problem.shard is None:
                X, Y = problem.X[rows], problem.y[rows]
            else:  # global row numbers, the same on every rank: each rank fills in its own (exact sum)
                X, Y = problem.shard.take_rows(problem.X, rows), problem.shard.take_rows(problem.y, rows)
        else:
            X, Y = problem.X, problem.y
        _check_sizes(problem, X, size, subset)
        count = Y.numel()

        def loss(noise: Tensor, mean: Tensor) -> Tensor:
            K = problem.kernel_operator(X).to_dense()
            # closed-form backward (gaussian_nll.py): autograd through the Cholesky was 3-4x slower
            nll = gaussian_nll(
                K,
                noise,
                Y - mean,
                what=f"objective 'exact': K + noise*I with noise={float(noise.detach()):.6g}",
                remedy="raise learn_options['min_noise'] or use float64",
            )
            nll = nll + 0.5 * Y.shape[1] * size * math.log(2 * math.pi)
            return nll / count

        # the value is averaged over these terms: -value * terms is the log marginal likelihood
        return ObjectiveLoss(loss, terms=count)


# S x S float64 arrays an evaluation holds at once: K, its Cholesky factor, C^{-1} and the gradient's terms
_DENSE_ARRAYS = 5


def _check_sizes(problem: LearningProblem, X: Tensor, size: int, subset: int | None) -> None:
    """Refuse, before the first evaluation, a subset whose kernel rows or dense arrays cannot be held.

    The loss fills ``K`` in row blocks under ``kgp.settings.memory_budget``; where not even one row of
    ``size`` entries fits, the first evaluation without autograd (the final point's) would fail only after
    the whole optimisation. The ``_DENSE_ARRAYS`` ``size x size`` arrays must fit the available memory.
    """
    where = f"learn_options['subset']={subset}" if subset is not None else f"all n={size} rows"
    try:
        problem.kernel_operator(X).block_rows()
    except MemoryError as exc:
        raise InsufficientMemoryError(
            f"objective 'exact' on {size:,} rows ({where}): {str(exc).rstrip('.')}, or lower "
            "learn_options['subset'] (the rows the likelihood is computed on); nothing was evaluated"
        ) from None
    check_memory(
        _DENSE_ARRAYS * size * size * 8,
        what=f"objective 'exact' on {size:,} rows ({where}): its {_DENSE_ARRAYS} dense {size:,} x {size:,} arrays",
        remedy="lower learn_options['subset'], or use learn='sgpr'",
        device=problem.device,
    )
