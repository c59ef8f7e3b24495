"""The plugin contract checked at registration (kgp/registry/contract.py) and the built-ins' declarations."""

from __future__ import annotations

import pickle
import types
import warnings

import numpy as np
import pytest
import torch

import kgp
from kgp.registry import LoadFailure, PluginLoadError, Registry, UnknownPluginError


class GoodSolver:
    capabilities = kgp.Capabilities(target="exact")
    option_defaults = {"shift": kgp.Option.number(0.0, help="added to alpha")}

    def fit(self, problem):
        K = problem.kernel_operator(problem.X).to_dense()
        K.diagonal().add_(problem.noise)
        alpha = torch.linalg.solve(K, problem.y) + problem.options["shift"]
        return kgp.KernelExpansion(problem.kernel, problem.X, alpha)


def _plugin(name: str, kind: str, obj, registered: str = "contract-thing"):
    module = types.ModuleType(name)

    @kgp.hookimpl
    def hook(register):
        register(registered, obj)

    setattr(module, f"register_{kind}s", hook)
    return module


def _refused(kind: str, obj) -> PluginLoadError:
    with pytest.raises(PluginLoadError) as info:
        kgp.register(_plugin("contract_plugin", kind, obj), name="contract_plugin")
    assert info.value.failure.stage == "contract" and info.value.__cause__ is None
    assert not kgp.registry.registry.pm.has_plugin("contract_plugin")  # nothing kept
    with pytest.raises(UnknownPluginError):
        kgp.registry.registry.get(kind, "contract-thing")
    return info.value


def _without(cls, *names, **changes):
    """A copy of ``cls`` without the attributes ``names`` and with ``changes``."""
    namespace = {k: v for k, v in vars(cls).items() if k not in names and not k.startswith("__")}
    return type(cls.__name__, (), {**namespace, **changes})()


def test_a_solver_without_capabilities_is_refused_showing_the_declaration():
    error = _refused("solver", _without(GoodSolver, "capabilities"))
    assert str(error) == (
        "kgp plugin 'contract_plugin' registered solver 'contract-thing', which declares no capabilities: declare "
        "what it can do with `capabilities = kgp.Capabilities(...)` on its class, e.g. `capabilities = "
        'kgp.Capabilities(uses_centers=True, target="nystrom")` (fields: uses_centers, target, needs_grad, '
        "distributed, distributed_refusal, partial_fit, loop_defaults, likelihood) and was not registered"
    )
    assert error.failure.names == (("solver", "contract-thing"),)


@pytest.mark.parametrize("kind", ["solver", "selector", "objective"])
def test_capabilities_of_the_wrong_type_are_refused_for_every_kind(kind):
    obj = _without(GoodSolver, "capabilities", capabilities={"uses_centers": True}, select=len, prepare=len)
    message = str(_refused(kind, obj))
    assert f"registered {kind} 'contract-thing'" in message
    assert "has capabilities = {'uses_centers': True} (dict), not a kgp.Capabilities" in message
    assert "`capabilities = kgp.Capabilities(...)`" in message


@pytest.mark.parametrize(
    "obj, expected",
    [
        (
            _without(GoodSolver, "option_defaults", option_defaults={"shift": 0.0, "scale": 1.0}),
            "declares option(s) ['shift', 'scale'] in option_defaults with plain values, not kgp.Option declarations",
        ),
        (
            _without(GoodSolver, "option_defaults", option_defaults={"maxiter": kgp.Option.integer(0, minimum=1)}),
            "declares option 'maxiter' with default 0, which its own declaration rejects (it accepts an integer >= 1)",
        ),
        (_without(GoodSolver, "option_defaults"), "needs option_defaults, a dict of option name -> kgp.Option"),
        (_without(GoodSolver, "fit"), "has no callable fit(problem)"),
        (
            _without(GoodSolver, capabilities=kgp.Capabilities(partial_fit=True)),
            "declares Capabilities(partial_fit=True) but has no partial_fit(problem, previous) method",
        ),
        (
            _without(GoodSolver, partial_fit=lambda self, problem, previous: None),
            "has a partial_fit(problem, previous) method but its capabilities say partial_fit=False",
        ),
        (_without(GoodSolver, check_options=3), "has a check_options that is not callable (int)"),
    ],
)
def test_solver_contract_violations_name_what_is_wrong(obj, expected):
    assert expected in str(_refused("solver", obj))


