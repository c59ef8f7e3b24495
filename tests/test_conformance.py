"""kgp's built-in plugins against the conformance kit, and the kit against deliberately broken plugins.

Every built-in solver registered by the ``kgp`` distribution is run through every check of
:mod:`kgp.testing` with the tolerances in :data:`SOLVER_CASES`; solvers still being written are simply
absent from the parametrisation until their entry point registers them.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kgp
from kgp.plugin import Centers, KernelExpansion, Problem, SelectionRequest
from kgp.registry import registry
from kgp.testing import (
    SELECTOR_CHECKS,
    SOLVER_CHECKS,
    OracleSpec,
    SelectorConformance,
    SolverConformance,
    check_selector,
    check_selector_in_model,
    check_solver,
    dense_nystrom_mean,
    dense_posterior_mean,
    make_oracle_data,
)

# Per built-in solver: keyword arguments of the checks. Exact solvers meet tight tolerances; the
# iterative ones are approximate by design and state their own bound here.
SOLVER_CASES: dict[str, dict] = {
    "exact": {"rtol": 1e-8, "rtol_float32": 1e-4},
    # 20 iterations (the default) reach 6e-5 on the oracle problem but only 1e-2 with the kit's random
    # center weights D, which worsen the preconditioner (the estimator itself does not depend on D).
    "falkon": {
        "solver_options": {"maxiter": 50},
        "rtol": 1e-4,
        "rtol_float32": 1e-2,
        "iterative": True,
        "invalid_options": ({"maxiter": 0}, {"tol": -1.0}),
    },
    # Gradient methods approach the ridge solution slowly at sigma^2 = 1e-2. Measured with the default
    # 10 epochs on the kit's problem (single output / worst of 3 outputs): eigenpro 0.030 / 0.063
    # (0.023 / 0.032 at 100 epochs), eigenpro2 0.053 / 0.078 (0.009 / 0.017 at 100 epochs).
    "eigenpro": {"rtol": 0.1, "rtol_float32": 0.1, "iterative": True, "invalid_options": ({"epochs": 0},)},
    "eigenpro2": {"rtol": 0.1, "rtol_float32": 0.1, "iterative": True, "invalid_options": ({"epochs": 0},)},
    # measured 0.027 with the default 10 epochs (docs/solvers/eigenpro4.md)
    "eigenpro4": {"rtol": 0.1, "rtol_float32": 0.1, "iterative": True, "invalid_options": ({"projection_period": 0},)},
    # Random features + SGD: measured 0.18 / 0.32 with the default 10 passes (0.11 / 0.22 at 30).
    "dsg": {"rtol": 0.1, "rtol_float32": 0.1, "iterative": True, "invalid_options": ({"batch_size": 0},)},
}
DEFAULT_CASE: dict = {"rtol": 1e-2, "rtol_float32": 1e-2}

SELECTOR_CASES: dict[str, dict] = {
    "uniform": {"data_rows": True},
    "bless": {"exact_count": False, "data_rows": True, "invalid_options": ({"q": 1.0}, {"linalg_dtype": "half"})},
    "bless-r": {"exact_count": False, "data_rows": True, "invalid_options": ({"q2": 0.0}, {"score_lambda": "x"})},
}


def _builtin(kind: str) -> list[str]:
    return [name for name in registry.names(kind) if (registry.get(kind, name).distribution or "").lower() == "kgp"]


BUILTIN_SOLVERS = _builtin("solver")
BUILTIN_SELECTORS = _builtin("selector")


@pytest.mark.parametrize("check", list(SOLVER_CHECKS))
@pytest.mark.parametrize("name", BUILTIN_SOLVERS)
def test_builtin_solver_conforms(name, check):
    case = SOLVER_CASES.get(name, DEFAULT_CASE)
    SOLVER_CHECKS[check](name, **case)


@pytest.mark.parametrize("check", list(SELECTOR_CHECKS))
@pytest.mark.parametrize("name", BUILTIN_SELECTORS)
def test_builtin_selector_conforms(name, check):
    # The in-model check fits FALKON (default 20 iterations) on the selected centers, when it is installed.
    in_model = {"solver": "falkon", "rtol": 1e-3} if "falkon" in BUILTIN_SOLVERS else {}
    SELECTOR_CHECKS[check](name, **{**in_model, **SELECTOR_CASES.get(name, {})})


def test_exact_is_in_the_parametrisation():
    assert "exact" in BUILTIN_SOLVERS and "uniform" in BUILTIN_SELECTORS


def test_oracles_agree_with_an_independent_numpy_solve():
    """The kit's float64 oracles against numpy: the posterior mean, and Nystrom with M = n centers."""
    np = pytest.importorskip("numpy")
    spec = OracleSpec(n=50, n_test=20, n_centers=50)
    data = make_oracle_data(spec, n_outputs=2)
    X, Xt, y = data.X.numpy(), data.X_test.numpy(), data.y.numpy()

    def rbf(a, b):
        return np.exp(-((a[:, None, :] - b[None, :, :]) ** 2).sum(-1) / 2.0)

    mean = rbf(Xt, X) @ np.linalg.solve(rbf(X, X) + spec.noise * np.eye(spec.n), y)
    np.testing.assert_allclose(dense_posterior_mean(data).numpy(), mean, rtol=1e-8, atol=1e-10)
    # With every training point as a center, the Nystrom estimator is the posterior mean.
    all_centers = data.X[torch.randperm(spec.n, generator=torch.Generator().manual_seed(3))]
    np.testing.assert_allclose(dense_nystrom_mean(data, centers=all_centers).numpy(), mean, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# A reference center-based solver, and broken variants of it: the kit must catch each defect.
# ---------------------------------------------------------------------------------------------
class RefNystrom:
    """Dense Nystrom solve, eq. 8 of Rudi et al. with lambda n = sigma^2; ``bug`` injects one defect."""

    capabilities = kgp.Capabilities(uses_centers=True, target="nystrom")
    option_defaults = {"jitter": kgp.Option.number(0.0, minimum=0.0, help="unused; declared for the option checks")}

    def __init__(self, bug: str | None = None):
        self.bug = bug

    def fit(self, problem: Problem):
        # Solve in float64 (small dense test problem) and return the input dtype, unless buggy.
        dtype = torch.float64
        X, y, Z = problem.X.to(dtype), problem.y.to(dtype), problem.centers.points.to(dtype)
        kernel = copy.deepcopy(problem.kernel).to(dtype)
        KnM = kgp.kernel_operator(kernel, X, Z).to_dense()
        KMM = kgp.kernel_operator(kernel, Z).to_dense()
        noise = problem.noise * (2.0 if self.bug == "wrong_noise" else 1.0)
        if self.bug == "weights_in_regulariser" and problem.centers.weights is not None:
            D = torch.diag(problem.centers.weights.to(dtype))
            KMM = D @ KMM @ D  # Appendix G defect (a): a different regulariser
        H = KnM.T @ KnM + noise * KMM
        alpha = torch.linalg.lstsq(H, KnM.T @ y).solution
        if self.bug == "global_rng":
            alpha = alpha + 1e-3 * torch.randn(alpha.shape, dtype=dtype)
        if self.bug == "mutate":
            problem.y.mul_(1.0)
            problem.y[0, 0] += 1.0
        if self.bug != "upcast":
            kernel, Z, alpha = problem.kernel, problem.centers.points, alpha.to(problem.dtype)
        problem.monitor.start(3)
        for it in range(1, 4):
            stop = problem.monitor.step(it, lambda: KernelExpansion(kernel, Z, alpha))
            if stop and self.bug != "ignore_stop":
                break
        if self.bug == "unregistered_kind":
            return _OddPredictor(kernel, Z, alpha)
        return KernelExpansion(kernel, Z, alpha)


class _OddPredictor(KernelExpansion):
    kind = "not-registered-anywhere"


class RefSelector:
    capabilities = kgp.Capabilities()
    option_defaults: dict = {}

    def __init__(self, bug: str | None = None):
        self.bug = bug

    def select(self, request: SelectionRequest) -> Centers:
        m = request.n_centers or 10
        gen = None if self.bug == "global_rng" else request.generator
        idx = torch.randperm(request.n, generator=gen)[:m]
        points = request.X[idx]
        if self.bug == "float64":
            points = points.double()
        return Centers(points=points, indices=idx)


class _Plugin:
    def __init__(self, solvers=None, selectors=None):
        self.solvers = solvers or {}
        self.selectors = selectors or {}

    @kgp.hookimpl
    def register_solvers(self, register):
        for name, obj in self.solvers.items():
            register(name, obj)

    @kgp.hookimpl
    def register_selectors(self, register):
        for name, obj in self.selectors.items():
            register(name, obj)


@pytest.fixture
def runtime_plugin():
    names = []

    def add(plugin_name, **kinds):
        kgp.register(_Plugin(**kinds), name=plugin_name)
        names.append(plugin_name)

    yield add
    for name in names:
        kgp.unregister(name)


def test_reference_nystrom_passes_every_check(runtime_plugin):
    runtime_plugin("ref-nystrom-plugin", solvers={"ref-nystrom": RefNystrom()})
    results = check_solver(
        "ref-nystrom", rtol=1e-8, rtol_float32=1e-3, iterative=True, invalid_options=({"jitter": -1.0},)
    )
    assert results["oracle"]["rel_error"] < 1e-8
    assert results["callback"] == {"iterations_full": 3, "iterations_stopped": 1}
    assert results["center_weights"]["rel_error"] < 1e-8
    assert results["protocol"]["distribution"] is None  # registered at runtime, not installed
    assert results["partial_fit"] == "skipped (solver 'ref-nystrom' has no partial_fit)"  # recorded, not raised


@pytest.mark.parametrize(
    "bug, check, kwargs, message",
    [
        ("wrong_noise", "oracle", {}, "relative error"),
        ("upcast", "dtype", {}, "torch.float32 input gave torch.float64"),
        ("global_rng", "seed", {}, "global torch / numpy RNG"),
        ("ignore_stop", "callback", {"iterative": True}, "returned True at iteration 1 but was called 3 times"),
        ("weights_in_regulariser", "center_weights", {}, "weighted centers"),
        ("mutate", "protocol", {}, "modified problem.y"),
        ("unregistered_kind", "protocol", {}, "is not registered"),
        (None, "invalid_options", {"invalid_options": ({"jitter": 1.0},)}, "were accepted"),
    ],
)
def test_kit_catches_broken_solver(runtime_plugin, bug, check, kwargs, message):
    runtime_plugin(f"broken-{bug}", solvers={"broken": RefNystrom(bug)})
    with pytest.raises(AssertionError, match=message):
        SOLVER_CHECKS[check]("broken", rtol=1e-8, **kwargs)


def test_check_solver_reports_every_failure_at_once(runtime_plugin):
    runtime_plugin("broken-upcast", solvers={"broken": RefNystrom("upcast")})
    with pytest.raises(AssertionError) as info:
        check_solver("broken", rtol=1e-8, skip=("callback",))
    text = str(info.value)
    assert "[dtype]" in text and "[oracle]" not in text


def test_unknown_solver_and_unknown_skip():
    with pytest.raises(AssertionError, match="not registered; registered solvers: .*exact"):
        SOLVER_CHECKS["oracle"]("no-such-solver")
    with pytest.raises(ValueError, match="skip: unknown check"):
        check_solver("exact", skip=("nonsense",))


@pytest.mark.parametrize("bug, message", [("global_rng", "same generator seed"), ("float64", "points are")])
def test_kit_catches_broken_selector(runtime_plugin, bug, message):
    runtime_plugin(f"broken-selector-{bug}", selectors={"broken-selector": RefSelector(bug)})
    with pytest.raises(AssertionError, match=message):
        check_selector("broken-selector")


def test_selector_in_model_with_reference_solver(runtime_plugin):
    runtime_plugin("ref-nystrom-plugin", solvers={"ref-nystrom": RefNystrom()})
    result = check_selector("uniform", solver="ref-nystrom", rtol=1e-8)
    assert result["in_model"]["rel_error"] < 1e-8


def test_selector_in_model_check_takes_solver_options():
    # FALKON's default 20 iterations reach 6.9e-6 on the kit's problem, above the default rtol 1e-6.
    result = check_selector("uniform", solver="falkon", solver_options={"maxiter": 50}, skip=("device",))
    assert result["in_model"]["rel_error"] < 1e-6
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bogus'\] for solver 'falkon'"):
        check_selector_in_model("uniform", solver="falkon", solver_options={"bogus": 1})  # they reach the fit


class TestUniformInModelThroughBaseClass(SelectorConformance):
    """``solver_options`` as a class attribute of the selector base class."""

    selector_name = "uniform"
    solver = "falkon"
    solver_options = {"maxiter": 50}
    skip_checks = ("contract", "seed", "device", "unknown_option")


class TestExactThroughBaseClass(SolverConformance):
    """The pytest base class, as a plugin author would use it."""

    solver_name = "exact"
    rtol = 1e-8
    rtol_float32 = 1e-4


def test_device_checks_run_on_an_explicit_device():
    """The CUDA checks' code path, exercised on the CPU (the machine running CI may have no GPU)."""
    measured = SOLVER_CHECKS["device"]("exact", device="cpu", rtol=1e-8, rtol_float32=1e-4)
    assert set(measured) == {"rel_error_cpu_float32", "rel_error_cpu_float64"}
    assert SELECTOR_CHECKS["device"]("uniform", device="cpu") == {"n_centers": 40}


@pytest.fixture(scope="module")
def example_plugin():
    """plugins/kgp-example from the source tree, registered at runtime (tests/test_third_party_install.py
    covers the pip-installed path); reuses it when the distribution is installed and loaded."""
    import sys
    from pathlib import Path

    registered = []
    if "nystrom-direct" not in registry.names("solver"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "kgp-example"))
        try:
            from kgp_example import kmeanspp, nystrom
        finally:
            sys.path.pop(0)
        for module, name in ((nystrom, "nystrom-direct"), (kmeanspp, "kmeanspp")):
            kgp.register(module, name=name)
            registered.append(name)
    yield
    for name in registered:
        kgp.unregister(name)


