"""What an ``eigenpro4`` fit holds in memory, estimated before any kernel evaluation, and the refusal above the budget.

The fit keeps (all in the input dtype):

- the expansion's points ``[Z; X_s; temporary centers]`` and their coefficients:
  ``(M + e + C) x (d + k)``, C = T m the temporary centers' capacity, e = s when the preconditioner's
  subsample X_s is drawn from the data, 0 when from the centers (its points are then the centers');
- on the centers: the accumulated values ``h`` of the temporary part (``M x k``), the tail average
  (``M x k``) and ``K(Z, X_s) E`` (``M x q``);
- on the subsample: ``f(X_s)``, the correction ``c``, ``K(X_s, Z) a`` (the last two when X_s is among the
  centers) and ``K(X_s, X_s) E`` (at most ``s x (3k + q)``);
- one step's kernel block ``K(X_b, [Z; X_s; temporaries])``, in row chunks of at most the budget;
- the setup's dense blocks (the Nystrom subsample ``s x s``, the held-out curvature blocks, the
  projection's own subsample), each sized within ``kgp.settings.memory_budget`` by their builders.

With ``projection="eigenpro2"`` nothing is ``M x M``: that is O(M (d + k + q) + C (d + k) + chunk (M + e + C)).
With ``projection="cholesky"`` the factor of ``K(Z, Z)`` is kept (``M x M`` in the input dtype) and its
construction holds three float64 ``M x M`` arrays at once (``CHOLESKY_PEAK_ARRAYS`` of
:mod:`kgp_builtins.eigenpro.budget`; the peak,
before the epochs' buffers exist). The persistent part, and that peak, must fit ``kgp.settings.memory_budget``;
otherwise the fit is refused before any work, naming the number of centers and ``projection_period`` (the
capacity C = T m is the other term that grows), or ``projection``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kgp import settings
from kgp.options import InvalidOptionError
from kgp_builtins.eigenpro.budget import CHOLESKY_PEAK_ARRAYS, ITEMSIZE

from .options import OWNER

__all__ = ["MemoryPlan", "plan_memory"]


@dataclass(frozen=True)
class MemoryPlan:
    """Sizes in bytes of what the fit holds (see the module docstring); ``factor_setup`` is the exact projection's
    peak while its factor is formed (0 with ``projection="eigenpro2"``)."""

    state: int
    block: int
    chunk: int
    budget: int
    factor_setup: int = 0

    @property
    def total(self) -> int:
        return max(self.state + self.block, self.factor_setup)

    def describe(self) -> str:
        mib = 2.0**20
        factor = f", the projection's factor: {self.factor_setup / mib:.1f} MiB while formed" * bool(self.factor_setup)
        return (
            f"{OWNER}: memory estimate {self.total / mib:.1f} MiB (state {self.state / mib:.1f} MiB, one step's "
            f"kernel block {self.block / mib:.1f} MiB in chunks of {self.chunk} rows{factor}; "
            f"budget {self.budget / mib:.0f} MiB)"
        )


def plan_memory(
    *,
    n_centers: int,
    s: int,
    q: int,
    stored_subsample: bool,
    capacity: int,
    d: int,
    k: int,
    batch: int,
    itemsize: int,
    device,
    projection: str = "eigenpro2",
) -> MemoryPlan:
    """The :class:`MemoryPlan` of a fit (``projection``: ``"cholesky"`` or ``"eigenpro2"``, resolved).

    Raises
    ------
    kgp.options.InvalidOptionError
        When the state exceeds ``kgp.settings.memory_budget``, naming the centers and ``projection_period``;
        when the exact projection's factor does, naming ``projection``.
    """
    budget = settings.memory_budget.value(device)
    width = n_centers + (s if stored_subsample else 0) + capacity
    state = itemsize * (width * (d + k) + n_centers * (2 * k + q) + s * (3 * k + q))
    factor_setup = 0
    if projection == "cholesky":
        state += itemsize * n_centers**2  # the factor, kept in the input dtype
        factor_setup = CHOLESKY_PEAK_ARRAYS * ITEMSIZE * n_centers**2
        if factor_setup > budget:
            raise InvalidOptionError(
                f"{OWNER} option 'projection': 'cholesky' with {n_centers} centers forms {CHOLESKY_PEAK_ARRAYS} "
                f"float64 {n_centers} x {n_centers} arrays, {factor_setup / 2**20:.1f} MiB, more than "
                f"kgp.settings.memory_budget = {budget / 2**20:.1f} MiB; use projection='eigenpro2' (no M x M "
                "array) or 'auto', fewer centers (n_centers), or raise the budget"
            )
    # a step's block K(X_b, points) is formed in row chunks within the budget (at least one row)
    chunk = max(1, min(batch, budget // (itemsize * width)))
    block = itemsize * chunk * width
    if state > budget:
        raise InvalidOptionError(
            f"{OWNER}: {n_centers} centers with {capacity} temporary centers (projection_period x batch_size) "
            f"need {state / 2**20:.1f} MiB of state, more than kgp.settings.memory_budget = {budget / 2**20:.1f} MiB; "
            "use fewer centers (n_centers), a smaller 'projection_period' or 'batch_size', or raise the budget"
        )
    return MemoryPlan(state=state, block=block, chunk=chunk, budget=budget, factor_setup=factor_setup)
