"""Third-party plugins as a user meets them: installed with pip, found by name, listed, uninstalled.

The slow test installs kgp and ``plugins/kgp-example`` with ``pip install --target`` into a temporary
folder (no virtual environment needed: the folder goes on ``PYTHONPATH`` of the subprocesses, and
torch & co. come from the running environment). The other tests build tiny fake distributions (a
``*.dist-info`` with ``entry_points.txt`` next to a module) to check the documented messages for a
name clash and for broken plugins (kgp/registry.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import kgp
from kgp.cli import main
from kgp.registry import PluginConflictError, Registry, UnknownPluginError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "plugins" / "kgp-example"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", ".pytest_cache")

# kgp's own solvers: they load whatever KGP_PLUGINS lists (the estimator's defaults name built-ins)
# (conftest.py sets KGP_DISABLE_ENTRYPOINTS=1, so the process registry holds exactly the built-ins)
BUILTIN_SOLVERS = ", ".join(kgp.registry.registry.names("solver"))


def _env(*paths: Path | str, **extra: str) -> dict[str, str]:
    """The test environment minus kgp's plugin switches, with ``paths`` as PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KGP_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env.update(extra)
    return env


def _python(args: list[str], env: dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    # cwd is a scratch folder: running from the checkout would import its kgp instead of the installed one.
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def _rows(listing: str) -> dict[str, list[str]]:
    """``kgp plugins`` output -> {name: columns} for the table rows (name kind plugin distribution version)."""
    rows = {}
    for line in listing.splitlines():
        cols = line.split()
        if len(cols) == 5 and cols[1] in ("solver", "selector", "predictor"):
            rows[cols[0]] = cols
    return rows


def _setuptools_can_build_offline() -> bool:
    """Whether this environment can build both projects without fetching setuptools (PEP 639 licences: >= 77)."""
    try:
        import setuptools
    except ImportError:
        return False
    major = int(setuptools.__version__.split(".")[0])
    return major >= 77


# ---------------------------------------------------------------------------------------------
# pip install --target of kgp + kgp-example
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("third_party")
    # Build from copies so that setuptools writes build/ and *.egg-info there, not into the checkout.
    kgp_src = root / "kgp-src"
    shutil.copytree(REPO / "kgp", kgp_src / "kgp", ignore=IGNORE)
    shutil.copytree(REPO / "plugins" / "kgp_builtins", kgp_src / "plugins" / "kgp_builtins", ignore=IGNORE)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, kgp_src / name)
    example_src = root / "kgp-example"
    shutil.copytree(EXAMPLE, example_src, ignore=IGNORE)
    target = root / "site"
    cmd = ["-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check", "--quiet"]
    if _setuptools_can_build_offline():
        cmd.append("--no-build-isolation")  # else pip fetches setuptools from the package index
    result = _python([*cmd, "--target", str(target), str(kgp_src), str(example_src)], _env(), root, timeout=600)
    _ok(result)
    scratch = root / "work"
    scratch.mkdir()
    return {"root": root, "target": target, "cwd": scratch, "tests": example_src / "tests"}


USE_BY_NAME = """
import json, sys
import kgp, kgp_example
from kgp.testing import OracleSpec, dense_nystrom_mean, make_oracle_data, relative_error

data = make_oracle_data(OracleSpec())
model = kgp.KernelRegressor(solver="nystrom-direct", centers="kmeans++", n_centers=30, noise=1e-2, random_state=0)
model.fit(data.X, data.y[:, 0])
err = relative_error(model.predict(data.X_test), dense_nystrom_mean(data, centers=model.centers_)[:, 0])
model.save(sys.argv[1])
print(json.dumps({
    "kgp_file": kgp.__file__,
    "example_file": kgp_example.__file__,
    "plugins": {i.name: [i.kind, i.plugin, i.distribution, i.version] for i in kgp.list_plugins()},
    "rel_error": err,
    "centers_shape": list(model.centers_.shape),
    "centers_from_X": bool((model.centers_[:, None, :] == data.X[None]).all(-1).any(-1).all()),
    "potential": model.selection_info_.get("potential"),
}))
"""

