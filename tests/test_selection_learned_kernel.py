"""A kernel-aware selector (``Capabilities(uses_kernel=True)``: BLESS) in a fit that learns hyperparameters
selects with the learned kernel and noise, not the starting one, and ``selection_info_`` says so; a selector
that ignores the kernel (uniform) selects once, as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kgp
from kgp.options import resolve_options
from kgp.plugin import SelectionRequest

_rng = np.random.default_rng(0)
X = _rng.normal(size=(1200, 3))
Y = np.sin(2.5 * X[:, 0]) + 0.3 * X[:, 1] ** 2 + 0.05 * _rng.normal(size=1200)


def _nystrom_trace_error(kernel, X: torch.Tensor, Z: torch.Tensor) -> float:
    """tr(K - K_nM K_MM^+ K_Mn) / tr(K): the part of the kernel the centers do not resolve (dense oracle)."""
    with torch.no_grad():
        K = kernel(X, X).to_dense()
        Knm = kernel(X, Z).to_dense()
        Kmm = kernel(Z, Z).to_dense()
        Q = Knm @ torch.linalg.pinv(Kmm, hermitian=True) @ Knm.T
    return float((K - Q).diagonal().sum() / K.diagonal().sum())


def _bless(kernel, Xt: torch.Tensor, noise: float, n_centers: int, seed: int):
    selector = kgp.registry.get_selector("bless")
    options = resolve_options("selector 'bless'", selector)
    request = SelectionRequest(
        X=Xt,
        n_centers=n_centers,
        kernel=kernel,
        noise=noise,
        generator=torch.Generator().manual_seed(seed),  # the fit's "select" stream: the seed itself
        options=options,
    )
    with torch.no_grad():
        return selector.select(request)


def test_bless_in_a_learning_fit_selects_with_the_learned_kernel():
    model = kgp.KernelRegressor(
        "rbf",
        learn="exact",
        centers="bless",
        solver="falkon",
        n_centers=150,
        random_state=3,
        normalize_y=True,
        normalize_X=False,  # the selector then sees X as given, and so does the oracle below
    ).fit(X, Y)
    assert model.selection_info_["kernel"] == "learned"
    Xt = torch.as_tensor(X, dtype=model.dtype_)
    # the oracle: the selector run by hand with the fitted kernel and noise and the fit's seed
    again = _bless(model.kernel_, Xt, model.noise_, 150, model.seed_)
    torch.testing.assert_close(torch.as_tensor(model.centers_, dtype=model.dtype_), again.points, rtol=0, atol=0)
    # and those centers resolve the learned kernel better than the ones the starting kernel picks
    start = kgp.KernelRegressor("rbf", centers="bless", solver="falkon", n_centers=150, random_state=3).fit(X, Y)
    learned_error = _nystrom_trace_error(model.kernel_, Xt, again.points)
    start_error = _nystrom_trace_error(model.kernel_, Xt, torch.as_tensor(start.centers_, dtype=model.dtype_))
    assert learned_error < 0.5 * start_error, (learned_error, start_error)


def test_uniform_centers_are_selected_once_and_unchanged():
    model = kgp.KernelRegressor(
        "rbf", learn="exact", solver="falkon", n_centers=100, random_state=4, normalize_X=False
    ).fit(X, Y)
    fixed = kgp.KernelRegressor("rbf", solver="falkon", n_centers=100, random_state=4).fit(X, Y)
    np.testing.assert_array_equal(np.asarray(model.centers_), np.asarray(fixed.centers_))
    assert "kernel" not in model.selection_info_


def test_capabilities_uses_kernel_is_a_bool():
    with pytest.raises(TypeError, match="uses_kernel"):
        kgp.Capabilities(uses_kernel="yes")
