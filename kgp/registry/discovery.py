"""Discovery: which entry points of the ``kgp`` group load, in which order, and what the switches kept out.

kgp's built-in plugins are entry points of the ``kgp`` distribution itself, so they are found
exactly like a third party's. Order: kgp's own first, then the others by name.

Environment variables (read when the registry loads; ``Registry.reload()`` re-reads them):

``KGP_DISABLE_ENTRYPOINTS=1``
    Load only the entry points that the ``kgp`` distribution declares (its built-ins), no third
    party's: reproducible runs and tests.
``KGP_PLUGINS=name1,name2``
    Load only the listed third-party entry points; kgp's own built-ins always load (the
    estimator's defaults name them). A listed name that is not installed is warned about.

Why not pluggy's ``PluginManager.load_setuptools_entrypoints``: the registry registers every
plugin with pluggy's own ``register`` (signature validation), finds misspelt hooks with
``check_pending`` and runs hooks through pluggy's hook relay (historic hooks, :mod:`.admission`),
but it reads the entry points itself, because pluggy's loader cannot keep three documented behaviours:

- it stops at the first entry point whose import raises, so one broken distribution would leave
  every later plugin unloaded; here each failure is a :class:`~kgp.registry.LoadFailure` and the
  others load;
- of two distributions declaring the same entry-point name it silently keeps whichever comes first
  on ``sys.path`` (``has_plugin``), so a third party's entry point named ``falkon`` could replace
  kgp's built-in; here kgp's own distribution loads first and the other is reported (stage
  ``"duplicate-name"``);
- it can exclude names only with ``set_blocked``, which would also make a later runtime
  ``kgp.register(plugin, name=...)`` of that name return silently instead of registering;
  ``KGP_PLUGINS`` and ``KGP_DISABLE_ENTRYPOINTS`` only skip entry points, and a name that was
  kept out says so when it is looked up (:mod:`.names`).
"""

from __future__ import annotations

import difflib
import importlib.metadata as metadata
import os
from collections.abc import Callable
from dataclasses import dataclass

from .records import LoadFailure, Rejected, format_traceback, is_own, one_line

__all__ = ["ENTRY_POINT_GROUP", "Skipped", "Switches", "entry_points", "load_entry_points"]

ENTRY_POINT_GROUP = "kgp"


@dataclass(frozen=True)
class Skipped:
    """An installed entry point that the environment switches kept out."""

    name: str
    distribution: str | None
    switch: str  # e.g. "KGP_PLUGINS=falkon": what to change to load it


@dataclass(frozen=True)
class Switches:
    """The environment switches, read once per discovery."""

    only: frozenset[str] | None  # KGP_PLUGINS as a set of entry-point names, None when unset
    raw_only: str
    builtins_only: bool  # KGP_DISABLE_ENTRYPOINTS

    @classmethod
    def from_environment(cls) -> Switches:
        raw = os.environ.get("KGP_PLUGINS", "")
        only = frozenset(part.strip() for part in raw.split(",") if part.strip()) if raw.strip() else None
        disabled = os.environ.get("KGP_DISABLE_ENTRYPOINTS", "").strip() not in ("", "0", "false", "no")
        return cls(only, raw.strip(), disabled)

    def keeps_out(self, name: str, distribution: str | None) -> Skipped | None:
        """Why the entry point ``name`` of ``distribution`` is not loaded, or None if it is.

        kgp's own entry points always load: the estimator's defaults (solver 'exact', selector
        'uniform') name them, and a built-in never clashes (built-ins win), so leaving one out could
        only break a default.
        """
        if is_own(distribution):
            return None
        if self.only is not None and name not in self.only:
            return Skipped(name, distribution, f"KGP_PLUGINS={self.raw_only}")
        if self.builtins_only:
            return Skipped(name, distribution, "KGP_DISABLE_ENTRYPOINTS=1")
        return None


def distribution_of(ep: metadata.EntryPoint) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def entry_points() -> list[metadata.EntryPoint]:
    """The ``kgp`` group's entry points, kgp's own first, then by name (each listed once)."""
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen, ordered = set(), []
    for ep in sorted(eps, key=lambda e: (not is_own(distribution_of(e)), e.name)):
        key = (ep.name, ep.value, distribution_of(ep))
        if key not in seen:  # an editable install can list a distribution twice
            seen.add(key)
            ordered.append(ep)
    return ordered


def load_entry_points(
    admit: Callable[[object, str, str | None, str | None], None],
    is_loaded: Callable[[object], bool],
    report: Callable[[LoadFailure], None],
    warn: Callable[[str], None],
) -> dict[str, Skipped]:
    """Import every entry point the switches allow and hand each plugin to ``admit``.

    Parameters
    ----------
    admit:
        ``admit(plugin, entry_point_name, distribution, version)`` registers the plugin; it raises
        :class:`~kgp.registry.records.Rejected` (with nothing kept) when the plugin is broken.
    is_loaded:
        Whether a plugin object is registered already (two entry points naming the same module).
    report:
        Receives one :class:`~kgp.registry.LoadFailure` per skipped plugin.
    warn:
        Receives the warning for ``KGP_PLUGINS`` names that are no installed entry point.

    Returns
    -------
    dict
        Entry-point name -> :class:`Skipped`, for the entry points the switches kept out.
    """
    switches = Switches.from_environment()
    eps = entry_points()
    if switches.only is not None:
        _warn_unknown_requested(switches, eps, warn)
    skipped: dict[str, Skipped] = {}
    declared_by: dict[str, str | None] = {}  # entry-point name -> distribution whose entry point loaded
    for ep in eps:
        dist = distribution_of(ep)
        reason = switches.keeps_out(ep.name, dist)
        if reason is not None:
            skipped.setdefault(ep.name, reason)
            continue
        where = f"kgp plugin {ep.name!r} (entry point {ep.value!r} of distribution {dist or 'unknown'})"
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            report(
                LoadFailure(
                    plugin=ep.name,
                    distribution=dist,
                    stage="import",
                    error=one_line(exc),
                    message=f"{where} failed to load and was skipped: {one_line(exc)}",
                    traceback=format_traceback(exc),
                )
            )
            continue
        if is_loaded(plugin):  # two entry points naming the same module
            continue
        if ep.name in declared_by:  # the same entry-point name in two distributions
            other = declared_by[ep.name]
            report(
                LoadFailure(
                    plugin=ep.name,
                    distribution=dist,
                    stage="duplicate-name",
                    error=f"entry point {ep.name!r} is also declared by {other}",
                    message=f"{where} was skipped: distribution {other} already declares an entry point named "
                    f"{ep.name!r} (KGP_PLUGINS could not tell them apart); uninstall one of them",
                )
            )
            continue
        try:
            admit(plugin, ep.name, dist, ep.dist.version if ep.dist is not None else None)
        except Rejected as exc:
            report(exc.failure(ep.name, dist, f"{where} {exc.detail} and was skipped"))
        else:
            declared_by[ep.name] = dist
    return skipped


def _warn_unknown_requested(switches: Switches, eps: list[metadata.EntryPoint], warn: Callable[[str], None]) -> None:
    installed = sorted({ep.name for ep in eps})
    for name in sorted((switches.only or frozenset()) - set(installed)):
        close = difflib.get_close_matches(name, installed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        warn(
            f"KGP_PLUGINS={switches.raw_only} lists {name!r}, which is not an installed kgp entry point{hint}; "
            f"installed entry points: {', '.join(installed) or '(none)'}"
        )