AFTER_UNINSTALL = """
import json, sys
import kgp
out = {"solvers": kgp.registry.registry.names("solver"), "selectors": kgp.registry.registry.names("selector")}
try:
    kgp.load(sys.argv[1])
except ValueError as exc:
    out["load_error"] = str(exc)
try:
    kgp.fitting.resolve_plan(kgp.KernelRegressor(solver="nystrom-direct").get_params())
except ValueError as exc:
    out["solver_error"] = str(exc)
print(json.dumps(out))
"""


def _uninstall(target: Path, dist_info: str) -> None:
    """What ``pip uninstall`` does (it refuses locations outside its environment): delete every RECORD entry."""
    record = target / dist_info / "RECORD"
    for line in record.read_text().splitlines():
        path = (target / line.split(",")[0]).resolve()
        if path.is_file() and target.resolve() in path.parents:
            path.unlink()
    for folder in sorted((p for p in target.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()


@pytest.mark.slow
def test_pip_installed_plugin_works_by_name_is_listed_and_uninstalls(installed):
    target, cwd = installed["target"], installed["cwd"]
    model_file = cwd / "model.kgp.pt"
    env = _env(target)

    # 1. Found through its entry points, usable by name from the public API.
    info = json.loads(_ok(_python(["-c", USE_BY_NAME, str(model_file)], env, cwd)).splitlines()[-1])
    assert Path(info["kgp_file"]).is_relative_to(target), "the installed kgp must be the one imported"
    assert Path(info["example_file"]).is_relative_to(target)
    assert info["plugins"]["nystrom-direct"] == ["solver", "nystrom-direct", "kgp-example", "0.1.0"]
    assert info["plugins"]["kmeans++"] == ["selector", "kmeanspp", "kgp-example", "0.1.0"]
    assert info["plugins"]["exact"][2] == "kgp"
    assert info["rel_error"] < 1e-9  # against the float64 dense Nystrom solution at the chosen centers
    assert info["centers_shape"] == [30, 3] and info["centers_from_X"] and info["potential"] > 0

    # 2. `kgp plugins` (the installed console script) lists them with their distribution and version.
    script = target / "bin" / "kgp"
    listing_cmd = [str(script), "plugins"] if script.exists() else ["-m", "kgp", "plugins"]
    listing = (
        _ok(subprocess.run(listing_cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=300, check=False))
        if script.exists()
        else _ok(_python(listing_cmd, env, cwd))
    )
    rows = _rows(listing)
    assert rows["nystrom-direct"] == ["nystrom-direct", "solver", "nystrom-direct", "kgp-example", "0.1.0"], listing
    assert rows["kmeans++"] == ["kmeans++", "selector", "kmeanspp", "kgp-example", "0.1.0"], listing
    assert rows["exact"][3] == "kgp"

    # 3. The switches of docs/plugin-loading.md keep it out.
    for switch in ({"KGP_DISABLE_ENTRYPOINTS": "1"}, {"KGP_PLUGINS": "exact,uniform"}):
        rows = _rows(_ok(_python(["-m", "kgp", "plugins"], _env(target, **switch), cwd)))
        assert "nystrom-direct" not in rows and "kmeans++" not in rows and "exact" in rows, switch
    rows = _rows(_ok(_python(["-m", "kgp", "plugins"], _env(target, KGP_PLUGINS="nystrom-direct,exact"), cwd)))
    # kgp's own always load (the defaults name them); the unlisted third-party entry point does not
    assert "nystrom-direct" in rows and "kmeans++" not in rows and "uniform" in rows

    # 4. The distribution's own test suite (kgp.testing conformance included) passes on the installed copy.
    suite = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(installed["tests"])], env, cwd, timeout=600)
    assert suite.returncode == 0, suite.stdout[-4000:] + suite.stderr[-2000:]
    assert " passed" in suite.stdout

    # 5. Uninstalled: gone from the registry and the listing; its saved model names what is missing.
    dist_info = next(p.name for p in target.glob("kgp_example-*.dist-info"))
    _uninstall(target, dist_info)
    assert not (target / "kgp_example").exists() and not (target / dist_info).exists()
    after = json.loads(_ok(_python(["-c", AFTER_UNINSTALL, str(model_file)], env, cwd)).splitlines()[-1])
    assert "nystrom-direct" not in after["solvers"] and "kmeans++" not in after["selectors"]
    assert "exact" in after["solvers"] and "uniform" in after["selectors"]
    assert "fitted by solver 'nystrom-direct'" in after["load_error"] and "not installed" in after["load_error"]
    assert "unknown solver 'nystrom-direct'" in after["solver_error"]
    rows = _rows(_ok(_python(["-m", "kgp", "plugins"], env, cwd)))
    assert "nystrom-direct" not in rows and "kmeans++" not in rows and "exact" in rows


