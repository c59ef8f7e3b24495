"""Plugin registry: runtime registration, conflicts, broken plugins, entry-point switches, loading once."""

import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch

import kgp
from kgp.options import merge_options
from kgp.registry import LoadFailure, PluginConflictError, PluginLoadError, Registry, UnknownPluginError


class ScaledExact:
    """A toy third-party solver: the exact solution computed with a dense solve (no Cholesky)."""

    option_defaults = {"shift": kgp.Option.number(0.0, help="added to every coefficient")}
    capabilities = kgp.Capabilities(target="exact")

    def fit(self, problem):
        K = problem.kernel_operator(problem.X).to_dense()
        K.diagonal().add_(problem.noise)
        alpha = torch.linalg.solve(K, problem.y) + problem.options["shift"]
        return kgp.KernelExpansion(problem.kernel, problem.X, alpha)


def _plugin(name, solver_name="toy-solver"):
    module = types.ModuleType(name)

    @kgp.hookimpl
    def register_solvers(register):
        register(solver_name, ScaledExact())

    module.register_solvers = register_solvers
    return module


def test_runtime_plugin_is_usable_by_name_and_listed():
    name = kgp.register(_plugin("toy_plugin"))
    try:
        X = np.random.default_rng(0).normal(size=(60, 2))
        y = X[:, 0]
        toy = kgp.KernelRegressor(solver="toy-solver", noise=0.1).fit(X, y).predict(X)
        exact = kgp.KernelRegressor(solver="exact", noise=0.1).fit(X, y).predict(X)
        assert np.allclose(toy, exact, rtol=1e-9, atol=1e-12)
        rows = [(i.name, i.kind, i.plugin) for i in kgp.list_plugins()]
        assert ("toy-solver", "solver", "toy_plugin") in rows
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['shfit'\].*valid options: shift"):
            kgp.KernelRegressor(solver="toy-solver", solver_options={"shfit": 1}).fit(X, y)
    finally:
        kgp.unregister(name)
    with pytest.raises(UnknownPluginError, match="toy-solver"):
        kgp.get_solver("toy-solver")


def test_duplicate_name_names_both_origins():
    first = kgp.register(_plugin("first_plugin", "dup-solver"))
    try:
        with pytest.raises(PluginConflictError) as info:
            kgp.register(_plugin("second_plugin", "dup-solver"))
        message = str(info.value)
        assert "first_plugin" in message and "second_plugin" in message and "dup-solver" in message
        # the clash was rolled back: the first registration still works
        assert isinstance(kgp.get_solver("dup-solver"), ScaledExact)
    finally:
        kgp.unregister(first)


def test_duplicate_with_builtin_is_refused():
    with pytest.raises(PluginConflictError, match="exact.*distribution kgp"):
        kgp.register(_plugin("shadowing_plugin", "exact"))
    assert type(kgp.get_solver("exact")).__name__ == "ExactSolver"


def test_reregistering_a_taken_plugin_name_is_refused_by_kgp():
    name = kgp.register(_plugin("taken_plugin", "taken-solver"))
    try:
        with pytest.raises(PluginConflictError) as info:
            kgp.register(_plugin("other_module", "other-solver"), name="taken_plugin")
        assert str(info.value) == (
            "a plugin named 'taken_plugin' is already registered (registered at runtime); "
            "call kgp.unregister('taken_plugin') first, or pass another name="
        )
        assert "other-solver" not in kgp.registry.registry.names("solver")
        module = kgp.registry.registry.pm.get_plugin(name)
        with pytest.raises(PluginConflictError, match=r"already registered as 'taken_plugin'.*kgp.unregister"):
            kgp.register(module, name="same_object_again")
    finally:
        kgp.unregister(name)


def _misspelt_plugin(name):
    module = _plugin(name, "misspelt-solver")  # a valid hook too: the whole plugin must still be refused

    @kgp.hookimpl
    def register_selector(register):
        register("never-selector", object())

    module.register_selector = register_selector
    return module


