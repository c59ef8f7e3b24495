"""Declared plugin options: a default, what values are accepted, and one line of help.

A plugin's ``option_defaults`` maps each option name to an :class:`Option` (the registry refuses
plain values), which :func:`resolve_options` uses to validate and normalise the user's value with
one message format for every plugin::

    from kgp.options import Option

    option_defaults = {
        "maxiter": Option.integer(20, minimum=1, help="conjugate-gradient iterations"),
        "tol": Option.number(1e-7, minimum=0.0, help="stop at this relative residual"),
        "factorization": Option.choice("auto", ("auto", "cholesky", "eigh"), help="how K_MM is factored"),
    }

Rules between options (``average <= epochs``) are the plugin's optional method
``check_options(options) -> options``, which :func:`resolve_options` runs right after the options
are parsed. Options are resolved once, before any work: the plugin's ``fit`` / ``select`` /
``prepare`` reads ``problem.options`` (a :class:`ResolvedOptions`) and never validates again; a test
calling a plugin directly builds them the same way, e.g.
``kgp.resolve_options("solver 'falkon'", kgp.get_solver("falkon"), maxiter=5)``.

Rules between options may also be declared as data, in the plugin's optional ``option_rules`` (a
tuple of :class:`Requires`): "``polish_iterations``, when set, needs ``optimizer == 'adam'``".

**Where values come from, and which wins.** An option's value comes from one of three layers: the
declaration's default, a suggestion (``suggested``: the values a recipe chose for ``"auto"``), and the
user's (``given``). The user's value wins over a suggestion, and a suggestion over the default. When a
declared rule fails, the value it governs gives way if the user did not give it (it is switched off:
set to the rule's ``off`` value, None), and the fit raises, naming both options, if the user did. So
a recipe's or a plugin's default never overrides an explicit choice, and two explicit choices in
conflict are an error, never silently dropped. The learning loop's options (``learn_options``) and
every plugin's options go through this one function.

``kgp plugins --options NAME`` prints the declarations. In the spirit of scikit-learn's
``_parameter_constraints``: the declaration is data, so help, errors and checks cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

__all__ = [
    "InvalidOptionError",
    "Option",
    "Requires",
    "ResolvedOptions",
    "apply_rules",
    "describe_options",
    "merge_options",
    "option_default",
    "resolve_options",
]


class InvalidOptionError(ValueError, TypeError):
    """An option value outside what its declaration accepts.

    Subclasses both ``ValueError`` and ``TypeError`` (as scikit-learn's ``InvalidParameterError``
    does), so callers catching either keep working whether the value had the wrong type or range.
    """


@dataclass(frozen=True)
class Option:
    """One declared option.

    Attributes
    ----------
    default:
        Value used when the user does not give one (itself checked when merged).
    help:
        One line for ``kgp plugins --options`` and the docs.
    expected:
        What the option accepts, in words (used in errors and help), e.g. ``"an integer >= 1"``.
    check:
        ``check(value) -> normalised value``; raises ``ValueError`` / ``TypeError`` (any message)
        when the value is not accepted. None accepts anything.
    """

    default: Any
    help: str = ""
    expected: str = "any value"
    check: Callable[[Any], Any] | None = None

    def parse(self, owner: str, name: str, value: Any) -> Any:
        """Return ``value`` normalised, or raise :class:`InvalidOptionError` in kgp's one format."""
        if self.check is None:
            return value
        try:
            return self.check(value)
        except (ValueError, TypeError) as exc:
            raise InvalidOptionError(f"{owner} option {name!r}: expected {self.expected}, got {value!r}") from exc

    # ------------------------------------------------------------------ constructors
    @classmethod
    def integer(
        cls,
        default: int | None,
        *,
        minimum: int | None = None,
        maximum: int | None = None,
        allow_none: bool = False,
        help: str = "",
    ) -> Option:
        """An ``int`` (numpy integers accepted, bools refused) within ``[minimum, maximum]``."""
        expected = _with_none("an integer" + _bounds(minimum, maximum), allow_none)

        def check(value: Any) -> int | None:
            if value is None and allow_none:
                return None
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError("not an integer")
            value = int(value)
            _check_bounds(value, minimum, maximum, strict_minimum=False)
            return value

        return cls(default, help, expected, check)

    @classmethod
    def number(
        cls,
        default: float | str | None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
        exclusive_maximum: bool = False,
        allow_none: bool = False,
        keywords: tuple[str, ...] = (),
        help: str = "",
    ) -> Option:
        """A finite real number (returned as ``float``) within bounds, or one of ``keywords`` (e.g. "auto")."""
        words = "".join(f" or {k!r}" for k in keywords)
        expected = _with_none(
            "a finite number" + _bounds(minimum, maximum, exclusive_minimum, exclusive_maximum) + words, allow_none
        )

        def check(value: Any) -> float | str | None:
            if value is None and allow_none:
                return None
            if isinstance(value, str) and value in keywords:
                return value
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
                raise TypeError("not a finite number")
            value = float(value)
            _check_bounds(value, minimum, maximum, strict_minimum=exclusive_minimum, strict_maximum=exclusive_maximum)
            return value

        return cls(default, help, expected, check)

    @classmethod
    def choice(cls, default: Any, choices: tuple[Any, ...], *, help: str = "") -> Option:
        """One of ``choices`` (compared with ``==``; e.g. strings, or None)."""
        expected = "one of " + ", ".join(repr(c) for c in choices)

        def check(value: Any) -> Any:
            if not any(value == c and type(value) is type(c) for c in choices):
                raise ValueError("not a choice")
            return value

        return cls(default, help, expected, check)

    @classmethod
    def boolean(cls, default: bool, *, help: str = "") -> Option:
        """``True`` or ``False`` (no truthy stand-ins: ``"no"`` is a string, not False)."""

        def check(value: Any) -> bool:
            if not isinstance(value, bool):
                raise TypeError("not a bool")
            return value

        return cls(default, help, "True or False", check)


