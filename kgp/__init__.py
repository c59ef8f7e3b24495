"""kgp: large-scale kernel methods and GP posterior-mean regression with pluggable solvers.

Quick start::

    import kgp
    model = kgp.KernelRegressor(kernel="rbf", lengthscale=1.0, noise=1e-2, solver="exact")
    model.fit(X, y).predict(X_test)

Solvers, center selectors and hyperparameter objectives are plugins picked by name (``kgp plugins``
lists them); see :mod:`kgp.hookspecs` and docs/plugin-author-guide.md for the plugin contract.
"""

# datasets (numpy only) and plot (matplotlib imported on first use) cost nothing at import
from . import datasets, plot, settings
from ._version import __version__
from .capabilities import Capabilities
from .diagnostics import ConvergenceWarning, DivergenceError, IllConditionedError, NotFittedError
from .hookspecs import hookimpl
from .interop import from_gpytorch
from .models import KernelClassifier, KernelRegressor, ModelFileError, load
from .monitor import IterationInfo, Monitor
from .operators import KernelOperator, kernel_operator

# merge_options: transitional, no part of the API (not in __all__): kgp_builtins/objectives still call
# kgp.merge_options in prepare(); drop it from this line when the learning branch removes those calls.
from .options import Option, resolve_options
from .options import merge_options as merge_options
from .plugin import Centers, Problem, SelectionRequest, default_n_centers
from .predictors import KernelExpansion
from .registry import get_selector, get_solver, list_plugins, register, unregister
from .safeguards import AccuracyWarning, CostWarning, InsufficientMemoryError

__all__ = [
    "AccuracyWarning",
    "Capabilities",
    "Centers",
    "ConvergenceWarning",
    "CostWarning",
    "DivergenceError",
    "IllConditionedError",
    "InsufficientMemoryError",
    "IterationInfo",
    "KernelClassifier",
    "KernelExpansion",
    "KernelOperator",
    "KernelRegressor",
    "ModelFileError",
    "Monitor",
    "NotFittedError",
    "Option",
    "Problem",
    "SelectionRequest",
    "__version__",
    "datasets",
    "default_n_centers",
    "from_gpytorch",
    "get_selector",
    "get_solver",
    "hookimpl",
    "kernel_operator",
    "list_plugins",
    "load",
    "plot",
    "register",
    "resolve_options",
    "settings",
    "unregister",
]