@pytest.mark.parametrize("check", list(SOLVER_CHECKS))
def test_example_solver_conforms(example_plugin, check):
    SOLVER_CHECKS[check]("nystrom-direct", rtol=1e-9, rtol_float32=1e-3, invalid_options=({"rcond": -1.0},))


@pytest.mark.parametrize("check", list(SELECTOR_CHECKS))
def test_example_selector_conforms(example_plugin, check):
    SELECTOR_CHECKS[check](
        "kmeans++", solver="nystrom-direct", rtol=1e-9, data_rows=True, invalid_options=({"n_local_trials": 0},)
    )


# ---------------------------------------------------------------------------------------------
# The oracle follows the declared target; fit runs as the model runs it
# ---------------------------------------------------------------------------------------------
class NystromPreconditionedCG:
    """A third party's solver: CG on ``(K + s^2 I) alpha = y`` preconditioned by the Nystrom approximation.

    The centers only precondition: with ``P = K_nM K_MM^-1 K_Mn + s^2 I`` (Woodbury:
    ``P^-1 v = (v - K_nM (s^2 K_MM + K_Mn K_nM)^-1 K_Mn v) / s^2``) the iteration converges to the
    exact GP posterior mean, which is what it declares: ``target="exact"`` with ``uses_centers=True``.
    """

    capabilities = kgp.Capabilities(uses_centers=True, target="exact")
    option_defaults = {
        "maxiter": kgp.Option.integer(200, minimum=1, help="CG iterations"),
        "tol": kgp.Option.number(1e-12, minimum=0.0, help="stop at this relative residual"),
    }

    def fit(self, problem: Problem):
        X, y, noise = problem.X, problem.y, problem.noise
        Z = problem.centers.points
        K = problem.kernel_operator(X)
        knm = problem.kernel_operator(X, Z)
        eye = torch.eye(Z.shape[0], dtype=torch.float64, device=X.device)
        inner = noise * problem.kernel_operator(Z).to_dense().double() + knm.fused_matmul(eye.to(X.dtype)).double()
        factor = torch.linalg.cholesky(inner + 1e-10 * inner.diagonal().mean() * eye)

        def precondition(v):
            w = torch.cholesky_solve((knm.T @ v).double(), factor).to(v.dtype)
            return (v - knm @ w) / noise

        alpha = torch.zeros_like(y)
        r = y.clone()
        z = precondition(r)
        p, rz = z.clone(), (r * z).sum(0)
        stop_at = problem.options["tol"] * y.norm(dim=0)
        problem.monitor.start(total=problem.options["maxiter"], desc="pcg")
        for it in range(1, problem.options["maxiter"] + 1):
            Ap = K @ p + noise * p
            step = rz / (p * Ap).sum(0)
            alpha = alpha + step * p
            r = r - step * Ap
            z = precondition(r)
            rz_new = (r * z).sum(0)
            p, rz = z + (rz_new / rz) * p, rz_new
            stop = problem.monitor.step(it, lambda alpha=alpha: KernelExpansion(problem.kernel, X, alpha))
            if stop or bool((r.norm(dim=0) <= stop_at).all()):
                break
        return KernelExpansion(problem.kernel, X, alpha)


