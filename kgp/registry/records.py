"""What the registry records: one registered name (:class:`PluginInfo`), one skipped plugin
(:class:`LoadFailure`), and the errors a lookup or a registration raises."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

from ..capabilities import Capabilities

__all__ = [
    "HOOK_NAMES",
    "KINDS",
    "OWN_DISTRIBUTION",
    "LoadFailure",
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadError",
    "Rejected",
    "UnknownPluginError",
]

OWN_DISTRIBUTION = "kgp"
KINDS = ("solver", "selector", "predictor", "objective", "recipe")
HOOK_NAMES: tuple[str, ...] = tuple(f"register_{kind}s" for kind in KINDS)
"""Every hook a plugin may implement (the specs of :mod:`kgp.hookspecs`), in :data:`KINDS` order."""


class UnknownPluginError(ValueError):
    """A plugin name that no loaded plugin registered (the message says why, when kgp knows)."""


class PluginConflictError(ValueError):
    """Two plugins registered the same name, or a plugin name / object is already registered."""


class PluginLoadError(RuntimeError):
    """A plugin given to :func:`kgp.register` is broken; nothing of it was kept.

    Attributes
    ----------
    failure:
        The same record an entry point failing this way leaves in ``Registry.load_failures``.
    """

    def __init__(self, failure: LoadFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass(frozen=True)
class PluginInfo:
    """One registered name: what it is, where it came from, and what it declared it can do.

    ``capabilities`` is the plugin's :class:`kgp.Capabilities` record, checked at registration
    (None for predictor kinds, which declare none).
    """

    name: str
    kind: str
    obj: Any
    plugin: str
    distribution: str | None
    version: str | None
    capabilities: Capabilities | None = field(default=None, compare=False)

    @property
    def origin(self) -> str:
        if self.distribution:
            return f"plugin {self.plugin!r} from distribution {self.distribution} {self.version}"
        return f"plugin {self.plugin!r} (registered at runtime)"

    @property
    def builtin(self) -> bool:
        """Whether kgp's own distribution provides it (built-ins win name clashes with entry points)."""
        return is_own(self.distribution)


@dataclass(frozen=True)
class LoadFailure:
    """A plugin that was skipped, and why.

    ``str(failure)`` is the one-line message that was warned, so code printing the failures keeps working.

    Attributes
    ----------
    plugin:
        Entry-point name (or the name given to :func:`kgp.register`).
    distribution:
        Distribution declaring the entry point; None for a runtime registration.
    stage:
        ``"import"`` (loading the entry point raised), ``"duplicate-name"`` (another distribution
        declares an entry point of the same name), ``"validation"`` (pluggy rejected a hook
        implementation's signature), ``"unknown-hook"`` (a hook implementation matches no hook
        spec, e.g. a misspelling), ``"hook"`` (a ``register_*`` hook raised) or ``"contract"`` (a
        registered solver, selector or objective breaks the plugin contract, e.g. it declares no
        :class:`kgp.Capabilities`).
    error:
        ``"ExceptionType: message"`` of the cause, one line (for ``"contract"``: what is wrong).
    message:
        The full one-line message, naming the plugin, its distribution and what to do.
    traceback:
        The formatted traceback of the cause ("" when nothing raised: ``"unknown-hook"``, ``"contract"``).
    names:
        ``(kind, name)`` pairs the plugin had registered before it failed: using one of them
        reports this failure instead of "unknown".
    """

    plugin: str
    distribution: str | None
    stage: str
    error: str
    message: str
    traceback: str = ""
    names: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.message

    @property
    def origin(self) -> str:
        if self.distribution:
            return f"plugin {self.plugin!r} from distribution {self.distribution}"
        return f"plugin {self.plugin!r} (registered at runtime)"


class Rejected(Exception):
    """Internal: a plugin that pluggy accepted must be dropped as a whole (the cause, if any, is chained).

    ``detail`` completes "kgp plugin NAME ..." (e.g. ``"raised in register_solvers"``); the caller
    adds how the plugin was met and what happened to it (skipped, not registered).
    """

    def __init__(self, stage: str, error: str, detail: str, names: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(detail)
        self.stage, self.error, self.detail, self.names = stage, error, detail, names

    def failure(self, plugin: str, distribution: str | None, message: str) -> LoadFailure:
        cause = self.__cause__
        return LoadFailure(
            plugin=plugin,
            distribution=distribution,
            stage=self.stage,
            error=self.error,
            message=message + (f": {self.error}" if cause is not None else ""),
            traceback=format_traceback(cause) if cause is not None else "",
            names=self.names,
        )


def one_line(exc: BaseException) -> str:
    """``"ExceptionType: message"`` with the message's whitespace collapsed."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def format_traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def is_own(distribution: str | None) -> bool:
    """Whether ``distribution`` is kgp's own (its built-in plugins)."""
    return (distribution or "").lower() == OWN_DISTRIBUTION
