"""Resolve an estimator's parameters once into a frozen :class:`FitPlan` (before any data work).

The plan holds the plugin objects picked by name, their options validated once
(:func:`kgp.resolve_options`, cross-option rules included), their declared
:class:`kgp.Capabilities`, and the named random streams. Every later stage reads the plan; nothing
looks a plugin up or validates an option again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gpytorch
import numpy as np
import torch
from torch import Tensor

from ..capabilities import Capabilities
from ..kernels import KERNEL_SHORTCUTS
from ..learning.loop import split_learn_options
from ..options import ResolvedOptions, resolve_options
from ..registry import UnknownPluginError, get_objective, get_selector, get_solver
from ..validation import check_n_centers, check_positive, resolve_dtype

__all__ = ["DEFAULT_SELECTOR", "DEFAULT_SOLVER", "FitPlan", "PluginChoice", "RandomStreams", "resolve_plan"]

DEFAULT_SOLVER = "exact"
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
        The learning loop's and the objective's options as the user gave them (validated here once).
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
    learn_options: Mapping[str, Any]
    explicit_centers: Any
    n_centers: int | None
    noise: float
    dtype: torch.dtype | None
    device: torch.device | None
    ard: bool = False
    normalize_y: bool = False
    normalize_X: bool = False

    @property
    def needs_centers(self) -> bool:
        """Whether the solver or the learning objective works on centers."""
        uses = self.solver.capabilities.uses_centers
        return uses or (self.objective is not None and self.objective.capabilities.uses_centers)


def resolve_plan(params: Mapping[str, Any]) -> FitPlan:
    """Check every estimator parameter and resolve the plugins, before any data work.

    ``params`` are the constructor parameters of :class:`kgp.KernelRegressor` (``get_params()``).

    Raises
    ------
    ValueError, TypeError
        Naming the parameter and what was expected; unknown plugin names list the available ones.
    """
    check_positive(params["noise"], "noise")
    if params["lengthscale"] is not None:
        check_positive(params["lengthscale"], "lengthscale")
    n_centers = check_n_centers(params["n_centers"])
    kernel = params["kernel"]
    if not isinstance(params["solver"], str):
        raise TypeError(f"solver: expected a plugin name (str), got {type(params['solver']).__name__}")
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
    dtype = resolve_dtype(params["dtype"])
    device = _check_device(params["device"])
    solver = _choice("solver", params["solver"], _named(get_solver, DEFAULT_SOLVER, "solver=<name>"))
    solver = _with_options(solver, params["solver_options"])
    objective, learn_options = _learning(params)
    switches = _switches(params, learning=objective is not None)
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
        getter = get_selector if centers else _named(get_selector, DEFAULT_SELECTOR, "centers=<selector name or array>")
        selector = _with_options(_choice("selector", centers or DEFAULT_SELECTOR, getter), params["selector_options"])
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
        **switches,
    )


def _switches(params: Mapping[str, Any], learning: bool) -> dict[str, bool]:
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


def _learning(params: Mapping[str, Any]) -> tuple[PluginChoice | None, dict[str, Any]]:
    """Check ``learn`` and ``learn_options``; resolve the objective plugin."""
    learn, given = params["learn"], params["learn_options"]
    if given is not None and not isinstance(given, dict):
        raise TypeError(f"learn_options: expected a dict or None, got {type(given).__name__}")
    if learn is None:
        if given:
            raise ValueError("learn_options: given without learn; set learn='sgpr' or learn='exact' to use them")
        return None, {}
    if not isinstance(learn, str):
        raise TypeError(f"learn: expected an objective plugin name (str) or None, got {type(learn).__name__}")
    objective = get_objective(learn)
    _, own = split_learn_options(learn, objective, given)  # unknown keys and bad values fail here
    choice = PluginChoice("objective", learn, objective, ResolvedOptions(f"objective {learn!r}", own), _caps(objective))
    return choice, dict(given or {})


def _choice(kind: str, name: str, getter: Callable[[str], Any]) -> PluginChoice:
    plugin = getter(name)
    return PluginChoice(kind, name, plugin, ResolvedOptions(f"{kind} {name!r}", {}), _caps(plugin))


def _with_options(choice: PluginChoice, given: Mapping[str, Any] | None) -> PluginChoice:
    options = resolve_options(choice.label, choice.plugin, given)
    return PluginChoice(choice.kind, choice.name, choice.plugin, options, choice.capabilities)


def _caps(plugin: Any) -> Capabilities:
    caps = getattr(plugin, "capabilities", None)
    if caps is None:  # TEMPORARY until the built-ins declare capabilities (contract branch)
        caps = _legacy(plugin)
    if not isinstance(caps, Capabilities):
        raise TypeError(f"plugin {type(plugin).__name__}: capabilities must be a kgp.Capabilities")
    return caps


def _named(getter: Callable[[str], Any], default: str, argument: str) -> Callable[[str], Any]:
    """``getter`` whose unknown-name error says the name was a default (KGP_PLUGINS may leave it out)."""

    def get(name: str) -> Any:
        try:
            return getter(name)
        except UnknownPluginError as exc:
            if name != default:
                raise
            kind = "solver" if argument.startswith("solver") else "selector"
            raise UnknownPluginError(
                f"{exc}. The default {kind} is {default!r}: pass {argument} explicitly to use another one"
            ) from None

    return get


def _check_device(device: Any) -> torch.device | None:
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


def _legacy(plugin: Any) -> Capabilities:  # TEMPORARY: removed when the contract branch lands
    exact = getattr(plugin, "exact_posterior", False)
    centers = getattr(plugin, "uses_centers", False)
    target = "exact" if exact else ("nystrom" if centers else "mean_only")
    return Capabilities(
        uses_centers=bool(centers),
        target=target,
        needs_grad=bool(getattr(plugin, "needs_grad", False)),
        distributed=bool(getattr(plugin, "supports_distributed", False)),
        distributed_refusal=getattr(plugin, "distributed_refusal", None),
        partial_fit=hasattr(plugin, "partial_fit"),
        loop_defaults=dict(getattr(plugin, "loop_defaults", None) or {}),
    )
