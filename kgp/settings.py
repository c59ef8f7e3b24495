"""Settings: a plain call sets the process default, a ``with`` block overrides it in its own thread only.

Every setting has a process-wide default, can be overridden by an environment variable
read once at import, and can be changed either way::

    kgp.settings.max_exact_size(32_000)              # the process default, from now on, in every thread
    with kgp.settings.memory_budget(256 * 2**20):    # only inside the block, in this thread (or asyncio task)
        model.fit(X, y)

Threads (docs/guarantees.md). A ``with`` override is held in a :mod:`contextvars` variable, as
scikit-learn's ``config_context`` and numpy's ``errstate`` hold theirs: another thread never sees it,
so a block in one thread cannot change a fit running in another, and blocks interleaved across
threads cannot leave a value behind (a process-global override would do both). A thread
started inside a block starts from the process default. A plain call inside a block sets the process
default and, until the block ends, the block's value too.

Why a call can be both: ``setting(value)`` cannot know whether a ``with`` follows, so it changes
nothing that another thread can see; it returns an :class:`Override` that is decided on its first
use: ``__enter__`` makes it a block; anything else makes it the process default -- the object being
discarded (at once for a plain call statement), shown by ``repr`` (an interactive session), or the
same thread touching any setting again (before every read, so a fit right after a plain call sees it).

An invalid environment value never breaks ``import kgp``: it is ignored with a warning naming the
variable, and the default is used.
"""

from __future__ import annotations

import contextvars
import numbers
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "Override",
    "block_rows",
    "device_flops",
    "distributed_timeout",
    "fused_kernels",
    "interrupted_learning",
    "kernel_cache",
    "max_exact_size",
    "memory_budget",
]

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


# Per thread (.refs): weak references to the overrides this thread made and has not decided yet (entered, or
# applied as the process default); weak, so that a discarded plain call is applied at once by its finalizer. At
# most a few: the thread's next settings operation decides them.
_undecided_overrides = threading.local()


def _decide_pending() -> None:
    """Apply this thread's undecided overrides as plain calls: the thread has moved on without a ``with``."""
    pending = getattr(_undecided_overrides, "refs", None)
    while pending:
        override = pending.pop(0)()
        if override is not None:
            override._apply_as_default()


class Override:
    """What calling a setting returns: a block override when entered, else the new process default.

    Use it at once: ``with kgp.settings.X(v):`` or the plain statement ``kgp.settings.X(v)``.
    Kept in a variable and entered later, it has usually been applied as the process default
    already, and entering it then raises a RuntimeError rather than override twice.
    """

    __slots__ = ("__weakref__", "_finalizer", "_owner", "_reset", "_setting", "_state", "_value")

    def __init__(self, setting: _Setting, value: Any):
        self._setting, self._value = setting, value
        self._state = "undecided"  # then "block" (entered), "exited", or "default" (applied to the process)
        self._owner = threading.get_ident()
        self._reset: contextvars.Token | None = None
        state = _Decision(setting, value, self._owner)
        self._finalizer = weakref.finalize(self, state.apply)
        pending = getattr(_undecided_overrides, "refs", None)
        if pending is None:
            pending = _undecided_overrides.refs = []
        pending.append(weakref.ref(self))

    def _apply_as_default(self) -> None:
        if self._state == "undecided":
            self._state = "default"
            self._finalizer()  # runs _Decision.apply once, then never again

    def __enter__(self) -> None:
        if self._state != "undecided" or threading.get_ident() != self._owner:
            raise RuntimeError(
                f"kgp.settings.{self._setting.name}({self._value!r}) was already applied as the process default "
                f"(state: {self._state}); write `with kgp.settings.{self._setting.name}(value):` directly, "
                "without keeping the call's result for later"
            )
        self._finalizer.detach()
        self._state = "block"
        _undecided_overrides.refs = [ref for ref in _undecided_overrides.refs if ref() is not self]
        self._reset = self._setting._block.set((*self._setting._block.get(), self._value))

    def __exit__(self, *exc) -> None:
        if self._state != "block":
            raise RuntimeError(f"kgp.settings.{self._setting.name}: __exit__ without a matching __enter__")
        self._state = "exited"
        self._setting._block.reset(self._reset)

    def __repr__(self) -> str:
        self._apply_as_default()  # shown by an interactive session: it was a plain call
        return repr(self._setting)


