"""Model API: scikit-learn conventions, input kinds, bad input, save/load, classifier."""

import gpytorch
import numpy as np
import pytest
import torch

import kgp


def _data(n=120, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    return X, np.sin(X[:, 0]) + 0.5 * X[:, 1]


def test_constructor_only_stores_and_params_round_trip():
    kernel = gpytorch.kernels.RBFKernel()
    model = kgp.KernelRegressor(kernel, noise=0.3, solver="exact", solver_options={"a": 1})
    assert model.kernel is kernel and model.noise == 0.3 and model.solver_options == {"a": 1}
    assert not hasattr(model, "predictor_")  # nothing fitted, nothing validated yet
    params = model.get_params()
    assert params["noise"] == 0.3 and set(params) >= {"kernel", "solver", "centers", "n_centers", "random_state"}
    clone = kgp.KernelRegressor(**params)
    assert clone.get_params() == params
    assert model.set_params(noise=0.5) is model and model.noise == 0.5
    with pytest.raises(ValueError, match="invalid parameter 'nosie'"):
        model.set_params(nosie=1)


def test_fit_returns_self_and_sets_fitted_attributes():
    X, y = _data()
    model = kgp.KernelRegressor(noise=0.1, random_state=3)
    assert model.fit(X, y) is model
    assert isinstance(model.predictor_, kgp.KernelExpansion)
    assert model.solver_name_ == "exact" and model.centers_ is None and model.n_features_in_ == 3
    assert model.seed_ == 3 and model.fit_time_ > 0 and model.n_outputs_ == 1


def test_kernel_object_is_not_mutated_by_fit():
    kernel = gpytorch.kernels.RBFKernel()
    kernel.lengthscale = 0.7
    X, y = _data()
    model = kgp.KernelRegressor(kernel, noise=0.1).fit(X, y)
    assert model.kernel_ is not kernel
    assert kernel.lengthscale.dtype == torch.float32 and float(kernel.lengthscale.detach()) == pytest.approx(0.7)


def test_numpy_in_numpy_out_tensor_in_tensor_out():
    X, y = _data()
    model = kgp.KernelRegressor(noise=0.1).fit(X, y)
    out_np = model.predict(X[:5])
    assert isinstance(out_np, np.ndarray) and out_np.shape == (5,)
    out_t = model.predict(torch.as_tensor(X[:5]))
    assert isinstance(out_t, torch.Tensor) and out_t.shape == (5,)
    np.testing.assert_allclose(out_t.numpy(), out_np)
    tmodel = kgp.KernelRegressor(noise=0.1).fit(torch.as_tensor(X), torch.as_tensor(y))
    np.testing.assert_allclose(tmodel.predict(X[:5]), out_np, rtol=1e-12)
    Y2 = np.stack([y, -y], 1)
    assert kgp.KernelRegressor(noise=0.1).fit(X, Y2).predict(X[:4]).shape == (4, 2)


def test_score_is_r2():
    X, y = _data()
    model = kgp.KernelRegressor(noise=0.1).fit(X, y)
    pred = model.predict(X)
    r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    assert model.score(X, y) == pytest.approx(r2, rel=1e-12)


def test_explicit_dtype_and_integer_input():
    X, y = _data()
    model = kgp.KernelRegressor(noise=0.1, dtype="float32").fit(X, y)
    assert model.predict(X).dtype == np.float32
    Xi = np.round(X * 3).astype(np.int64)
    pred = kgp.KernelRegressor(noise=0.1).fit(Xi, y).predict(Xi)
    assert pred.dtype == np.float64  # integers become float64, documented


BAD_INPUTS = [
    (
        "nan in X",
        lambda X, y: (np.where(np.arange(X.size).reshape(X.shape) == 4, np.nan, X), y),
        ValueError,
        "X: contains 1 NaN",
    ),
    ("inf in y", lambda X, y: (X, np.where(np.arange(y.size) == 2, np.inf, y)), ValueError, "y: contains 1 NaN or inf"),
    ("length mismatch", lambda X, y: (X, y[:-1]), ValueError, "same number of samples"),
    ("1-D X", lambda X, y: (X[:, 0], y), ValueError, r"X: expected a 2-D array.*reshape"),
    ("3-D X", lambda X, y: (X[None], y), ValueError, "X: expected a 2-D array"),
    ("float16", lambda X, y: (X.astype(np.float16), y), TypeError, "X: float16 is not supported"),
    ("torch float16", lambda X, y: (torch.as_tensor(X).half(), y), TypeError, "X: torch.float16 is not supported"),
    ("empty", lambda X, y: (X[:0], y[:0]), ValueError, "X: expected a non-empty array"),
    ("strings", lambda X, y: (X.astype(str), y), TypeError, "X: expected a numeric array"),
    ("2-D y with 3 dims", lambda X, y: (X, y[:, None, None]), ValueError, "y: expected a 1-D or 2-D array"),
]


@pytest.mark.parametrize("case,make,exc,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_data_raises_early(case, make, exc, match):
    X, y = _data()
    Xb, yb = make(X, y)
    with pytest.raises(exc, match=match):
        kgp.KernelRegressor(noise=0.1).fit(Xb, yb)


BAD_PARAMS = [
    ({"noise": 0.0}, ValueError, "noise: expected a finite positive number"),
    ({"noise": -1.0}, ValueError, "noise"),
    ({"noise": float("nan")}, ValueError, "noise"),
    ({"noise": "big"}, ValueError, "noise: expected a positive number"),
    ({"lengthscale": 0.0}, ValueError, "lengthscale"),
    ({"lengthscale": -2}, ValueError, "lengthscale"),
    ({"kernel": "rbff"}, ValueError, "kernel: unknown shortcut 'rbff'"),
    ({"kernel": 3}, TypeError, "kernel: expected a gpytorch.kernels.Kernel"),
    ({"solver": "nope"}, ValueError, "unknown solver 'nope'; available solvers"),
    ({"solver": 3}, TypeError, "solver: expected a plugin name"),
    ({"solver_options": {"maxiter": 3}}, ValueError, r"solver_options: given with solver='auto'"),
    (
        {"solver": "exact", "solver_options": {"maxiter": 3}},
        ValueError,
        r"unknown option\(s\) \['maxiter'\] for solver 'exact'",
    ),
    ({"solver_options": [1]}, TypeError, "solver_options: expected a dict"),
    ({"dtype": "float16"}, TypeError, "dtype: expected None, 'float32' or 'float64'"),
    ({"n_centers": 0}, ValueError, "n_centers: expected a positive integer"),
    ({"n_centers": 2.5}, ValueError, "n_centers"),
    ({"random_state": "seed"}, TypeError, "random_state"),
    ({"centers": "uniform"}, ValueError, "solver 'exact' takes no centers"),
]


@pytest.mark.parametrize("params,exc,match", BAD_PARAMS, ids=[str(p[0]) for p in BAD_PARAMS])
def test_bad_parameters_raise_before_work(params, exc, match):
    X, y = _data()
    with pytest.raises(exc, match=match):
        kgp.KernelRegressor(**params).fit(X, y)


def test_n_centers_larger_than_n_is_rejected():
    X, y = _data(50)
    kgp.register(_center_solver_plugin(), name="center_toy")
    try:
        with pytest.raises(ValueError, match="n_centers: expected at most n_samples=50"):
            kgp.KernelRegressor(solver="center-toy", n_centers=51).fit(X, y)
        with pytest.raises(ValueError, match="unknown selector 'farthest'"):
            kgp.KernelRegressor(solver="center-toy", centers="farthest").fit(X, y)
        model = kgp.KernelRegressor(solver="center-toy", n_centers=20, random_state=0, noise=0.1).fit(X, y)
        assert model.centers_.shape == (20, 3)
        # uniform selection is without replacement and seeded
        rows = {tuple(r) for r in model.centers_.numpy()}
        assert len(rows) == 20
        again = kgp.KernelRegressor(solver="center-toy", n_centers=20, random_state=0, noise=0.1).fit(X, y)
        assert torch.equal(again.centers_, model.centers_)
        other = kgp.KernelRegressor(solver="center-toy", n_centers=20, random_state=1, noise=0.1).fit(X, y)
        assert not torch.equal(other.centers_, model.centers_)
        explicit = kgp.KernelRegressor(solver="center-toy", centers=X[:7] + 0.5, noise=0.1).fit(X, y)
        assert explicit.centers_.shape == (7, 3)
        with pytest.raises(ValueError, match="centers: expected 3 columns"):
            kgp.KernelRegressor(solver="center-toy", centers=X[:7, :2]).fit(X, y)
    finally:
        kgp.unregister("center_toy")


def _center_solver_plugin():
    import types

    class DenseNystrom:
        capabilities = kgp.Capabilities(uses_centers=True, target="nystrom")
        option_defaults = {}
        uses_centers = True

        def fit(self, problem):
            Z = problem.centers.points
            knm = problem.kernel_operator(problem.X, Z).to_dense()
            kmm = problem.kernel_operator(Z).to_dense()
            H = knm.T @ knm + problem.noise * kmm
            alpha = torch.linalg.lstsq(H, knm.T @ problem.y).solution
            return kgp.KernelExpansion(problem.kernel, Z, alpha)

    module = types.ModuleType("center_toy")

    @kgp.hookimpl
    def register_solvers(register):
        register("center-toy", DenseNystrom())

    module.register_solvers = register_solvers
    return module


def test_predict_checks():
    X, y = _data()
    model = kgp.KernelRegressor(noise=0.1)
    with pytest.raises(RuntimeError, match="not fitted"):
        model.predict(X)
    model.fit(X, y)
    with pytest.raises(ValueError, match="X has 2 features, but KernelRegressor is expecting 3 features as input"):
        model.predict(X[:, :2])


def test_save_load_round_trip_identical(tmp_path):
    X, y = _data()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=3)).double()
    kernel.outputscale = 2.0
    model = kgp.KernelRegressor(kernel, noise=0.05).fit(X, y)
    path = tmp_path / "model.pt"
    model.save(path)
    state = torch.load(path, weights_only=True)  # plain data, no pickled code
    assert state["solver"] == "exact"
    loaded = kgp.load(path)
    assert np.array_equal(loaded.predict(X), model.predict(X))
    assert float(loaded.kernel_.outputscale.detach()) == pytest.approx(2.0)