# ---------------------------------------------------------------------------------------------
# Name clashes and broken plugins: the documented messages
# ---------------------------------------------------------------------------------------------
def _fake_dist(site: Path, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[kgp]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))


SHADOW_EXACT = """
    import kgp
    from kgp_builtins.exact import ExactSolver

    class ShadowExact(ExactSolver):
        pass

    @kgp.hookimpl
    def register_solvers(register):
        register("exact", ShadowExact())        # clashes with kgp's built-in
        register("shadow-only", ShadowExact())  # unique: stays usable
"""

REPORT = """
import json, warnings
import numpy as np
import kgp
from kgp.cli import main

out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["solvers"] = kgp.registry.registry.names("solver")
out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
X = np.linspace(0, 1, 20)[:, None]
for name in ("exact", "shadow-only"):
    try:
        kgp.KernelRegressor(solver=name).fit(X, np.sin(X[:, 0]))
        out[name] = "ok"
    except ValueError as exc:  # PluginConflictError and UnknownPluginError are ValueErrors
        out[name] = type(exc).__name__ + ": " + str(exc)
if out["exact"] == "ok":
    out["exact_class"] = type(kgp.get_solver("exact")).__name__
out["failures"] = [str(f) for f in kgp.registry.registry.load_failures]
out["plugins_status"] = main(["plugins"])  # the `kgp plugins` listing, in the same process
print(json.dumps(out))
"""


def _report(site: Path, cwd: Path, **switches: str) -> tuple[dict, str]:
    """Run REPORT with ``site`` on the path; return its JSON and the `kgp plugins` listing above it."""
    # This checkout's kgp and built-ins, not whichever copy the environment has installed.
    env = _env(site, REPO, REPO / "plugins", **switches)
    lines = _ok(_python(["-c", REPORT], env, cwd)).splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_third_party_registering_a_builtin_name_is_ignored_and_the_builtin_wins(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "kgp-shadow", "9.9", {"shadow": "kgp_shadow"}, {"kgp_shadow": SHADOW_EXACT})
    out, listing = _report(site, tmp_path)
    # Policy: built-ins win, so an installed package cannot make `exact` unusable for everyone.
    expected = (
        "solver name 'exact' of plugin 'shadow' from distribution kgp-shadow 9.9 is ignored: kgp's built-in "
        f"plugin 'exact' from distribution kgp {kgp.__version__} has that name and built-ins win; rename the "
        "solver in kgp-shadow's register_solvers, or uninstall kgp-shadow"
    )
    assert out["warnings"] == [expected]  # warned once, at discovery
    assert out["exact"] == "ok" and out["exact_class"] == "ExactSolver"  # kgp's own, not the subclass
    assert out["shadow-only"] == "ok"  # the plugin's other names work
    assert f"SHADOWED: {expected}" in listing and "CONFLICT" not in listing
    assert _rows(listing)["exact"][3] == "kgp" and _rows(listing)["shadow-only"][3] == "kgp-shadow"
    assert out["plugins_status"] == 1  # `kgp plugins` fails so that CI notices the shadowing
    # Without the third party: no warning, clean status.
    for switch in ({"KGP_PLUGINS": "exact,uniform"}, {"KGP_DISABLE_ENTRYPOINTS": "1"}):
        fixed, listing = _report(site, tmp_path, **switch)
        assert fixed["exact"] == "ok" and fixed["warnings"] == [] and "SHADOWED" not in listing, switch
        assert fixed["shadow-only"].startswith("UnknownPluginError: unknown solver 'shadow-only'")
        assert fixed["plugins_status"] == 0