def test_runtime_plugin_with_a_misspelt_hook_is_refused_with_the_closest_hook():
    with pytest.raises(PluginLoadError) as info:
        kgp.register(_misspelt_plugin("misspelt_plugin"))
    assert str(info.value) == (
        "kgp plugin 'misspelt_plugin' implements hook 'register_selector' (did you mean 'register_selectors'?), "
        "which kgp does not define (kgp's hooks: register_solvers, register_selectors, register_predictors, "
        "register_objectives, register_recipes) and was not registered"
    )
    assert info.value.failure.stage == "unknown-hook" and info.value.__cause__ is None
    # nothing kept: neither its valid hook's names nor its plugin name
    assert "misspelt-solver" not in kgp.registry.registry.names("solver")
    assert not kgp.registry.registry.pm.has_plugin("misspelt_plugin")
    assert not hasattr(kgp.registry.registry.pm.hook, "register_selector") or not (
        kgp.registry.registry.pm.hook.register_selector.get_hookimpls()
    )
    kgp.unregister(kgp.register(_plugin("misspelt_plugin", "misspelt-solver")))  # the name is free


def _raising_plugin(name):
    module = types.ModuleType(name)

    @kgp.hookimpl
    def register_solvers(register):
        register("half-registered", ScaledExact())
        raise KeyError("missing setting")

    module.register_solvers = register_solvers
    return module


def test_runtime_plugin_whose_hook_raises_is_refused_and_its_name_freed():
    with pytest.raises(PluginLoadError) as info:
        kgp.register(_raising_plugin("raising_plugin"))
    assert str(info.value) == (
        "kgp plugin 'raising_plugin' raised in register_solvers and was not registered: KeyError: 'missing setting'"
    )
    assert isinstance(info.value.__cause__, KeyError)
    failure = info.value.failure
    assert failure.stage == "hook" and failure.names == (("solver", "half-registered"),)
    assert "KeyError: 'missing setting'" in failure.traceback and "register_solvers" in failure.traceback
    with pytest.raises(UnknownPluginError, match="unknown solver 'half-registered'"):
        kgp.get_solver("half-registered")  # nothing it registered before raising was kept
    # The fixed plugin registers under the same name (pluggy's raw "Plugin name already registered" before).
    name = kgp.register(_plugin("raising_plugin", "half-registered"))
    try:
        assert name == "raising_plugin" and isinstance(kgp.get_solver("half-registered"), ScaledExact)
    finally:
        kgp.unregister(name)


def test_runtime_plugin_with_a_bad_hook_signature_is_refused_and_its_name_freed():
    module = types.ModuleType("badsig_plugin")

    @kgp.hookimpl
    def register_solvers(register, unexpected_argument):
        pass

    module.register_solvers = register_solvers
    with pytest.raises(PluginLoadError, match=r"'badsig_plugin' has a hook implementation pluggy rejects") as info:
        kgp.register(module)
    assert info.value.failure.stage == "validation" and "unexpected_argument" in str(info.value)
    assert not kgp.registry.registry.pm.has_plugin("badsig_plugin")


def test_load_failure_prints_as_its_message():
    failure = LoadFailure("p", "d", "import", "ImportError: x", "kgp plugin 'p' failed", "Traceback ...")
    assert str(failure) == "kgp plugin 'p' failed" and f"FAILED: {failure}" == "FAILED: kgp plugin 'p' failed"
    with pytest.raises(AttributeError):
        failure.message = "changed"  # frozen: records of what happened


def test_merge_options_checks_the_type_before_converting():
    with pytest.raises(TypeError, match=r"^options for solver 'x': expected a dict, got list$"):
        merge_options("solver 'x'", {"a": 1}, [("a", 2)])  # dict() would have accepted the pairs
    assert merge_options("solver 'x'", {"a": 1}, types.MappingProxyType({"a": 2})) == {"a": 2}
    assert merge_options("solver 'x'", {"a": 1}, None) == {"a": 1}


