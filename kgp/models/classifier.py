"""One-vs-all kernel classification on +-1 targets (as in the FALKON experiments)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .. import distributed as _dist
from .base import BaseKernelModel
from .regressor import as_numpy

__all__ = ["KernelClassifier"]


def _error_rate(pred: Tensor, target: Tensor) -> float:
    if target.shape[1] == 1:
        return float(((pred[:, 0] > 0) != (target[:, 0] > 0)).double().mean())
    return float((pred.argmax(1) != target.argmax(1)).double().mean())


class KernelClassifier(BaseKernelModel):
    """Kernel classifier: one regression per class on +-1 targets, predict by the largest score.

    Two classes use a single output (+1 for ``classes_[1]``, -1 for ``classes_[0]``) and predict
    by its sign. Parameters are those of :class:`kgp.KernelRegressor`.

    Attributes
    ----------
    classes_:
        Sorted class labels (numpy array).
    predictor_, solver_, kernel_, centers_, history_, fit_time_, seed_, n_features_in_, feature_names_in_:
        As for :class:`kgp.KernelRegressor`. The validation metric reported to the callback
        is the error rate.
    """

    _estimator_type = "classifier"
    _validation_metric = staticmethod(_error_rate)

    def fit(self, X, y, *, validation_data=None, distributed=False) -> KernelClassifier:
        """Fit on ``X`` (n x d) and 1-D labels ``y`` (any sortable values).

        Parameters
        ----------
        validation_data:
            Optional ``(X_val, y_val)``; iterative solvers then report the validation error rate
            to the callback after every iteration (in a distributed fit: of all ranks' validation
            rows together).
        distributed:
            ``True`` or a ``torch.distributed`` ProcessGroup: ``X``, ``y`` are this rank's rows and
            every rank gets the model of all ranks' rows (docs/scaling-out.md). The classes are
            those of all ranks' labels (a rank may lack some classes, or hold no rows). Default False.

        Returns
        -------
        self
        """
        return super().fit(X, y, validation_data=validation_data, distributed=distributed)

    def _encode_fit_targets(self, y, X: Tensor) -> tuple[Tensor, dict]:
        labels = _labels(y, "y")
        classes = np.unique(labels)
        if classes.shape[0] < 2:
            raise ValueError(f"y: expected at least 2 classes, got 1 class ({classes[0]!r})")
        return _one_vs_all(labels, classes).to(device=X.device, dtype=X.dtype), {"classes_": classes}

    def _encode_sharded_targets(self, y, X: Tensor, channel) -> tuple[Tensor, dict]:
        # the class set of all ranks' labels: each rank's distinct labels, gathered
        labels = _labels(y, "y", allow_empty=X.shape[0] == 0)
        per_rank = _dist.gather_objects(channel, np.unique(labels))
        # numpy would turn numbers into strings when joining them with string labels: refuse instead
        kinds = {_label_kind(c) for c in per_rank if c.size}
        if len(kinds) > 1:
            found = ", ".join(f"rank {r}: {c.dtype}" for r, c in enumerate(per_rank) if c.size)
            raise ValueError(f"y: the ranks' class labels are of different kinds ({found}); use one label type")
        try:
            classes = np.unique(np.concatenate([c for c in per_rank if c.size]))
        except TypeError:
            kinds = ", ".join(f"rank {r}: {c.dtype}" for r, c in enumerate(per_rank))
            raise ValueError(f"y: the ranks' class labels are not mutually comparable ({kinds})") from None
        if classes.shape[0] < 2:
            raise ValueError(f"y: expected at least 2 classes over all ranks, got {classes.shape[0]}")
        return _one_vs_all(labels, classes).to(device=X.device, dtype=X.dtype), {"classes_": classes}

    def _encode_targets(self, y, name: str, X: Tensor, targets: dict) -> Tensor:
        labels = _labels(y, name)
        unknown = np.setdiff1d(labels, targets["classes_"])
        if unknown.size:
            raise ValueError(f"{name}: labels {unknown[:5].tolist()} were not seen in y")
        return _one_vs_all(labels, targets["classes_"]).to(device=X.device, dtype=X.dtype)

    def _target_state(self) -> dict:
        return {"classes": self.classes_.tolist()}

    @classmethod
    def _targets_from_state(cls, state: dict) -> dict:
        return {"classes_": np.asarray(state["classes"])}

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

    def predict_proba(self, X) -> np.ndarray:
        r"""Class probabilities, ``n x n_classes`` (columns in the order of ``classes_``).

        The softmax of the one-vs-all scores, :math:`p_k(x) = e^{f_k(x)} / \sum_j e^{f_j(x)}`; with
        two classes the single score :math:`f` stands for the pair :math:`(-f, f)`, so that
        :math:`p_1 = 1 / (1 + e^{-2f})`.

        Why this map: a least-squares fit to +-1 targets estimates the regression function
        :math:`f_k = E[y_k | x] = 2 P(k | x) - 1`, i.e. :math:`P(k|x) \approx (1 + f_k) / 2`.
        That estimate leaves [0, 1] and does not sum to one; the softmax is the smooth map that
        agrees with it to first order at the decision boundary (slope 1/2 at :math:`f = 0` for two
        classes), keeps every probability strictly inside (0, 1) (so ``log_loss`` is finite) and is
        strictly increasing in each score, so ``predict_proba(X).argmax(1)`` matches ``predict`` and
        its ranking matches ``decision_function``. It is fitted to nothing: the probabilities are
        not calibrated. For calibrated probabilities wrap the model in scikit-learn's
        ``CalibratedClassifierCV``, which fits a calibration map on held-out folds.
        """
        scores, _ = self._raw_predict(X)
        return _softmax_of_scores(scores).cpu().numpy()

    def predict_log_proba(self, X) -> np.ndarray:
        """Logarithm of :meth:`predict_proba`, computed stably (log-softmax)."""
        scores, _ = self._raw_predict(X)
        return torch.log_softmax(_paired(scores).double(), dim=1).cpu().numpy()

    def score(self, X, y) -> float:
        """Accuracy."""
        return float(np.mean(self.predict(X) == _labels(y, "y")))


def _label_kind(labels: np.ndarray) -> str:
    """``"number"``, ``"text"`` or ``"object"``: label arrays of one kind can be joined without conversion."""
    if labels.dtype.kind in "biuf":
        return "number"
    return "text" if labels.dtype.kind in "US" else "object"


def _paired(scores: Tensor) -> Tensor:
    """One score column per class: a single two-class score ``f`` becomes ``(-f, f)``."""
    return torch.cat([-scores, scores], dim=1) if scores.shape[1] == 1 else scores


def _softmax_of_scores(scores: Tensor) -> Tensor:
    return torch.softmax(_paired(scores).double(), dim=1)


def _labels(y, name: str, allow_empty: bool = False) -> np.ndarray:
    """Check class labels: 1-D, non-empty (unless ``allow_empty``: a rank without rows), discrete
    (not continuous floats), mutually sortable."""
    if y is None:
        raise ValueError(f"{name}: Expected array-like (array or non-string sequence), got None")
    arr = as_numpy(y)
    if arr.ndim == 2 and arr.shape[1] == 1:
        raise ValueError(f"{name}: expected 1-D class labels, got a column of shape {arr.shape}; use y.ravel()")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected 1-D class labels, got shape {arr.shape}")
    if arr.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{name}: expected a non-empty array")
    if arr.dtype.kind == "c":
        raise ValueError(f"{name}: complex class labels are not supported")
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise ValueError(f"{name}: contains NaN or infinite labels")
        if not np.array_equal(arr, np.round(arr)):
            # scikit-learn's wording ("Unknown label type"): continuous targets are a regression problem
            raise ValueError(
                f"{name}: Unknown label type: continuous values (e.g. {arr[arr != np.round(arr)][0]!r}); "
                "KernelClassifier needs class labels; use KernelRegressor for continuous targets"
            )
    if arr.dtype.kind == "O":
        kinds = sorted({type(v).__name__ for v in arr})
        if any(v is None for v in arr):
            raise ValueError(f"{name}: contains None; every sample needs a class label")
        try:
            np.unique(arr)
        except TypeError:
            raise ValueError(
                f"{name}: class labels must be mutually comparable (all numbers or all strings), got types "
                f"{', '.join(kinds)}"
            ) from None
    return arr


def _one_vs_all(labels: np.ndarray, classes: np.ndarray) -> Tensor:
    """+-1 targets: one column (+1 for ``classes[1]``) for two classes, one column per class otherwise."""
    index = np.searchsorted(classes, labels)
    if len(classes) == 2:
        return torch.from_numpy(np.where(index == 1, 1.0, -1.0)[:, None])
    Y = -np.ones((labels.shape[0], len(classes)))
    Y[np.arange(labels.shape[0]), index] = 1.0
    return torch.from_numpy(Y)
