"""Conformance kit for solver, center-selector and objective plugins.

Run it from a plugin's own test suite, either as a pytest base class::

    from kgp.testing import ObjectiveConformance, SelectorConformance, SolverConformance

    class TestMySolver(SolverConformance):
        solver_name = "my-solver"
        solver_options = {"maxiter": 50}
        rtol = 1e-4              # iterative: relative error allowed against the dense oracle
        iterative = True

    class TestMySelector(SelectorConformance):
        selector_name = "my-selector"
        solver = "falkon"                    # also fit a model on the chosen centers (in_model check)
        solver_options = {"maxiter": 50}     # ... with enough iterations to meet rtol

    class TestMyObjective(ObjectiveConformance):
        objective_name = "my-objective"
        oracle = "exact_nll"                 # what it computes (or a function computing it densely)

or as plain functions (every check raises ``AssertionError`` with the measured numbers)::

    from kgp.testing import check_objective, check_selector, check_solver

    check_solver("my-solver", solver_options={"maxiter": 50}, rtol=1e-4, iterative=True)

The kit calls each plugin as the model does: options resolved once by :func:`kgp.resolve_options`,
``fit`` / ``select`` under ``torch.no_grad()`` unless the plugin's capabilities declare
``needs_grad``. A solver's oracle follows its declared ``capabilities.target``: the exact GP
posterior mean ``K_t* (K + sigma^2 I)^-1 y`` for ``"exact"`` and ``"mean_only"`` (also for a solver
that uses centers only as a preconditioner), the Nystrom solution of
``(K_nM^T K_nM + sigma^2 K_MM) a = K_nM^T y`` at the same centers for ``"nystrom"``; both in float64
by GPyTorch's dense kernel evaluation, independent of kgp's backend.

Solver checks (:data:`SOLVER_CHECKS`; modules :mod:`.solver_checks`, :mod:`.solver_model_checks`):
``protocol`` (declarations; a registered predictor kind, ``n x k`` predictions in the input dtype, a
plain ``state_dict`` that ``from_state`` reproduces; inputs unmodified), ``oracle``, ``dtype``
(float32 and float64, tensor and numpy), ``device`` (CUDA or ``device=``), ``multi_output``,
``seed`` (randomness only through the generators), ``callback`` (``IterationInfo``, stopping),
``validation_metric``, ``unknown_option``, ``invalid_options``, ``save_load``, ``center_weights``
(weights D leave the target unchanged: Rudi et al. 2017, Appendix A, Def. 4) and ``partial_fit``.

Selector checks (:data:`SELECTOR_CHECKS`, :mod:`.selector_checks`): ``contract`` (a
:class:`kgp.Centers` of ``M x d`` finite points in X's dtype and device, positive weights, indices
with ``X[indices] == points``, for float32, float64 and ``n_centers=None``), ``distinct`` (no center
twice), ``data_rows`` (every center a row of X, when the selector promises it), ``seed``, ``device``,
``unknown_option``, ``invalid_options``, ``memory`` (no n x n tensor, nothing above the memory budget but
M x M or n x d) and ``in_model`` (a fit on the chosen centers matches the dense Nystrom solution).

Objective checks (:data:`OBJECTIVE_CHECKS`, :mod:`.objective_checks`): ``protocol`` (a finite 0-d
loss in the input dtype with gradients for the kernel's parameters, the noise and the mean),
``value`` (against a dense oracle, :mod:`.objective_oracles`), ``gradcheck``
(``torch.autograd.gradcheck`` in float64), ``seed``, ``unknown_option``, ``invalid_options``,
``memory`` (no n x n tensor above ``kgp.settings.max_exact_size``, nothing above the memory budget
but M x M, measured by :class:`LargestTensor`) and ``device``.

Tolerances are explicit parameters: exact solvers meet the float64 default (1e-6) with room to
spare; iterative and stochastic solvers set their own. The kit imports only kgp, torch, numpy and
GPyTorch; pytest collects the ``*Conformance`` classes (``pip install 'kgp[testing]'``).
"""

from __future__ import annotations

from .conformance import ObjectiveConformance, SelectorConformance, SolverConformance
from .memory import LargestTensor, check_objective_memory
from .objective_checks import (
    OBJECTIVE_CHECKS,
    check_objective,
    check_objective_device,
    check_objective_gradcheck,
    check_objective_invalid_options,
    check_objective_protocol,
    check_objective_seed,
    check_objective_unknown_option,
    check_objective_value,
)
from .objective_oracles import OBJECTIVE_ORACLES, exact_nll, objective_problem, sgpr_bound
from .oracles import (
    OracleData,
    OracleSpec,
    dense_nystrom_mean,
    dense_posterior_mean,
    make_oracle_data,
    relative_error,
    target_oracle,
)
from .selector_checks import (
    SELECTOR_CHECKS,
    check_selector,
    check_selector_contract,
    check_selector_data_rows,
    check_selector_device,
    check_selector_distinct,
    check_selector_in_model,
    check_selector_invalid_options,
    check_selector_memory,
    check_selector_seed,
    check_selector_unknown_option,
)
from .solver_checks import (
    check_solver_center_weights,
    check_solver_device,
    check_solver_dtype,
    check_solver_multi_output,
    check_solver_oracle,
    check_solver_partial_fit,
    check_solver_protocol,
)
from .solver_model_checks import (
    SOLVER_CHECKS,
    check_solver,
    check_solver_callback,
    check_solver_invalid_options,
    check_solver_save_load,
    check_solver_seed,
    check_solver_unknown_option,
    check_solver_validation_metric,
)
from .support import REPRO_RTOL, options_for

__all__ = [
    "LargestTensor",
    "OBJECTIVE_CHECKS",
    "OBJECTIVE_ORACLES",
    "ObjectiveConformance",
    "OracleData",
    "OracleSpec",
    "REPRO_RTOL",
    "SELECTOR_CHECKS",
    "SOLVER_CHECKS",
    "SelectorConformance",
    "SolverConformance",
    "check_objective",
    "check_objective_device",
    "check_objective_gradcheck",
    "check_objective_invalid_options",
    "check_objective_memory",
    "check_objective_protocol",
    "check_objective_seed",
    "check_objective_unknown_option",
    "check_objective_value",
    "check_selector",
    "check_selector_contract",
    "check_selector_data_rows",
    "check_selector_device",
    "check_selector_distinct",
    "check_selector_in_model",
    "check_selector_invalid_options",
    "check_selector_memory",
    "check_selector_seed",
    "check_selector_unknown_option",
    "check_solver",
    "check_solver_callback",
    "check_solver_center_weights",
    "check_solver_device",
    "check_solver_dtype",
    "check_solver_invalid_options",
    "check_solver_multi_output",
    "check_solver_oracle",
    "check_solver_partial_fit",
    "check_solver_protocol",
    "check_solver_save_load",
    "check_solver_seed",
    "check_solver_unknown_option",
    "check_solver_validation_metric",
    "dense_nystrom_mean",
    "dense_posterior_mean",
    "exact_nll",
    "make_oracle_data",
    "objective_problem",
    "options_for",
    "relative_error",
    "sgpr_bound",
    "target_oracle",
]
