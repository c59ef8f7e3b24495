"""The name table: which registered name is usable, which two plugins clash, and what a lookup says.

Names are global. When two plugins register the same ``(kind, name)``:

- a third-party entry point against kgp's own distribution: **the built-in wins**, the third
  party's registration of that name is ignored (:attr:`NameTable.shadowed`; its other names work);
- two third parties (or a runtime plugin and anything): the name is unusable
  (:class:`~kgp.registry.PluginConflictError` naming both origins) until one is removed.

A :class:`NameTable` is built from what each plugin registered and never changes; the registry
builds a new one after every runtime (un)registration. An unknown name's message lists the
available names of its kind and, when kgp can tell, why the name is missing: the plugin that
provides it failed to load, or an environment switch (:mod:`.discovery`) kept its entry point out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .discovery import Skipped
from .records import KINDS, LoadFailure, PluginConflictError, PluginInfo, UnknownPluginError

__all__ = ["NameTable", "conflict_message", "shadow_message"]

Key = tuple[str, str]  # (kind, name)


class NameTable:
    """Usable names, clashes and shadowed registrations of one set of plugins.

    Parameters
    ----------
    provided:
        Plugin name -> what its hooks registered, in registration order (first registrant first).
    failures:
        The plugins that were skipped (their names are reported as unavailable, not unknown).
    skipped:
        Entry-point name -> the switch that kept it out.
    """

    def __init__(
        self,
        provided: Mapping[str, Sequence[PluginInfo]],
        failures: Sequence[LoadFailure] = (),
        skipped: Mapping[str, Skipped] | None = None,
    ) -> None:
        self._failures = tuple(failures)
        self._skipped = dict(skipped or {})
        by_key: dict[Key, list[PluginInfo]] = {}
        for infos in provided.values():
            for info in infos:
                by_key.setdefault((info.kind, info.name), []).append(info)
        self.entries: dict[Key, PluginInfo] = {}
        self.conflicts: dict[Key, list[PluginInfo]] = {}
        self.shadowed: dict[Key, list[PluginInfo]] = {}
        for key, infos in by_key.items():
            if any(i.builtin for i in infos):
                # Built-ins win against other distributions' entry points: an installed package must not be
                # able to take `exact` away from everyone. Runtime plugins are refused by register() instead.
                losers = [i for i in infos if i.distribution is not None and not i.builtin]
                if losers:
                    self.shadowed[key] = losers
                    infos = [i for i in infos if i.distribution is None or i.builtin]
            if len(infos) == 1:
                self.entries[key] = infos[0]
            else:
                self.conflicts[key] = infos

    # ------------------------------------------------------------------ lookup
    def get(self, kind: str, name: str) -> PluginInfo:
        """The registration of ``name``.

        Raises
        ------
        PluginConflictError
            If two plugins registered it and neither is a built-in.
        UnknownPluginError
            If no loaded plugin registered it; the message says why when kgp can tell.
        """
        key = (kind, name)
        if key in self.conflicts:
            raise PluginConflictError(conflict_message(key, self.conflicts[key]))
        if key not in self.entries:
            raise UnknownPluginError(self.unknown_message(kind, name))
        return self.entries[key]

    def names(self, kind: str) -> list[str]:
        """Usable names of ``kind``, sorted (never one that two plugins registered)."""
        return sorted(n for k, n in self.entries if k == kind)

    def infos(self) -> list[PluginInfo]:
        """Every usable registration, by kind then name."""
        return sorted(self.entries.values(), key=lambda i: (KINDS.index(i.kind), i.name))

    def clash_of(self, plugin: str) -> tuple[Key, list[PluginInfo]] | None:
        """The first unusable name that ``plugin`` registered, with every registration of it."""
        return next(((k, v) for k, v in self.conflicts.items() if any(i.plugin == plugin for i in v)), None)

    # ------------------------------------------------------------------ messages
    def discovery_warnings(self) -> list[str]:
        """What to warn once at discovery: every shadowed name, and every clash between entry points."""
        lines = [shadow_message(key, self._winner(key), losers) for key, losers in self.shadowed.items()]
        # runtime clashes raise in register() instead of warning
        lines += [
            conflict_message(key, infos)
            for key, infos in self.conflicts.items()
            if all(i.distribution is not None for i in infos)
        ]
        return lines

    def problems(self) -> list[str]:
        """One line per shadowed name, unusable name and load failure (what `kgp plugins` reports)."""
        lines = [f"SHADOWED: {shadow_message(k, self._winner(k), v)}" for k, v in self.shadowed.items()]
        lines += [f"CONFLICT: {conflict_message(k, v)}" for k, v in self.conflicts.items()]
        lines += [f"FAILED: {f.message}" for f in self._failures]
        return lines

    def unknown_message(self, kind: str, name: str) -> str:
        """Why ``name`` is not a usable ``kind``, ending with the available names of that kind."""
        available = f"available {kind}s: {', '.join(self.names(kind)) or '(none)'}"
        for failure in self._failures:
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
        if self._failures:
            failed = ", ".join(f.origin for f in self._failures)
            message += f"; note: these plugins failed to load and may provide it: {failed} (see `kgp plugins`)"
        if self._skipped:
            switches = sorted({s.switch for s in self._skipped.values()})
            message += (
                f"; note: {' and '.join(switches)} kept out the entry points "
                f"{', '.join(sorted(self._skipped))}, which may provide it"
            )
        return message

    def _winner(self, key: Key) -> PluginInfo:
        return self.entries[key] if key in self.entries else self.conflicts[key][0]


def conflict_message(key: Key, infos: Iterable[PluginInfo]) -> str:
    kind, name = key
    origins = " and ".join(i.origin for i in infos)
    return (
        f"{kind} name {name!r} is registered twice: by {origins}; it is unusable until you uninstall one of "
        "them or leave one out with KGP_PLUGINS"
    )


def shadow_message(key: Key, winner: PluginInfo, losers: Iterable[PluginInfo]) -> str:
    kind, name = key
    return "; ".join(
        f"{kind} name {name!r} of {loser.origin} is ignored: kgp's built-in {winner.origin} has that name and "
        f"built-ins win; rename the {kind} in {loser.distribution}'s register_{kind}s, or uninstall "
        f"{loser.distribution}"
        for loser in losers
    )