class _Decision:
    """The process-default half of an :class:`Override`, run at most once (kept apart so that the
    finalizer holds no reference to the override itself)."""

    __slots__ = ("owner", "setting", "value")

    def __init__(self, setting: _Setting, value: Any, owner: int):
        self.setting, self.value, self.owner = setting, value, owner

    def apply(self) -> None:
        self.setting._set_default(self.value, same_thread=threading.get_ident() == self.owner)


class _Setting:
    """A validated value: a process default, and per-thread (per-context) ``with`` overrides on top of it."""

    def __init__(self, name: str, default, validate: Callable[[Any], Any]):
        self.name = name
        self._validate = validate
        self._default = validate(default)
        self._block: contextvars.ContextVar[tuple] = contextvars.ContextVar(f"kgp.settings.{name}", default=())

    def value(self):
        """The value in effect in this thread: the innermost ``with`` block's, else the process default."""
        _decide_pending()
        blocks = self._block.get()
        return blocks[-1] if blocks else self._default

    def set(self, value) -> None:
        """Set the process default (and this thread's innermost block's value, if inside one)."""
        checked = self._validate(value)
        _decide_pending()
        self._set_default(checked, same_thread=True)

    def _set_default(self, value, *, same_thread: bool) -> None:
        self._default = value
        blocks = self._block.get() if same_thread else ()
        if blocks:  # a plain call inside this thread's block: the block sees it too, until it ends
            self._block.set((*blocks[:-1], value))

    def __call__(self, value) -> Override:
        """``with setting(v):`` overrides in this thread for the block; the plain call sets the process default."""
        checked = self._validate(value)
        _decide_pending()
        return Override(self, checked)

    def __repr__(self) -> str:
        return f"kgp.settings.{self.name}({self.value()!r})"


def _positive_int(name: str):
    def check(value):
        # any integer type (numpy's np.int64 from arithmetic on array sizes included), never a bool
        # (numpy's bool is no numbers.Integral)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        return value if isinstance(value, int) else int(value)  # an int subclass (the automatic budget) stays

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


class _AutomaticBudget(int):
    """The default budget, marked as chosen by kgp (not by the user), so that a device may lower it."""

    __slots__ = ()
    __repr__ = int.__repr__


def device_memory_budget(device: Any) -> int | None:
    """A fifth of an accelerator's memory in bytes; None for the CPU (or a device whose memory is the host's).

    The automatic :data:`memory_budget` comes from host RAM, which says nothing about a GPU's memory:
    on a card smaller than five times the host default (8 GiB: a 16 or 24 GB card on a large host) a
    stored ``n x M`` matrix at that budget would not fit next to the model's other arrays.
    """
    import torch

    device = torch.device(device)
    backend = getattr(torch, device.type, None) if device.type in ("cuda", "xpu") else None
    if backend is None or not backend.is_available():
        return None
    return int(backend.get_device_properties(device).total_memory) // 5


class _MemoryBudget(_Setting):
    """:data:`memory_budget`: ``value(device)`` caps kgp's automatic default by the device's memory."""

    def value(self, device: Any = None) -> int:
        """The budget in effect in this thread; for a ``device``, the automatic default at most a fifth of its
        memory (:func:`device_memory_budget`). A budget the user set (call, ``with`` block, environment) is
        returned as it is. The automatic value read back and passed again (``memory_budget.set(saved)``, or a
        call or ``with`` block with it) stays automatic: it restores the default, not a user choice."""
        budget = super().value()
        if device is None or not isinstance(budget, _AutomaticBudget):
            return budget
        on_device = device_memory_budget(device)
        return int(budget) if on_device is None else min(int(budget), on_device)