def test_load_fails_clearly_when_plugin_missing(tmp_path):
    X, y = _data()
    kgp.register(_center_solver_plugin(), name="center_toy")
    try:
        model = kgp.KernelRegressor(solver="center-toy", n_centers=10, noise=0.1).fit(X, y)
        model.save(tmp_path / "m.pt")
    finally:
        kgp.unregister("center_toy")
    with pytest.raises(ValueError, match="solver 'center-toy'.*not installed"):
        kgp.load(tmp_path / "m.pt")


def test_classifier_binary_and_multiclass(tmp_path):
    rng = np.random.default_rng(0)
    centers = np.array([[0, 0], [3, 0], [0, 3]])
    labels = rng.integers(0, 3, 300)
    X = centers[labels] + 0.6 * rng.normal(size=(300, 2))
    names = np.array(["a", "b", "c"])[labels]
    clf = kgp.KernelClassifier(noise=0.5).fit(X[:200], names[:200])
    assert list(clf.classes_) == ["a", "b", "c"]
    assert clf.score(X[200:], names[200:]) > 0.9
    scores = clf.decision_function(X[200:])
    assert scores.shape == (100, 3)
    assert np.array_equal(clf.predict(X[200:]), clf.classes_[scores.argmax(1)])
    binary = kgp.KernelClassifier(noise=0.5).fit(X[:200], labels[:200] == 1)
    assert binary.decision_function(X[:5]).shape == (5,)
    assert binary.score(X[200:], labels[200:] == 1) > 0.9
    clf.save(tmp_path / "c.pt")
    assert np.array_equal(kgp.load(tmp_path / "c.pt").predict(X[200:]), clf.predict(X[200:]))
    with pytest.raises(ValueError, match="at least 2 classes"):
        kgp.KernelClassifier().fit(X, np.zeros(300))


def test_callback_and_history_receive_iteration_info():
    X, y = _data()
    seen = []
    model = kgp.KernelRegressor(noise=0.1, callback=seen.append).fit(X, y, validation_data=(X[:20], y[:20]))
    assert len(seen) == 1 and isinstance(seen[0], kgp.IterationInfo)
    # exact interpolates nearly: validation MSE on training points is small but computed
    pred = model.predict(X[:20])
    assert seen[0].metric == pytest.approx(float(np.mean((pred - y[:20]) ** 2)), rel=1e-9)
    assert model.history_ == seen
