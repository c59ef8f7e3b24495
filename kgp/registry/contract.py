"""The plugin contract, checked once when a solver, selector or objective registers.

Each must declare

- ``capabilities``: a :class:`kgp.Capabilities` record (what it can do; the only place kgp reads it);
- ``option_defaults``: a mapping from each option name (a str) to a :class:`kgp.Option`, whose own
  default it accepts; an optional ``check_options(options) -> options`` method for rules between
  options, which :func:`kgp.resolve_options` runs once;
- its method: ``fit(problem)`` (solver), ``select(request)`` (selector), ``prepare(problem)``
  (objective); a solver declares ``partial_fit=True`` in its capabilities exactly when it has a
  ``partial_fit(problem, previous)`` method.

A plugin that breaks one of these is refused as a whole (``LoadFailure.stage == "contract"``) with
a message naming the plugin, the registered name and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..capabilities import Capabilities
from ..options import Option
from .records import PluginInfo

__all__ = ["ContractError", "check_registration"]

# the method each kind must have
_METHOD = {"solver": "fit(problem)", "selector": "select(request)", "objective": "prepare(problem)"}
_EXAMPLE = {
    "solver": 'capabilities = kgp.Capabilities(uses_centers=True, target="nystrom")',
    "selector": "capabilities = kgp.Capabilities(distributed=False)",
    "objective": "capabilities = kgp.Capabilities(uses_centers=True)",
}


class ContractError(ValueError):
    """A registered plugin object breaks the plugin contract (the message completes "... which")."""


def check_registration(info: PluginInfo) -> PluginInfo:
    """Check ``info.obj`` against the contract of its kind; return ``info`` with its capabilities.

    Raises
    ------
    ContractError
        Saying what is wrong and how to fix it.
    """
    if info.kind == "recipe":  # a recipe declares no capabilities: it only chooses
        if not callable(getattr(info.obj, "choose", None)):
            raise ContractError("has no choose(request) method (kgp.recipes.Recipe)")
        return info
    if info.kind not in _METHOD:  # predictor kinds declare no capabilities
        return info
    obj, kind = info.obj, info.kind
    capabilities = getattr(obj, "capabilities", None)
    if not isinstance(capabilities, Capabilities):
        got = (
            "declares no capabilities"
            if capabilities is None
            else f"has capabilities = {capabilities!r} ({type(capabilities).__name__}), not a kgp.Capabilities"
        )
        raise ContractError(
            f"{got}: declare what it can do with `capabilities = kgp.Capabilities(...)` on its class, e.g. "
            f"`{_EXAMPLE[kind]}` (fields: uses_centers, target, needs_grad, distributed, distributed_refusal, "
            "partial_fit, loop_defaults, likelihood)"
        )
    method = _METHOD[kind].split("(")[0]
    if not callable(getattr(obj, method, None)):
        raise ContractError(f"has no callable {_METHOD[kind]}")
    _check_partial_fit(kind, obj, capabilities)
    _check_option_defaults(obj)
    check = getattr(obj, "check_options", None)
    if check is not None and not callable(check):
        raise ContractError(f"has a check_options that is not callable ({type(check).__name__})")
    return replace(info, capabilities=capabilities)


def _check_partial_fit(kind: str, obj: Any, capabilities: Capabilities) -> None:
    has_method = callable(getattr(obj, "partial_fit", None))
    if kind != "solver":
        if capabilities.partial_fit:
            raise ContractError(f"declares Capabilities(partial_fit=True), which only solvers can (it is a {kind})")
        return
    if capabilities.partial_fit and not has_method:
        raise ContractError(
            "declares Capabilities(partial_fit=True) but has no partial_fit(problem, previous) method; "
            "implement it or declare partial_fit=False"
        )
    if has_method and not capabilities.partial_fit:
        raise ContractError(
            "has a partial_fit(problem, previous) method but its capabilities say partial_fit=False; "
            "declare Capabilities(partial_fit=True) so that KernelRegressor.partial_fit uses it"
        )


def _check_option_defaults(obj: Any) -> None:
    defaults = getattr(obj, "option_defaults", None)
    if not isinstance(defaults, Mapping):
        raise ContractError(
            f"needs option_defaults, a dict of option name -> kgp.Option ({{}} for none), got {type(defaults).__name__}"
        )
    not_str = [name for name in defaults if not isinstance(name, str)]
    if not_str:
        raise ContractError(f"has option names that are not str in option_defaults: {not_str!r}")
    plain = [name for name, declaration in defaults.items() if not isinstance(declaration, Option)]
    if plain:
        raise ContractError(
            f"declares option(s) {plain} in option_defaults with plain values, not kgp.Option declarations; "
            "declare each with its default, accepted values and help, e.g. "
            '`kgp.Option.integer(100, minimum=1, help="iterations")` or `kgp.Option(default, help=...)` '
            "for any value"
        )
    for name, declaration in defaults.items():
        try:  # the declaration's own check, not Option.parse: checking a default is no validation of options
            if declaration.check is not None:
                declaration.check(declaration.default)
        except (ValueError, TypeError):
            raise ContractError(
                f"declares option {name!r} with default {declaration.default!r}, which its own declaration "
                f"rejects (it accepts {declaration.expected})"
            ) from None