def test_broken_plugins_are_skipped_and_blame_their_distribution(tmp_path):
    site = tmp_path / "site"
    _fake_dist(
        site,
        "kgp-broken",
        "0.0.1",
        {"needs-dep": "kgp_broken_dep", "no-attr": "kgp_broken_dep2:plugin_object"},
        {"kgp_broken_dep": "import some_missing_dependency_xyz\n", "kgp_broken_dep2": "x = 1\n"},
    )
    out, listing = _report(site, tmp_path)
    expected = [
        "kgp plugin 'needs-dep' (entry point 'kgp_broken_dep' of distribution kgp-broken) failed to load and was "
        "skipped: ModuleNotFoundError: No module named 'some_missing_dependency_xyz'",
        "kgp plugin 'no-attr' (entry point 'kgp_broken_dep2:plugin_object' of distribution kgp-broken) failed to "
        "load and was skipped: AttributeError: module 'kgp_broken_dep2' has no attribute 'plugin_object'",
    ]
    assert sorted(out["warnings"]) == sorted(expected)
    assert sorted(out["failures"]) == sorted(expected)
    assert out["exact"] == "ok"  # everything else keeps working
    for message in expected:
        assert f"FAILED: {message}" in listing
    assert "exact" in _rows(listing)
    assert out["plugins_status"] == 1


RAISES_IN_HOOK = """
    import kgp

    @kgp.hookimpl
    def register_solvers(register):
        raise RuntimeError("boom while registering")
"""

BAD_SIGNATURE = """
    import kgp

    @kgp.hookimpl
    def register_solvers(register, unexpected_argument):
        pass
"""


def test_plugin_failing_after_import_is_skipped_and_blamed(tmp_path):
    site = tmp_path / "site"
    _fake_dist(
        site,
        "kgp-badhook",
        "0.2",
        {"raises": "kgp_raises", "badsig": "kgp_badsig"},
        {"kgp_raises": RAISES_IN_HOOK, "kgp_badsig": BAD_SIGNATURE},
    )
    out, listing = _report(site, tmp_path)
    assert out["exact"] == "ok"
    for plugin in ("raises", "badsig"):
        assert any(f"'{plugin}'" in w and "kgp-badhook" in w for w in out["warnings"]), plugin
        assert any(f"'{plugin}'" in f and "kgp-badhook" in f for f in out["failures"]), plugin


# ---------------------------------------------------------------------------------------------
# Plugin mistakes, discovered in this process: a fresh Registry over a fake site folder (no
# interpreter start-up per case). KGP_PLUGINS pins the entry points, whatever else is installed.
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """``(site, make)``: put fake distributions in ``site``; ``make(**env)`` installs a fresh global registry."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    for var in ("KGP_DISABLE_ENTRYPOINTS", "KGP_PLUGINS"):
        monkeypatch.delenv(var, raising=False)

    def make(**env: str) -> tuple[Registry, list[str]]:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        reg = Registry()
        monkeypatch.setattr(kgp.registry, "registry", reg)  # what get_solver, the models and the CLI use
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reg.infos()  # discovery
        return reg, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    return site, make


def _plugins_command(capsys, *args: str) -> tuple[int, str]:
    status = main(["plugins", *args])
    return status, capsys.readouterr().out


MISSPELT_HOOK = """
    import kgp
    from kgp_builtins.exact import ExactSolver

    @kgp.hookimpl
    def register_solver(register):  # the hook is register_solvers
        register("typo-solver", ExactSolver())
