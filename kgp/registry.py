"""Plugin discovery: built-ins and third parties through the same hooks.

Load order: the core's own hook implementations (the ``kernel_expansion`` predictor), then every
entry point in the ``kgp`` group, kgp's own first. kgp's built-in solvers and selectors are entry
points of the ``kgp`` distribution itself, so they are found exactly like a third party's.

Each plugin's hooks are called once, right after it is registered: a plugin that fails to import,
implements a hook kgp does not define (a misspelt ``register_solver``), has a hook signature pluggy
rejects, or raises in a hook is skipped as a whole (none of its names are kept) and recorded in
:attr:`Registry.load_failures` with its traceback; the other plugins stay usable.

Names are global. When two plugins register the same name:

- a third-party entry point against kgp's own distribution: **the built-in wins**, the third
  party's registration of that name is ignored with a ``RuntimeWarning`` (its other names work);
- two third parties (or a runtime plugin and anything): the name is unusable
  (:class:`PluginConflictError` naming both origins) until one is removed.

Environment variables (read at first use, see docs/plugin-author-guide.md):

``KGP_DISABLE_ENTRYPOINTS=1``
    Load only the entry points that the ``kgp`` distribution declares (its built-ins), no third
    party's: reproducible runs and tests.
``KGP_PLUGINS=name1,name2``
    Load only the listed third-party entry points; kgp's own built-ins always load (the
    estimator's defaults name them). A listed name that is not installed is warned about.
"""

from __future__ import annotations

import difflib
import importlib.metadata as metadata
import os
import traceback
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from . import hookspecs

