"""Global settings: a plain call sets one for the process, a ``with`` block for that block.

Every setting has a process-wide default, can be overridden by an environment variable
read once at import, and can be changed either way::

    kgp.settings.max_exact_size(32_000)              # from now on
    with kgp.settings.memory_budget(256 * 2**20):    # only inside the block, then restored
        model.fit(X, y)

An invalid environment value never breaks ``import kgp``: it is ignored with a warning naming the
variable, and the default is used.
"""

from __future__ import annotations

import os
import warnings

_MIB = 2**20


def _env_value(name: str, default, validate):
    """The environment variable ``name`` checked by ``validate``; the default (with a warning) if invalid."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return validate(raw.strip())
    except ValueError as exc:
        warnings.warn(f"ignoring {name}={raw!r} ({exc}); using the default {default!r}", RuntimeWarning, stacklevel=3)
        return default


def _env_int(name: str, default: int) -> int:
    def parse(raw: str) -> int:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("expected a positive integer") from None
        if not value.is_integer() or value <= 0:
            raise ValueError("expected a positive integer")
        return int(value)

    return _env_value(name, default, parse)


class _Override:
    """What a setting's call returns: already applied; as a context manager it restores the old value on exit."""

    def __init__(self, setting: _Setting, previous):
        self._setting, self._previous = setting, previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self._setting._value = self._previous


class _Setting:
    """A value with a default; calling it sets the value (for good, or for a ``with`` block)."""

    def __init__(self, name: str, default, validate):
        self.name = name
        self._validate = validate
        self._value = validate(default)

    def value(self):
        return self._value

    def set(self, value) -> None:
        """Set the value for the rest of the process."""
        self._value = self._validate(value)

    def __call__(self, value) -> _Override:
        """Set the value now; used as ``with setting(value):`` the previous value is restored after the block."""
        previous = self._value
        self._value = self._validate(value)
        return _Override(self, previous)

    def __repr__(self) -> str:
        return f"kgp.settings.{self.name}({self._value!r})"


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
    "kernel_cache",
    _env_value("KGP_KERNEL_CACHE", "never", _choice("KGP_KERNEL_CACHE", ("never", "auto"))),
    _choice("kernel_cache", ("never", "auto")),
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
