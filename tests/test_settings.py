"""kgp.settings: a plain call sets for the process, a `with` block restores; bad environment values never
break `import kgp`."""

import subprocess
import sys

import numpy as np
import pytest

import kgp


def test_plain_call_sets_globally_and_with_block_restores():
    before = kgp.settings.max_exact_size.value()
    try:
        kgp.settings.max_exact_size(123)  # the form the exact solver's error message advises
        assert kgp.settings.max_exact_size.value() == 123
        with kgp.settings.max_exact_size(7):
            assert kgp.settings.max_exact_size.value() == 7
        assert kgp.settings.max_exact_size.value() == 123
        with pytest.raises(ValueError, match="max_exact_size: expected a positive integer"):
            kgp.settings.max_exact_size(0)
        assert kgp.settings.max_exact_size.value() == 123
    finally:
        kgp.settings.max_exact_size.set(before)


def test_exact_solver_advice_works_as_given():
    X = np.linspace(0, 1, 30)[:, None]
    before = kgp.settings.max_exact_size.value()
    try:
        kgp.settings.max_exact_size(20)
        with pytest.raises(ValueError) as info:
            kgp.KernelRegressor(solver="exact").fit(X, X[:, 0])
        message = str(info.value)
        assert "--solver falkon" in message and "KGP_MAX_EXACT_SIZE=30" in message
        assert "kgp.settings.max_exact_size(30)" in message
        kgp.settings.max_exact_size(30)  # following the advice literally
        assert kgp.KernelRegressor(solver="exact").fit(X, X[:, 0]).score(X, X[:, 0]) > 0.99
    finally:
        kgp.settings.max_exact_size.set(before)


@pytest.mark.parametrize(
    ("variable", "value", "setting", "default_expr"),
    [
        ("KGP_MEMORY_BUDGET", "lots", "memory_budget", "settings._default_budget()"),
        ("KGP_MEMORY_BUDGET", "-5", "memory_budget", "settings._default_budget()"),
        ("KGP_KERNEL_CACHE", "always", "kernel_cache", "'never'"),
        ("KGP_MAX_EXACT_SIZE", "1.5", "max_exact_size", "20000"),
    ],
)
def test_invalid_environment_value_warns_and_uses_the_default(variable, value, setting, default_expr):
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import kgp\nfrom kgp import settings\n"
        f"assert settings.{setting}.value() == {default_expr}, settings.{setting}.value()\n"
        "print('ok')"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), variable: value, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert f"ignoring {variable}={value!r}" in out.stderr and "Traceback" not in out.stderr


def test_valid_environment_values_are_used():
    code = "import kgp; print(kgp.settings.memory_budget.value(), kgp.settings.kernel_cache.value())"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": ":".join(sys.path),
        "KGP_MEMORY_BUDGET": "1e6",
        "KGP_KERNEL_CACHE": "auto",
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["1000000", "auto"] and out.stderr == ""


# ------------------------------------------------------------------ the budget on a GPU
class _Card:
    def __init__(self, total_memory):
        self.total_memory = total_memory


@pytest.fixture
def small_card(monkeypatch):
    """A CUDA device of 5 MiB as far as kgp's budget can tell (no card needed: nothing is allocated on it),
    with kgp's automatic default in force (whatever KGP_MEMORY_BUDGET or an earlier test set)."""
    import torch

    from kgp import settings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Card(5 * 2**20))
    monkeypatch.setattr(settings.memory_budget, "_default", settings._AutomaticBudget(settings._default_budget()))
    return torch.device("cuda", 0)


def test_automatic_budget_is_at_most_a_fifth_of_the_card(small_card):
    budget = kgp.settings.memory_budget
    host = budget.value()
    assert host >= 512 * 2**20  # the host default (a fifth of RAM, at least 512 MiB)
    assert budget.value(small_card) == 2**20  # 5 MiB / 5
    assert budget.value("cpu") == host and budget.value(None) == host
    # the row-block planner follows the card's budget: 1 MiB of float64 rows of 1,000 columns
    from kgp.operators.blocks import plan_block_rows

    assert plan_block_rows(10**6, 1000, 8, device=small_card) <= 2**20 // 8000
    assert plan_block_rows(10**6, 1000, 8, device="cpu") > 2**20 // 8000
    with pytest.raises(MemoryError, match="memory_budget=1048576 bytes cannot hold one row"):
        plan_block_rows(10, 2**20, 8, device=small_card)


def test_a_budget_the_user_sets_applies_to_the_card_as_it_is(small_card):
    budget = kgp.settings.memory_budget
    before = budget.value()
    with budget(3 * 2**30):
        assert budget.value(small_card) == 3 * 2**30
    try:
        budget(2**30)  # the plain call: the process default, from now on
        assert budget.value(small_card) == 2**30
        budget.set(before)  # restoring the saved automatic value makes it automatic again
        assert budget.value(small_card) == 2**20
    finally:
        budget.set(before)


def test_budget_from_the_environment_applies_to_the_card_as_it_is():
    code = (
        "import torch, kgp\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.get_device_properties = lambda device=None: type('P', (), {'total_memory': 5 * 2**20})\n"
        "print(kgp.settings.memory_budget.value(torch.device('cuda', 0)))"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "KGP_MEMORY_BUDGET": "1e9"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["1000000000"], out.stderr[-2000:]


def test_budget_readers_pass_the_device(small_card):
    """The dense-matrix refusal (exact variance, refit subsets) and EigenPro's subsample size follow the card."""
    from kgp_builtins.eigenpro.options import resolve_subsample

    from kgp.variance import check_dense_size

    check_dense_size(300, 8, "a 300-row matrix")  # 720 KB: within the host budget
    check_dense_size(300, 8, "a 300-row matrix", small_card)  # and within the card's 1 MiB
    with pytest.raises(ValueError, match="kgp.settings.memory_budget=1,048,576 bytes"):
        check_dense_size(400, 8, "a 400-row matrix", small_card)  # 1.28 MB
    # s = min(n, 2000, side of a float64 square within the budget): isqrt(2^20 / 8) = 362 on the card
    assert resolve_subsample("x", 5000, None, None, device=small_card) == (362, 36)
    assert resolve_subsample("x", 5000, None, None, device="cpu") == (2000, 200)


def test_device_memory_budget_is_a_fifth_of_the_card_and_none_on_the_cpu(small_card):
    from kgp import settings

    assert settings.device_memory_budget(small_card) == 2**20  # 5 MiB / 5
    assert settings.device_memory_budget("cuda") == 2**20  # no index: the current device
    assert settings.device_memory_budget("cpu") is None and settings.device_memory_budget("meta") is None
    with pytest.raises(RuntimeError, match="gpu"):
        settings.device_memory_budget("gpu")  # not a device name: torch's error names it