__all__ = [
    "HOOK_NAMES",
    "LoadFailure",
    "PluginConflictError",
    "PluginInfo",
    "PluginLoadError",
    "UnknownPluginError",
    "get_objective",
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
KINDS = ("solver", "selector", "predictor", "objective")
HOOK_NAMES: tuple[str, ...] = tuple(f"register_{kind}s" for kind in KINDS)
"""Every hook a plugin may implement (the specs of :mod:`kgp.hookspecs`), in :data:`KINDS` order."""


class UnknownPluginError(ValueError):
    """A plugin name that no loaded plugin registered (the message says why, when kgp knows)."""


class PluginConflictError(ValueError):
    """Two plugins registered the same name, or a plugin name / object is already registered."""


class PluginLoadError(RuntimeError):
    """A plugin given to :func:`register` is broken; nothing of it was kept.

    Attributes
    ----------
    failure:
        The same record an entry point failing this way leaves in :attr:`Registry.load_failures`.
    """

    def __init__(self, failure: LoadFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


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

    @property
    def builtin(self) -> bool:
        """Whether kgp's own distribution provides it (built-ins win name clashes with entry points)."""
        return _is_own(self.distribution)


@dataclass(frozen=True)
class LoadFailure:
    """A plugin that was skipped, and why.

    ``str(failure)`` is the one-line message that was warned (what ``load_failures`` held before it
    became a list of records), so code printing the failures keeps working.

    Attributes
    ----------
    plugin:
        Entry-point name (or the name given to :func:`register`).
    distribution:
        Distribution declaring the entry point; None for a runtime registration.
    stage:
        ``"import"`` (loading the entry point raised), ``"duplicate-name"`` (another distribution
        declares an entry point of the same name), ``"validation"`` (pluggy rejected a hook
        implementation's signature), ``"unknown-hook"`` (a hook implementation matches no hook
        spec, e.g. a misspelling) or ``"hook"`` (a ``register_*`` hook raised).
    error:
        ``"ExceptionType: message"`` of the cause, one line.
    message:
        The full one-line message, naming the plugin, its distribution and what to do.
    traceback:
        The formatted traceback of the cause ("" for ``"unknown-hook"``, which raised nothing).
    names:
        ``(kind, name)`` pairs the plugin had registered before its hook raised: using one of them
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


class _Rejected(Exception):
    """Internal: a plugin was registered with pluggy but must be dropped (see :meth:`Registry._add`)."""

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
            traceback=_traceback(cause) if cause is not None else "",
            names=self.names,
        )


@dataclass(frozen=True)
class _Skipped:
    """An installed entry point that the environment switches kept out."""

    name: str
    distribution: str | None
    switch: str  # e.g. "KGP_PLUGINS=falkon": what to change to load it


class Registry:
    """Holds the pluggy plugin manager and the names each plugin registered.

    Attributes
    ----------
    load_failures:
        One :class:`LoadFailure` per skipped entry-point plugin, in discovery order.
    """

    def __init__(self) -> None:
        self._pm: pluggy.PluginManager | None = None
        self._dists: dict[str, tuple[str | None, str | None]] = {}
        # What each registered plugin's hooks registered, in registration order (first registrant first).
        self._provided: dict[str, list[PluginInfo]] = {}
        self._entries: dict[tuple[str, str], PluginInfo] | None = None
        self._conflicts: dict[tuple[str, str], list[PluginInfo]] = {}
        self._shadowed: dict[tuple[str, str], list[PluginInfo]] = {}
        self._skipped: dict[str, _Skipped] = {}
        self._warned: set[str] = set()
        self.load_failures: list[LoadFailure] = []

    # ------------------------------------------------------------------ loading
    @property
    def pm(self) -> pluggy.PluginManager:
        if self._pm is None:
            self._pm = pluggy.PluginManager("kgp")
            self._pm.add_hookspecs(hookspecs)
            self._load()
        return self._pm

    def _load(self) -> None:
        from . import predictors

        try:
            self._add(predictors, "kgp.predictors", OWN_DISTRIBUTION, _version(OWN_DISTRIBUTION))
        except _Rejected as exc:  # the core's own hooks: a bug in kgp, not a plugin to skip
            raise RuntimeError(f"kgp's core hooks are broken: {exc.detail}") from exc.__cause__
        raw_only = os.environ.get("KGP_PLUGINS", "")
        only = _env_list("KGP_PLUGINS")
        builtins_only = os.environ.get("KGP_DISABLE_ENTRYPOINTS", "").strip() not in ("", "0", "false", "no")
        eps = list(_entry_points())
        if only is not None:
            self._warn_unknown_requested(only, raw_only, eps)
        for ep in eps:
            dist = _ep_dist(ep)
            # kgp's own entry points always load: the estimator's defaults (solver 'exact', selector
            # 'uniform') name them, and a built-in never clashes (built-ins win), so leaving one out
            # could only break a default
            if only is not None and ep.name not in only and not _is_own(dist):
                self._skipped.setdefault(ep.name, _Skipped(ep.name, dist, f"KGP_PLUGINS={raw_only.strip()}"))
                continue
            if builtins_only and not _is_own(dist):
                self._skipped.setdefault(ep.name, _Skipped(ep.name, dist, "KGP_DISABLE_ENTRYPOINTS=1"))
                continue
            where = f"kgp plugin {ep.name!r} (entry point {ep.value!r} of distribution {dist or 'unknown'})"
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                self._report_failure(
                    LoadFailure(
                        plugin=ep.name,
                        distribution=dist,
                        stage="import",
                        error=_one_line(exc),
                        message=f"{where} failed to load and was skipped: {_one_line(exc)}",
                        traceback=_traceback(exc),
                    )
                )
                continue
            if self._pm.is_registered(plugin):  # two entry points naming the same module
                continue
            if self._pm.has_plugin(ep.name):  # the same entry-point name in two distributions
                self._report_failure(
                    LoadFailure(
                        plugin=ep.name,
                        distribution=dist,
                        stage="duplicate-name",
                        error=f"entry point {ep.name!r} is also declared by {self._dists[ep.name][0]}",
                        message=f"{where} was skipped: distribution {self._dists[ep.name][0]} already declares an "
                        f"entry point named {ep.name!r} (KGP_PLUGINS could not tell them apart); uninstall one of them",
                    )
                )
                continue
            try:
                self._add(plugin, ep.name, dist, ep.dist.version if ep.dist is not None else None)
            except _Rejected as exc:
                self._report_failure(exc.failure(ep.name, dist, f"{where} {exc.detail} and was skipped"))

    def _add(self, plugin: object, name: str, dist: str | None, version: str | None) -> None:
        """Register ``plugin`` with pluggy and call its hooks.

        Raises
        ------
        _Rejected
            With nothing left registered, if the plugin is broken (the cause, if any, is chained).
        """
        pm = self._pm
        assert pm is not None
        try:
            pm.register(plugin, name=name)  # pluggy checks hook signatures against the specs here
        except pluggy.PluginValidationError as exc:
            if pm.get_plugin(name) is plugin:  # older pluggy registered before validating
                pm.unregister(plugin)
            raise _Rejected("validation", _one_line(exc), "has a hook implementation pluggy rejects") from exc
        try:
            unknown = [
                caller.name
                for caller in pm.get_hookcallers(plugin) or ()
                if not caller.has_spec()
                and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
            ]
            if unknown:
                raise _Rejected("unknown-hook", _unknown_hook_error(unknown), _unknown_hook_detail(unknown))
            infos: list[PluginInfo] = []
            for kind, hook_name in zip(KINDS, HOOK_NAMES):
                for impl in getattr(pm.hook, hook_name).get_hookimpls():
                    if impl.plugin is plugin:
                        infos.extend(self._call_hook(impl, kind, hook_name, name, dist, version, infos))
        except BaseException:
            pm.unregister(plugin)  # leave nothing behind: the name is free for a fixed version
            raise
        self._dists[name] = (dist, version)
        self._provided[name] = infos
        self._entries = None

    @staticmethod
    def _call_hook(impl, kind, hook_name, plugin_name, dist, version, earlier) -> list[PluginInfo]:
        added: list[PluginInfo] = []

        def register(name: str, obj: Any) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"plugin {plugin_name!r} registered a {kind} with invalid name {name!r}")
            added.append(PluginInfo(name, kind, obj, plugin_name, dist, version))

        # pluggy lets a hook implementation take a subset of the spec's arguments: pass only those.
        arguments = {"register": register}
        try:
            impl.function(*(arguments[a] for a in impl.argnames))
        except Exception as exc:
            names = tuple((i.kind, i.name) for i in [*earlier, *added])
            raise _Rejected("hook", _one_line(exc), f"raised in {hook_name}", names) from exc
        return added

    def _collect(self) -> dict[tuple[str, str], PluginInfo]:
        """Resolve name clashes between the plugins' registrations (cached until one changes)."""
        if self._entries is not None:
            return self._entries
        self.pm  # noqa: B018 -- discovery on first use
        by_key: dict[tuple[str, str], list[PluginInfo]] = {}
        for infos in self._provided.values():
            for info in infos:
                by_key.setdefault((info.kind, info.name), []).append(info)
        entries: dict[tuple[str, str], PluginInfo] = {}
        conflicts: dict[tuple[str, str], list[PluginInfo]] = {}
        shadowed: dict[tuple[str, str], list[PluginInfo]] = {}
        for key, infos in by_key.items():
            if any(i.builtin for i in infos):
                # Built-ins win against other distributions' entry points: an installed package must not be
                # able to take `exact` away from everyone. Runtime plugins are refused by register() instead.
                losers = [i for i in infos if i.distribution is not None and not i.builtin]
                if losers:
                    shadowed[key] = losers
                    infos = [i for i in infos if i.distribution is None or i.builtin]
            if len(infos) == 1:
                entries[key] = infos[0]
            else:
                conflicts[key] = infos
        self._entries, self._conflicts, self._shadowed = entries, conflicts, shadowed
        for key, losers in shadowed.items():
            self._warn_once(_shadow_message(key, self._winner(key), losers))
        for key, infos in conflicts.items():
            if all(i.distribution is not None for i in infos):  # runtime clashes raise in register() instead
                self._warn_once(_conflict_message(key, infos))
        return entries

    def _winner(self, key: tuple[str, str]) -> PluginInfo:
        assert self._entries is not None
        return self._entries[key] if key in self._entries else self._conflicts[key][0]

    def _warn_once(self, message: str) -> None:
        # Warn at discovery only: _collect runs again after every runtime (un)registration.
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _report_failure(self, failure: LoadFailure) -> None:
        self.load_failures.append(failure)
        self._warn_once(failure.message)

    def _warn_unknown_requested(self, only: set[str], raw: str, eps: list[metadata.EntryPoint]) -> None:
        installed = sorted({ep.name for ep in eps})
        for name in sorted(only - set(installed)):
            close = difflib.get_close_matches(name, installed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            self._warn_once(
                f"KGP_PLUGINS={raw.strip()} lists {name!r}, which is not an installed kgp entry point{hint}; "
                f"installed entry points: {', '.join(installed) or '(none)'}"
            )

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
            rejects, or one of its hooks raises (the exception is the ``__cause__``). Nothing is
            kept, so the fixed plugin can be registered under the same name.
        """
        if plugin is None:
            raise TypeError("plugin: expected a module or object with kgp.hookimpl functions, got None")
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        self._collect()
        pm = self.pm
        if pm.has_plugin(name):
            dist = self._dists.get(name, (None, None))[0]
            what = f"entry point of distribution {dist}" if dist else "registered at runtime"
            raise PluginConflictError(
                f"a plugin named {name!r} is already registered ({what}); call kgp.unregister({name!r}) first, "
                "or pass another name="
            )
        if pm.is_registered(plugin):
            raise PluginConflictError(
                f"this plugin object is already registered as {pm.get_name(plugin)!r}; "
                f"call kgp.unregister({pm.get_name(plugin)!r}) first"
            )
        try:
            self._add(plugin, name, None, None)
        except _Rejected as exc:
            failure = exc.failure(name, None, f"kgp plugin {name!r} {exc.detail} and was not registered")
            raise PluginLoadError(failure) from exc.__cause__
        self._collect()
        clash = next(
            ((key, infos) for key, infos in self._conflicts.items() if any(i.plugin == name for i in infos)), None
        )
        if clash is not None:
            (kind, taken), infos = clash
            others = " and ".join(i.origin for i in infos if i.plugin != name)
            self._remove(name)
            raise PluginConflictError(
                f"plugin {name!r} registers {kind} name {taken!r}, which {others} already registered; "
                f"nothing of plugin {name!r} was kept: register the {kind} under another name"
            )
        return name

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name``."""
        if self.pm.get_plugin(name) is None:
            raise UnknownPluginError(f"no plugin registered under {name!r}")
        self._remove(name)

    def _remove(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._dists.pop(name, None)
        self._provided.pop(name, None)
        self._entries = None

    def reload(self) -> None:
        """Forget everything and rediscover plugins (after installing one, or changing env vars)."""
        self.__init__()

    # ------------------------------------------------------------------ lookup
    def get(self, kind: str, name: str) -> PluginInfo:
        """The registration of ``name``.

        Raises
        ------
        PluginConflictError
            If two plugins registered it and neither is a built-in.
        UnknownPluginError
            If no loaded plugin registered it; the message says why when kgp can tell (the plugin
            failed to load, or ``KGP_PLUGINS`` / ``KGP_DISABLE_ENTRYPOINTS`` kept its entry point out).
        """
        entries = self._collect()
        key = (kind, name)
        if key in self._conflicts:
            raise PluginConflictError(_conflict_message(key, self._conflicts[key]))
        if key not in entries:
            raise UnknownPluginError(self._unknown_message(kind, name))
        return entries[key]

    def _unknown_message(self, kind: str, name: str) -> str:
        available = f"available {kind}s: {', '.join(self.names(kind)) or '(none)'}"
        for failure in self.load_failures:
            if (kind, name) in failure.names or failure.plugin == name:
                return (
                    f"{kind} {name!r} is unavailable: {failure.origin} failed to load: {failure.error} "
                    f"(traceback: `kgp plugins --traceback`); {available}"
                )
        skipped = self._skipped.get(name)
        if skipped is not None:
            origin = f"the entry point {name!r} (distribution {skipped.distribution or 'unknown'}) that provides it"
            if skipped.switch.startswith("KGP_PLUGINS="):
                fix = f"add it ({skipped.switch},{name}) or unset KGP_PLUGINS"
                return f"{kind} {name!r} is not loaded: {skipped.switch} does not list {origin}; {fix}; {available}"
            return (
                f"{kind} {name!r} is not loaded: {skipped.switch} loads only kgp's own plugins, not {origin}; "
                f"unset KGP_DISABLE_ENTRYPOINTS to use it; {available}"
            )
        message = f"unknown {kind} {name!r}; {available}"
        if self.load_failures:
            failed = ", ".join(f.origin for f in self.load_failures)
            message += f"; note: these plugins failed to load and may provide it: {failed} (see `kgp plugins`)"
        if self._skipped:
            switches = sorted({s.switch for s in self._skipped.values()})
            message += (
                f"; note: {' and '.join(switches)} kept out the entry points "
                f"{', '.join(sorted(self._skipped))}, which may provide it"
            )
        return message

    def names(self, kind: str) -> list[str]:
        """Usable names of ``kind``, sorted (never one that two plugins registered)."""
        return sorted(n for k, n in self._collect() if k == kind)

    def infos(self) -> list[PluginInfo]:
        """Every usable registration, by kind then name."""
        entries = self._collect()
        return sorted(entries.values(), key=lambda i: (KINDS.index(i.kind), i.name))

    @property
    def conflicts(self) -> dict[tuple[str, str], list[PluginInfo]]:
        """Unusable names: ``(kind, name)`` -> every registration of it."""
        self._collect()
        return dict(self._conflicts)

    @property
    def shadowed(self) -> dict[tuple[str, str], list[PluginInfo]]:
        """Names a built-in keeps: ``(kind, name)`` -> the other distributions' ignored registrations."""
        self._collect()
        return dict(self._shadowed)

    def problems(self) -> list[str]:
        """One line per shadowed name, unusable name and load failure (what `kgp plugins` reports)."""
        self._collect()
        lines = [f"SHADOWED: {_shadow_message(k, self._winner(k), v)}" for k, v in self._shadowed.items()]
        lines += [f"CONFLICT: {_conflict_message(k, v)}" for k, v in self._conflicts.items()]
        lines += [f"FAILED: {f.message}" for f in self.load_failures]
        return lines


def _conflict_message(key: tuple[str, str], infos: Iterable[PluginInfo]) -> str:
    kind, name = key
    origins = " and ".join(i.origin for i in infos)
    return (
        f"{kind} name {name!r} is registered twice: by {origins}; it is unusable until you uninstall one of "
        "them or leave one out with KGP_PLUGINS"
    )


def _shadow_message(key: tuple[str, str], winner: PluginInfo, losers: Iterable[PluginInfo]) -> str:
    kind, name = key
    return "; ".join(
        f"{kind} name {name!r} of {loser.origin} is ignored: kgp's built-in {winner.origin} has that name and "
        f"built-ins win; rename the {kind} in {loser.distribution}'s register_{kind}s, or uninstall "
        f"{loser.distribution}"
        for loser in losers
    )


def _unknown_hook_detail(hooks: list[str]) -> str:
    parts = []
    for hook in sorted(hooks):
        close = difflib.get_close_matches(hook, HOOK_NAMES, n=1, cutoff=0.5)
        parts.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"implements {'hook' if len(parts) == 1 else 'hooks'} {', '.join(parts)}, which kgp does not define "
        f"(kgp's hooks: {', '.join(HOOK_NAMES)})"
    )


def _unknown_hook_error(hooks: list[str]) -> str:
    return f"unknown hook(s) {', '.join(sorted(hooks))}"


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _is_own(dist: str | None) -> bool:
    return (dist or "").lower() == OWN_DISTRIBUTION


def _ep_dist(ep: metadata.EntryPoint) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def _entry_points() -> Iterator[metadata.EntryPoint]:
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen = set()
    for ep in sorted(eps, key=lambda e: (not _is_own(_ep_dist(e)), e.name)):
        key = (ep.name, ep.value, _ep_dist(ep))
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


def get_objective(name: str):
    """Return the hyperparameter objective registered under ``name`` (error lists the available ones)."""
    return registry.get("objective", name).obj


def register(plugin: ModuleType | object, name: str | None = None) -> str:
    """Register a plugin at runtime; see :meth:`Registry.register`."""
    return registry.register(plugin, name)


def unregister(name: str) -> None:
    """Unregister a runtime plugin by name."""
    registry.unregister(name)


def list_plugins() -> list[PluginInfo]:
    """Every usable registered name with its kind and origin."""
    return registry.infos()