memory_budget = _MemoryBudget(
    "memory_budget",
    _env_int("KGP_MEMORY_BUDGET", _AutomaticBudget(_default_budget())),
    _positive_int("memory_budget"),
)
"""Bytes that kernel blocks, and a stored kernel matrix, may use (env ``KGP_MEMORY_BUDGET``).

Default: a fifth of physical memory, clamped to [512 MiB, 8 GiB] (4.8 GB on a 24 GB machine), and for
arrays on a GPU at most a fifth of the card's memory (``memory_budget.value(device)``; 3.2 GB on a 16 GB
card). Row blocks are sized for the cache (about 8 MB), far below this budget; the budget matters when
an operator may keep its whole matrix (:data:`kernel_cache`, FALKON's ``kernel_cache`` option), for the
dense blocks of the exact and EigenPro solvers, and caps the block size when M is very large. A budget
you set (a call, a ``with`` block, ``KGP_MEMORY_BUDGET``) applies to every device as it is: on a GPU it
counts bytes of the card's memory."""

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
(d = 500) faster than recomputing (docs/backend.md). Where only part fits, the native CPU pass keeps
the leading rows that fit, reads them and forms the rest in every product it serves (products with more
than 16 columns, Matern 1/2, K(X, X) and autograd form all rows; docs/backend.md, "The native CPU pass").
Iterative solvers that reuse one operator (FALKON's ``kernel_cache`` option) turn it on for their
own loop."""

fused_kernels = _Setting(
    "fused_kernels",
    _env_value("KGP_FUSED_KERNELS", "auto", _choice("KGP_FUSED_KERNELS", ("auto", "always", "never"))),
    _choice("fused_kernels", ("auto", "always", "never")),
)
"""Whether kernel products may run in fused kernels, Triton's on a GPU, kgp's native one on a CPU (env
``KGP_FUSED_KERNELS``).

``"auto"`` (default): float32 single-column products with an RBF or Matern 3/2 / 5/2 kernel on a CUDA
card with TF32 tensor cores (compute capability 8.0 on) form kernel tiles in registers, their distance
part on the tensor cores in 3xTF32 (float32 accuracy), when Triton is installed (:mod:`kgp.operators.fused_gpu`:
0.11-0.25x the blocked pass's time on an H200, docs/backend.md "On a GPU"); otherwise the blocked pass,
silently. ``"always"``: older cards too, with the distance part as an
FMA loop whose tile shape is tuned on first use (2-16 s), and a warning where Triton is not usable.
``"never"``: always the blocked pass. On the CPU, ``"auto"`` and ``"always"`` run FALKON's ``K^T (K v + w)``
and ``K v`` (predictions) with an RBF or Matern 3/2, 5/2 kernel (float32 or float64, up to 16 columns) in a
C loop compiled on first use
(:mod:`kgp.operators.fused_cpu`: 0.21-0.70x the blocked pass's time on a 2-core host,
docs/backend.md "The native CPU pass"); without a C compiler ``"auto"`` falls back silently and
``"always"`` with a warning."""

max_exact_size = _Setting("max_exact_size", _env_int("KGP_MAX_EXACT_SIZE", 20_000), _positive_int("max_exact_size"))
"""Largest n for which dense O(n^2)-memory routines (exact solver, exact leverage scores) run."""


interrupted_learning = _Setting(
    "interrupted_learning", "keep_best", _choice("interrupted_learning", ("keep_best", "stop_fit"))
)
"""What a Ctrl-C during hyperparameter learning does.

``"keep_best"`` (default): it ends the learning, not the fit: the solve runs with the best point found
and a :class:`kgp.ConvergenceWarning` says so; a second Ctrl-C stops the fit. ``"stop_fit"``: it stops
the fit at once (``KeyboardInterrupt`` reaches the caller, the estimator keeps its previous state). The
``kgp fit`` command runs under ``"stop_fit"``, so an interrupted command writes nothing and exits 130,
unless ``--keep-best-on-interrupt`` is given. A distributed fit, and an interrupt before the first
evaluation, always stop the fit."""


def _positive_seconds(name: str):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0 or value != value:
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


def _optional_flops(name: str):
    def check(value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < float("inf"):
            raise ValueError(
                f"{name}: expected a positive, finite number of float64 flop/s (e.g. 1e11) or None, got {value!r}"
            )
        return float(value)

    return check


def _env_flops(name: str):
    strict = _optional_flops(name)

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("expected a positive, finite number of float64 flop/s, e.g. 1e11") from None
        return strict(value)

    return parse


device_flops = _Setting(
    "device_flops",
    _env_value("KGP_DEVICE_FLOPS", None, _env_flops("KGP_DEVICE_FLOPS")),
    _optional_flops("device_flops"),
)
"""The float64 matrix-product rate, in flop/s, that ``solver="auto"`` sizes FALKON's centers by (env
``KGP_DEVICE_FLOPS``).

``None`` (default): measured on the fit's device the first time the recipe needs it, once per process
and device (:mod:`kgp.device_speed`: a few float64 products of 1,024 x 1,024 matrices on a CPU, well
under a second). A number (e.g. ``1e11``) is used as it is, for every device, and nothing is measured:
the same data then get the same number of centers on every host, whatever its load. The rate only
raises the recipe's cap of 11,241 centers on a device faster than the 2-core CPU it was measured on
(``kgp_builtins.recipes.rule``); ``recipe_["device"]`` reports the rate used and where it came from."""
