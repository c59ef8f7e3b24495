"""The measured rule behind ``solver="auto"`` and ``learn="auto"``.

Learning (``learn="auto"``): the exact marginal likelihood (objective ``exact``) on a random subset of
``SUBSET`` rows, by Adam (``ADAM_STEPS`` steps at the loop's default step 0.1). L-BFGS with 50
evaluations was 2-3x cheaper and as good on pol, but ended in a worse optimum on elevators (test RMSE
1.19x the exact GP's against 1.01x for Adam), as it did there before (docs/gp-workflow.md). Started from
Adam's best point instead, while Adam's objective still falls, ``POLISH_EVALUATIONS`` L-BFGS evaluations
converge where Adam's fixed step crawls (``learn_options['polish_iterations']``, measured in
docs/benchmarks/gp-default.md, "Polish"). When the first stage has converged (no polish needed) and n
exceeds ``SUBSET``, up to ``REFINE_EVALUATIONS`` L-BFGS evaluations on ``REFINE_SUBSET`` rows that contain
the first ``SUBSET`` (``learn_options['refine_subset']``): which 3,000 rows are drawn moved elevators' test
RMSE over 0.3599-0.3648 across seeds, and the refine stage brought it to 0.3516-0.3526, ahead of SGPR
(docs/benchmarks/gp-default.md, "Refine"). The
subset's exact likelihood has no Nystrom bias (the collapsed bound with few centers learns
lengthscales too long and a noise too large: docs/gp-workflow.md 8.1), and its hyperparameters are
those the exact GP of the benchmark uses.

The noise starts at ``INITIAL_NOISE_FRACTION`` of the (standardised) targets' variance, GPyTorch's own
starting noise (softplus(0) = 0.69) for unit-variance targets, not at the model's ``noise`` (1e-2, the
kernel ridge default). From 1e-2 Adam settled in a worse optimum on the noisy sets: a near-interpolating
fit with short lengthscales (exact likelihood on the same 3,000 rows, per point, and test RMSE with
FALKON at M = 3,000; runs recorded in docs/benchmarks/gp-default.md):

=========  ======================  ======================  =======================================
set        start 1e-2              start 0.7 var(y)        learned noise (1e-2 -> 0.7 start)
=========  ======================  ======================  =======================================
protein    1.1325, RMSE 0.6360     1.0851, RMSE 0.5993     0.050 -> 0.165 (GPyTorch's: 0.174)
airline    1.4391, RMSE 0.9506     1.3376, RMSE 0.8063     0.031 -> 0.720 (SVGP's: 0.690)
pol        -0.6147, RMSE 0.0852    -0.6225, RMSE 0.0838    0.0027 -> 0.0026
elevators  0.5472, RMSE 0.3630     0.5513, RMSE 0.3633     0.139 -> 0.139
=========  ======================  ======================  =======================================

Solving (``solver="auto"``): the exact solve while the dense ``n x n`` matrix fits the memory budget
and ``kgp.settings.max_exact_size``; above, FALKON on uniform centers, as many as the budget holds
(:func:`nystrom_centers`), up to a time cap, whatever n is: more rows never buy fewer centers. The
variance a learned GP builds at fit sums ``K_Mn K_nM`` over at most ``max(4 M, 20,000)`` rows
(:mod:`kgp.variance.nystrom`: a uniform subset, scaled, above that), so its cost is bounded by
``max(4 M, 2e4) M^2`` flops; summed over all rows it would cost ``n M^2``, and a time budget would then allow only
``M ~ n^(-1/2)`` centers (3,872 at 1e6 rows, 1,224 at 1e7 for 1.5e13 flops). What grows with n is
FALKON's ``n M`` per iteration (docs/benchmarks/large-data.md has the measured table).

Two caps bound the centers from the time side, and the larger applies. The time cap (:func:`time_cap`)
is set by the device's float64 GEMM rate. ``MAX_CENTERS`` = 11,241 is the
M of the measured default table (docs/benchmarks/gp-default.md), on a 2-core CPU at ``REFERENCE_FLOPS``
(106 GFLOP/s), whose times are the targets the default is held to: the memory cap of a 24 GB host would
allow more centers, which cost 1.5-2x the time there for a test RMSE at most a few percent lower
(docs/benchmarks/large-data.md, "Three M x M arrays"). A GPU does the same work about 100x faster. The
setup that does not grow with n (:func:`setup_flops`) is five ``M^3 / 3`` factor steps (three of FALKON's
preconditioner, two of the variance) and the Gram, ``2 max(4 M, 2e4) M^2``: above
M = 5,000 every term is a multiple of ``M^3``, so the M whose setup takes a fixed time
(``SETUP_SECONDS``: what 11,241 centers take at the reference rate) grows as the cube root of the rate:
11,241 x 100^(1/3) = 52,176 at 100x the rate, 52,000 in whole thousands, then the memory cap applies.
The cap never falls below ``MAX_CENTERS``: a CPU slower than the reference, or one that other processes
load while it is measured, keeps the measured default, so that fits on such hosts choose the same M from
run to run, and the measurement (:func:`kgp.device_speed.measured_flops`, once per process and device)
only ever adds centers on a faster device.

The passes cap (:func:`passes_cap`) lets the setup grow with the work that grows with n: FALKON's
``FALKON_PASSES`` fused passes over the ``n x M`` kernel matrix (:func:`passes_flops`). It is the
largest M whose setup costs at most ``SETUP_SHARE`` of those passes, both counted in flops of matrix-product
time, so the device's rate cancels and every host (and every rank of a distributed fit) gets the same cap:
``9.67 M^3 <= 0.5 x 21 n M (3 d + 65)`` above 5,000 centers, ``M ~ sqrt(96 n)`` at d = 8 (the pass cost is
an RBF kernel's in float64, measured; other kernels' entries cost about as much; a float32 pass ran 2.1x
faster, so a float32 fit on this cap may spend about as long on the setup, still float64, as on the
passes). A distributed fit counts all ranks' rows, so that it chooses the M of one process on the same data
and gives its model. It is below ``MAX_CENTERS`` up to
1.3e6 rows at d = 8 (0.8e6 at d = 28), where the time cap alone decides as before; at 1e7 rows it is
31,000, so the memory cap decides (14,513 centers on a 24 GB host: docs/benchmarks/large-data.md). A fit
on the passes cap spends at most 1.5x its passes' time on passes and setup together.

The rate is taken only where it can change M (n and the memory cap above both ``MAX_CENTERS`` and the
passes cap; never for the exact solve, nor in a distributed fit, whose ranks must agree on M), and
``kgp.settings.device_flops`` pins the rate instead, for the same M on every host.
``recipe_["device"]`` reports the rate, its source (``"setting"``, ``"measured"``, or why none was
measured) and the three caps (:class:`CenterCaps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kgp.recipes import RecipeChoice, RecipeRequest
from kgp.variance import GRAM_MIN_ROWS, GRAM_ROWS_PER_CENTER

__all__ = [
    "AutoRecipe",
    "CenterCaps",
    "center_caps",
    "exact_limit",
    "memory_cap",
    "nystrom_centers",
    "passes_cap",
    "passes_flops",
    "refine_rows",
    "setup_flops",
    "time_cap",
]

SUBSET = 3000
ADAM_STEPS = 100
INITIAL_NOISE_FRACTION = 0.7
# while the objective still falls after the Adam steps (more than 0.03 nats per point over the last quarter;
# bike at 100 steps: 0.091; the other five sets 0.0001-0.009), at most this many L-BFGS evaluations from
# Adam's best point: bike's test RMSE 0.0204 -> 0.0100 and its time 280 -> 137 s against 200 more Adam
# steps. Run on every set, it helped two and hurt two (docs/benchmarks/gp-default.md, "Polish")
POLISH_EVALUATIONS = 20
# then at most REFINE_EVALUATIONS L-BFGS evaluations on REFINE_SUBSET rows (a superset of the first SUBSET)
# from the best point: which 3,000 rows are drawn moves the learned GP more than the optimizer does
# (elevators over three seeds: 0.3599-0.3648 test RMSE), and the refine stage on 5,000 rows removes most of
# that at (5 / 3)^3 = 4.6x the cost of one Adam step each (docs/benchmarks/gp-default.md, "Refine")
REFINE_SUBSET = 5000
REFINE_EVALUATIONS = 15
# n x n float64 arrays an 'exact' evaluation holds at once (K, its factor, the inverse and its triangular
# factor, the gradient): the refine subset is capped so that they fit the memory budget
_EXACT_ARRAYS = 5
MAX_CENTERS = 11_241
MIN_CENTERS = 100
# float64 GEMM rate of the 2-core CPU that MAX_CENTERS was measured on (flop/s): the time cap is MAX_CENTERS
# there, and grows as the cube root of a faster device's rate (module docstring)
REFERENCE_FLOPS = 106e9
# FALKON's Cholesky of K_MM, its L^T L and the Cholesky of A, and the variance's two Cholesky factors: five
# M x M steps of M^3 / 3 flops each
_FACTOR_FLOPS = 5 / 3
# the time cap is rounded down to whole thousands of centers
CAP_STEP = 1_000
# FALKON's passes over the n x M kernel matrix: its default 20 CG iterations (solver option maxiter), one
# fused pass K_nM^T (K_nM v) each, and the right-hand side's K_nM^T y
FALKON_PASSES = 21
# one kernel entry of a fused RBF pass costs as long as PASS_FLOPS_PER_FEATURE d + PASS_FLOPS_PER_ENTRY
# float64 matrix-product flops: on a 2-core CPU measuring 152 GFLOP/s, a pass over 1e6 rows and 4,000 or
# 12,000 centers ran at 1.70-1.75e9 entries/s at d = 8 (89 flops each) and 1.01-1.03e9 at d = 28 (149);
# docs/benchmarks/large-data.md, "The passes cap"
PASS_FLOPS_PER_FEATURE = 3
PASS_FLOPS_PER_ENTRY = 65
# the M^3 setup may cost at most this share of the passes: passes and setup together then take at most 1.5x
# the passes, and up to 1.3e6 rows at d = 8 the time cap alone decides (module docstring)
SETUP_SHARE = 0.5
# float64 M x M arrays alive at once in a FALKON fit with its Nystrom variance: FALKON's K_MM and two
# triangular factors at its peak (measured 2.4 at M = 3,000); the variance, built after the solve, holds two
# (the Gram and K_MM, each factored over itself; measured 2.2, tests/test_memory_estimate.py)
_SQUARE_ARRAYS = 3
_FACTOR_BYTES = 8  # the preconditioner and the variance factors are float64 whatever the input dtype


def exact_limit(request: RecipeRequest) -> int:
    """Largest n whose dense ``n x n`` matrix (in the input dtype) fits the budget and max_exact_size."""
    itemsize = 8 if str(request.dtype) == "torch.float64" else 4
    by_memory = int(math.isqrt(max(request.memory_budget, 1) // itemsize))
    return min(request.max_exact_size, by_memory)


def setup_flops(n_centers: int) -> float:
    """Float64 flops of the ``M^3`` setup of a FALKON fit and its Nystrom variance on ``M`` centers.

    The five ``M x M`` factor steps (``_FACTOR_FLOPS M^3``) and the variance's Gram ``K_Mm K_mM`` over
    ``m = max(GRAM_ROWS_PER_CENTER M, GRAM_MIN_ROWS)`` rows (``2 m M^2``, counted as a GEMM is: a multiply
    and an add per term). Nothing here grows with n.
    """
    m = int(n_centers)
    return _FACTOR_FLOPS * m**3 + 2.0 * max(GRAM_ROWS_PER_CENTER * m, GRAM_MIN_ROWS) * m**2


SETUP_SECONDS = setup_flops(MAX_CENTERS) / REFERENCE_FLOPS
"""Seconds of ``M^3`` setup the time cap allows: what ``MAX_CENTERS`` take at ``REFERENCE_FLOPS``."""


def time_cap(flops: float | None) -> int:
    """Largest M whose :func:`setup_flops` take at most ``SETUP_SECONDS`` at ``flops`` float64 flop/s.

    Rounded down to ``CAP_STEP`` and never below ``MAX_CENTERS`` (module docstring); ``MAX_CENTERS`` for
    an unknown rate (None).
    """
    if flops is None:
        return MAX_CENTERS
    allowed = float(flops) * SETUP_SECONDS
    return max(MAX_CENTERS, _largest_centers(lambda m: setup_flops(m) <= allowed) // CAP_STEP * CAP_STEP)


def passes_flops(n: int, d: int, n_centers: int) -> float:
    """Matrix-product-time flops of FALKON's ``FALKON_PASSES`` fused passes over ``n x M`` kernel entries.

    One entry of a fused pass ``K_nM^T (K_nM v)`` in d features costs as long as
    ``PASS_FLOPS_PER_FEATURE d + PASS_FLOPS_PER_ENTRY`` float64 matrix-product flops (the distance product,
    the exponential and the two products with v; measured, see the constants).
    """
    per_entry = PASS_FLOPS_PER_FEATURE * int(d) + PASS_FLOPS_PER_ENTRY
    return FALKON_PASSES * float(n) * int(n_centers) * per_entry


def passes_cap(n: int, d: int) -> int:
    """Largest M whose :func:`setup_flops` are at most ``SETUP_SHARE`` of :func:`passes_flops` at that M.

    Rounded down to ``CAP_STEP``; 0 where no whole thousand qualifies. Both sides are flops of the same
    device, so no rate enters (module docstring).
    """
    allowed = _largest_centers(lambda m: setup_flops(m) <= SETUP_SHARE * passes_flops(n, d, m))
    return allowed // CAP_STEP * CAP_STEP


def _largest_centers(fits: Callable[[int], bool]) -> int:
    """Largest M >= 1 with ``fits(M)`` (0 if none), for a ``fits`` true up to some M and false beyond."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # fits(low) and not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def memory_cap(request: RecipeRequest) -> int:
    """Largest M whose ``_SQUARE_ARRAYS`` float64 ``M x M`` arrays fit the memory budget."""
    return int(math.isqrt(max(request.memory_budget, 1) // (_SQUARE_ARRAYS * _FACTOR_BYTES)))


@dataclass(frozen=True)
class CenterCaps:
    """FALKON's centers (:func:`center_caps`), the three caps that bound them and the rate behind the time cap.

    ``source`` says where ``flops`` came from: ``"setting"`` (``kgp.settings.device_flops``), ``"measured"``
    (:func:`kgp.device_speed.measured_flops`), ``"not measured"`` (the time cap could not bind: n or the
    memory cap is at most ``MAX_CENTERS`` or the passes cap), ``"distributed"`` (not measured: the ranks'
    measurements could differ, and every rank must choose the same M) or ``"unavailable"`` (the device could
    not run the probe, or the request carries no way to measure).
    """

    n_centers: int
    time_cap: int
    passes_cap: int
    memory_cap: int
    flops: float | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        """Plain values, as ``recipe_["device"]`` holds them."""
        return {
            "flops": self.flops,
            "source": self.source,
            "time_cap": self.time_cap,
            "passes_cap": self.passes_cap,
            "memory_cap": self.memory_cap,
        }

    def describe_rate(self) -> str:
        """The rate and its source, in words."""
        if self.source == "setting":
            return f"kgp.settings.device_flops = {self.flops:.3g} flop/s"
        if self.source == "measured":
            return f"the device's measured {self.flops:.3g} float64 flop/s"
        if self.source == "distributed":
            return "no rate measured in a distributed fit; kgp.settings.device_flops would set one"
        if self.source == "not measured":
            return f"no rate measured: n or the memory cap is at most {max(MAX_CENTERS, self.passes_cap):,}"
        return "no rate: the device could not be measured"


def center_caps(request: RecipeRequest) -> CenterCaps:
    """Centers for FALKON: at most n, the memory cap and the larger of the time and passes caps; never
    fewer as n grows.

    The device's rate is the request's ``device_flops`` (the setting) if given; else it is measured, once
    per process, only where the time cap can decide (n and the memory cap above ``MAX_CENTERS`` and the
    passes cap) and the fit is not distributed.
    """
    memory = memory_cap(request)
    passes = passes_cap(request.n, request.d)
    flops, source = request.device_flops, "setting"
    if flops is None:
        if request.distributed:
            source = "distributed"
        elif min(request.n, memory) <= max(MAX_CENTERS, passes):
            source = "not measured"
        else:
            flops = None if request.measure_flops is None else request.measure_flops()
            source = "unavailable" if flops is None else "measured"
    time = time_cap(flops)
    n_centers = max(min(request.n, MIN_CENTERS), min(request.n, max(time, passes), memory))
    return CenterCaps(
        n_centers=n_centers, time_cap=time, passes_cap=passes, memory_cap=memory, flops=flops, source=source
    )


def nystrom_centers(request: RecipeRequest) -> int:
    """Centers for FALKON: as many as ``_SQUARE_ARRAYS`` float64 ``M x M`` arrays in the budget allow, at
    most n and at most the larger of the time cap (``MAX_CENTERS``, more on a device faster than
    ``REFERENCE_FLOPS``) and the passes cap (grows with n); never fewer as n grows (:func:`center_caps`)."""
    return center_caps(request).n_centers


def refine_rows(request: RecipeRequest) -> int:
    """Rows of the refine stage: ``REFINE_SUBSET``, fewer when ``_EXACT_ARRAYS`` float64 ``S x S`` arrays
    would not fit the memory budget."""
    by_memory = int(math.isqrt(max(request.memory_budget, 1) // (_EXACT_ARRAYS * 8)))
    return min(REFINE_SUBSET, by_memory)


class AutoRecipe:
    """Chooses the solver, the centers and the learning from the data's size (see the module docstring)."""

    def choose(self, request: RecipeRequest) -> RecipeChoice:
        reasons: dict[str, str] = {}
        solver = n_centers = learn = learn_options = device = None
        if request.solver_auto:
            limit = exact_limit(request)
            if request.n <= limit and not request.distributed and not request.uses_centers_explicitly:
                solver = "exact"
                reasons["solver"] = f"n = {request.n:,} <= {limit:,}: the dense exact solve fits the memory budget"
            else:
                solver = "falkon"
                why = (
                    "a distributed fit"
                    if request.distributed
                    else "centers were given"
                    if request.uses_centers_explicitly
                    else f"n = {request.n:,} > {limit:,} (dense n x n beyond the memory budget or max_exact_size)"
                )
                reasons["solver"] = f"{why}: FALKON on Nystrom centers"
                if not request.uses_centers_explicitly:
                    caps = center_caps(request)
                    n_centers, device = caps.n_centers, caps.as_dict()
                    reasons["n_centers"] = _centers_reason(caps)
        if request.learn_auto:
            learn = "exact"
            subset = min(request.n, SUBSET)
            learn_options = {
                "optimizer": "adam",
                "iterations": ADAM_STEPS,
                "polish_iterations": POLISH_EVALUATIONS,
                "initial_noise_fraction": INITIAL_NOISE_FRACTION,
            }
            if subset < request.n or request.distributed:  # a distributed fit gathers the subset's rows
                learn_options["subset"] = subset
            refine = min(request.n, refine_rows(request))
            refined = ""
            if "subset" in learn_options and refine > subset:
                learn_options["refine_subset"] = refine
                learn_options["refine_iterations"] = REFINE_EVALUATIONS
                refined = f", then up to {REFINE_EVALUATIONS} L-BFGS evaluations on {refine:,} rows (a superset)"
            reasons["learn"] = (
                f"exact marginal likelihood on {subset:,} random rows, {ADAM_STEPS} Adam steps (then up to "
                f"{POLISH_EVALUATIONS} L-BFGS evaluations while it still falls){refined}, the noise starting at "
                f"{INITIAL_NOISE_FRACTION} of the targets' variance"
            )
        return RecipeChoice(
            solver=solver,
            n_centers=n_centers,
            learn=learn,
            learn_options=learn_options,
            reasons=reasons,
            device=device,
        )


def _centers_reason(caps: CenterCaps) -> str:
    """The ``reasons["n_centers"]`` line: the three caps, the rate behind the time cap."""
    reference = f"{MAX_CENTERS:,} centers at {REFERENCE_FLOPS:.3g} flop/s"
    if caps.flops is None:
        timed = f"the time cap {MAX_CENTERS:,} (at the reference {REFERENCE_FLOPS:.3g} flop/s; {caps.describe_rate()})"
    else:
        timed = (
            f"the time cap {caps.time_cap:,}, the most whose M^3 setup takes at {caps.describe_rate()} no longer "
            f"than {reference} do (never fewer than {MAX_CENTERS:,})"
        )
    passes = (
        f"the passes cap {caps.passes_cap:,}, the most whose M^3 setup costs at most {SETUP_SHARE:g} of "
        f"FALKON's {FALKON_PASSES} passes over the n x M kernel matrix"
    )
    return (
        f"{caps.n_centers:,} centers: at most {caps.memory_cap:,} ({_SQUARE_ARRAYS} float64 M x M arrays in "
        f"kgp.settings.memory_budget) and at most the larger of {timed} and {passes}; the variance sums "
        f"K_Mn K_nM over at most max({GRAM_ROWS_PER_CENTER} M, {GRAM_MIN_ROWS:,}) rows, so its cost does not "
        "grow with n"
    )