def test_unknown_names_list_available():
    with pytest.raises(UnknownPluginError, match=r"unknown solver 'nope'; available solvers: .*exact"):
        kgp.get_solver("nope")
    with pytest.raises(UnknownPluginError, match=r"available selectors: .*uniform"):
        kgp.get_selector("nope")
    X = np.zeros((5, 1))
    with pytest.raises(ValueError, match="unknown solver 'nope'"):
        kgp.KernelRegressor(solver="nope").fit(X, X[:, 0])


def _fake_distribution(root, dist, entry_points, modules):
    """Create an importable distribution (dist-info + modules) under ``root``."""
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = ["[kgp]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def _env_for(path, **env):
    """The test environment minus kgp's switches, with ``path`` and this checkout (kgp, built-ins) importable."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KGP_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(path), repo, os.path.join(repo, "plugins")])
    return full_env


def _run(code, path, **env):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env_for(path, **env), timeout=120
    )


def test_entry_points_broken_plugin_and_switches(tmp_path):
    _fake_distribution(
        tmp_path,
        "good-dist",
        {"good": "good_plugin", "broken": "broken_plugin"},
        {
            "good_plugin": """
                import kgp
                class S:
                    option_defaults = {}
                    capabilities = kgp.Capabilities()
                    def fit(self, problem):
                        raise NotImplementedError
                @kgp.hookimpl
                def register_solvers(register):
                    register("good-solver", S())
            """,
            "broken_plugin": "raise ImportError('missing dependency xyz')\n",
        },
    )
    code = (
        "import warnings, kgp\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    names = kgp.registry.registry.names('solver')\n"
        "print('SOLVERS', names)\n"
        "print('WARN', [str(x.message) for x in w])\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "good-solver" in out.stdout and "exact" in out.stdout
    assert "'broken'" in out.stdout and "good-dist" in out.stdout and "missing dependency xyz" in out.stdout

    disabled = _run(code, tmp_path, KGP_DISABLE_ENTRYPOINTS="1")
    assert "good-solver" not in disabled.stdout and "exact" in disabled.stdout
    assert "missing dependency" not in disabled.stdout

    only = _run(code, tmp_path, KGP_PLUGINS="good,exact")
    assert "good-solver" in only.stdout and "'exact'" in only.stdout and "uniform" not in only.stdout

    listing = subprocess.run(
        [sys.executable, "-m", "kgp", "plugins"],
        capture_output=True,
        text=True,
        env=_env_for(tmp_path),
        timeout=120,
    )
    assert listing.returncode == 1, listing.stderr  # a plugin failed to load: `kgp plugins` says so by its status
    row = next(line for line in listing.stdout.splitlines() if line.startswith("good-solver"))
    assert "good-dist" in row and "1.2.3" in row
    assert "FAILED" in listing.stdout and "broken" in listing.stdout


def test_entry_point_name_clash_reports_both_distributions(tmp_path):
    src = """
        import kgp
        class S:
            option_defaults = {}
            capabilities = kgp.Capabilities()
            def fit(self, problem):
                raise NotImplementedError
        @kgp.hookimpl
        def register_solvers(register):
            register("clash-solver", S())
    """
    _fake_distribution(tmp_path / "a", "dist-a", {"a": "plugin_a"}, {"plugin_a": src})
    _fake_distribution(tmp_path / "b", "dist-b", {"b": "plugin_b"}, {"plugin_b": src})
    code = (
        "import kgp\n"
        "try:\n"
        "    kgp.get_solver('clash-solver')\n"
        "except kgp.registry.PluginConflictError as e:\n"
        "    print('ERR', e)\n"
        "print('EXACT', kgp.get_solver('exact') is not None)\n"
    )
    path = f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}"
    out = _run(code, path)
    assert out.returncode == 0, out.stderr
    assert "dist-a" in out.stdout and "dist-b" in out.stdout and "clash-solver" in out.stdout
    assert "EXACT True" in out.stdout  # other names keep working


def test_fresh_registry_loads_builtins_through_entry_points():
    reg = Registry()
    info = reg.get("solver", "exact")
    assert info.distribution == "kgp" and info.plugin == "exact"
    assert reg.get("selector", "uniform").distribution == "kgp"


# ---------------------------------------------------------------------------------------------
# Loading once, from any thread (without the lock 7 of 8 threads saw "available solvers: (none)")
# ---------------------------------------------------------------------------------------------
RACE = """
import threading
import kgp

barrier = threading.Barrier(8)
errors = []


def lookup():
    barrier.wait()  # all eight threads reach the registry's first use together
    try:
        assert type(kgp.get_solver("exact")).__name__ == "ExactSolver"
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")


threads = [threading.Thread(target=lookup) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(errors))
print("\\n".join(errors[:1]))
"""


@pytest.mark.slow
def test_first_lookup_from_eight_threads_in_a_fresh_process_sees_every_plugin(tmp_path):
    """10 fresh processes, 8 threads each behind a barrier: before the fix every process had 7 failures."""
    env = _env_for(tmp_path, KGP_DISABLE_ENTRYPOINTS="1")
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(10)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err
        failed, _, first = out.partition("\n")
        assert failed == "0", f"{failed} of 8 threads failed, e.g. {first.strip()}"


def test_lookups_during_a_slow_discovery_wait_for_it(monkeypatch):
    """Threads that arrive while the registry is still importing plugins wait and then see all of them."""
    import threading
    import time

    from kgp import registry as registry_module

    loaded = registry_module.load_entry_points

    def slow_discovery(*args, **kwargs):
        time.sleep(0.3)  # an entry point importing a heavy dependency
        return loaded(*args, **kwargs)

    monkeypatch.setattr(registry_module, "load_entry_points", slow_discovery)
    reg = Registry()
    barrier = threading.Barrier(8)
    seen: list = []

    def lookup():
        barrier.wait()
        try:
            seen.append(type(reg.get("solver", "exact").obj).__name__)
        except Exception as exc:  # the race reported UnknownPluginError here
            seen.append(repr(exc))

    threads = [threading.Thread(target=lookup) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == ["ExactSolver"] * 8
    assert len({id(reg.pm)} | {id(reg.pm) for _ in range(3)}) == 1  # one plugin manager, loaded once


def test_a_plugin_looking_names_up_while_it_is_imported_sees_the_plugins_loaded_so_far(monkeypatch):
    """Re-entrant use from the loading thread (a plugin module calling kgp at import) does not deadlock."""
    from kgp import registry as registry_module

    loaded = registry_module.load_entry_points
    during: list = []

    def discovery_that_looks_up(admit, *args, **kwargs):
        during.append(reg.names("predictor"))  # the core's predictor is registered before the entry points
        return loaded(admit, *args, **kwargs)

    monkeypatch.setattr(registry_module, "load_entry_points", discovery_that_looks_up)
    reg = Registry()
    assert "exact" in reg.names("solver")
    assert during == [["kernel_expansion"]]


def test_each_plugins_hooks_run_once_as_it_registers_and_unhashable_plugins_work():
    """Hooks run through pluggy's historic relay: once per plugin, never again when others register."""
    calls = []

    @kgp.hookimpl
    def register_solvers(register):
        calls.append("a")
        register("once-solver", ScaledExact())

    plugin = types.SimpleNamespace(register_solvers=register_solvers)  # unhashable: defines __eq__
    first = kgp.register(plugin, name="once-plugin")
    second = kgp.register(_plugin("other_plugin", "other-once-solver"))
    try:
        assert calls == ["a"]  # registering another plugin did not call this one's hook again
        assert isinstance(kgp.get_solver("once-solver"), ScaledExact)
        assert kgp.registry.registry.get("solver", "once-solver").plugin == "once-plugin"
    finally:
        kgp.unregister(first)
        kgp.unregister(second)
    assert "once-solver" not in kgp.registry.registry.names("solver")
