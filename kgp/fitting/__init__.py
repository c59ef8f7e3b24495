"""The fit path: resolve once into a plan, then three stages, then one Posterior.

:func:`fit_model` (:mod:`.fit`) is the whole fit, from the estimator's parameters and converted rows to a
:class:`ModelFit`; inside it::

    plan = resolve_plan(params, shape)             # plugins, validated options, capabilities (no data work)
    centers = select_centers(plan, rows, kernel)   # stage 1 (None when no plugin uses centers)
    learned = learn(plan, rows, kernel, centers)   # stage 2 (the fixed hyperparameters when learn=None)
    result = solve(plan, rows, kernel, centers, learned)  # stage 3, ending in a kgp.Posterior

Each stage receives the plan and the previous stage's result (docs/architecture.md). ``rows`` is a
:class:`~kgp.fitting.rows.TrainingRows`: the training inputs and targets with their communicator, which
does nothing in a single process and holds the collectives in a distributed fit.
"""

from .fit import ModelFit, fit_chunk, fit_model, learn_only
from .plan import FitPlan, PluginChoice, RandomStreams, resolve_plan
from .rows import LocalComm, TrainingRows
from .stages import FitHyperparameters, FitResult, learn, run, select_centers, solve

__all__ = [
    "FitPlan",
    "FitResult",
    "FitHyperparameters",
    "LocalComm",
    "ModelFit",
    "PluginChoice",
    "RandomStreams",
    "TrainingRows",
    "fit_chunk",
    "fit_model",
    "learn",
    "learn_only",
    "resolve_plan",
    "run",
    "select_centers",
    "solve",
]