@dataclass(frozen=True)
class Requires:
    """A declared rule between options: ``option``, when set, needs ``condition(options)`` to hold.

    Attributes
    ----------
    option:
        The option the rule governs (e.g. ``"polish_iterations"``).
    condition:
        ``condition(options) -> bool`` on the merged options; checked only while ``option`` is set
        (its value is not ``off``).
    message:
        ``message(owner, options) -> str``: the error when the user gave ``option`` and the rule fails;
        it names both options and says what to change.
    off:
        The value that switches ``option`` off, and that it takes when it gives way (default None).
    """

    option: str
    condition: Callable[[Mapping[str, Any]], bool]
    message: Callable[[str, Mapping[str, Any]], str]
    off: Any = None


def apply_rules(
    owner: str, rules: tuple[Requires, ...], options: Mapping[str, Any], given: Mapping[str, Any]
) -> dict[str, Any]:
    """Apply declared rules in order, with kgp's one precedence rule (module docstring).

    A failing rule raises ``ValueError`` (its message) when the user gave ``rule.option`` (it is in
    ``given``); otherwise ``rule.option`` is switched off (set to ``rule.off``) and the later rules
    see it off.

    Returns
    -------
    dict
        The options with the values that gave way switched off.
    """
    out = dict(options)
    for rule in rules:
        if out[rule.option] is rule.off or rule.condition(out):
            continue
        if rule.option in given:
            raise ValueError(rule.message(owner, out))
        out[rule.option] = rule.off
    return out


def option_default(declaration: Any) -> Any:
    """The default of an ``option_defaults`` entry (an :class:`Option` or a plain value)."""
    return declaration.default if isinstance(declaration, Option) else declaration


