"""scikit-learn compatibility: its own estimator checks, tags, clone, feature names, and the
model-selection tools on real data."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

sklearn = pytest.importorskip("sklearn", reason="scikit-learn compatibility tests need scikit-learn")

from sklearn.base import clone, is_classifier, is_regressor  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

import kgp  # noqa: E402

# Checks that cannot apply, each with the reason (scikit-learn's documented way to declare them).
_REGRESSOR_XFAIL: dict[str, str] = {}
_CLASSIFIER_XFAIL: dict[str, str] = {
    "check_supervised_y_2d": "a column-vector y is refused with a ValueError (use y.ravel()) instead of being "
    "raveled with a DataConversionWarning: kgp never coerces input silently",
}


def _expected_failed(estimator) -> dict[str, str]:
    return _CLASSIFIER_XFAIL if is_classifier(estimator) else _REGRESSOR_XFAIL


# kgp deliberately does not inherit from sklearn.base.BaseEstimator (no hard dependency); scikit-learn
# warns about that when the checks are generated (at collection), which is expected here.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Estimator .* does not inherit from `sklearn.base.BaseEstimator`")
    _with_checks = parametrize_with_checks(
        [
            kgp.KernelRegressor(lengthscale=1.0, noise=1e-2, random_state=0),
            kgp.KernelClassifier(lengthscale=1.0, noise=1e-2, random_state=0),
        ],
        expected_failed_checks=_expected_failed,
    )


@_with_checks
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


def test_import_kgp_does_not_import_sklearn():
    import subprocess
    import sys

    code = "import sys, kgp; kgp.KernelRegressor().get_params(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tags_clone_and_type_predicates():
    from sklearn.utils import get_tags

    reg = kgp.KernelRegressor(noise=0.1, solver="falkon", n_centers=50, solver_options={"maxiter": 5})
    clf = kgp.KernelClassifier(noise=0.1)
    assert is_regressor(reg) and not is_classifier(reg)
    assert is_classifier(clf) and not is_regressor(clf)
    assert get_tags(reg).target_tags.multi_output and not get_tags(clf).target_tags.multi_output
    copy = clone(reg)
    assert copy is not reg and copy.get_params() == reg.get_params()
    assert copy.solver_options is not reg.solver_options  # clone deep-copies plain parameters
    # old-style protocol for scikit-learn < 1.6
    assert reg._estimator_type == "regressor" and clf._more_tags()["multioutput"] is False


def test_partial_fit_exists_only_for_streaming_solvers():
    assert not hasattr(kgp.KernelRegressor(solver="exact"), "partial_fit")
    assert hasattr(kgp.KernelRegressor(solver="dsg"), "partial_fit")
    with pytest.raises(AttributeError, match="solver 'exact' does not support partial_fit"):
        getattr(kgp.KernelRegressor(solver="exact"), "partial_fit")  # noqa: B009


def test_not_fitted_error_is_sklearns():
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError, match="not fitted"):
        kgp.KernelRegressor().predict(np.zeros((2, 2)))
    with pytest.raises(kgp.NotFittedError):
        kgp.KernelClassifier().predict_proba(np.zeros((2, 2)))


# ---------------------------------------------------------------------- feature names (pandas)
def test_feature_names_from_a_dataframe(tmp_path):
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)
    X = pd.DataFrame(rng.normal(size=(60, 3)), columns=["a", "b", "c"])
    y = np.sin(X["a"].to_numpy()) + X["b"].to_numpy()
    model = kgp.KernelRegressor(noise=0.1).fit(X, y)
    assert model.feature_names_in_.dtype == object and model.feature_names_in_.tolist() == ["a", "b", "c"]
    with pytest.warns(UserWarning, match="columns are taken by position"):
        by_position = model.predict(X.to_numpy())
    np.testing.assert_allclose(model.predict(X), by_position, rtol=0, atol=0)
    with pytest.raises(ValueError, match="same order as they were in fit"):
        model.predict(X[["b", "a", "c"]])
    with pytest.raises(ValueError, match="seen at fit time, yet now missing:\n- c"):
        model.predict(X[["a", "b"]])
    with pytest.raises(ValueError, match="unseen at fit time:\n- d"):
        model.predict(X.rename(columns={"c": "d"}))
    with pytest.warns(UserWarning, match="does not have valid feature names"):
        model.predict(X.to_numpy())
    model.save(tmp_path / "m.pt")
    loaded = kgp.load(tmp_path / "m.pt")
    assert loaded.feature_names_in_.tolist() == ["a", "b", "c"]
    with pytest.raises(ValueError, match="same order"):
        loaded.predict(X[["c", "b", "a"]])
    # refitting on an array forgets the names
    assert not hasattr(model.fit(X.to_numpy(), y), "feature_names_in_")


# ---------------------------------------------------------------------- model selection on real data
def _concrete(shared_data, n=400):
    z = np.load(shared_data / "concrete.npz")
    return z["X"][:n], z["y"][:n]


def test_pipeline_cross_val_score_matches_kernel_ridge(shared_data):
    """Oracle: scikit-learn's KernelRidge(alpha=noise, rbf, gamma=1/(2 l^2)) is the exact solver's model."""
    from sklearn.kernel_ridge import KernelRidge
    from sklearn.model_selection import KFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X, y = _concrete(shared_data)
    y = (y - y.mean()) / y.std()
    cv = KFold(4, shuffle=True, random_state=0)
    model = make_pipeline(StandardScaler(), kgp.KernelRegressor(lengthscale=2.0, noise=0.1))
    oracle = make_pipeline(StandardScaler(), KernelRidge(alpha=0.1, kernel="rbf", gamma=1 / 8))
    ours = cross_val_score(model, X, y, cv=cv)
    ref = cross_val_score(oracle, X, y, cv=cv)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-8)
    assert ours.mean() > 0.7  # concrete, 400 rows: a real fit, not a constant


def test_grid_search_picks_what_kernel_ridge_picks(shared_data):
    from sklearn.kernel_ridge import KernelRidge
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    X, y = _concrete(shared_data)
    y = (y - y.mean()) / y.std()
    ours = GridSearchCV(
        Pipeline([("scale", StandardScaler()), ("model", kgp.KernelRegressor())]),
        {"model__lengthscale": [1.0, 2.0, 4.0], "model__noise": [1e-2, 1e-1]},
        cv=3,
    ).fit(X, y)
    ref = GridSearchCV(
        Pipeline([("scale", StandardScaler()), ("model", KernelRidge(kernel="rbf"))]),
        {"model__gamma": [1 / 2, 1 / 8, 1 / 32], "model__alpha": [1e-2, 1e-1]},
        cv=3,
    ).fit(X, y)
    ours_scores = {
        (p["model__lengthscale"], p["model__noise"]): s
        for p, s in zip(ours.cv_results_["params"], ours.cv_results_["mean_test_score"])
    }
    ref_scores = {
        ((1 / (2 * p["model__gamma"])) ** 0.5, p["model__alpha"]): s
        for p, s in zip(ref.cv_results_["params"], ref.cv_results_["mean_test_score"])
    }
    assert np.isfinite(list(ours_scores.values())).all() and ours_scores.keys() == ref_scores.keys()
    for key, value in ref_scores.items():
        np.testing.assert_allclose(ours_scores[key], value, rtol=1e-6)  # noise 1e-2: condition ~1e4
    assert ours.best_params_["model__lengthscale"] == (1 / (2 * ref.best_params_["model__gamma"])) ** 0.5
    assert ours.best_params_["model__noise"] == ref.best_params_["model__alpha"]


def test_randomized_search_with_an_iterative_solver(shared_data):
    from scipy.stats import loguniform
    from sklearn.model_selection import RandomizedSearchCV

    X, y = _concrete(shared_data)
    X = (X - X.mean(0)) / X.std(0)
    y = (y - y.mean()) / y.std()
    search = RandomizedSearchCV(
        kgp.KernelRegressor(solver="falkon", n_centers=100, random_state=0),
        {"lengthscale": loguniform(0.5, 5.0), "noise": loguniform(1e-3, 1.0)},
        n_iter=4,
        cv=3,
        random_state=0,
    ).fit(X, y)
    scores = search.cv_results_["mean_test_score"]
    assert np.isfinite(scores).all() and scores.max() > 0.3  # R^2 on 3 folds of 400 rows, M = 100
    # the refitted best model scores like a fresh fit with the best parameters
    fresh = kgp.KernelRegressor(solver="falkon", n_centers=100, random_state=0, **search.best_params_).fit(X, y)
    np.testing.assert_allclose(search.best_estimator_.predict(X), fresh.predict(X), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------- predict_proba on real data
def _penbased(shared_data, n=1200):
    z = np.load(shared_data / "penbased.npz")
    X = z["X"][:n].astype(np.float64)
    return (X - X.mean(0)) / X.std(0), z["y"][:n]


def test_predict_proba_is_the_softmax_of_the_scores_and_log_loss_works(shared_data):
    from sklearn.metrics import accuracy_score, log_loss
    from sklearn.model_selection import train_test_split

    X, y = _penbased(shared_data)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=0)
    model = kgp.KernelClassifier(lengthscale=3.0, noise=1.0).fit(Xtr, ytr)
    proba = model.predict_proba(Xte)
    scores = model.decision_function(Xte)
    expected = np.exp(scores) / np.exp(scores).sum(1, keepdims=True)  # closed form, eq. in the docstring
    np.testing.assert_allclose(proba, expected, rtol=1e-12)
    np.testing.assert_allclose(model.predict_log_proba(Xte), np.log(expected), rtol=1e-10)
    assert (model.classes_[proba.argmax(1)] == model.predict(Xte)).all()
    assert accuracy_score(yte, model.predict(Xte)) > 0.95
    loss = log_loss(yte, proba, labels=model.classes_)
    assert np.isfinite(loss) and loss < np.log(10)  # better than the uniform guess


def test_binary_predict_proba_and_calibrated_classifier(shared_data):
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.metrics import log_loss
    from sklearn.model_selection import train_test_split

    z = np.load(shared_data / "magic_gamma.npz")
    rows = np.random.default_rng(0).permutation(len(z["y"]))[:1500]  # the file is sorted by class
    X, y = z["X"][rows].astype(np.float64), z["y"][rows]
    X = (X - X.mean(0)) / X.std(0)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=0)
    model = kgp.KernelClassifier(lengthscale=2.0, noise=1.0).fit(Xtr, ytr)
    f = model.decision_function(Xte)
    proba = model.predict_proba(Xte)
    np.testing.assert_allclose(proba[:, 1], 1 / (1 + np.exp(-2 * f)), rtol=1e-12)
    assert model.classes_.tolist() == [-1, 1]
    calibrated = CalibratedClassifierCV(kgp.KernelClassifier(lengthscale=2.0, noise=1.0), cv=3).fit(Xtr, ytr)
    raw_loss = log_loss(yte, proba)
    cal_loss = log_loss(yte, calibrated.predict_proba(Xte))
    assert np.isfinite(raw_loss) and np.isfinite(cal_loss)
    assert cal_loss < raw_loss  # the softmax map is not calibrated; Platt scaling on held-out folds is


def test_classifier_label_errors():
    X = np.zeros((4, 2))
    with pytest.raises(ValueError, match="y: contains None"):
        kgp.KernelClassifier().fit(X, np.array([None, 1, None, 1], dtype=object))
    with pytest.raises(ValueError, match="mutually comparable"):
        kgp.KernelClassifier().fit(X, np.array(["a", 1, "a", 1], dtype=object))
    with pytest.raises(ValueError, match="Unknown label type: continuous"):
        kgp.KernelClassifier().fit(X, np.array([0.5, 1.0, 0.5, 2.0]))


def test_readme_lists_every_builtin_plugin():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Built-in plugins")[1].split("\n## ")[0]
    listed = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    builtins = {info.name for info in kgp.list_plugins() if info.distribution == "kgp"}
    assert builtins and listed == builtins