"""


def test_entry_point_with_a_misspelt_hook_is_skipped_naming_the_closest_hook(fresh, capsys):
    site, make = fresh
    _fake_dist(site, "kgp-typo", "0.3", {"typo": "kgp_t_typo"}, {"kgp_t_typo": MISSPELT_HOOK})
    reg, warned = make(KGP_PLUGINS="exact,typo")
    expected = (
        "kgp plugin 'typo' (entry point 'kgp_t_typo' of distribution kgp-typo) implements hook 'register_solver' "
        "(did you mean 'register_solvers'?), which kgp does not define (kgp's hooks: register_solvers, "
        "register_selectors, register_predictors, register_objectives, register_recipes) and was skipped"
    )
    assert warned == [expected]
    [failure] = reg.load_failures
    assert (failure.plugin, failure.distribution, failure.stage, str(failure)) == (
        "typo",
        "kgp-typo",
        "unknown-hook",
        expected,
    )
    assert not reg.pm.has_plugin("typo")
    with pytest.raises(UnknownPluginError) as info:
        kgp.get_solver("typo-solver")  # its names are unknown: the note points at the failed plugin
    assert str(info.value).startswith(
        f"unknown solver 'typo-solver'; available solvers: {BUILTIN_SOLVERS}; note: these plugins failed to load "
        "and may provide it: plugin 'typo' from distribution kgp-typo (see `kgp plugins`)"
    )
    status, listing = _plugins_command(capsys)
    assert status == 1 and f"FAILED: {expected}" in listing


CLASH = """
    import kgp
    from kgp_builtins.exact import ExactSolver

    @kgp.hookimpl
    def register_solvers(register):
        register("clash-solver", ExactSolver())
        register("{own}", ExactSolver())
"""


def test_two_third_parties_clashing_leave_the_name_unusable_and_unlisted(fresh, capsys):
    site, make = fresh
    for letter in "ab":
        module = f"kgp_t_clash_{letter}"
        _fake_dist(site, f"dist-{letter}", "1.0", {letter: module}, {module: CLASH.format(own=f"{letter}-only")})
    reg, warned = make(KGP_PLUGINS="exact,a,b")
    expected = (
        "solver name 'clash-solver' is registered twice: by plugin 'a' from distribution dist-a 1.0 and plugin 'b' "
        "from distribution dist-b 1.0; it is unusable until you uninstall one of them or leave one out with KGP_PLUGINS"
    )
    assert warned == [expected]
    with pytest.raises(PluginConflictError) as info:
        kgp.get_solver("clash-solver")
    assert str(info.value) == expected
    assert reg.names("solver") == sorted(["a-only", "b-only", *BUILTIN_SOLVERS.split(", ")])  # never the unusable name
    assert "clash-solver" not in [i.name for i in kgp.list_plugins()]
    with pytest.raises(UnknownPluginError) as unknown:
        kgp.get_solver("nope")
    assert f"available solvers: a-only, b-only, {BUILTIN_SOLVERS}" in str(unknown.value)
    assert reg.conflicts == {("solver", "clash-solver"): reg.conflicts[("solver", "clash-solver")]}
    assert [i.plugin for i in reg.conflicts[("solver", "clash-solver")]] == ["a", "b"] and reg.shadowed == {}
    status, listing = _plugins_command(capsys)
    assert status == 1 and f"CONFLICT: {expected}" in listing and "clash-solver" not in _rows(listing)


FRAGILE_IMPORT = """
    raise ImportError("missing dependency xyz")
"""

FRAGILE_HOOK = """
    import kgp
    from kgp_builtins.exact import ExactSolver

    @kgp.hookimpl
    def register_solvers(register):
        register("half-solver", ExactSolver())
        raise ValueError("bad configuration")
