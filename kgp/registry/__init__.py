"""The plugin registry: built-ins and third parties through the same hooks, loaded once, thread-safe.

Load order: the core's own hook implementations (the ``kernel_expansion`` predictor), then every
entry point in the ``kgp`` group, kgp's own first (:mod:`.discovery`, which also reads the
switches ``KGP_DISABLE_ENTRYPOINTS`` and ``KGP_PLUGINS``). Each plugin is admitted whole or not
at all (:mod:`.admission`: pluggy's registration and ``check_pending``, its historic hooks replayed
by pluggy's hook relay as it registers, the plugin contract of :mod:`.contract`); a plugin that
fails is skipped and recorded in :attr:`Registry.load_failures` with its traceback, and the other
plugins stay usable. Which
names are usable, which clash and what an unknown name's message says is the name table's job
(:mod:`.names`: built-ins win against third-party entry points; two third parties registering one
name make it unusable).

Loading happens once, at first use, under a lock: a lookup from any thread waits until every
plugin is loaded, and the loaded state is published only when complete (otherwise a second thread
could see the half-built plugin manager and report ``unknown solver 'exact'``). Runtime
:func:`register` / :func:`unregister` and lookups take the same lock.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from types import ModuleType

import pluggy

from .admission import HookRelay
from .discovery import Skipped, load_entry_points
from .names import NameTable
from .records import (
    HOOK_NAMES,
    KINDS,
    OWN_DISTRIBUTION,
    LoadFailure,
    PluginConflictError,
    PluginInfo,
    PluginLoadError,
    Rejected,
    UnknownPluginError,
)

__all__ = [
    "HOOK_NAMES",
    "KINDS",
    "LoadFailure",
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadError",
    "Registry",
    "UnknownPluginError",
    "get_objective",
    "get_recipe",
    "get_predictor_class",
    "get_selector",
    "get_solver",
    "list_plugins",
    "register",
    "registry",
    "unregister",
]


@dataclass
class _Loaded:
    """Everything the registry knows after discovery (mutated only under the registry's lock)."""

    relay: HookRelay = field(default_factory=HookRelay)
    dists: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    provided: dict[str, list[PluginInfo]] = field(default_factory=dict)  # plugin name -> its registrations
    failures: list[LoadFailure] = field(default_factory=list)
    skipped: dict[str, Skipped] = field(default_factory=dict)
    table: NameTable | None = None  # rebuilt after every change

    def names_table(self) -> NameTable:
        if self.table is None:
            self.table = NameTable(self.provided, self.failures, self.skipped)
        return self.table

    @property
    def pm(self) -> pluggy.PluginManager:
        return self.relay.pm

    def add(self, plugin: object, name: str, dist: str | None, version: str | None) -> None:
        self.provided[name] = self.relay.admit(plugin, name, dist, version)
        self.dists[name] = (dist, version)
        self.table = None

    def remove(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.dists.pop(name, None)
        self.provided.pop(name, None)
        self.table = None


class Registry:
    """Holds the pluggy plugin manager and the names each plugin registered.

    Attributes
    ----------
    load_failures:
        One :class:`LoadFailure` per skipped entry-point plugin, in discovery order.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loaded: _Loaded | None = None
        self._building: _Loaded | None = None  # seen only by the loading thread (a plugin importing kgp)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ loading
    def _state(self) -> _Loaded:
        loaded = self._loaded
        if loaded is not None:
            return loaded
        with self._lock:
            if self._loaded is not None:
                return self._loaded
            if self._building is not None:  # re-entered from a plugin's import, in the loading thread
                return self._building
            state = _Loaded()
            self._building = state
            try:
                self._discover(state)
            finally:
                self._building = None
            self._loaded = state  # published complete: other threads never see a half-loaded registry
            return state

    def _discover(self, state: _Loaded) -> None:
        from .. import predictors

        try:
            state.add(predictors, "kgp.predictors", OWN_DISTRIBUTION, _own_version())
        except Rejected as exc:  # the core's own hooks: a bug in kgp, not a plugin to skip
            raise RuntimeError(f"kgp's core hooks are broken: {exc.detail}") from exc.__cause__

        def report(failure: LoadFailure) -> None:
            state.failures.append(failure)
            self._warn_once(failure.message)

        state.skipped = load_entry_points(state.add, state.pm.is_registered, report, self._warn_once)
        for message in state.names_table().discovery_warnings():
            self._warn_once(message)

    def _warn_once(self, message: str) -> None:
        # Warn at discovery only: the name table is rebuilt after every runtime (un)registration.
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    @property
    def pm(self) -> pluggy.PluginManager:
        """The pluggy plugin manager, every plugin loaded."""
        return self._state().pm

    @property
    def load_failures(self) -> list[LoadFailure]:
        with self._lock:
            return list(self._state().failures)

    def reload(self) -> None:
        """Forget everything and rediscover plugins at next use (after installing one, or changing env vars)."""
        with self._lock:
            self._loaded, self._warned = None, set()

    # ------------------------------------------------------------------ runtime registration
    def register(self, plugin: ModuleType | object, name: str | None = None) -> str:
        """Register a plugin object at runtime (e.g. a module with hook implementations).

        Parameters
        ----------
        plugin:
            A module or object with functions decorated by :data:`kgp.hookimpl`.
        name:
            Plugin name (default: the module's ``__name__``); :func:`unregister` takes it.

        Returns
        -------
        str
            The plugin name.

        Raises
        ------
        PluginConflictError
            If a plugin is already registered under ``name`` or the same object is already
            registered, or if it registers a name that is already taken (then nothing is kept).
        PluginLoadError
            If the plugin implements a hook kgp does not define, has a hook signature pluggy
            rejects, one of its hooks raises (the exception is the ``__cause__``), or what it
            registers breaks the plugin contract (e.g. no ``capabilities``). Nothing is kept, so
            the fixed plugin can be registered under the same name.
        """
        if plugin is None:
            raise TypeError("plugin: expected a module or object with kgp.hookimpl functions, got None")
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        with self._lock:
            state = self._state()
            if state.pm.has_plugin(name):
                dist = state.dists.get(name, (None, None))[0]
                what = f"entry point of distribution {dist}" if dist else "registered at runtime"
                raise PluginConflictError(
                    f"a plugin named {name!r} is already registered ({what}); call kgp.unregister({name!r}) "
                    "first, or pass another name="
                )
            if state.pm.is_registered(plugin):
                taken = state.pm.get_name(plugin)
                raise PluginConflictError(
                    f"this plugin object is already registered as {taken!r}; call kgp.unregister({taken!r}) first"
                )
            try:
                state.add(plugin, name, None, None)
            except Rejected as exc:
                failure = exc.failure(name, None, f"kgp plugin {name!r} {exc.detail} and was not registered")
                raise PluginLoadError(failure) from exc.__cause__
            clash = state.names_table().clash_of(name)
            if clash is not None:
                (kind, taken), infos = clash
                others = " and ".join(i.origin for i in infos if i.plugin != name)
                state.remove(name)
                raise PluginConflictError(
                    f"plugin {name!r} registers {kind} name {taken!r}, which {others} already registered; "
                    f"nothing of plugin {name!r} was kept: register the {kind} under another name"
                )
            return name

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name``."""
        with self._lock:
            state = self._state()
            if state.pm.get_plugin(name) is None:
                raise UnknownPluginError(f"no plugin registered under {name!r}")
            state.remove(name)

    # ------------------------------------------------------------------ lookup
    def _table(self) -> NameTable:
        with self._lock:
            return self._state().names_table()

    def get(self, kind: str, name: str) -> PluginInfo:
        """The registration of ``name`` (see :meth:`NameTable.get` for the errors)."""
        return self._table().get(kind, name)

    def names(self, kind: str) -> list[str]:
        """Usable names of ``kind``, sorted (never one that two plugins registered)."""
        return self._table().names(kind)

    def infos(self) -> list[PluginInfo]:
        """Every usable registration, by kind then name."""
        return self._table().infos()

    @property
    def conflicts(self) -> dict[tuple[str, str], list[PluginInfo]]:
        """Unusable names: ``(kind, name)`` -> every registration of it."""
        return dict(self._table().conflicts)

    @property
    def shadowed(self) -> dict[tuple[str, str], list[PluginInfo]]:
        """Names a built-in keeps: ``(kind, name)`` -> the other distributions' ignored registrations."""
        return dict(self._table().shadowed)

    def problems(self) -> list[str]:
        """One line per shadowed name, unusable name and load failure (what `kgp plugins` reports)."""
        return self._table().problems()


def _own_version() -> str | None:
    import importlib.metadata as metadata

    try:
        return metadata.version(OWN_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


registry = Registry()
"""The process-wide registry used by the model API and the CLI."""


def get_solver(name: str):
    """Return the solver registered under ``name`` (error lists the available ones)."""
    return registry.get("solver", name).obj


def get_selector(name: str):
    """Return the center selector registered under ``name``."""
    return registry.get("selector", name).obj


def get_predictor_class(kind: str):
    """Return the predictor class registered for ``kind`` (used by :func:`kgp.load`)."""
    return registry.get("predictor", kind).obj


def get_objective(name: str):
    """Return the hyperparameter objective registered under ``name`` (error lists the available ones)."""
    return registry.get("objective", name).obj


def get_recipe(name: str):
    """Return the recipe registered under ``name`` (:mod:`kgp.recipes`; error lists the available ones)."""
    return registry.get("recipe", name).obj


def register(plugin: ModuleType | object, name: str | None = None) -> str:
    """Register a plugin at runtime; see :meth:`Registry.register`."""
    return registry.register(plugin, name)


def unregister(name: str) -> None:
    """Unregister a runtime plugin by name."""
    registry.unregister(name)


def list_plugins() -> list[PluginInfo]:
    """Every usable registered name with its kind and origin."""
    return registry.infos()
