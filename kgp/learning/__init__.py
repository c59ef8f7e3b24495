"""Hyperparameter learning: kgp's optimisation loop around objective plugins.

An objective plugin (hook ``register_objectives``, e.g. the built-ins ``exact`` and ``sgpr``) turns a
:class:`LearningProblem` into a differentiable loss per data point (an :class:`ObjectiveLoss`);
:func:`learn_hyperparameters` minimises it with torch.optim over the kernel's GPyTorch raw parameters,
the raw noise and a constant mean. ``KernelRegressor(learn=NAME)`` calls it before solving.
"""

from .loop import LEARN_OPTIONS, LearnResult, learn_hyperparameters
from .problem import LearningProblem, ObjectiveLoss

__all__ = ["LEARN_OPTIONS", "LearnResult", "LearningProblem", "ObjectiveLoss", "learn_hyperparameters"]
