"""One-vs-all kernel classification on +-1 targets (as in the FALKON experiments)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .base import BaseKernelModel
from .regressor import _numpy

__all__ = ["KernelClassifier"]


class KernelClassifier(BaseKernelModel):
    """Kernel classifier: one regression per class on +-1 targets, predict by the largest score.

    Two classes use a single output (+1 for ``classes_[1]``, -1 for ``classes_[0]``) and predict
    by its sign. Parameters are those of :class:`kgp.KernelRegressor`.

    Attributes
    ----------
    classes_:
        Sorted class labels (numpy array).
    predictor_, solver_, kernel_, centers_, history_, fit_time_, seed_, n_features_in_:
        As for :class:`kgp.KernelRegressor`. The validation metric reported to the callback
        is the error rate.
    """

    def fit(self, X, y, *, validation_data=None) -> KernelClassifier:
        """Fit on ``X`` (n x d) and 1-D labels ``y`` (any sortable values)."""
        _, _, dtype, device = self._check_params()
        Xt = self._prepare_inputs(X, np.zeros(_len(X)), dtype, device)[0]
        labels = _labels(y, "y")
        if labels.shape[0] != Xt.shape[0]:
            raise ValueError(f"X and y: expected the same number of samples, got {Xt.shape[0]} and {labels.shape[0]}")
        classes = np.unique(labels)
        if classes.shape[0] < 2:
            raise ValueError(f"y: expected at least 2 classes, got {classes.shape[0]}")
        self.classes_ = classes
        Y = self._encode(labels).to(device=Xt.device, dtype=Xt.dtype)
        validation = None
        if validation_data is not None:
            if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
                raise ValueError("validation_data: expected a pair (X_val, y_val)")
            Xv = self._prepare_inputs(validation_data[0], np.zeros(_len(validation_data[0])), Xt.dtype, Xt.device)[0]
            validation = (Xv, self._encode(_labels(validation_data[1], "y_val")).to(Xt))
        self._fit_targets(Xt, Y, dtype, device, validation, _error_rate)
        return self

    def _encode(self, labels: np.ndarray) -> Tensor:
        unknown = np.setdiff1d(labels, self.classes_)
        if unknown.size:
            raise ValueError(f"y_val: labels {unknown[:5].tolist()} were not seen in y")
        index = np.searchsorted(self.classes_, labels)
        if len(self.classes_) == 2:
            return torch.from_numpy(np.where(index == 1, 1.0, -1.0)[:, None])
        Y = -np.ones((labels.shape[0], len(self.classes_)))
        Y[np.arange(labels.shape[0]), index] = 1.0
        return torch.from_numpy(Y)

    def decision_function(self, X):
        """Scores: ``n`` values for two classes, ``n x n_classes`` otherwise (numpy or tensor like X)."""
        out, numpy_out = self._raw_predict(X)
        if out.shape[1] == 1:
            out = out[:, 0]
        return out.cpu().numpy() if numpy_out else out

    def predict(self, X) -> np.ndarray:
        """Predicted class labels (numpy array of ``classes_`` values)."""
        scores, _ = self._raw_predict(X)
        if scores.shape[1] == 1:
            index = (scores[:, 0] > 0).long()
        else:
            index = scores.argmax(dim=1)
        return self.classes_[index.cpu().numpy()]

    def score(self, X, y) -> float:
        """Accuracy."""
        return float(np.mean(self.predict(X) == _labels(y, "y")))


def _labels(y, name: str) -> np.ndarray:
    arr = _numpy(y)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected 1-D class labels, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError(f"{name}: expected a non-empty array")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError(f"{name}: contains NaN or infinite labels")
    return arr


def _len(X) -> int:
    try:
        return len(X)
    except TypeError as exc:
        raise TypeError(f"X: expected an array or tensor, got {type(X).__name__}") from exc


def _error_rate(pred: Tensor, target: Tensor) -> float:
    if target.shape[1] == 1:
        return float(((pred[:, 0] > 0) != (target[:, 0] > 0)).double().mean())
    return float((pred.argmax(1) != target.argmax(1)).double().mean())
