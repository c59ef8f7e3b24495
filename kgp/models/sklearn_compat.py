"""scikit-learn's protocol for third-party estimators, without importing scikit-learn.

scikit-learn finds out what an estimator is and accepts through duck typing: ``get_params`` /
``set_params`` (in :class:`kgp.models.base.BaseKernelModel`), ``__sklearn_tags__`` (scikit-learn
>= 1.6; it is only called by scikit-learn, so it imports scikit-learn lazily), ``_more_tags`` and
``_estimator_type`` (older versions), ``__sklearn_is_fitted__``, ``n_features_in_`` and
``feature_names_in_``. ``import kgp`` therefore never needs scikit-learn.

Feature names follow scikit-learn's rules: a table with string column names (a pandas
DataFrame) given to ``fit`` sets ``feature_names_in_``; later calls with a table must have the
same names in the same order (ValueError listing what differs); a plain array after a table, or
a table after a plain array, warns (the columns are taken by position).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

__all__ = ["SklearnProtocol", "feature_names_of"]


def feature_names_of(X: Any) -> np.ndarray | None:
    """Column names of a table-like ``X`` (``X.columns``) as an object array, or None.

    Only all-string names count (scikit-learn's rule): integer column labels, as in
    ``pd.DataFrame(array)``, are positions rather than names.
    """
    columns = getattr(X, "columns", None)
    if columns is None or not hasattr(X, "shape") or len(getattr(X, "shape", ())) != 2:
        return None
    names = np.asarray(list(columns), dtype=object)
    if names.size == 0 or not all(isinstance(name, str) for name in names):
        return None
    return names


def _listed(names) -> str:
    shown = [f"- {name}\n" for name in list(names)[:5]]
    return "".join(shown) + ("- ...\n" if len(names) > 5 else "")


class SklearnProtocol:
    """Mixin of :class:`kgp.KernelRegressor` / :class:`kgp.KernelClassifier`: tags, fitted check, feature names."""

    _estimator_type: str  # "regressor" or "classifier" (scikit-learn < 1.6 reads this attribute)

    def __sklearn_tags__(self):
        """Tags for scikit-learn >= 1.6 (called by scikit-learn only, so importing it here is safe)."""
        from sklearn.utils import ClassifierTags, InputTags, RegressorTags, Tags, TargetTags

        regressor = self._estimator_type == "regressor"
        return Tags(
            estimator_type=self._estimator_type,
            target_tags=TargetTags(required=True, multi_output=regressor, single_output=True),
            classifier_tags=None if regressor else ClassifierTags(multi_class=True, multi_label=False),
            regressor_tags=RegressorTags() if regressor else None,
            # a seed is drawn per fit unless random_state is set (scikit-learn's checks set it)
            non_deterministic=False,
            requires_fit=True,
            input_tags=InputTags(two_d_array=True, sparse=False, allow_nan=False),
        )

    def _more_tags(self) -> dict[str, Any]:
        """Tags for scikit-learn < 1.6 (same content as :meth:`__sklearn_tags__`)."""
        return {
            "multioutput": self._estimator_type == "regressor",
            "requires_y": True,
            "allow_nan": False,
            "requires_fit": True,
        }

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "predictor_")

    def _check_feature_names(self, X: Any, *, argument: str = "X") -> None:
        """Compare the column names of ``X`` with ``feature_names_in_`` (scikit-learn's wording)."""
        fitted = getattr(self, "feature_names_in_", None)
        given = feature_names_of(X)
        name = type(self).__name__
        if fitted is None and given is None:
            return
        if fitted is None:
            warnings.warn(
                f"{argument} has feature names, but {name} was fitted without feature names; "
                "columns are taken by position",
                UserWarning,
                stacklevel=3,
            )
            return
        if given is None:
            warnings.warn(
                f"{argument} does not have valid feature names, but {name} was fitted with feature names; "
                "columns are taken by position",
                UserWarning,
                stacklevel=3,
            )
            return
        if len(given) == len(fitted) and (given == fitted).all():
            return
        unseen = sorted(set(given) - set(fitted))
        missing = sorted(set(fitted) - set(given))
        message = "The feature names should match those that were passed during fit.\n"
        if unseen:
            message += "Feature names unseen at fit time:\n" + _listed(unseen)
        if missing:
            message += "Feature names seen at fit time, yet now missing:\n" + _listed(missing)
        if not unseen and not missing:
            message += "Feature names must be in the same order as they were in fit.\n"
        raise ValueError(f"{argument}: {message}" if argument != "X" else message)


class solver_method:
    """Descriptor: the decorated estimator method exists only if the chosen solver implements it.

    scikit-learn (and any code using ``hasattr``) decides whether an estimator streams by looking
    for ``partial_fit``, as with scikit-learn's ``available_if``. With a solver that does not
    implement the method, looking it up raises an AttributeError that names the solver; with an
    unknown solver name the method is returned, and calling it reports the unknown name.
    """

    def __init__(self, method):
        self.method = method
        self.__doc__ = method.__doc__
        self.__name__ = method.__name__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.method
        from ..registry import registry

        if obj.solver == "auto":
            # the recipe picks a solver from the whole training set: never a streaming fit
            raise AttributeError(
                f"{type(obj).__name__}.{self.name}: solver='auto' does not stream; name a streaming solver "
                "(e.g. solver='dsg')"
            )
        try:
            capabilities = registry.get("solver", obj.solver).capabilities if isinstance(obj.solver, str) else None
        except Exception:  # noqa: BLE001 - an attribute lookup may raise only AttributeError; the call reports it
            capabilities = None
        if capabilities is not None and not capabilities.partial_fit:
            raise AttributeError(
                f"{type(obj).__name__}.{self.name}: solver {obj.solver!r} does not support {self.name}; "
                "choose a streaming solver (e.g. solver='dsg')"
            )
        return self.method.__get__(obj, owner)
