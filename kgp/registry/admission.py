"""Admitting one plugin: pluggy registers and validates it, its hooks run through pluggy's hook relay,
and what they registered is checked against the plugin contract (:mod:`.contract`).

The four ``register_*`` hooks are *historic* (``kgp/hookspecs.py``): :class:`HookRelay` calls each
once, through pluggy (``HookCaller.call_historic``), when the plugin manager is created, and pluggy
replays that call for every plugin registered later, inside ``PluginManager.register`` and for that
plugin's hook implementations only. So each plugin's hooks run exactly once, right when it
registers, and every name its ``register`` callback receives belongs to the plugin being admitted;
pluggy passes each implementation only the arguments it declares. (pluggy's
``subset_hook_caller`` would do the same per call, but it puts plugins in a set, which refuses
unhashable plugin objects such as a ``types.SimpleNamespace``.)

A plugin is admitted whole or not at all: if pluggy rejects a hook signature, if a hook
implementation matches no hook spec (pluggy's ``check_pending``: a misspelt ``register_solver``),
if a ``register_*`` hook raises, or if a registered solver, selector or objective breaks the
contract, the plugin is unregistered again and :class:`~kgp.registry.records.Rejected` says why;
its name is then free for a fixed version.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

import pluggy

from .. import hookspecs
from .contract import ContractError, check_registration
from .records import HOOK_NAMES, KINDS, PluginInfo, Rejected, one_line

__all__ = ["HookRelay"]


@dataclass
class _Admission:
    """The plugin being registered: where it comes from, what it registered, which hook raised."""

    plugin: str
    dist: str | None
    version: str | None
    infos: list[PluginInfo] = field(default_factory=list)
    failed_hook: str | None = None


class HookRelay:
    """kgp's pluggy ``PluginManager``, whose historic ``register_*`` hooks reach each plugin as it registers.

    Not thread-safe by itself: the registry admits plugins under its lock.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("kgp")
        self.pm.add_hookspecs(hookspecs)
        self._admitting: _Admission | None = None
        self.pm.add_hookcall_monitoring(lambda *_: None, self._after_hook)
        for kind, hook_name in zip(KINDS, HOOK_NAMES):
            getattr(self.pm.hook, hook_name).call_historic(kwargs={"register": self._callback(kind)})

    def admit(self, plugin: object, name: str, dist: str | None, version: str | None) -> list[PluginInfo]:
        """Register ``plugin`` under ``name``, run its hooks and return what it registered (by kind).

        Raises
        ------
        Rejected
            With nothing left registered, if the plugin is broken (the cause, if any, is chained).
        """
        pm = self.pm
        if pm.has_plugin(name):
            raise Rejected("duplicate-name", f"a plugin named {name!r} is already registered", "was a duplicate")
        admission = self._admitting = _Admission(name, dist, version)
        try:
            pm.register(plugin, name=name)  # validates every signature, then replays the historic hooks
        except Exception as exc:
            self._forget(plugin, name)
            names = tuple((i.kind, i.name) for i in sorted(admission.infos, key=lambda i: KINDS.index(i.kind)))
            if admission.failed_hook is not None:
                raise Rejected("hook", one_line(exc), f"raised in {admission.failed_hook}", names) from exc
            raise Rejected("validation", one_line(exc), "has a hook implementation pluggy rejects") from exc
        finally:
            self._admitting = None
        infos = sorted(admission.infos, key=lambda i: KINDS.index(i.kind))  # stable: registration order per kind
        try:
            self._check_known_hooks(plugin)
            return [_checked(info, infos) for info in infos]
        except BaseException:
            self._forget(plugin, name)
            raise

    def _forget(self, plugin: object, name: str) -> None:
        if self.pm.get_plugin(name) is plugin:
            self.pm.unregister(name=name)

    def _callback(self, kind: str):
        def register(name: str, obj: Any) -> None:
            admission = self._admitting
            if admission is None:  # a plugin registered with the plugin manager directly: not kgp's to name
                return
            if not isinstance(name, str) or not name:
                raise TypeError(f"plugin {admission.plugin!r} registered a {kind} with invalid name {name!r}")
            admission.infos.append(PluginInfo(name, kind, obj, admission.plugin, admission.dist, admission.version))

        return register

    def _after_hook(self, outcome: pluggy.Result, hook_name: str, hook_impls: Any, kwargs: Any) -> None:
        # pluggy's call monitoring: which hook of the plugin being admitted raised
        admission = self._admitting
        if admission is not None and outcome.exception is not None and admission.failed_hook is None:
            admission.failed_hook = hook_name

    def _check_known_hooks(self, plugin: object) -> None:
        """pluggy's ``check_pending``, reported for ``plugin`` with every unknown hook and the closest real one."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            unknown = [
                caller.name
                for caller in self.pm.get_hookcallers(plugin) or ()
                if not caller.has_spec()
                and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
            ]
            if unknown:  # else the pending hook is another plugin's, registered with pluggy directly: not ours
                error = f"unknown hook(s) {', '.join(sorted(unknown))}"
                raise Rejected("unknown-hook", error, _unknown_hooks(unknown)) from None  # nothing raised


def _checked(info: PluginInfo, infos: list[PluginInfo]) -> PluginInfo:
    try:
        return check_registration(info)
    except ContractError as exc:  # the contract's verdict: a message, nothing the plugin raised
        names = tuple((i.kind, i.name) for i in infos)
        raise Rejected("contract", str(exc), f"registered {info.kind} {info.name!r}, which {exc}", names) from None


def _unknown_hooks(hooks: list[str]) -> str:
    parts = []
    for hook in sorted(hooks):
        close = difflib.get_close_matches(hook, HOOK_NAMES, n=1, cutoff=0.5)
        parts.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"implements {'hook' if len(parts) == 1 else 'hooks'} {', '.join(parts)}, which kgp does not define "
        f"(kgp's hooks: {', '.join(HOOK_NAMES)})"
    )