def test_a_solver_using_centers_as_a_preconditioner_passes_against_the_exact_posterior(runtime_plugin):
    """The oracle follows the declared target, not uses_centers: the Nystrom oracle would fail this solver (0.15).

    Measured: 8.4e-11 against the exact posterior mean in 77 iterations (float32 2.7e-6), 0.152 against
    the Nystrom estimator on its centers.
    """
    runtime_plugin("pcg-plugin", solvers={"pcg-exact": NystromPreconditionedCG()})
    results = check_solver("pcg-exact", rtol=1e-8, rtol_float32=1e-3, iterative=True, invalid_options=({"maxiter": 0},))
    assert results["oracle"]["target"] == "exact" and results["oracle"]["rel_error"] < 1e-8
    assert results["center_weights"]["rel_error"] < 1e-8  # weights change the preconditioner, not the target
    # the Nystrom estimator on the same centers is a different function: judged by it, the solver would fail
    data = make_oracle_data(OracleSpec())
    model = kgp.KernelRegressor("rbf", noise=1e-2, solver="pcg-exact", centers=data.centers).fit(data.X, data.y[:, 0])
    ref = dense_nystrom_mean(data)[:, 0]
    assert float(torch.linalg.norm(model.predict(data.X_test) - ref) / torch.linalg.norm(ref)) > 1e-2


