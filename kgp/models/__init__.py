"""scikit-learn-style estimators, and :func:`load` for their saved files."""

from .classifier import KernelClassifier
from .loading import ModelFileError, load
from .regressor import KernelRegressor

__all__ = ["KernelClassifier", "KernelRegressor", "ModelFileError", "load"]
