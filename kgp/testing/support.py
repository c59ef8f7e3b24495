"""What every check of the kit shares: finding the plugin, resolving its options, calling it as the
model does, comparing results, skipping, and running a list of checks."""

from __future__ import annotations

import contextlib
import sys
import unittest
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import registry as _registry_module
from ..capabilities import Capabilities
from ..options import ResolvedOptions, resolve_options
from .oracles import relative_error

__all__ = [
    "REPRO_RTOL",
    "GlobalRngGuard",
    "capabilities_of",
    "check_close",
    "current_registry",
    "is_plain",
    "options_for",
    "plugin_info",
    "plugin_work",
    "reproduces",
    "run_all",
    "skip",
    "skip_types",
]

REPRO_RTOL: dict[torch.dtype, float] = {torch.float64: 1e-9, torch.float32: 1e-4}
"""How close "identical" results must be: ``max|a - b| <= rtol * max|b|``.

Not bit-for-bit, because MKL's LAPACK routines (e.g. ``torch.linalg.lstsq``) are not bitwise
reproducible across memory alignments: on the development machine two identical float64 solves of
the kit's ill-conditioned Nystrom system differed by 3e-11. A plugin drawing from the global RNG
instead of the problem's generator differs by far more than these bounds."""


def current_registry():
    """The process registry, looked up at call time (a test may install a fresh one)."""
    return _registry_module.registry


def plugin_info(kind: str, name: str):
    """The registration of ``name`` (:class:`kgp.registry.PluginInfo`), or an AssertionError listing the others."""
    registry = current_registry()
    if name not in registry.names(kind):
        raise AssertionError(
            f"{kind} {name!r} is not registered; registered {kind}s: {', '.join(registry.names(kind)) or '(none)'}"
            " (is the plugin's distribution installed, and not excluded by KGP_PLUGINS / KGP_DISABLE_ENTRYPOINTS?)"
        )
    return registry.get(kind, name)


def capabilities_of(kind: str, name: str) -> Capabilities:
    """The capabilities the registry checked when ``name`` registered."""
    return plugin_info(kind, name).capabilities


def options_for(kind: str, name: str, given: Mapping[str, Any] | None = None, **options: Any) -> ResolvedOptions:
    """The options of the registered ``kind`` ``name``, resolved as the model resolves them.

    For a test calling a plugin directly: ``Problem(..., options=options_for("solver", "falkon", maxiter=5))``.
    """
    return resolve_options(f"{kind} {name!r}", plugin_info(kind, name).obj, given, **options)


@contextlib.contextmanager
def plugin_work(capabilities: Capabilities) -> Iterator[None]:
    """Run a plugin's ``fit`` / ``partial_fit`` / ``select`` as the model does: under ``torch.no_grad()``
    unless it declares ``needs_grad``."""
    with contextlib.nullcontext() if capabilities.needs_grad else torch.no_grad():
        yield


def check_close(what: str, pred: Tensor, ref: Tensor, rtol: float) -> float:
    """The relative error of ``pred`` against ``ref``; AssertionError above ``rtol`` or on NaN / inf."""
    if not bool(torch.isfinite(torch.as_tensor(pred)).all()):
        raise AssertionError(f"{what}: predictions contain NaN or infinite values")
    err = relative_error(pred, ref)
    if not err <= rtol:
        raise AssertionError(f"{what}: relative error {err:.3e} against the dense float64 oracle > rtol={rtol:.1e}")
    return err


def reproduces(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` equals ``b`` up to :data:`REPRO_RTOL` (same shape, dtype and device)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    if a.numel() == 0:
        return True
    scale = max(float(b.abs().max()), 1e-30)
    return float((a - b).abs().max()) <= REPRO_RTOL.get(a.dtype, 1e-9) * scale


def is_plain(value: Any) -> bool:
    """Whether ``value`` holds only tensors and plain values (what ``weights_only`` loading accepts)."""
    if value is None or isinstance(value, (bool, int, float, str, Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


class GlobalRngGuard:
    """Restore the global torch / numpy RNG states after a check perturbs them."""

    def __enter__(self):
        self._torch = torch.random.get_rng_state()
        self._numpy = np.random.get_state()
        return self

    def __exit__(self, *exc):
        torch.random.set_rng_state(self._torch)
        np.random.set_state(self._numpy)
        return False


def skip_types() -> tuple[type[BaseException], ...]:
    """The exceptions :func:`skip` may raise (pytest's only when pytest is loaded)."""
    pytest_skip = getattr(sys.modules.get("pytest"), "skip", None)
    return (unittest.SkipTest, pytest_skip.Exception) if hasattr(pytest_skip, "Exception") else (unittest.SkipTest,)


def skip(reason: str):
    """Skip the current check."""
    # Under pytest, its own skip exception with the item's location, so that `pytest -rs` points at the
    # test rather than at pytest's unittest shim; elsewhere unittest.SkipTest (kgp never imports pytest).
    pytest_skip = getattr(sys.modules.get("pytest"), "skip", None)
    if pytest_skip is not None and hasattr(pytest_skip, "Exception"):
        try:
            raise pytest_skip.Exception(reason, _use_item_location=True)
        except TypeError:  # a pytest without _use_item_location
            pass
    raise unittest.SkipTest(reason)


def run_all(checks: Mapping[str, Callable[..., dict]], skip_names, label: str, **kwargs) -> dict[str, Any]:
    """Run every check of ``checks`` but ``skip_names``; one AssertionError listing every failure."""
    unknown = sorted(set(skip_names) - set(checks))
    if unknown:
        raise ValueError(f"skip: unknown check(s) {unknown}; valid: {', '.join(checks)}")
    results: dict[str, Any] = {}
    failures: list[str] = []
    for check_name, check in checks.items():
        if check_name in skip_names:
            results[check_name] = "skipped (by request)"
            continue
        try:
            results[check_name] = check(**kwargs)
        except skip_types() as exc:
            results[check_name] = f"skipped ({getattr(exc, 'msg', None) or exc})"
        except AssertionError as exc:
            failures.append(f"[{check_name}] {exc}")
    if failures:
        raise AssertionError(f"{label} failed {len(failures)} conformance check(s):\n" + "\n".join(failures))
    return results
