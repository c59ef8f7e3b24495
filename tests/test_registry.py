"""Plugin registry: runtime registration, conflicts, broken plugins, entry-point switches."""

import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch

import kgp
from kgp.registry import PluginConflictError, Registry, UnknownPluginError


class ScaledExact:
    """A toy third-party solver: the exact solution computed with a dense solve (no Cholesky)."""

    option_defaults = {"shift": 0.0}
    uses_centers = False

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


def _run(code, path, **env):
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KGP_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = str(path)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


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
                    uses_centers = False
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
        env={
            **{k: v for k, v in __import__("os").environ.items() if not k.startswith("KGP_")},
            "PYTHONPATH": str(tmp_path),
        },
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith("good-solver"))
    assert "good-dist" in row and "1.2.3" in row
    assert "FAILED" in listing.stdout and "broken" in listing.stdout


def test_entry_point_name_clash_reports_both_distributions(tmp_path):
    src = """
        import kgp
        class S:
            option_defaults = {}
            uses_centers = False
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
    import os

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
