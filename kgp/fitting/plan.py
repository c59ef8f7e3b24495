"""Resolve an estimator's parameters once into a frozen :class:`FitPlan` (before any data work).

The plan holds the plugin objects picked by name, their options validated once
(:func:`kgp.resolve_options`, cross-option rules included), their declared
:class:`kgp.Capabilities`, and the named random streams. Every later stage reads the plan; nothing
looks a plugin up or validates an option again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from ..capabilities import Capabilities
from ..kernels import KERNEL_SHORTCUTS
from ..learning.loop_options import ResolvedLearnOptions, resolve_learn_options
from ..options import ResolvedOptions, resolve_options
from ..recipes import RecipeChoice, RecipeRequest
from ..registry import UnknownPluginError, registry
from ..validation import check_n_centers, check_positive, resolve_dtype

__all__ = ["DEFAULT_SELECTOR", "DEFAULT_SOLVER", "FitPlan", "PluginChoice", "RandomStreams", "resolve_plan"]

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


def resolve_plan(params: Mapping[str, Any], shape: DataShape | None = None) -> FitPlan | None:
    """Check every estimator parameter and resolve the plugins, before any data work.

    ``params`` are the constructor parameters of :class:`kgp.KernelRegressor` (``get_params()``).
    With ``solver="auto"`` or ``learn="auto"`` the recipe plugin ``"auto"`` (:mod:`kgp.recipes`)
    chooses those values from the data's ``shape``; called without a shape, the parameters are
    checked and None is returned (the fit calls again once the data's shape is known).

    Raises
    ------
    ValueError, TypeError
        Naming the parameter and what was expected; unknown plugin names list the available ones.
    """
    _check_scalars(params)
    auto_solver, auto_learn = params["solver"] == AUTO, params["learn"] == AUTO
    if auto_solver and params["solver_options"]:
        raise ValueError(
            "solver_options: given with solver='auto'; name the solver they are for (e.g. solver='falkon'), "
            "or leave them to the recipe"
        )
    choice = None
    if auto_solver or auto_learn:
        if shape is None:
            return None
        choice = _recipe_choice(params, shape, auto_solver, auto_learn)
        params = _with_choice(params, choice, auto_solver, auto_learn)
    plan = _assemble(params)
    return plan if choice is None else replace(plan, recipe=choice)


def _check_scalars(params: Mapping[str, Any]) -> None:
    check_positive(params["noise"], "noise")
    if params["lengthscale"] is not None:
        check_positive(params["lengthscale"], "lengthscale")
    check_n_centers(params["n_centers"])
    kernel = params["kernel"]
    if not isinstance(params["solver"], str):
        raise TypeError(f"solver: expected a plugin name (str) or 'auto', got {type(params['solver']).__name__}")
    if not isinstance(kernel, (gpytorch.kernels.Kernel, str)):
        got = type(kernel).__name__
        raise TypeError(f"kernel: expected a gpytorch.kernels.Kernel or one of {KERNEL_SHORTCUTS}, got {got}")
    if isinstance(kernel, str) and kernel.lower() not in KERNEL_SHORTCUTS:
        raise ValueError(f"kernel: unknown shortcut {kernel!r}; expected one of {KERNEL_SHORTCUTS}")
    for name in ("solver_options", "selector_options"):
        if params[name] is not None and not isinstance(params[name], dict):
            raise TypeError(f"{name}: expected a dict or None, got {type(params[name]).__name__}")
    seed = params["random_state"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"random_state: expected an int or None, got {seed!r}")
    if params["callback"] is not None and not callable(params["callback"]):
        raise TypeError("callback: expected a callable taking an IterationInfo")
    given = params["learn_options"]
    if given is not None and not isinstance(given, dict):
        raise TypeError(f"learn_options: expected a dict or None, got {type(given).__name__}")
    if params["learn"] is None and given:
        raise ValueError("learn_options: given without learn; set learn='auto' (or an objective such as 'exact')")
    if params["learn"] is not None and not isinstance(params["learn"], str):
        raise TypeError(f"learn: expected an objective plugin name (str), 'auto' or None, got {params['learn']!r}")
    resolve_dtype(params["dtype"])
    check_device(params["device"])
    switches(params, learning=params["learn"] is not None)


def _recipe_choice(params: Mapping[str, Any], shape: DataShape, auto_solver: bool, auto_learn: bool) -> RecipeChoice:
    from .. import settings
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


def _with_choice(params: Mapping[str, Any], choice: RecipeChoice, auto_solver: bool, auto_learn: bool) -> dict:
    """The parameters with the recipe's values in place of ``"auto"`` (the user's explicit values win)."""
    out = dict(params)
    if auto_solver:
        out["solver"] = choice.solver
        out["solver_options"] = dict(choice.solver_options or {}) or None
        if out["n_centers"] is None and choice.n_centers is not None:
            out["n_centers"] = choice.n_centers
    if auto_learn:
        out["learn"] = choice.learn
        given = dict(params["learn_options"] or {})
        merged = {**dict(choice.learn_options or {}), **given}
        if merged.get("optimizer", "adam") != "adam":
            # the user's L-BFGS has one budget: the recipe's Adam-only extensions do not apply to it
            for key in ("max_iterations", "polish_iterations"):
                if key not in given:
                    merged.pop(key, None)
        if "refine_subset" not in given and "refine_subset" in merged:
            subset = merged.get("subset")
            if subset is None or subset >= merged["refine_subset"]:
                # the user's subset already holds as many rows as the recipe's refine stage would add
                merged.pop("refine_subset")
        out["learn_options"] = merged or None
    return out


def _assemble(params: Mapping[str, Any]) -> FitPlan:
    """The plan of concrete parameters (no ``"auto"`` left): plugins, validated options, centers."""
    n_centers = check_n_centers(params["n_centers"])
    dtype = resolve_dtype(params["dtype"])
    device = check_device(params["device"])
    solver = _choice("solver", params["solver"])
    solver = _with_options(solver, params["solver_options"])
    objective, learn_options = _learning(params)
    resolved_switches = switches(params, learning=objective is not None)
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
        choice = _choice("selector", centers or DEFAULT_SELECTOR, default, "centers=<selector name or array>")
        selector = _with_options(choice, params["selector_options"])
    elif isinstance(centers, (Tensor, np.ndarray, list)):
        explicit = centers
    else:
        raise TypeError(
            f"centers: expected a selector name, an (M x d) array/tensor or None, got {type(centers).__name__}"
        )
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
        **resolved_switches,
    )


def switches(params: Mapping[str, Any], learning: bool) -> dict[str, bool]:
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


def _learning(params: Mapping[str, Any]) -> tuple[PluginChoice | None, ResolvedLearnOptions | None]:
    """Check ``learn`` and ``learn_options``; resolve the objective plugin."""
    learn, given = params["learn"], params["learn_options"]
    if learn is None:
        return None, None
    info = registry.get("objective", learn)
    resolved = resolve_learn_options(learn, info.obj, given)  # unknown keys and bad values fail here, once
    choice = PluginChoice("objective", learn, info.obj, resolved.objective, _caps(info))
    return choice, resolved


def _choice(kind: str, name: str, default: str | None = None, argument: str = "") -> PluginChoice:
    """The registered plugin ``name`` of ``kind`` with its checked capabilities.

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
    return PluginChoice(kind, name, info.obj, ResolvedOptions(f"{kind} {name!r}", {}), _caps(info))


def _with_options(choice: PluginChoice, given: Mapping[str, Any] | None) -> PluginChoice:
    options = resolve_options(choice.label, choice.plugin, given)
    return PluginChoice(choice.kind, choice.name, choice.plugin, options, choice.capabilities)


def _caps(info: Any) -> Capabilities:
    """The capabilities the registry checked when the plugin registered."""
    caps = info.capabilities
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{info.kind} {info.name!r}: capabilities must be a kgp.Capabilities")
    return caps


def check_device(device: Any) -> torch.device | None:
    """``device`` as a torch.device; a ValueError naming it if torch does not know it or it is absent here."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r} ({exc})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested, but CUDA is not available to this torch ({torch.__version__})")
    return resolved