def merge_options(owner: str, defaults: Mapping[str, Any], given: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge user options into a plugin's ``option_defaults``, validating declared ones.

    The parsing step of :func:`resolve_options` (which adds the plugin's ``check_options``); the
    learning loop also uses it for its own options. Plugins call neither.

    Parameters
    ----------
    owner:
        How errors name the plugin, e.g. ``"solver 'falkon'"``.
    defaults:
        The plugin's ``option_defaults``: plain defaults or :class:`Option` declarations.
    given:
        The user's options (``solver_options`` / ``selector_options``), or None.

    Returns
    -------
    dict
        Every option name with its (normalised) value.

    Raises
    ------
    TypeError
        If ``given`` is not a mapping.
    ValueError
        Naming unknown options and listing the valid ones.
    InvalidOptionError
        (a ValueError and a TypeError) naming the option, what it accepts and the value given.
    """
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise TypeError(f"options for {owner}: expected a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        valid = ", ".join(sorted(defaults)) or "(none)"
        raise ValueError(f"unknown option(s) {unknown} for {owner}; valid options: {valid}")
    merged = {}
    for name, declaration in defaults.items():
        value = given[name] if name in given else option_default(declaration)
        merged[name] = declaration.parse(owner, name, value) if isinstance(declaration, Option) else value
    return merged


class ResolvedOptions(Mapping[str, Any]):
    """A plugin's options, validated once against its declaration (read-only mapping).

    Made only by :func:`resolve_options` (the fit plan does it once per plugin, before any data work):
    a plugin receiving one in ``problem.options`` reads it and never validates again.
    """

    __slots__ = ("_owner", "_values")

    def __init__(self, owner: str, values: Mapping[str, Any]) -> None:
        self._owner = owner
        self._values = dict(values)

    @property
    def owner(self) -> str:
        """How errors name the plugin, e.g. ``"solver 'falkon'"``."""
        return self._owner

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            valid = ", ".join(sorted(self._values)) or "(none)"
            raise KeyError(f"{self._owner} has no option {name!r}; its options: {valid}") from None

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ResolvedOptions({self._owner}, {self._values!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    __hash__ = None  # a mapping, compared by value

    def __reduce__(self):
        return (ResolvedOptions, (self._owner, self._values))


def resolve_options(
    owner: str,
    plugin: Any,
    given: Mapping[str, Any] | None = None,
    suggested: Mapping[str, Any] | None = None,
    /,
    **options: Any,
) -> ResolvedOptions:
    """Validate options against ``plugin.option_defaults`` once, the rules between options included.

    Every option is parsed by its :class:`Option` (unknown names and bad values raise, naming the
    option); then the plugin's declared ``option_rules`` (:class:`Requires`, optional) apply with the
    precedence rule of the module docstring; then, if the plugin defines
    ``check_options(options) -> options``, its own rules run on the merged dict (raising
    :class:`InvalidOptionError` or ``ValueError`` naming the options).

    Parameters
    ----------
    owner:
        How errors name the plugin, e.g. ``"solver 'falkon'"``.
    plugin:
        The plugin object (its ``option_defaults``, optional ``option_rules`` and ``check_options``).
    given:
        The user's options, or None.
    suggested:
        Values chosen for the user (a recipe's), or None: they replace the declared defaults, the
        user's values replace them, and they give way where a rule fails (module docstring).
    **options:
        More user options, taking precedence over ``given``: ``resolve_options(owner, plugin, maxiter=5)``
        is the short form for a test calling a plugin directly.

    Returns
    -------
    ResolvedOptions
        Every declared option with its value (``given`` itself when it is already the resolved
        options of the same ``owner`` and nothing is added).
    """
    if isinstance(given, ResolvedOptions) and given.owner == owner and not options and not suggested:
        return given  # already validated: a plan's options handed on
    given = _mapping(owner, given)
    if options:
        given = {**given, **options}
    merged = merge_options(owner, plugin.option_defaults, {**_mapping(owner, suggested), **given})
    merged = apply_rules(owner, tuple(getattr(plugin, "option_rules", ())), merged, given)
    check = getattr(plugin, "check_options", None)  # an optional method, not a capability flag
    if check is not None:
        declared = set(merged)
        merged = check(merged)
        if not isinstance(merged, dict):
            raise TypeError(f"{owner}: check_options must return the options dict, got {type(merged).__name__}")
        if set(merged) != declared:
            changed = sorted(set(merged) ^ declared)
            raise TypeError(
                f"{owner}: check_options must return every declared option and no other; it changed {changed}"
            )
    return ResolvedOptions(owner, merged)


def _mapping(owner: str, values: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise TypeError(f"options for {owner}: expected a dict, got {type(values).__name__}")
    return values


def describe_options(defaults: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows ``(name, default, expected, help)`` for every option (plain defaults: expected "any value")."""
    rows = []
    for name, declaration in defaults.items():
        if isinstance(declaration, Option):
            rows.append((name, repr(declaration.default), declaration.expected, declaration.help))
        else:
            rows.append((name, repr(declaration), "any value (not declared)", ""))
    return rows


def _bounds(
    minimum: float | None, maximum: float | None, exclusive_minimum: bool = False, exclusive_maximum: bool = False
) -> str:
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if exclusive_minimum else '>='} {minimum:g}")
    if maximum is not None:
        parts.append(f"{'<' if exclusive_maximum else '<='} {maximum:g}")
    return (" " + " and ".join(parts)) if parts else ""


def _check_bounds(
    value: float,
    minimum: float | None,
    maximum: float | None,
    *,
    strict_minimum: bool = False,
    strict_maximum: bool = False,
) -> None:
    if minimum is not None and (value < minimum or (strict_minimum and value == minimum)):
        raise ValueError("below the minimum")
    if maximum is not None and (value > maximum or (strict_maximum and value == maximum)):
        raise ValueError("above the maximum")


def _with_none(expected: str, allow_none: bool) -> str:
    return expected + " or None" if allow_none else expected
