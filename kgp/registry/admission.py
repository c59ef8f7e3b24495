"""Admitting one plugin: pluggy registers and validates it, its hooks are called through the relay,
and what they registered is checked against the plugin contract (:mod:`.contract`).

A plugin is admitted whole or not at all: if pluggy rejects a hook signature, if a hook
implementation matches no hook spec (pluggy's ``check_pending``: a misspelt ``register_solver``),
if a ``register_*`` hook raises, or if a registered solver, selector or objective breaks the
contract, the plugin is unregistered again and :class:`~kgp.registry.records.Rejected` says why;
its name is then free for a fixed version.

Each plugin's hooks are called once, right after it is registered, through a pluggy hook caller
restricted to that plugin (``PluginManager.subset_hook_caller``): pluggy passes each
implementation the arguments it declares, and the registry knows which plugin registered which
name and can drop one broken plugin without touching the others.
"""

from __future__ import annotations

import difflib
from typing import Any

import pluggy

from .contract import ContractError, check_registration
from .records import HOOK_NAMES, KINDS, PluginInfo, Rejected, one_line

__all__ = ["admit"]


def admit(
    pm: pluggy.PluginManager, plugin: object, name: str, dist: str | None, version: str | None
) -> list[PluginInfo]:
    """Register ``plugin`` under ``name``, call its hooks and return what it registered.

    Raises
    ------
    Rejected
        With nothing left registered, if the plugin is broken (the cause, if any, is chained).
    """
    if pm.has_plugin(name):
        raise Rejected("duplicate-name", f"a plugin named {name!r} is already registered", "was a duplicate")
    try:
        pm.register(plugin, name=name)  # pluggy checks hook signatures against the specs here
    except pluggy.PluginValidationError as exc:
        if pm.get_plugin(name) is plugin:  # older pluggy registered before validating
            pm.unregister(plugin)
        raise Rejected("validation", one_line(exc), "has a hook implementation pluggy rejects") from exc
    try:
        _check_known_hooks(pm, plugin)
        infos: list[PluginInfo] = []
        for kind, hook_name in zip(KINDS, HOOK_NAMES):
            if any(impl.plugin is plugin for impl in getattr(pm.hook, hook_name).get_hookimpls()):
                infos.extend(_call_hook(pm, plugin, kind, hook_name, name, dist, version, infos))
        return [_checked(info, infos) for info in infos]
    except BaseException:
        pm.unregister(plugin)  # leave nothing behind
        raise


def _check_known_hooks(pm: pluggy.PluginManager, plugin: object) -> None:
    """pluggy's ``check_pending``, reported for ``plugin`` with every unknown hook and the closest real one."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        unknown = [
            caller.name
            for caller in pm.get_hookcallers(plugin) or ()
            if not caller.has_spec() and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())
        ]
        if unknown:  # else the pending hook is another plugin's, registered with pluggy directly: not ours to judge
            error = f"unknown hook(s) {', '.join(sorted(unknown))}"
            raise Rejected("unknown-hook", error, _unknown_hooks(unknown)) from None  # no traceback: nothing raised


def _call_hook(
    pm: pluggy.PluginManager,
    plugin: object,
    kind: str,
    hook_name: str,
    plugin_name: str,
    dist: str | None,
    version: str | None,
    earlier: list[PluginInfo],
) -> list[PluginInfo]:
    added: list[PluginInfo] = []

    def register(name: str, obj: Any) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"plugin {plugin_name!r} registered a {kind} with invalid name {name!r}")
        added.append(PluginInfo(name, kind, obj, plugin_name, dist, version))

    others = [p for p in pm.get_plugins() if p is not plugin]
    try:
        pm.subset_hook_caller(hook_name, remove_plugins=others)(register=register)
    except Exception as exc:
        names = tuple((i.kind, i.name) for i in [*earlier, *added])
        raise Rejected("hook", one_line(exc), f"raised in {hook_name}", names) from exc
    return added


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
