"""Plugin discovery: built-ins and third parties through the same hooks.

Load order: the core's own hook implementations (the ``kernel_expansion`` predictor), then every
entry point in the ``kgp`` group. kgp's built-in solvers and selectors are entry points of the
``kgp`` distribution itself, so they are found exactly like a third party's.

Environment variables (read at first use, see docs/plugin-author-guide.md):

``KGP_DISABLE_ENTRYPOINTS=1``
    Load only the entry points that the ``kgp`` distribution declares (its built-ins), no third
    party's: reproducible runs and tests.
``KGP_PLUGINS=name1,name2``
    Load only the listed entry points (built-ins included only if listed).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from . import hookspecs

__all__ = [
    "PluginConflictError",
    "PluginInfo",
    "UnknownPluginError",
    "get_predictor_class",
    "get_selector",
    "get_solver",
    "list_plugins",
    "register",
    "registry",
    "unregister",
]

ENTRY_POINT_GROUP = "kgp"
OWN_DISTRIBUTION = "kgp"
KINDS = ("solver", "selector", "predictor")


class UnknownPluginError(ValueError):
    """A plugin name that no loaded plugin registered."""


class PluginConflictError(ValueError):
    """Two plugins registered the same name."""


@dataclass(frozen=True)
class PluginInfo:
    """One registered name: what it is and where it came from."""

    name: str
    kind: str
    obj: Any
    plugin: str
    distribution: str | None
    version: str | None

    @property
    def origin(self) -> str:
        if self.distribution:
            return f"plugin {self.plugin!r} from distribution {self.distribution} {self.version}"
        return f"plugin {self.plugin!r} (registered at runtime)"


class Registry:
    """Holds the pluggy plugin manager and the names each hook registered."""

    def __init__(self) -> None:
        self._pm: pluggy.PluginManager | None = None
        self._dists: dict[str, tuple[str | None, str | None]] = {}
        self._entries: dict[tuple[str, str], PluginInfo] | None = None
        self._conflicts: dict[tuple[str, str], list[PluginInfo]] = {}
        self.load_failures: list[str] = []

    # ------------------------------------------------------------------ loading
    @property
    def pm(self) -> pluggy.PluginManager:
        if self._pm is None:
            self._pm = self._load()
        return self._pm

    def _load(self) -> pluggy.PluginManager:
        pm = pluggy.PluginManager("kgp")
        pm.add_hookspecs(hookspecs)
        from . import predictors

        pm.register(predictors, name="kgp.predictors")
        self._dists["kgp.predictors"] = (OWN_DISTRIBUTION, _version(OWN_DISTRIBUTION))
        only = _env_list("KGP_PLUGINS")
        builtins_only = os.environ.get("KGP_DISABLE_ENTRYPOINTS", "").strip() not in ("", "0", "false", "no")
        for ep in _entry_points():
            dist = ep.dist.name if ep.dist is not None else None
            if only is not None and ep.name not in only:
                continue
            if builtins_only and (dist or "").lower() != OWN_DISTRIBUTION:
                continue
            try:
                plugin = ep.load()
                if pm.is_registered(plugin):
                    continue
                pm.register(plugin, name=ep.name)  # pluggy validates the hookimpl signatures here
            except Exception as exc:  # a broken plugin must not take the others down
                message = (
                    f"kgp plugin {ep.name!r} (entry point {ep.value!r} of distribution "
                    f"{dist or 'unknown'}) failed to load and was skipped: {type(exc).__name__}: {exc}"
                )
                self._report_failure(message)
                continue
            self._dists[ep.name] = (dist, ep.dist.version if ep.dist is not None else None)
        return pm

    def _collect(self, warn: bool = True) -> dict[tuple[str, str], PluginInfo]:
        if self._entries is not None:
            return self._entries
        entries: dict[tuple[str, str], PluginInfo] = {}
        conflicts: dict[tuple[str, str], list[PluginInfo]] = {}
        hooks = {
            "solver": self.pm.hook.register_solvers,
            "selector": self.pm.hook.register_selectors,
            "predictor": self.pm.hook.register_predictors,
        }
        for kind, hook in hooks.items():
            for impl in hook.get_hookimpls():
                dist, version = self._dists.get(impl.plugin_name, (None, None))

                added: list[PluginInfo] = []

                def add(name, obj, _kind=kind, _plugin=impl.plugin_name, _dist=dist, _version=version, _added=added):
                    if not isinstance(name, str) or not name:
                        raise TypeError(f"plugin {_plugin!r} registered a {_kind} with invalid name {name!r}")
                    _added.append(PluginInfo(name, _kind, obj, _plugin, _dist, _version))

                try:
                    impl.function(register=add)
                except Exception as exc:  # keep none of its names; the other plugins stay usable
                    self._report_failure(
                        f"kgp plugin {impl.plugin_name!r} (distribution {dist or 'unknown'}) raised in "
                        f"register_{kind}s and was skipped: {type(exc).__name__}: {exc}"
                    )
                    continue
                for info in added:
                    key = (kind, info.name)
                    if key in entries:
                        conflicts.setdefault(key, [entries[key]]).append(info)
                    else:
                        entries[key] = info
        for key, infos in conflicts.items() if warn else ():
            warnings.warn(_conflict_message(key, infos), RuntimeWarning, stacklevel=3)
        self._entries, self._conflicts = entries, conflicts
        return entries

    def _report_failure(self, message: str) -> None:
        if message not in self.load_failures:  # _collect runs again after every runtime (un)registration
            self.load_failures.append(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ runtime registration
    def register(self, plugin: ModuleType | object, name: str | None = None) -> str:
        """Register a plugin object at runtime (e.g. a module with hook implementations).

        Raises
        ------
        PluginConflictError
            If it registers a name that is already taken (the plugin is not kept).
        """
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        before = dict(self._collect())
        self.pm.register(plugin, name=name)
        self._dists[name] = (None, None)
        self._entries = None
        self._collect(warn=False)
        clash = [key for key in self._conflicts if any(i.plugin == name for i in self._conflicts[key])]
        if clash:
            infos = self._conflicts[clash[0]]
            self.pm.unregister(name=name)
            self._entries = None
            self._collect()
            assert before.keys() == self._entries.keys()
            raise PluginConflictError(_conflict_message(clash[0], infos))
        return name

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name``."""
        if self.pm.get_plugin(name) is None:
            raise UnknownPluginError(f"no plugin registered under {name!r}")
        self.pm.unregister(name=name)
        self._dists.pop(name, None)
        self._entries = None

    def reload(self) -> None:
        """Forget everything and rediscover plugins (after installing one, or changing env vars)."""
        self.__init__()

    # ------------------------------------------------------------------ lookup
    def get(self, kind: str, name: str) -> PluginInfo:
        entries = self._collect()
        key = (kind, name)
        if key in self._conflicts:
            raise PluginConflictError(_conflict_message(key, self._conflicts[key]))
        if key not in entries:
            available = sorted(n for k, n in entries if k == kind)
            raise UnknownPluginError(f"unknown {kind} {name!r}; available {kind}s: {', '.join(available) or '(none)'}")
        return entries[key]

    def names(self, kind: str) -> list[str]:
        return sorted(n for k, n in self._collect() if k == kind)

    def infos(self) -> list[PluginInfo]:
        entries = self._collect()
        return sorted(entries.values(), key=lambda i: (KINDS.index(i.kind), i.name))

    @property
    def conflicts(self) -> dict[tuple[str, str], list[PluginInfo]]:
        self._collect()
        return dict(self._conflicts)


def _conflict_message(key: tuple[str, str], infos: Iterable[PluginInfo]) -> str:
    kind, name = key
    origins = " and ".join(i.origin for i in infos)
    return f"{kind} name {name!r} is registered twice: by {origins}; uninstall or disable one of them"


def _entry_points():
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen = set()
    for ep in sorted(eps, key=lambda e: ((e.dist.name if e.dist else "").lower() != OWN_DISTRIBUTION, e.name)):
        key = (ep.name, ep.value, ep.dist.name if ep.dist else None)
        if key not in seen:  # an editable install can list a distribution twice
            seen.add(key)
            yield ep


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
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


def register(plugin, name: str | None = None) -> str:
    """Register a plugin at runtime; see :meth:`Registry.register`."""
    return registry.register(plugin, name)


def unregister(name: str) -> None:
    """Unregister a runtime plugin by name."""
    registry.unregister(name)


def list_plugins() -> list[PluginInfo]:
    """Every registered name with its kind and origin."""
    return registry.infos()


def import_plugin_module(path: str) -> ModuleType:
    """Import a module by dotted path (helper for tests and the CLI)."""
    return importlib.import_module(path)
