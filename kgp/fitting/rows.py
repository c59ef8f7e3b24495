"""The training rows of a fit and their communicator.

A single-process fit and a data-parallel fit (:mod:`kgp.distributed`) run the same stages: the only
difference is the communicator. :class:`LocalComm` does nothing (every sum is already global); a
:class:`ShardComm` sums over the ranks of a :class:`kgp.distributed.Shard`. Plugins keep receiving
``problem.shard`` (None in a single process), so that a plugin that is not distributed never sees one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from .. import distributed as _dist

if TYPE_CHECKING:
    from .plan import FitPlan

__all__ = ["FitDescription", "LocalComm", "ShardComm", "TrainingRows", "describe_fit"]


class LocalComm:
    """The communicator of a single-process fit: every collective is the identity."""

    shard = None
    rank = 0
    world_size = 1

    def __init__(self, n: int):
        self.n_total = n

    def all_reduce_(self, t: Tensor) -> Tensor:
        return t

    def broadcast_(self, t: Tensor) -> Tensor:
        return t

    def replicate_(self, tensors: Sequence[Tensor]) -> bool:
        return False

    def identical(self, tensors: Sequence[Tensor]) -> bool:
        return True

    def replicate_predictor(self, predictor: Any, kernel: Any) -> Any:
        return predictor

    def agree(self, description: FitDescription) -> None:
        """Nothing to compare in one process."""


class ShardComm:
    """The communicator of a distributed fit: collectives over the ranks of ``shard``."""

    def __init__(self, shard: _dist.Shard):
        self.shard = shard
        self.rank = shard.rank
        self.world_size = shard.world_size
        self.n_total = shard.n_total

    def all_reduce_(self, t: Tensor) -> Tensor:
        return self.shard.all_reduce_(t)

    def broadcast_(self, t: Tensor) -> Tensor:
        return self.shard.broadcast_(t.to(self.shard._device())).to(t.device)

    def replicate_(self, tensors: Sequence[Tensor]) -> bool:
        return self.shard.replicate_(list(tensors))

    def identical(self, tensors: Sequence[Tensor]) -> bool:
        return self.shard.identical(list(tensors))

    def agree(self, description: FitDescription) -> None:
        """Every rank describes the same fit (:func:`describe_fit`), or every rank raises the same ValueError."""
        d = description
        _dist.agree(self.shard.channel, d.entries, d.context, remedy=AGREE_REMEDY, derived=d.derived)

    def replicate_predictor(self, predictor: Any, kernel: Any) -> Any:
        """The fitted predictor, made bitwise identical on every rank (rank 0's where they differ)."""
        state = predictor.state_dict()
        names = [k for k, v in state.items() if isinstance(v, Tensor)]
        device = self.shard._device()
        moved = {k: state[k].to(device) for k in names}
        if not self.shard.replicate_(list(moved.values())):
            return predictor
        rebuilt = {**state, **{k: v.to(state[k].device) for k, v in moved.items()}}
        return type(predictor).from_state(rebuilt, kernel)


@dataclass
class TrainingRows:
    """The rows a fit works on: inputs ``X`` (n x d), targets ``Y`` (n x k, 2-D) and the communicator.

    In a distributed fit ``X`` and ``Y`` are this rank's rows and :attr:`n` counts all ranks' rows.
    """

    X: Tensor
    Y: Tensor
    comm: LocalComm | ShardComm

    @property
    def n(self) -> int:
        return self.comm.n_total

    @property
    def shard(self) -> _dist.Shard | None:
        return self.comm.shard

    def column_mean(self, Y: Tensor | None = None) -> Tensor:
        """Mean of each column of ``Y`` (default: the targets) over all ranks' rows."""
        Y = self.Y if Y is None else Y
        if self.comm.shard is None:
            return Y.mean(0)
        return self.comm.all_reduce_(Y.sum(0)).div_(self.n)

    def column_std(self, Y: Tensor, mean: Tensor) -> Tensor:
        """Standard deviation (no correction) of each column over all ranks' rows, about ``mean``."""
        if self.comm.shard is None:
            return Y.std(0, correction=0)
        return self.comm.all_reduce_((Y - mean).square().sum(0)).div_(self.n).sqrt_()


def comm_for(shard: _dist.Shard | None, n: int) -> LocalComm | ShardComm:
    """The communicator of a fit: :class:`ShardComm` for a shard, else :class:`LocalComm` of ``n`` rows."""
    return LocalComm(n) if shard is None else ShardComm(shard)


def broadcast_seed(comm: LocalComm | ShardComm, seed: int) -> int:
    """The seed of rank 0 on every rank (``random_state=None`` draws a different one on each)."""
    if comm.shard is None:
        return seed
    return int(comm.broadcast_(torch.tensor([seed], dtype=torch.int64)).item())


AGREE_REMEDY = (
    "Construct the estimator with the same parameters on every rank (only X, y, validation_data, callback, "
    "progress and device may differ between ranks)"
)

# the constructor parameters that may differ between ranks: each rank's own rows and reporting, and its
# device (one GPU per rank); every other parameter must agree
_PER_RANK = frozenset({"callback", "progress", "device"})
_SHOWN_VALUES = 8  # a tensor with more entries is described by its shape and a digest of its bytes


@dataclass(frozen=True)
class FitDescription:
    """What every rank of a distributed fit must share (:func:`describe_fit`).

    ``entries``: ``(name, canonical text)`` pairs, compared; ``derived``: the names of entries that follow
    from others (named in a message only when no given parameter differs); ``context``: pairs named where
    they differ, not compared.
    """

    entries: list[tuple[str, str]]
    derived: frozenset[str]
    context: list[tuple[str, str]]


def describe_fit(params: Mapping[str, Any], plan: FitPlan, kernel: Any, X: Tensor, Y: Tensor) -> FitDescription:
    """What every rank of a distributed fit must share, as canonical texts.

    In the order a message names the first difference: the constructor parameters (``params``, all
    but ``callback``, ``progress`` and ``device``); then what the plan resolved from them (the plugins
    ``"auto"`` chose, ``n_centers``, every option with its default, the switches); then the data's
    dtype, feature and output counts; then the built kernel's hyperparameters (values and structure,
    for a GPyTorch kernel object too). The texts are canonical: the same values give the same text in
    every process (no object addresses, dict keys sorted, floats by ``repr``, 1.0 as 1).

    The context (not compared, named where it differs) holds the settings a recipe decides from
    (``kgp.settings.memory_budget``, ``max_exact_size``, ``device_flops``) when ``solver="auto"`` or ``learn="auto"``.
    """
    given: list[tuple[str, str]] = []
    for name, value in params.items():
        if name not in _PER_RANK:
            given.append(
                (name, _qualname(value) if name == "kernel" and not isinstance(value, str) else _canonical(value))
            )
    derived: list[tuple[str, str]] = [
        ("solver (resolved)", plan.solver.name),
        *_flatten("solver option", plan.solver.options),
        ("centers (resolved)", "none" if plan.selector is None else plan.selector.name),
        *(_flatten("selector option", plan.selector.options) if plan.selector is not None else ()),
        ("n_centers (resolved)", _canonical(plan.n_centers)),
        ("learn (resolved)", "none" if plan.objective is None else plan.objective.name),
    ]
    if plan.learn_options is not None:
        derived.extend(_flatten("learn option", plan.learn_options.loop))
        derived.extend(_flatten("learn option", plan.learn_options.objective))
    derived.extend(
        (f"{name} (resolved)", _canonical(getattr(plan, name))) for name in ("ard", "normalize_y", "normalize_X")
    )
    derived.append(("dtype of X", str(X.dtype).replace("torch.", "")))
    derived.append(("number of features", str(X.shape[1])))
    derived.append(("number of outputs", str(Y.shape[1])))
    built = _kernel_entries(kernel)
    # a GPyTorch kernel object's hyperparameters are given, not derived: name them first where they differ
    kernel_given = not isinstance(params.get("kernel"), str)
    context: list[tuple[str, str]] = []
    if plan.recipe is not None:
        from .. import settings

        context = [
            ("kgp.settings.memory_budget", str(settings.memory_budget.value(X.device))),
            ("kgp.settings.max_exact_size", str(settings.max_exact_size.value())),
            ("kgp.settings.device_flops", str(settings.device_flops.value())),
        ]
    names = {k for k, _ in derived} | (set() if kernel_given else {k for k, _ in built})
    return FitDescription([*given, *derived, *built], frozenset(names), context)


def _kernel_entries(kernel: Any) -> list[tuple[str, str]]:
    """The built kernel: each hyperparameter's value (constrained, as the user sets it), its buffers (the
    constraints' bounds), then its structure: each module's type and plain settings (Matern's ``nu``)."""
    out: list[tuple[str, str]] = []
    structure: list[tuple[str, str]] = []
    for path, module in kernel.named_modules():
        prefix = f"{path}." if path else ""
        structure.append((f"kernel type {path or '(the kernel)'}", _qualname(module)))
        for key, value in sorted(vars(module).items()):  # plain settings (Matern's nu, ard_num_dims, eps)
            if not key.startswith("_") and key != "training" and _plain(value):
                structure.append((f"kernel setting {prefix}{key}", _canonical(value)))
        for name, p in module.named_parameters(recurse=False):
            shown = name
            value = p
            if name.startswith("raw_") and isinstance(getattr(type(module), name[4:], None), property):
                shown, value = name[4:], getattr(module, name[4:])
            out.append((f"kernel hyperparameter {prefix}{shown}", _canonical(value)))
        for name, b in module.named_buffers(recurse=False):
            out.append((f"kernel {prefix}{name}", _canonical(b)))
    return out + structure


def _plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), np.integer, np.floating)):
        return True
    return isinstance(value, (tuple, list, torch.Size)) and all(_plain(v) for v in value)


