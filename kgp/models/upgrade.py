"""Model files written by kgp before the Posterior (format versions 1 and 2), read in today's layout."""

from __future__ import annotations

from typing import Any

import torch

from ..registry import UnknownPluginError, get_solver
from ..variance import legacy_state

__all__ = ["upgrade"]


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """The version-3 layout of a file written by kgp before the Posterior (format versions 1 and 2).

    Their ``fitted.gp`` held the noise, mean, target scaling and (once computed) the variance factors;
    the predictor sat at the top level. The probe is recomputed from the file itself (those files
    recorded none), so only the other checks apply to them.
    """
    state = dict(state)
    fitted = dict(state.get("fitted") or {})
    gp = dict(fitted.pop("gp", None) or {})
    solver = state.get("solver")
    predictor_state = state.pop("predictor_state", None)
    centers = predictor_state.get("centers") if isinstance(predictor_state, dict) else None
    target = _target(solver) if isinstance(solver, str) else None
    variance = legacy_state(target, gp.get("variance"), centers)
    like = torch.zeros(1, dtype=torch.float64)
    state["posterior"] = {
        "version": 1,
        "noise": gp.get("noise", (state.get("params") or {}).get("noise")),
        "offset": _vector(gp.get("mean"), like, 0.0),
        "y_mean": _vector(gp.get("y_train_mean"), like, 0.0),
        "y_std": _vector(gp.get("y_train_std"), like, 1.0),
        "predictor_kind": state.pop("predictor_kind", None),
        "predictor": predictor_state,
        "variance": variance,
    }
    fitted["learning"] = {"history": list(gp.get("learn_history", [])), "refit": gp.get("learn_refit")}
    state["fitted"] = fitted
    n_features = fitted.get("n_features_in")
    if torch.is_tensor(centers) and centers.dim() == 2 and centers.shape[0] >= 2:
        state["probe"] = {"X": centers[:2].clone()}
    elif isinstance(n_features, int) and 0 < n_features <= 1_000_000:
        state["probe"] = {"X": torch.zeros(2, n_features, dtype=torch.float64)}
    return state


def _target(solver: str) -> str | None:
    try:
        plugin = get_solver(solver)
    except UnknownPluginError:
        return None
    return plugin.capabilities.target


def _vector(value: Any, like: torch.Tensor, fill: float) -> torch.Tensor:
    if value is None:
        return torch.full_like(like, fill)
    return torch.as_tensor(value).to(dtype=like.dtype).reshape(-1).clone()
