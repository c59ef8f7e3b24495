"""kgp.settings under threads and asyncio tasks: a ``with`` override stays in its own thread (or task) and
never outlives its block; a plain call sets the process default that every thread sees.

Interleavings are forced with barriers, not left to the scheduler, so each test runs the same
schedule every time. Before the fix, the first two failed every run: a block in one thread made
another thread's exact fit fail, and two interleaved blocks left 10 set for good.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import kgp
from kgp import settings

SETTINGS = ("memory_budget", "block_rows", "kernel_cache", "max_exact_size", "distributed_timeout")


@pytest.fixture(autouse=True)
def restore_defaults():
    before = {name: getattr(settings, name).value() for name in SETTINGS}
    yield
    for name, value in before.items():
        getattr(settings, name).set(value)


def _run_threads(*targets):
    """Run each target in its own thread; re-raise the first exception one of them raised."""
    errors: list[BaseException] = []

    def wrap(target):
        def run():
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - handed to the test below
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def _data(n=30):
    X = np.linspace(0.0, 1.0, n)[:, None]
    return X, np.sin(3 * X[:, 0])


def test_a_block_in_one_thread_does_not_limit_another_threads_fit():
    X, y = _data(30)
    inside, fitted = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)
    seen = {}

    def limited():
        with settings.max_exact_size(10):
            inside.wait()  # the other thread fits while this block is open
            fitted.wait()
            seen["limited"] = settings.max_exact_size.value()
            with pytest.raises(ValueError, match="max_exact_size"):
                kgp.KernelRegressor(solver="exact").fit(X, y)

    def free():
        inside.wait()
        seen["free"] = settings.max_exact_size.value()
        seen["pred"] = kgp.KernelRegressor(solver="exact").fit(X, y).predict(X)
        fitted.wait()

    _run_threads(limited, free)
    assert seen["limited"] == 10 and seen["free"] == 20_000
    # the fit ran on all 30 rows: the same model as here, where no block is open
    np.testing.assert_allclose(seen["pred"], kgp.KernelRegressor(solver="exact").fit(X, y).predict(X), rtol=1e-12)


def test_interleaved_blocks_leave_nothing_behind():
    """A enters, B enters, A exits, B exits (the order that left 10 set for good): each thread sees only
    its own value in its block, and the default afterwards, in both threads and in a new one."""
    step = threading.Barrier(2, timeout=60)
    seen: dict[str, list] = {"A": [], "B": []}

    def a():
        with settings.max_exact_size(10):
            seen["A"].append(settings.max_exact_size.value())
            step.wait()  # 1: A inside
            step.wait()  # 2: B inside
            seen["A"].append(settings.max_exact_size.value())
        step.wait()  # 3: A left
        step.wait()  # 4: B left
        seen["A"].append(settings.max_exact_size.value())

    def b():
        step.wait()  # 1
        with settings.max_exact_size(5):
            seen["B"].append(settings.max_exact_size.value())
            step.wait()  # 2
            step.wait()  # 3
            seen["B"].append(settings.max_exact_size.value())
        step.wait()  # 4
        seen["B"].append(settings.max_exact_size.value())

    _run_threads(a, b)
    assert seen == {"A": [10, 10, 20_000], "B": [5, 5, 20_000]}
    assert settings.max_exact_size.value() == 20_000
    fresh = []
    _run_threads(lambda: fresh.append(settings.max_exact_size.value()))
    assert fresh == [20_000]


def test_many_threads_in_blocks_each_see_their_own_value():
    """Eight threads open and close blocks of their own values 200 times each, all at once."""
    start = threading.Barrier(8, timeout=60)
    wrong: list[tuple[int, int]] = []

    def worker(k):
        def run():
            start.wait()
            for _ in range(200):
                with settings.block_rows(k + 1):
                    got = settings.block_rows.value()
                    if got != k + 1:
                        wrong.append((k + 1, got))

        return run

    _run_threads(*(worker(k) for k in range(8)))
    assert wrong == []
    assert settings.block_rows.value() is None


def test_a_plain_call_sets_the_process_default_for_every_thread():
    settings.max_exact_size(123)  # a plain call in this thread ...
    seen = []
    _run_threads(lambda: seen.append(settings.max_exact_size.value()))  # ... is seen by a new thread
    assert seen == [123]

    def plain_in_worker():
        settings.max_exact_size(456)

    _run_threads(plain_in_worker)  # and a plain call in another thread is seen here
    assert settings.max_exact_size.value() == 456


def test_a_thread_started_inside_a_block_starts_from_the_process_default():
    seen = []
    with settings.memory_budget(2**20):
        assert settings.memory_budget.value() == 2**20
        _run_threads(lambda: seen.append(settings.memory_budget.value()))
    assert seen == [settings.memory_budget.value()] and seen[0] != 2**20


def test_a_plain_call_inside_a_block_holds_there_and_afterwards():
    with settings.max_exact_size(7):
        settings.max_exact_size(50)
        assert settings.max_exact_size.value() == 50
    assert settings.max_exact_size.value() == 50


def test_nested_blocks_restore_in_order_and_bad_values_change_nothing():
    with settings.kernel_cache("auto"):
        with settings.kernel_cache("never"):
            assert settings.kernel_cache.value() == "never"
        assert settings.kernel_cache.value() == "auto"
        with pytest.raises(ValueError, match="kernel_cache: expected one of"):
            settings.kernel_cache("always")
        assert settings.kernel_cache.value() == "auto"
    assert settings.kernel_cache.value() == "never"


def test_an_override_kept_for_later_is_applied_once_and_not_entered_again():
    kept = settings.max_exact_size(99)
    assert settings.max_exact_size.value() == 99  # this thread moved on: it was a plain call
    with pytest.raises(RuntimeError, match=r"already applied as the process default.*with kgp\.settings"):
        with kept:
            pass
    assert settings.max_exact_size.value() == 99
    assert repr(settings.max_exact_size) == "kgp.settings.max_exact_size(99)"


def test_blocks_in_interleaved_asyncio_tasks_stay_in_their_task():
    async def task(value, other_entered: asyncio.Event, entered: asyncio.Event):
        with settings.block_rows(value):
            entered.set()
            await other_entered.wait()  # both blocks open at once, in one thread
            await asyncio.sleep(0)
            return settings.block_rows.value()

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task(3, b, a), task(4, a, b))

    assert asyncio.run(main()) == [3, 4]
    assert settings.block_rows.value() is None
