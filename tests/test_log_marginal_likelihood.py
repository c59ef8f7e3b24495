"""log_marginal_likelihood_value_ against scikit-learn's GaussianProcessRegressor at the same hyperparameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kgp

sklearn_gp = pytest.importorskip("sklearn.gaussian_process")
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel  # noqa: E402


def _data(n=200, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = np.sin(2 * X[:, 0]) + 0.5 * X[:, 1] + 0.1 * rng.normal(size=n)
    return X, y


def _sklearn_lml(model: kgp.KernelRegressor, X: np.ndarray, y: np.ndarray) -> float:
    """scikit-learn's log marginal likelihood of the same GP: ScaleKernel(RBF) + noise, targets minus the mean."""
    ls = model.kernel_.base_kernel.lengthscale.detach().double().numpy().ravel()
    scale = float(model.kernel_.outputscale.detach())
    kernel = ConstantKernel(scale, "fixed") * RBF(ls, "fixed") + WhiteKernel(model.noise_, "fixed")
    gp = sklearn_gp.GaussianProcessRegressor(kernel, optimizer=None, alpha=0.0, normalize_y=False)
    gp.fit(X, y - float(model.mean_[0]))
    return float(gp.log_marginal_likelihood_value_)


@pytest.mark.parametrize("ard", [False, True])
def test_exact_objective_matches_sklearn(ard):
    X, y = _data()
    model = kgp.KernelRegressor(
        "rbf",
        ard=ard,
        learn="exact",
        solver="exact",
        normalize_y=False,
        normalize_X=False,
        dtype=torch.float64,
        learn_options={"iterations": 30},
    ).fit(X, y)
    expected = _sklearn_lml(model, X, y)
    # float64 Cholesky of a 200 x 200 matrix: both sides agree to a few hundred eps of the total
    assert model.log_marginal_likelihood_value_ == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert model.learn_summary_["likelihood_terms"] == 200


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")
def test_subset_covers_the_subset_rows_only():
    X, y = _data(n=400)
    model = kgp.KernelRegressor(
        "rbf", learn="exact", solver="exact", learn_options={"subset": 150, "iterations": 10}, dtype=torch.float64
    ).fit(X, y)
    assert model.learn_summary_["likelihood_terms"] == 150
    assert model.log_marginal_likelihood_value_ == pytest.approx(-model.learn_summary_["best_value"] * 150)


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")
def test_sgpr_bound_is_below_the_exact_value():
    X, y = _data()
    options = {"iterations": 20}
    bound = kgp.KernelRegressor(
        "rbf",
        learn="sgpr",
        n_centers=20,
        normalize_y=False,
        normalize_X=False,
        learn_options=options,
        dtype=torch.float64,
        random_state=0,
    ).fit(X, y)
    # the collapsed bound (Titsias 2009, eq. 9) never exceeds the exact likelihood at the same point
    assert bound.log_marginal_likelihood_value_ < _sklearn_lml(bound, X, y)


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")
def test_none_without_a_likelihood():
    X, y = _data(n=200)
    assert kgp.KernelRegressor("rbf", solver="exact").fit(X, y).log_marginal_likelihood_value_ is None
    holdout = kgp.KernelRegressor("rbf", learn="holdout", solver="exact", learn_options={"iterations": 5})
    assert holdout.fit(X, y).log_marginal_likelihood_value_ is None
    refit = kgp.KernelRegressor(
        "rbf", learn="exact", solver="exact", learn_options={"iterations": 5, "refit_subset": 100}
    ).fit(X, y)
    assert refit.log_marginal_likelihood_value_ is None


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")
def test_kept_by_save_and_load(tmp_path):
    X, y = _data(n=120)
    model = kgp.KernelRegressor("rbf", learn="exact", solver="exact", learn_options={"iterations": 5}).fit(X, y)
    path = tmp_path / "m.kgp"
    model.save(path)
    loaded = kgp.load(path)
    assert loaded.log_marginal_likelihood_value_ == model.log_marginal_likelihood_value_
    assert loaded.learn_summary_ == model.learn_summary_


@pytest.mark.filterwarnings("ignore::kgp.ConvergenceWarning")
def test_the_refine_stage_is_kept_by_save_and_load(tmp_path):
    X, y = _data(n=120)
    options = {"iterations": 5, "subset": 60, "refine_subset": 100, "refine_iterations": 4}
    model = kgp.KernelRegressor("rbf", learn="exact", solver="exact", learn_options=options).fit(X, y)
    assert model.learn_summary_["refine"]["subset"] == 100
    model.save(tmp_path / "m.kgp")
    loaded = kgp.load(tmp_path / "m.kgp")
    assert loaded.learn_summary_ == model.learn_summary_
    assert loaded.log_marginal_likelihood_value_ == model.log_marginal_likelihood_value_


def test_unfitted_raises():
    with pytest.raises(kgp.NotFittedError):
        _ = kgp.KernelRegressor("rbf").log_marginal_likelihood_value_


@pytest.mark.parametrize(
    "summary, where",
    [
        ("text", "fitted.learning.summary must be a dict"),
        ({"log_marginal_likelihood": "big"}, "fitted.learning.summary.log_marginal_likelihood must be int or float"),
        ({"likelihood_terms": True}, "fitted.learning.summary.likelihood_terms must be int"),
        ({"surprise": 1}, "fitted.learning.summary.surprise is not an entry kgp writes"),
        ({"refine": [1]}, "fitted.learning.summary.refine must be dict"),
        ({"refine": {"subset": 2.5}}, "fitted.learning.summary.refine.subset must be int"),
        ({"refine": {"rows": 1}}, "fitted.learning.summary.refine.rows is not an entry kgp writes"),
    ],
)
def test_a_forged_summary_is_a_model_file_error(tmp_path, summary, where):
    from kgp import io

    X, y = _data(n=120)
    model = kgp.KernelRegressor("rbf", learn="exact", solver="exact", learn_options={"iterations": 5}).fit(X, y)
    model.save(tmp_path / "m.kgp")
    state = torch.load(tmp_path / "m.kgp", weights_only=True)
    state["fitted"]["learning"]["summary"] = summary
    body = {k: v for k, v in state.items() if k not in ("format", "format_version", "checksum")}
    io.write_model(body, tmp_path / "forged.kgp")  # a fresh checksum: a deliberate forgery
    with pytest.raises(kgp.ModelFileError, match=where.replace(".", r"\.")):
        kgp.load(tmp_path / "forged.kgp")