"""


def test_names_of_plugins_that_failed_to_load_say_so_with_the_traceback_kept(fresh, capsys):
    site, make = fresh
    _fake_dist(
        site,
        "kgp-fragile",
        "2.0",
        {"broken": "kgp_t_broken", "half": "kgp_t_half"},
        {"kgp_t_broken": FRAGILE_IMPORT, "kgp_t_half": FRAGILE_HOOK},
    )
    reg, warned = make(KGP_PLUGINS="exact,broken,half")
    assert len(warned) == 2
    broken, half = reg.load_failures
    assert (broken.plugin, broken.stage, broken.error) == ("broken", "import", "ImportError: missing dependency xyz")
    assert (half.plugin, half.stage, half.names) == ("half", "hook", (("solver", "half-solver"),))
    assert 'raise ImportError("missing dependency xyz")' in broken.traceback and "kgp_t_broken.py" in broken.traceback
    assert 'raise ValueError("bad configuration")' in half.traceback
    assert str(half) == (
        "kgp plugin 'half' (entry point 'kgp_t_half' of distribution kgp-fragile) raised in register_solvers and "
        "was skipped: ValueError: bad configuration"
    )
    # The entry point named like the solver, and a plugin that registered the name before raising:
    with pytest.raises(UnknownPluginError) as info:
        kgp.get_solver("broken")
    assert str(info.value) == (
        "solver 'broken' is unavailable: plugin 'broken' from distribution kgp-fragile failed to load: ImportError: "
        f"missing dependency xyz (traceback: `kgp plugins --traceback`); available solvers: {BUILTIN_SOLVERS}"
    )
    with pytest.raises(UnknownPluginError, match=r"^solver 'half-solver' is unavailable: plugin 'half' from "):
        kgp.get_solver("half-solver")
    status, listing = _plugins_command(capsys, "--traceback")
    assert status == 1 and f"FAILED: {half}" in listing
    assert "Traceback of plugin 'broken':" in listing and "kgp_t_broken.py" in listing


def test_kgp_plugins_naming_only_falkon_keeps_the_defaults(fresh):
    """KGP_PLUGINS=falkon keeps the default solver 'exact' and falkon's default selector 'uniform' (built-ins load)."""
    _, make = fresh
    reg, warned = make(KGP_PLUGINS="falkon")
    assert warned == [] and {"exact", "falkon"} <= set(reg.names("solver")) and "uniform" in reg.names("selector")
    X = np.linspace(0, 1, 30)[:, None]
    exact = kgp.KernelRegressor(noise=0.1).fit(X, X[:, 0])  # solver="exact" by default
    falkon = kgp.KernelRegressor(solver="falkon", noise=0.1, n_centers=30).fit(X, X[:, 0])  # centers="uniform"
    # with every point a center, FALKON solves the exact problem
    np.testing.assert_allclose(falkon.predict(X), exact.predict(X), atol=1e-6)


def test_kgp_plugins_naming_no_installed_entry_point_warns(fresh):
    _, make = fresh
    reg, warned = make(KGP_PLUGINS="exact,falcon")
    [message] = warned
    assert message.startswith(
        "KGP_PLUGINS=exact,falcon lists 'falcon', which is not an installed kgp entry point (did you mean "
        "'falkon'?); installed entry points: "
    )
    assert {"exact", "falkon", "uniform"} <= set(message.split("installed entry points: ")[1].split(", "))
    assert "exact" in reg.names("solver") and reg.load_failures == []


def test_disabled_entry_points_explain_a_missing_third_party_name(fresh):
    site, make = fresh
    _fake_dist(site, "kgp-extra", "0.1", {"extra": "kgp_t_extra"}, {"kgp_t_extra": CLASH.format(own="extra")})
    make(KGP_DISABLE_ENTRYPOINTS="1")
    with pytest.raises(UnknownPluginError) as info:
        kgp.get_solver("extra")
    assert str(info.value).startswith(
        "solver 'extra' is not loaded: KGP_DISABLE_ENTRYPOINTS=1 loads only kgp's own plugins, not the entry point "
        "'extra' (distribution kgp-extra) that provides it; unset KGP_DISABLE_ENTRYPOINTS to use it; available "
        "solvers: "
    )


def test_an_entry_point_name_declared_by_two_distributions_loads_once(fresh):
    site, make = fresh
    for letter in "ab":
        module = f"kgp_t_dup_{letter}"
        _fake_dist(site, f"dup-{letter}", "1.0", {"dup": module}, {module: CLASH.format(own=f"dup-{letter}")})
    reg, warned = make(KGP_PLUGINS="dup")
    [failure] = reg.load_failures
    loaded = reg.get("solver", "clash-solver").distribution
    skipped = {"dup-a": "dup-b", "dup-b": "dup-a"}[loaded]
    assert (failure.plugin, failure.distribution, failure.stage) == ("dup", skipped, "duplicate-name")
    assert warned == [str(failure)] and f"distribution {loaded} already declares an entry point named 'dup'" in (
        str(failure)
    )
    assert reg.names("solver") == sorted(["clash-solver", loaded, *BUILTIN_SOLVERS.split(", ")])
