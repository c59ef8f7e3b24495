"""The estimator's single fit path: gradients off for plugins, monitor ownership, state on failure, seeds."""

from __future__ import annotations

import types

import gpytorch
import numpy as np
import pytest
import torch

import kgp


def _data(n=80, d=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    return X, np.sin(X[:, 0]) + 0.3 * X[:, 1]


class RecordingSolver:
    """Exact Cholesky solve that records what the model handed it (grad mode, monitor, centers)."""

    option_defaults: dict = {}
    uses_centers = False

    def __init__(self, needs_grad: bool | None = None, fail_with: type[BaseException] | None = None):
        self.capabilities = kgp.Capabilities(target="exact", needs_grad=bool(needs_grad))
        if needs_grad is not None:
            self.needs_grad = needs_grad
        self.fail_with = fail_with
        self.seen: dict = {}

    def fit(self, problem):
        self.seen["grad_enabled"] = torch.is_grad_enabled()
        self.seen["monitor"] = problem.monitor
        problem.monitor.start(total=2)
        if self.fail_with is not None:
            raise self.fail_with("solver failed on purpose")
        K = problem.kernel_operator(problem.X).to_dense()
        K.diagonal().add_(problem.noise)
        alpha = torch.cholesky_solve(problem.y, torch.linalg.cholesky(K))
        return kgp.KernelExpansion(problem.kernel, problem.X, alpha.detach())


class RecordingSelector:
    option_defaults: dict = {}

    def __init__(self, needs_grad: bool | None = None):
        self.capabilities = kgp.Capabilities(needs_grad=bool(needs_grad))
        if needs_grad is not None:
            self.needs_grad = needs_grad
        self.seen: dict = {}

    def select(self, request):
        self.seen["grad_enabled"] = torch.is_grad_enabled()
        m = request.n_centers or 10
        idx = torch.randperm(request.n, generator=request.generator)[:m]
        return kgp.Centers(request.X[idx], indices=idx)


def _register(name: str, solver=None, selector=None) -> str:
    module = types.ModuleType(name)
    if solver is not None:

        @kgp.hookimpl
        def register_solvers(register):
            register(name, solver)

        module.register_solvers = register_solvers
    if selector is not None:

        @kgp.hookimpl
        def register_selectors(register):
            register(name, selector)

        module.register_selectors = register_selectors
    return kgp.register(module, name=name)


@pytest.fixture
def plugin():
    names = []

    def make(name, solver=None, selector=None):
        names.append(_register(name, solver, selector))
        return name

    yield make
    for name in names:
        kgp.unregister(name)


def _trainable_kernel():
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    assert all(p.requires_grad for p in kernel.parameters())
    return kernel


def test_solver_runs_without_autograd_unless_it_asks(plugin):
    X, y = _data()
    plain = RecordingSolver()
    plugin("rec-plain", solver=plain)
    model = kgp.KernelRegressor(_trainable_kernel(), noise=0.1, solver="rec-plain").fit(X, y)
    assert plain.seen["grad_enabled"] is False
    # the result is a plain tensor: no graph hangs off the fitted coefficients
    assert not model.predictor_.alpha.requires_grad

    asks = RecordingSolver(needs_grad=True)
    plugin("rec-grad", solver=asks)
    kgp.KernelRegressor(_trainable_kernel(), noise=0.1, solver="rec-grad").fit(X, y)
    assert asks.seen["grad_enabled"] is True


def test_no_grad_keeps_a_cg_loop_from_building_a_graph(plugin):
    """Products with a trainable kernel inside fit: without no_grad each one would join the graph."""

    class CGLike:
        capabilities = kgp.Capabilities(target="exact")
        option_defaults: dict = {}
        uses_centers = False

        def fit(self, problem):
            op = problem.kernel_operator(problem.X)
            v = problem.y.clone()
            for _ in range(5):
                v = op @ v / problem.n
            self.requires_grad = v.requires_grad
            return kgp.KernelExpansion(problem.kernel, problem.X, v)

    solver = CGLike()
    plugin("cg-like", solver=solver)
    X, y = _data()
    kgp.KernelRegressor(_trainable_kernel(), noise=0.1, solver="cg-like").fit(X, y)
    assert solver.requires_grad is False


def test_selector_runs_without_autograd_unless_it_asks(plugin):
    X, y = _data()
    plain = RecordingSelector()
    plugin("sel-plain", selector=plain)
    kgp.KernelRegressor(
        _trainable_kernel(), noise=0.1, solver="falkon", centers="sel-plain", n_centers=20, random_state=0
    ).fit(X, y)
    assert plain.seen["grad_enabled"] is False
    asks = RecordingSelector(needs_grad=True)
    plugin("sel-grad", selector=asks)
    kgp.KernelRegressor(
        _trainable_kernel(), noise=0.1, solver="falkon", centers="sel-grad", n_centers=20, random_state=0
    ).fit(X, y)
    assert asks.seen["grad_enabled"] is True


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failed_fit_closes_the_monitor_and_keeps_the_previous_model(plugin, error):
    X, y = _data()
    good = kgp.KernelRegressor(noise=0.1, random_state=1).fit(X, y)
    before = good.predict(X)
    attrs = {k: v for k, v in vars(good).items() if k.endswith("_")}
    failing = RecordingSolver(fail_with=error)
    plugin("rec-fail", solver=failing)
    with pytest.raises(error, match="on purpose"):
        good.set_params(solver="rec-fail", progress=True).fit(X[:40], y[:40])
    assert failing.seen["monitor"]._bar is None  # the model closed the progress bar
    assert np.array_equal(good.set_params(solver="exact").predict(X), before)
    assert {k: v for k, v in vars(good).items() if k.endswith("_")}.keys() == attrs.keys()
    assert good.n_features_in_ == 2 and good.solver_name_ == "exact"

    fresh = kgp.KernelRegressor(noise=0.1, solver="rec-fail")
    with pytest.raises(error):
        fresh.fit(X, y)
    assert not hasattr(fresh, "predictor_")  # still unfitted


def test_eigenpro_progress_bar_is_closed_by_the_model():
    X, y = _data(n=200)
    bars = []
    original = kgp.Monitor.close

    def spy(self):
        bars.append(self._bar)
        original(self)

    kgp.Monitor.close = spy
    try:
        model = kgp.KernelRegressor(
            noise=0.1, solver="eigenpro", n_centers=30, random_state=0, progress=True, solver_options={"epochs": 2}
        ).fit(X, y)
    finally:
        kgp.Monitor.close = original
    assert bars and bars[0] is not None  # the bar existed and was closed once, by the model
    assert len(model.history_) == 2


def test_validation_data_is_checked_in_one_place():
    X, y = _data()
    model = kgp.KernelRegressor(noise=0.1, solver="falkon", n_centers=20, random_state=0)
    with pytest.raises(ValueError, match="y_val: expected 1 output"):
        model.fit(X, y, validation_data=(X[:5], np.ones((5, 2))))
    with pytest.raises(ValueError, match="X_val has 3 features"):
        model.fit(X, y, validation_data=(np.ones((5, 3)), y[:5]))
    with pytest.raises(ValueError, match="as many samples in X_val as in y_val"):
        model.fit(X, y, validation_data=(X[:5], y[:4]))
    clf = kgp.KernelClassifier(noise=0.1, solver="falkon", n_centers=20, random_state=0)
    labels = (y > 0).astype(int)
    with pytest.raises(ValueError, match=r"y_val: labels \[7\] were not seen"):
        clf.fit(X, labels, validation_data=(X[:3], np.array([0, 1, 7])))
    errors = []
    clf.set_params(callback=lambda info: errors.append(info.metric))
    clf.fit(X, labels, validation_data=(X[:40], labels[:40]))
    assert errors and 0.0 <= errors[-1] <= 0.2
    assert errors[-1] == pytest.approx(float(np.mean(clf.predict(X[:40]) != labels[:40])))


def test_partial_fit_draws_one_seed_and_continues_after_fit():
    X, y = _data(n=400)
    model = kgp.KernelRegressor(noise=0.1, solver="dsg", solver_options={"partial_fit_passes": 1})
    model.partial_fit(X[:200], y[:200])
    seed = model.seed_
    model.partial_fit(X[200:], y[200:])
    assert model.seed_ == seed and model._chunks_seen == 2
    assert len(model.history_) >= 2
    # fit, then continue: same seed, a fresh random stream for the next chunk
    fitted = kgp.KernelRegressor(noise=0.1, solver="dsg", random_state=5, solver_options={"passes": 1}).fit(X, y)
    steps = fitted.predictor_.n_steps
    fitted.partial_fit(X[:100], y[:100])
    assert fitted.seed_ == 5 and fitted.predictor_.n_steps > steps
    with pytest.raises(ValueError, match="expected chunks of 2 features"):
        fitted.partial_fit(X[:10, :1], y[:10])


def test_problem_wraps_a_bare_center_tensor_and_rejects_other_types():
    X = torch.randn(10, 2, dtype=torch.float64)
    problem = kgp.Problem(X=X, y=X[:, :1], kernel=gpytorch.kernels.RBFKernel(), noise=0.1, centers=X[:3])
    assert isinstance(problem.centers, kgp.Centers) and torch.equal(problem.centers.points, X[:3])
    with pytest.raises(TypeError, match="Problem.centers: expected a kgp.Centers"):
        kgp.Problem(X=X, y=X[:, :1], kernel=gpytorch.kernels.RBFKernel(), noise=0.1, centers=[1, 2])


def test_load_uses_the_same_fitted_attributes_as_fit(tmp_path):
    X, y = _data()
    model = kgp.KernelRegressor(noise=0.1, solver="falkon", n_centers=20, random_state=0).fit(X, y)
    model.save(tmp_path / "m.pt")
    loaded = kgp.load(tmp_path / "m.pt")
    fitted = {k for k in vars(model) if k.endswith("_")}
    assert {k for k in vars(loaded) if k.endswith("_")} == fitted
    assert torch.equal(loaded.centers_, model.centers_)
    assert np.array_equal(loaded.predict(X), model.predict(X))