def test_only_solvers_declare_partial_fit():
    selector = _without(GoodSolver, "fit", capabilities=kgp.Capabilities(partial_fit=True), select=len)
    assert "declares Capabilities(partial_fit=True), which only solvers can (it is a selector)" in str(
        _refused("selector", selector)
    )


def test_a_contract_following_solver_is_usable_through_its_capabilities_alone():
    solver = GoodSolver()
    name = kgp.register(_plugin("good_contract_plugin", "solver", solver, "good-contract"))
    try:
        info = kgp.registry.registry.get("solver", "good-contract")
        assert info.capabilities is GoodSolver.capabilities
        # the core reads the record only: no loose flags are set on the plugin
        assert not any(hasattr(solver, f) for f in ("uses_centers", "exact_posterior", "supports_distributed"))
        X = np.random.default_rng(0).normal(size=(40, 2))
        model = kgp.KernelRegressor(solver="good-contract", noise=0.1).fit(X, X[:, 0])
        exact = kgp.KernelRegressor(solver="exact", noise=0.1).fit(X, X[:, 0])
        np.testing.assert_allclose(model.predict(X), exact.predict(X), rtol=1e-9, atol=1e-12)
        # target "exact": the exact posterior variance, like solver='exact'
        np.testing.assert_allclose(
            model.predict(X, return_std=True)[1], exact.predict(X, return_std=True)[1], rtol=1e-8
        )
    finally:
        kgp.unregister(name)


class FakeObjective:
    """A third-party objective: the exact NLL per data point (dense; small n only)."""

    capabilities = kgp.Capabilities(loop_defaults={"iterations": 7})
    option_defaults: dict = {}

    def prepare(self, problem):
        def loss(noise, mean):
            K = problem.kernel_operator(problem.X).to_dense()
            K = K + noise * torch.eye(problem.n, dtype=K.dtype)
            r = problem.y - mean
            L = torch.linalg.cholesky(K)
            a = torch.cholesky_solve(r, L)
            nll = 0.5 * (r * a).sum() + problem.n_outputs * (
                L.diagonal().log().sum() + 0.5 * problem.n * np.log(2 * np.pi)
            )
            return nll / r.numel()

        return loss


def test_objectives_follow_the_same_contract():
    error = _refused("objective", _without(FakeObjective, "capabilities"))
    assert "registered objective 'contract-thing', which declares no capabilities" in str(error)
    assert "kgp.Capabilities(uses_centers=True)" in str(error)
    objective = FakeObjective()
    name = kgp.register(_plugin("objective_plugin", "objective", objective, "fake-nll"))
    try:
        assert kgp.registry.registry.get("objective", "fake-nll").capabilities.loop_defaults == {"iterations": 7}
        X = np.random.default_rng(1).normal(size=(30, 2))
        model = kgp.KernelRegressor(learn="fake-nll", noise=0.1).fit(X, np.sin(X[:, 0]))
        assert len(model.learn_history_) == 7  # the loop took the objective's default
    finally:
        kgp.unregister(name)


def test_builtin_objectives_declare_their_capabilities():
    """kgp's own objectives follow the contract a third party's does (no allowance, no loose flags)."""
    reg = kgp.registry.registry
    expected = {
        "exact": kgp.Capabilities(likelihood=True, distributed=True),
        "sgpr": kgp.Capabilities(uses_centers=True, distributed=True, likelihood=True),
        "holdout": kgp.Capabilities(
            uses_centers=True, loop_defaults={"optimizer": "lbfgs", "iterations": 50, "learn_mean": False}
        ),
    }
    for name, caps in expected.items():
        info = reg.get("objective", name)
        assert info.builtin and info.capabilities == caps and info.obj.capabilities is info.capabilities
        assert not any(hasattr(info.obj, f) for f in ("uses_centers", "supports_distributed", "per_point_nll"))


