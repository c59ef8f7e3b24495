"""Resolve an estimator's parameters once into a frozen :class:`FitPlan` (before any data work).

The plan holds the plugin objects picked by name, their options validated once
(:func:`kgp.resolve_options`, cross-option rules included), their declared
:class:`kgp.Capabilities`, and the named random streams. Every later stage reads the plan; nothing
looks a plugin up or validates an option again.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..capabilities import Capabilities
from ..learning.loop_options import ResolvedLearnOptions, resolve_learn_options
from ..options import ResolvedOptions, resolve_options
from ..recipes import RecipeChoice, RecipeRequest
from ..registry import UnknownPluginError, registry
from ..validation import check_n_centers, resolve_dtype
from .parameters import check_device, check_parameters

__all__ = [
    "DEFAULT_SELECTOR",
    "DEFAULT_SOLVER",
    "FitPlan",
    "PendingPlan",
    "PluginChoice",
    "RandomStreams",
    "check_device",
    "prepare_plan",
    "resolve_plan",
]

AUTO = "auto"
DEFAULT_SOLVER = AUTO
DEFAULT_SELECTOR = "uniform"


@dataclass(frozen=True)
class PluginChoice:
    """One plugin of the fit: its kind, name, object, validated options and declared capabilities."""

    kind: str  # "solver", "selector" or "objective"
    name: str
    plugin: Any
    options: ResolvedOptions
    capabilities: Capabilities

    @property
    def label(self) -> str:
        """How messages name it, e.g. ``solver 'falkon'``."""
        return f"{self.kind} {self.name!r}"


class RandomStreams:
    """The fit's named random streams, all derived from one seed.

    Each stage draws from its own stream: ``"select"`` (center selection), ``"solve"`` (the solver),
    ``"learn"`` (the objective's draws, e.g. its subset). ``partial_fit`` chunk c draws from the solve
    stream of that chunk. The streams are fixed offsets of the seed (0, 1 + chunk, 3), the values kgp
    has always used, so that seeded fits keep their results.
    """

    _OFFSETS = {"select": 0, "solve": 1, "learn": 3}

    def __init__(self, seed: int):
        self.seed = int(seed)

    def generator(self, stream: str, chunk: int = 0) -> torch.Generator:
        """A fresh seeded CPU generator for ``stream`` (and ``chunk`` of a streaming fit)."""
        if stream not in self._OFFSETS:
            raise ValueError(f"unknown random stream {stream!r}; streams: {', '.join(self._OFFSETS)}")
        return torch.Generator().manual_seed(self.seed + self._OFFSETS[stream] + chunk)


@dataclass(frozen=True)
class FitPlan:
    """Everything :func:`resolve_plan` decided from the estimator's parameters.

    Attributes
    ----------
    solver, selector, objective:
        The plugins of the fit (``selector`` None: explicit centers or no plugin uses centers;
        ``objective`` None: the hyperparameters stay fixed).
    learn_options:
        The learning loop's and the objective's options, validated here once (None without learning).
    explicit_centers:
        The user's ``M x d`` centers (array-like), or None.
    n_centers, noise, dtype, device:
        The validated parameters.
    ard, normalize_y, normalize_X:
        Resolved switches: a parameter left at None is True when hyperparameters are learned (the GP
        user's defaults: one lengthscale per feature, standardised targets and inputs), False otherwise.
    """

    solver: PluginChoice
    selector: PluginChoice | None
    objective: PluginChoice | None
    learn_options: ResolvedLearnOptions | None
    explicit_centers: Any
    n_centers: int | None
    noise: float
    dtype: torch.dtype | None
    device: torch.device | None
    ard: bool = False
    normalize_y: bool = False
    normalize_X: bool = False
    recipe: RecipeChoice | None = None

    @property
    def needs_centers(self) -> bool:
        """Whether the solver or the learning objective works on centers."""
        uses = self.solver.capabilities.uses_centers
        return uses or (self.objective is not None and self.objective.capabilities.uses_centers)


@dataclass(frozen=True)
class DataShape:
    """What a recipe may know of the data: sizes, dtype, device, whether the rows are sharded."""

    n: int
    d: int
    k: int
    dtype: torch.dtype
    device: torch.device
    distributed: bool = False


@dataclass(frozen=True)
class PendingPlan:
    """Checked parameters whose plan waits for the data's shape: ``solver="auto"`` or ``learn="auto"``.

    Made by :func:`prepare_plan`; :meth:`resolve` asks the recipe and assembles the plan without checking
    the parameters again.
    """

    params: Mapping[str, Any]
    auto_solver: bool
    auto_learn: bool

    def resolve(self, shape: DataShape) -> FitPlan:
        """The plan, with the recipe's choices for the data of ``shape``."""
        choice = _recipe_choice(self.params, shape, self.auto_solver, self.auto_learn)
        return _assemble(self.params, choice, self.auto_solver, self.auto_learn)


def prepare_plan(params: Mapping[str, Any]) -> FitPlan | PendingPlan:
    """Check every estimator parameter once, before the data are looked at; resolve the plan if it can be.

    Without ``"auto"`` the plan is complete (plugins looked up, options validated); with ``solver="auto"``
    or ``learn="auto"`` a :class:`PendingPlan` is returned, resolved once the data's shape is known.

    Raises
    ------
    ValueError, TypeError
        Naming the parameter and what was expected; unknown plugin names list the available ones.
    """
    _check_parameters(params)
    auto_solver, auto_learn = params["solver"] == AUTO, params["learn"] == AUTO
    if auto_solver or auto_learn:
        return PendingPlan(params, auto_solver, auto_learn)
    return _assemble(params, None, auto_solver, auto_learn)


def resolve_plan(params: Mapping[str, Any], shape: DataShape | None = None) -> FitPlan | None:
    """Check every estimator parameter and resolve the plugins, before any data work.

    ``params`` are the constructor parameters of :class:`kgp.KernelRegressor` (``get_params()``),
    checked against their declarations (:data:`kgp.fitting.parameters.ESTIMATOR_PARAMETERS`), then
    the rules between them. With ``solver="auto"`` or ``learn="auto"`` the recipe plugin ``"auto"``
    (:mod:`kgp.recipes`) chooses those values from the data's ``shape``; called without a shape, the
    parameters are checked and None is returned (:func:`prepare_plan` keeps the checked parameters for
    the shape instead).

    The recipe's values enter in one place, :func:`_assemble`, under kgp's one precedence rule
    (:mod:`kgp.options`): its plugin names replace ``"auto"``, its ``n_centers`` fills a None, and its
    options are suggestions that the user's options override and that give way where they conflict.

    Raises
    ------
    ValueError, TypeError
        Naming the parameter and what was expected; unknown plugin names list the available ones.
    """
    prepared = prepare_plan(params)
    if isinstance(prepared, FitPlan):
        return prepared
    return None if shape is None else prepared.resolve(shape)


def _check_parameters(params: Mapping[str, Any]) -> None:
    """Each parameter against its declaration, then the rules between parameters."""
    check_parameters(params)
    if params["learn"] is None and params["learn_options"]:
        raise ValueError("learn_options: given without learn; set learn='auto' (or an objective such as 'exact')")
    if params["solver"] == AUTO and params["solver_options"]:
        raise ValueError(
            "solver_options: given with solver='auto'; name the solver they are for (e.g. solver='falkon'), "
            "or leave them to the recipe"
        )
    resolve_flags(params, learning=params["learn"] is not None)


def _recipe_choice(params: Mapping[str, Any], shape: DataShape, auto_solver: bool, auto_learn: bool) -> RecipeChoice:
    from .. import settings
    from ..device_speed import measured_flops
    from ..registry import get_recipe

    kernel = params["kernel"]
    request = RecipeRequest(
        n=shape.n,
        d=shape.d,
        k=shape.k,
        dtype=shape.dtype,
        device=shape.device,
        memory_budget=settings.memory_budget.value(shape.device),
        max_exact_size=settings.max_exact_size.value(),
        distributed=shape.distributed,
        solver_auto=auto_solver,
        learn_auto=auto_learn,
        uses_centers_explicitly=params["n_centers"] is not None
        or not (params["centers"] is None or isinstance(params["centers"], str)),
        kernel_has_lengthscale=not (isinstance(kernel, str) and kernel.lower() == "linear"),
        device_flops=settings.device_flops.value(),
        measure_flops=functools.partial(measured_flops, shape.device),
    )
    try:
        recipe = get_recipe(AUTO)
    except UnknownPluginError as exc:
        raise UnknownPluginError(
            f"{exc}. solver='auto' and learn='auto' ask the recipe 'auto' (kgp's own, kgp_builtins.recipes): "
            "name a solver and an objective instead, or let kgp's built-in plugins load"
        ) from None
    choice = recipe.choose(request)
    if not isinstance(choice, RecipeChoice):
        raise TypeError(
            f"recipe {AUTO!r}: choose() must return a kgp.recipes.RecipeChoice, got {type(choice).__name__}"
        )
    if auto_solver and choice.solver is None:
        raise TypeError(f"recipe {AUTO!r} left solver='auto' undecided")
    if auto_learn and choice.learn is None:
        raise TypeError(f"recipe {AUTO!r} left learn='auto' undecided")
    return choice


def _assemble(params: Mapping[str, Any], recipe: RecipeChoice | None, auto_solver: bool, auto_learn: bool) -> FitPlan:
    """The plan: plugins, validated options, centers, with the recipe's values where ``"auto"`` asked."""
    solver_name, solver_given, solver_suggested = params["solver"], params["solver_options"], None
    n_centers = params["n_centers"]
    if auto_solver:
        solver_name, solver_given, solver_suggested = recipe.solver, None, recipe.solver_options
        if n_centers is None:
            n_centers = recipe.n_centers
    n_centers = check_n_centers(n_centers)
    dtype = resolve_dtype(params["dtype"])
    device = check_device(params["device"])
    solver = _plugin("solver", solver_name, solver_given, solver_suggested)
    learn, learn_suggested = params["learn"], None
    if auto_learn:
        learn, learn_suggested = recipe.learn, recipe.learn_options
    objective, learn_options = _learning(learn, params["learn_options"], learn_suggested)
    resolved_flags = resolve_flags(params, learning=objective is not None)
    uses_centers = solver.capabilities.uses_centers or (objective is not None and objective.capabilities.uses_centers)
    selector, explicit = None, None
    centers = params["centers"]
    if not uses_centers:
        if centers is not None or n_centers is not None:
            raise ValueError(
                f"solver {solver.name!r} takes no centers (it uses no inducing points or Nystrom centers); "
                "leave centers and n_centers as None"
            )
    elif centers is None or isinstance(centers, str):
        default = None if centers else DEFAULT_SELECTOR
        name = centers or DEFAULT_SELECTOR
        selector = _plugin(
            "selector", name, params["selector_options"], None, default, "centers=<selector name or array>"
        )
    else:  # an array, as declared (kgp.fitting.parameters)
        explicit = centers
    return FitPlan(
        solver=solver,
        selector=selector,
        objective=objective,
        learn_options=learn_options,
        explicit_centers=explicit,
        n_centers=n_centers,
        noise=float(params["noise"]),
        dtype=dtype,
        device=device,
        recipe=recipe,
        **resolved_flags,
    )


def resolve_flags(params: Mapping[str, Any], learning: bool) -> dict[str, bool]:
    """``ard``, ``normalize_y`` and ``normalize_X``: True, False, or None (True exactly when learning)."""
    out = {}
    for name in ("ard", "normalize_y", "normalize_X"):
        value = params.get(name)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name}: expected True, False or None (on when learning), got {value!r}")
        out[name] = learning if value is None else value
    kernel = params["kernel"]
    if out["ard"] and params.get("ard") is None and (not isinstance(kernel, str) or kernel.lower() == "linear"):
        out["ard"] = False  # the default does not apply to a kernel object or a kernel without lengthscale
    if out["ard"] and not isinstance(kernel, str):
        raise ValueError("ard=True applies to shortcut kernels; give your GPyTorch kernel ard_num_dims=d instead")
    if out["ard"] and kernel.lower() == "linear":
        raise ValueError("ard=True: the 'linear' shortcut kernel has no lengthscale")
    return out


def _learning(
    learn: str | None, given: Mapping[str, Any] | None, suggested: Mapping[str, Any] | None
) -> tuple[PluginChoice | None, ResolvedLearnOptions | None]:
    """The objective plugin and ``learn_options`` resolved once (the recipe's as suggestions)."""
    if learn is None:
        return None, None
    info = registry.get("objective", learn)
    resolved = resolve_learn_options(learn, info.obj, given, suggested)  # unknown keys, bad values, rules: once
    choice = PluginChoice("objective", learn, info.obj, resolved.objective, _caps(info))
    return choice, resolved


def _plugin(
    kind: str,
    name: str,
    given: Mapping[str, Any] | None,
    suggested: Mapping[str, Any] | None,
    default: str | None = None,
    argument: str = "",
) -> PluginChoice:
    """The registered plugin ``name`` of ``kind``, its options resolved once, its checked capabilities.

    ``given`` / ``suggested``: the user's options and a recipe's (:func:`kgp.resolve_options`).
    ``default``: the name the parameter defaults to; an unknown default says so (KGP_PLUGINS may have
    left it out) and names the ``argument`` that picks another.
    """
    try:
        info = registry.get(kind, name)
    except UnknownPluginError as exc:
        if default is None or name != default:
            raise
        raise UnknownPluginError(
            f"{exc}. The default {kind} is {default!r}: pass {argument} explicitly to use another one"
        ) from None
    options = resolve_options(f"{kind} {name!r}", info.obj, given, suggested)
    return PluginChoice(kind, name, info.obj, options, _caps(info))


def _caps(info: Any) -> Capabilities:
    """The capabilities the registry checked when the plugin registered."""
    caps = info.capabilities
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{info.kind} {info.name!r}: capabilities must be a kgp.Capabilities")
    return caps
