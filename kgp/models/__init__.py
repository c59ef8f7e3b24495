"""scikit-learn-style estimators."""

from .classifier import KernelClassifier
from .regressor import KernelRegressor

__all__ = ["KernelClassifier", "KernelRegressor"]
