"""Global settings, used as context managers (the GPyTorch / linear_operator style).

Every setting has a process-wide default, can be overridden by an environment variable
read once at import, and can be changed for a block of code::

    with kgp.settings.memory_budget(256 * 2**20):
        model.fit(X, y)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_MIB = 2**20


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(float(raw))
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from exc
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r}: expected a positive integer")
    return value


class _Setting:
    """A value with a default and a context manager that overrides it temporarily."""

    def __init__(self, name: str, default, validate):
        self.name = name
        self._validate = validate
        self._value = validate(default)

    def value(self):
        return self._value

    def set(self, value) -> None:
        """Set the value for the rest of the process."""
        self._value = self._validate(value)

    @contextmanager
    def __call__(self, value) -> Iterator[None]:
        previous = self._value
        self._value = self._validate(value)
        try:
            yield
        finally:
            self._value = previous


def _positive_int(name: str):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        return value

    return check


def _optional_positive_int(name: str):
    strict = _positive_int(name)

    def check(value):
        return None if value is None else strict(value)

    return check


def _choice(name: str, choices: tuple[str, ...]):
    def check(value):
        if value not in choices:
            raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
        return value

    return check


def _default_budget() -> int:
    """A fifth of physical memory, between 512 MiB and 8 GiB (512 MiB when it cannot be read)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 512 * _MIB
    return int(min(8 * 1024 * _MIB, max(512 * _MIB, physical // 5)))


memory_budget = _Setting(
    "memory_budget",
    _env_int("KGP_MEMORY_BUDGET", _default_budget()),
    _positive_int("memory_budget"),
)
"""Bytes that kernel blocks, and a stored kernel matrix, may use (env ``KGP_MEMORY_BUDGET``).

Default: a fifth of physical memory, clamped to [512 MiB, 8 GiB] (4.8 GB on a 24 GB machine).
Row blocks are sized for the cache (about 8 MB), far below this budget; the budget matters when
an operator may keep its whole matrix (:data:`kernel_cache`, FALKON's ``kernel_cache`` option)
and caps the block size when M is very large. On a GPU the budget is still counted in bytes of
the operator's device; set it explicitly to fit the device's memory."""

block_rows = _Setting("block_rows", None, _optional_positive_int("block_rows"))
"""Force the number of rows per kernel block (``None``: chosen from the budget and cache size)."""

kernel_cache = _Setting(
    "kernel_cache", os.environ.get("KGP_KERNEL_CACHE", "never"), _choice("kernel_cache", ("never", "auto"))
)
"""Whether a kernel operator may keep its whole matrix in memory.

``"never"`` (default): recompute blocks on every product, so an operator holds no n x M memory
unless asked. ``"auto"``: from the operator's second product on, keep K(X, Z) when
``n * M * itemsize`` fits :data:`memory_budget`; later products read it, 5x (d = 10) to 25x
(d = 500) faster than recomputing (docs/backend.md). Iterative solvers that reuse one operator
(FALKON's ``kernel_cache`` option) turn it on for their own loop."""

max_exact_size = _Setting("max_exact_size", _env_int("KGP_MAX_EXACT_SIZE", 20_000), _positive_int("max_exact_size"))
"""Largest n for which dense O(n^2)-memory routines (exact solver, exact leverage scores) run."""


def _positive_seconds(name: str):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
            raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        return float(value)

    return check


distributed_timeout = _Setting(
    "distributed_timeout",
    _env_int("KGP_DISTRIBUTED_TIMEOUT", 1800),
    _positive_seconds("distributed_timeout"),
)
"""Seconds a rank of a distributed fit waits in one collective before raising (env ``KGP_DISTRIBUTED_TIMEOUT``).

Default 1800 (torch.distributed's own default). It bounds the wait for a rank that hangs; a rank
that raises is noticed within milliseconds, a rank that dies as soon as its connections close
(:mod:`kgp.distributed`). It must exceed the longest legitimate wait: the slowest rank's pass
(uneven shards) and the replicated ``M x M`` factorization."""