class _Declared(RefNystrom):
    """The reference Nystrom solve under another declared target."""

    def __init__(self, target: str):
        super().__init__()
        self.capabilities = kgp.Capabilities(uses_centers=True, target=target)


def test_the_oracle_is_the_declared_target(runtime_plugin):
    runtime_plugin("declared-plugin", solvers={"says-exact": _Declared("exact")})
    with pytest.raises(AssertionError, match=r"relative error .* against the dense float64 oracle"):
        SOLVER_CHECKS["oracle"]("says-exact", rtol=1e-6)  # computes the Nystrom estimator, declares the exact mean


class GradRecorder(RefNystrom):
    """Records whether autograd was on inside ``fit``."""

    def __init__(self, needs_grad: bool):
        super().__init__()
        self.capabilities = kgp.Capabilities(uses_centers=True, target="nystrom", needs_grad=needs_grad)
        self.seen: list[bool] = []

    def fit(self, problem: Problem):
        self.seen.append(torch.is_grad_enabled())
        return super().fit(problem)


@pytest.mark.parametrize("needs_grad", [False, True])
def test_the_kit_calls_fit_as_the_model_does(runtime_plugin, needs_grad):
    solver = GradRecorder(needs_grad)
    runtime_plugin("grad-plugin", solvers={"grad-recorder": solver})
    SOLVER_CHECKS["protocol"]("grad-recorder")
    SOLVER_CHECKS["center_weights"]("grad-recorder", rtol=1e-8)
    kgp.KernelRegressor("rbf", solver="grad-recorder", centers=torch.rand(5, 2).double()).fit(
        torch.rand(20, 2).double(), torch.rand(20).double()
    )
    assert solver.seen == [needs_grad] * 3  # the kit's two direct calls and the model's own