def _flatten(kind: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """One entry per resolved option (``solver option 'tol'``), so that a message names the option."""
    return [(f"{kind} {key!r}", _canonical(options[key])) for key in sorted(options, key=repr)]


def _canonical(value: Any) -> str:
    """A text of ``value`` that is the same in every process for equal values (no addresses)."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)  # 1.0 and 1 are the same parameter value
        return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):  # no numpy type: float32 holds them exactly
            t = t.float()
        return _array_text(t.numpy(), str(value.dtype).replace("torch.", ""))
    if isinstance(value, np.ndarray):
        return _array_text(np.ascontiguousarray(value), str(value.dtype))
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_canonical(value[k])}" for k in sorted(value, key=repr)) + "}"
    if isinstance(value, (list, tuple, torch.Size)):
        return "[" + ", ".join(_canonical(v) for v in value) + "]"
    return _qualname(value)


def _array_text(a: np.ndarray, dtype: str) -> str:
    """A small array by its values, a larger one by its shape and a digest of its bytes."""
    if a.dtype == object:  # the bytes of an object array are addresses: compare the values' texts
        a = np.asarray([_canonical(v) for v in a.reshape(-1)], dtype=str).reshape(a.shape)
    if a.size <= _SHOWN_VALUES:
        values = ", ".join(_canonical(v) for v in a.reshape(-1).tolist())
        return f"{dtype} {list(a.shape)} [{values}]"
    digest = hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()
    return f"{dtype} {list(a.shape)} sha256 {digest[:16]}"


def _qualname(value: Any) -> str:
    """A value's type (or a function's own name): the same in every process, unlike ``repr``."""
    target = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