def test_an_entry_point_breaking_the_contract_is_skipped_and_reported(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "kgp_contract-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kgp-contract\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kgp]\nold-style = kgp_t_old_style\n")
    (site / "kgp_t_old_style.py").write_text(
        "import kgp\n"
        "class OldStyle:\n"
        "    option_defaults = {'maxiter': 10}\n"
        "    uses_centers = False\n"
        "    def fit(self, problem):\n"
        "        raise NotImplementedError\n"
        "@kgp.hookimpl\n"
        "def register_solvers(register):\n"
        "    register('old-style', OldStyle())\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("KGP_DISABLE_ENTRYPOINTS", raising=False)
    monkeypatch.setenv("KGP_PLUGINS", "old-style")
    reg = Registry()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = reg.names("solver")
    [failure] = reg.load_failures
    assert isinstance(failure, LoadFailure) and (failure.plugin, failure.stage) == ("old-style", "contract")
    assert str(failure).startswith(
        "kgp plugin 'old-style' (entry point 'kgp_t_old_style' of distribution kgp-contract) registered solver "
        "'old-style', which declares no capabilities"
    )
    assert str(failure).endswith("and was skipped")
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [str(failure)]
    assert "old-style" not in names and "exact" in names
    with pytest.raises(UnknownPluginError, match="^solver 'old-style' is unavailable: plugin 'old-style' from"):
        reg.get("solver", "old-style")


# ---------------------------------------------------------------------------------------------
# kgp's built-ins
# ---------------------------------------------------------------------------------------------
EXPECTED = {
    ("solver", "exact"): kgp.Capabilities(target="exact"),
    ("solver", "falkon"): kgp.Capabilities(uses_centers=True, target="nystrom", distributed=True),
    ("solver", "eigenpro"): kgp.Capabilities(uses_centers=True, target="nystrom", distributed=True),
    ("solver", "dsg"): kgp.Capabilities(target="mean_only", distributed=True, partial_fit=True),
    ("selector", "uniform"): kgp.Capabilities(distributed=True),
    ("selector", "bless"): kgp.Capabilities(distributed=True, uses_kernel=True),
    ("selector", "bless-r"): kgp.Capabilities(distributed=True, uses_kernel=True),
}


@pytest.mark.parametrize("kind, name", list(EXPECTED))
def test_builtin_capabilities(kind, name):
    info = kgp.registry.registry.get(kind, name)
    assert info.obj.capabilities == EXPECTED[(kind, name)] and info.capabilities == EXPECTED[(kind, name)]


def test_eigenpro2_targets_the_exact_posterior_and_says_why_it_is_not_distributed():
    caps = kgp.get_solver("eigenpro2").capabilities
    assert (caps.target, caps.uses_centers, caps.distributed) == ("exact", False, False)
    assert caps.distributed_refusal.startswith("its n coefficients are one per training row")


@pytest.mark.parametrize("kind, name", list(EXPECTED) + [("solver", "eigenpro2")])
def test_builtins_carry_no_loose_capability_flags(kind, name):
    """The core reads capabilities only, so a loose flag on a built-in could only disagree with them."""
    obj = kgp.registry.registry.get(kind, name).obj
    loose = ("uses_centers", "exact_posterior", "supports_distributed", "needs_grad", "distributed_refusal")
    assert [f for f in loose if f in vars(type(obj)) or f in vars(obj)] == []
    assert hasattr(obj, "partial_fit") == obj.capabilities.partial_fit


def test_builtin_option_tables_are_plain_option_declarations():
    for kind in ("solver", "selector", "objective"):
        for name in kgp.registry.registry.names(kind):
            defaults = kgp.registry.registry.get(kind, name).obj.option_defaults
            assert all(isinstance(d, kgp.Option) and d.help for d in defaults.values()), (kind, name)


# ---------------------------------------------------------------------------------------------
# kgp.Capabilities itself
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"uses_centers": 1}, TypeError, "Capabilities.uses_centers: expected True or False, got 1"),
        ({"target": "nystroem"}, ValueError, "Capabilities.target: expected one of"),
        ({"distributed_refusal": 3}, TypeError, "expected a str or None, got 3"),
        ({"distributed": True, "distributed_refusal": "no"}, ValueError, "but distributed=True"),
        ({"loop_defaults": [("iterations", 3)]}, TypeError, "Capabilities.loop_defaults: expected a dict, got list"),
        ({"loop_defaults": {1: 3}}, TypeError, "expected option names"),
    ],
)
def test_capabilities_refuse_bad_fields(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        kgp.Capabilities(**kwargs)


def test_capabilities_are_frozen_and_pickle():
    defaults = {"iterations": 5}
    caps = kgp.Capabilities(loop_defaults=defaults)
    defaults["iterations"] = 6  # the record keeps its own copy
    assert caps.loop_defaults == {"iterations": 5}
    with pytest.raises(TypeError):
        caps.loop_defaults["iterations"] = 7
    with pytest.raises(AttributeError):
        caps.target = "nystrom"
    assert pickle.loads(pickle.dumps(caps)) == caps
