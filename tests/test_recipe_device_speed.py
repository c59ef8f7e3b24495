"""solver='auto': FALKON's center caps, from the device's float64 rate (measured once, or pinned by a
setting) and from FALKON's passes over the rows (no rate)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from kgp_builtins.falkon.solver import FalkonSolver
from kgp_builtins.recipes.rule import (
    FALKON_PASSES,
    MAX_CENTERS,
    REFERENCE_FLOPS,
    SETUP_SECONDS,
    SETUP_SHARE,
    center_caps,
    passes_cap,
    passes_flops,
    setup_flops,
    time_cap,
)

import kgp
from kgp import device_speed
from kgp.fitting.plan import DataShape, resolve_plan
from kgp.recipes import RecipeRequest

rng = np.random.default_rng(5)
X = rng.uniform(-2, 2, size=(300, 3))
Y = np.sin(X[:, 0]) + 0.05 * rng.normal(size=300)
BIG = DataShape(n=10**6, d=4, k=1, dtype=torch.float64, device=torch.device("cpu"))


def _request(n=10**6, budget=2**40, **kw) -> RecipeRequest:
    base = dict(
        n=n,
        d=4,
        k=1,
        dtype=torch.float64,
        device=torch.device("cpu"),
        memory_budget=budget,
        max_exact_size=20_000,
        distributed=False,
        solver_auto=True,
        learn_auto=False,
    )
    return RecipeRequest(**{**base, **kw})


def _never(*args):
    raise AssertionError("the device probe ran")


@pytest.fixture
def no_probe(monkeypatch):
    """A fresh cache whose probe fails the test if it runs."""
    monkeypatch.setattr(device_speed, "_measured", {})
    monkeypatch.setattr(device_speed, "_probe", _never)


def test_the_time_cap_grows_as_the_cube_root_of_the_rate_from_a_floor_of_max_centers():
    assert time_cap(REFERENCE_FLOPS) == MAX_CENTERS  # the measured default on the reference CPU
    assert time_cap(None) == time_cap(1e6) == time_cap(REFERENCE_FLOPS / 3) == MAX_CENTERS  # slow: the floor
    fast = time_cap(100 * REFERENCE_FLOPS)
    assert fast == 52_000  # 11,241 x 100^(1/3) = 52,176, whole thousands
    assert setup_flops(fast) <= 100 * REFERENCE_FLOPS * SETUP_SECONDS < setup_flops(fast + 1_000)
    caps = [time_cap(f * REFERENCE_FLOPS) for f in (1, 2, 8, 100, 1_000)]
    assert caps == sorted(caps) and caps[2] == 22_000  # 8x the rate: twice the centers


def _balanced_centers(n: int, d: int) -> float:
    """Closed form of the passes cap above M = 5,000, where the setup is (5 / 3 + 8) M^3 flops: the M with
    29 / 3 M^3 = 0.5 x 21 n M (3 d + 65)."""
    return math.sqrt(0.5 * 21 * n * (3 * d + 65) / (29 / 3))


@pytest.mark.parametrize(("n", "d"), [(10**7, 8), (10**6, 28), (2 * 10**6, 8), (10**8, 8), (10**7, 28)])
def test_the_passes_cap_balances_the_setup_against_half_of_falkons_passes(n, d):
    assert passes_cap(n, d) == int(_balanced_centers(n, d)) // 1_000 * 1_000
    cap = passes_cap(n, d)
    assert setup_flops(cap) <= SETUP_SHARE * passes_flops(n, d, cap)
    assert setup_flops(cap + 1_000) > SETUP_SHARE * passes_flops(n, d, cap + 1_000)


def test_falkon_passes_are_its_default_iterations_and_the_right_hand_side():
    assert FALKON_PASSES == FalkonSolver.option_defaults["maxiter"].default + 1


def test_the_passes_cap_grows_with_n_and_d_and_leaves_the_measured_sets_to_the_time_cap():
    caps = [passes_cap(n, 8) for n in (10**4, 10**5, 10**6, 10**7, 10**8)]
    assert caps == sorted(caps) and caps[-1] > caps[-2] > caps[-3]
    assert passes_cap(10**6, 28) > passes_cap(10**6, 8)
    assert passes_cap(10, 8) == 0  # no whole thousand of centers is paid for by 10 rows
    # the six UCI sets (12,000-39,000 rows, d <= 81), airline (219,082 x 8) and 1e6 rows at d <= 8: the passes
    # cap is below MAX_CENTERS, so the centers are what the time and memory caps gave before it
    for n, d in [(39_000, 81), (219_082, 8), (10**6, 8), (1_300_000, 8)]:
        assert passes_cap(n, d) < MAX_CENTERS
        for flops in (None, REFERENCE_FLOPS, 1.6 * REFERENCE_FLOPS, 100 * REFERENCE_FLOPS):
            for budget in (24 * 9_000**2, 24 * 14_513**2, 2**40):
                request = _request(n=n, d=d, budget=budget, device_flops=flops)
                memory = math.isqrt(budget // 24)
                assert center_caps(request).n_centers == min(n, time_cap(flops), memory)


def test_at_1e7_rows_the_memory_cap_decides_on_every_host_without_a_probe(no_probe):
    """The 24 GB host's automatic budget holds 14,513 centers: the passes cap (31,000) is above it, so the rate
    cannot change M and is not measured, in one process or over ranks."""
    budget = 24 * 14_513**2 + 23
    for distributed in (False, True):
        caps = center_caps(_request(n=10**7, d=8, budget=budget, distributed=distributed, measure_flops=_never))
        assert (caps.n_centers, caps.passes_cap, caps.memory_cap) == (14_513, 31_000, 14_513)
        assert caps.flops is None and caps.source == ("distributed" if distributed else "not measured")
    # with room for more, a large n buys more centers than the rate would (2e6 rows: 13,000 > 11,241)
    caps = center_caps(_request(n=2 * 10**6, d=8, measure_flops=lambda: REFERENCE_FLOPS))
    assert (caps.n_centers, caps.time_cap, caps.passes_cap, caps.source) == (13_000, MAX_CENTERS, 13_000, "measured")
    reason = kgp.registry.get_recipe("auto").choose(_request(n=10**7, d=8, budget=budget)).reasons["n_centers"]
    assert "14,513 centers" in reason and "the passes cap 31,000" in reason


def test_a_pinned_rate_sizes_the_centers_up_to_the_memory_cap():
    params = kgp.KernelRegressor("rbf").get_params()
    with kgp.settings.device_flops(100 * REFERENCE_FLOPS), kgp.settings.memory_budget(2**40):
        plan = resolve_plan(params, BIG)
    assert plan.solver.name == "falkon" and plan.n_centers == 52_000
    assert plan.recipe.device == {
        "flops": 100 * REFERENCE_FLOPS,
        "source": "setting",
        "time_cap": 52_000,
        "passes_cap": 9_000,  # d = 4: sqrt(0.5 x 21 x 77 x 1e6 / (29 / 3)) = 9,145
        "memory_cap": math.isqrt(2**40 // 24),
    }
    with kgp.settings.device_flops(100 * REFERENCE_FLOPS), kgp.settings.memory_budget(24 * 30_000**2):
        assert resolve_plan(params, BIG).n_centers == 30_000  # the memory cap binds
    with kgp.settings.device_flops(1e9), kgp.settings.memory_budget(2**40):
        assert resolve_plan(params, BIG).n_centers == MAX_CENTERS  # a slow device keeps the default
    with kgp.settings.device_flops(100 * REFERENCE_FLOPS), kgp.settings.memory_budget(2**40):
        assert resolve_plan(params, dataclasses.replace(BIG, n=40_000)).n_centers == 40_000  # at most n


def test_the_measured_rate_is_positive_finite_and_measured_once_per_device(monkeypatch):
    monkeypatch.setattr(device_speed, "_measured", {})
    calls = []
    probe = device_speed._probe
    monkeypatch.setattr(device_speed, "_probe", lambda device: calls.append(device) or probe(device))
    rate = device_speed.measured_flops("cpu")
    assert rate is not None and math.isfinite(rate) and rate > 0
    assert device_speed.measured_flops(torch.device("cpu")) == rate and len(calls) == 1
    # a device that cannot run the probe: no rate, not tried again, the recipe keeps the default
    monkeypatch.setattr(device_speed, "_probe", lambda device: calls.append(device) or _raise_runtime())
    assert device_speed.measured_flops("meta") is None and device_speed.measured_flops("meta") is None
    assert len(calls) == 2


def _raise_runtime():
    raise RuntimeError("no float64 here")


def test_the_recipe_measures_only_where_the_time_cap_can_bind(no_probe):
    recipe = kgp.registry.get_recipe("auto")
    rates = []

    def measure():
        rates.append(2 * REFERENCE_FLOPS)
        return rates[-1]

    choice = recipe.choose(_request(measure_flops=measure))
    assert choice.n_centers == 14_000 and len(rates) == 1  # 2^(1/3) x 11,241 = 14,163
    memory = math.isqrt(2**40 // 24)
    assert choice.device == {
        "flops": 2 * REFERENCE_FLOPS,
        "source": "measured",
        "time_cap": 14_000,
        "passes_cap": 9_000,
        "memory_cap": memory,
    }
    assert "measured 2.12e+11 float64 flop/s" in choice.reasons["n_centers"]
    # not where n or the memory cap is at most MAX_CENTERS, the exact solve, given centers, a distributed fit
    for request, source in [
        (_request(n=11_000, max_exact_size=10_000, measure_flops=_never), "not measured"),
        (_request(budget=24 * 9_000**2, measure_flops=_never), "not measured"),
        (_request(distributed=True, measure_flops=_never), "distributed"),
        (_request(measure_flops=lambda: None), "unavailable"),
        (_request(), "unavailable"),  # a request built without a way to measure
    ]:
        choice = recipe.choose(request)
        assert choice.device["source"] == source and choice.device["flops"] is None
        assert choice.device["time_cap"] == MAX_CENTERS and choice.n_centers <= MAX_CENTERS
    assert recipe.choose(_request(n=5_000, measure_flops=_never)).device is None  # exact
    assert recipe.choose(_request(uses_centers_explicitly=True, measure_flops=_never)).device is None
    pinned = center_caps(_request(device_flops=8 * REFERENCE_FLOPS, measure_flops=_never))
    assert (pinned.n_centers, pinned.source) == (22_000, "setting")


def test_fits_without_a_time_cap_to_decide_never_run_the_probe(no_probe):
    exact = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=0.05).fit(X, Y)
    assert exact.solver_name_ == "exact" and "device" not in exact.recipe_
    with kgp.settings.max_exact_size(200):
        small = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=0.05, random_state=0).fit(X, Y)
    assert small.solver_name_ == "falkon" and small.recipe_["device"]["source"] == "not measured"


def test_recipe_reports_the_pinned_rate(no_probe):
    with kgp.settings.max_exact_size(200), kgp.settings.device_flops(REFERENCE_FLOPS):
        model = kgp.KernelRegressor("rbf", lengthscale=0.9, noise=0.05, random_state=0).fit(X, Y)
    device = model.recipe_["device"]
    assert device["flops"] == REFERENCE_FLOPS and device["source"] == "setting"
    assert device["time_cap"] == MAX_CENTERS and model.recipe_["n_centers"] == 300
    assert all(isinstance(v, (int, float, str)) for v in device.values())  # plain values
    assert "kgp.settings.device_flops = 1.06e+11 flop/s" in model.recipe_["reasons"]["n_centers"]


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1e11", True, [1e11]])
def test_bad_device_flops_values_are_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match=r"device_flops: expected a positive, finite number of float64 flop/s"):
        kgp.settings.device_flops(value)
    assert kgp.settings.device_flops.value() is None


@pytest.mark.parametrize(("raw", "expected"), [("2.5e11", "250000000000.0"), ("fast", "None")])
def test_the_environment_variable_pins_the_rate(raw, expected):
    code = "import warnings; warnings.simplefilter('always')\nimport kgp\nprint(kgp.settings.device_flops.value())"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "KGP_DEVICE_FLOPS": raw}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr[-2000:]
    assert ("ignoring KGP_DEVICE_FLOPS='fast'" in out.stderr) == (raw == "fast")
