"""The variance strategies of :mod:`kgp.variance`: one class per kind, chosen once from the solver's target,
and a covariance and draws that treat each row as the std does.

Oracles: the dense float64 exact and DTC covariances of :mod:`kgp.testing.oracles` (GPyTorch's own pairwise
kernel values, LU solves), and the std of ``predict(return_std=True)``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import kgp
from kgp.capabilities import TARGETS
from kgp.posterior import PosteriorStateError, sampling_factor
from kgp.testing.oracles import dense_dtc_covariance, dense_exact_covariance
from kgp.variance import STRATEGIES, ExactVariance, NoVariance, NystromVariance, for_target

g = np.random.default_rng(11)
X = g.uniform(-2, 2, size=(200, 2))
Y = np.sin(X[:, 0]) + 0.5 * np.cos(X[:, 1]) + 0.05 * g.normal(size=200)
NEAR = g.uniform(-2.2, 2.2, size=(6, 2))
SOLVERS = [("exact", {}), ("falkon", {"n_centers": 40})]


def _with_far_row(near: np.ndarray, at: float) -> tuple[np.ndarray, list[int]]:
    """``near`` with a row at ``(at, at)`` in the middle, and the indices of the near rows in it."""
    rows = np.vstack([near[:3], [[at, at]], near[3:]])
    return rows, [0, 1, 2, 4, 5, 6]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("solver", "extra"), SOLVERS)
def test_the_covariance_of_two_rows_does_not_depend_on_the_other_rows(solver, extra, dtype):
    """A row at 1e8 joining a batch changed the other rows' covariance by up to 490% (its kernel block was
    centred on the batch)."""
    model = kgp.KernelRegressor("rbf", noise=1e-2, solver=solver, dtype=dtype, random_state=0, **extra).fit(X, Y)
    torch_dtype = getattr(torch, dtype)
    batch, near = _with_far_row(NEAR, 1e8)
    alone = model.posterior_.covariance(torch.as_tensor(NEAR, dtype=torch_dtype)).double()
    joint = model.posterior_.covariance(torch.as_tensor(batch, dtype=torch_dtype)).double()
    # the same arithmetic per entry either way: a few roundings of entries of size <= the prior variance 1
    tol = 16 * torch.finfo(torch_dtype).eps
    torch.testing.assert_close(joint[near][:, near], alone, rtol=0, atol=tol)
    # the far row: the prior variance (outputscale 1), uncorrelated with the others
    assert abs(float(joint[3, 3]) - 1.0) <= tol
    assert float(joint[3, near].abs().max()) <= tol
    # its diagonal is the variance predict gives, row by row
    _, std = model.predict(batch.astype(dtype), return_std=True)
    np.testing.assert_allclose(joint.diagonal().numpy(), np.asarray(std, dtype=np.float64) ** 2, rtol=tol, atol=0)


@pytest.mark.parametrize(("solver", "extra"), SOLVERS)
def test_the_covariance_with_a_far_row_is_the_dense_float64_one(solver, extra):
    model = kgp.KernelRegressor("rbf", noise=1e-2, solver=solver, random_state=0, **extra).fit(X, Y)
    batch, _ = _with_far_row(NEAR, 1e8)
    cov = model.posterior_.covariance(torch.as_tensor(batch))
    Xt, Q = torch.as_tensor(X), torch.as_tensor(batch)
    with torch.no_grad():
        if solver == "exact":
            ref = dense_exact_covariance(model.kernel_, Xt, model.noise_, Q)
            cond = 1 + len(X) / model.noise_  # of K + noise I, at most
        else:
            Z = model.posterior_.variance.centers
            ref = dense_dtc_covariance(model.kernel_, Xt, Z, model.noise_, Q)
            cond = float(torch.linalg.cond(kgp.kernel_operator(model.kernel_, Z).to_dense()))  # of K_MM
    # the solves' rounding, eps times the condition number, against entries of at most the prior variance 1
    torch.testing.assert_close(cov, ref, rtol=0, atol=10 * torch.finfo(torch.float64).eps * cond)


@pytest.mark.parametrize(("solver", "extra"), SOLVERS)
def test_sample_y_with_a_far_row_draws_with_the_predicted_mean_and_std(solver, extra):
    """A row at 1e9 made ``sample_y`` raise torch's _LinAlgError (Cholesky of an indefinite covariance)."""
    model = kgp.KernelRegressor("rbf", noise=1e-2, solver=solver, random_state=0, **extra).fit(X, Y)
    batch, _ = _with_far_row(NEAR, 1e9)
    n = 4000
    draws = model.sample_y(batch, n_samples=n, random_state=0)
    mean, std = model.predict(batch, return_std=True)
    assert draws.shape == (7, n) and np.isfinite(draws).all()
    # 5 standard errors of the sample mean (std / sqrt n) and of the sample std (std / sqrt(2 n))
    assert np.all(np.abs(draws.mean(1) - mean) <= 5 * std / np.sqrt(n))
    assert np.all(np.abs(draws.std(1) - std) <= 5 * std / np.sqrt(2 * n))
    np.testing.assert_array_equal(draws, model.sample_y(batch, n_samples=n, random_state=0))


@pytest.mark.parametrize("singular", [False, True])
def test_the_sampling_factor_reproduces_a_badly_scaled_covariance(singular):
    """Variances 1e-20 to 1e10; singular: a repeated row whose variance rounded down (an eigenvalue -1e-15)."""
    base = torch.tensor([[1.0, 0.6, 0.2], [0.6, 1.0, 0.3], [0.2, 0.3, 1.0]], dtype=torch.float64)
    C = torch.eye(4, dtype=torch.float64)
    C[:3, :3] = base
    if singular:
        C[3, :3] = C[:3, 3] = base[2]
        C[3, 3] = 1.0 - 1e-15
    scale = torch.tensor([1e-10, 1.0, 1e5, 1e5], dtype=torch.float64)
    cov = C * scale[:, None] * scale[None, :]
    A = sampling_factor(cov)
    # entrywise, relative to the rows' scales (sqrt(C_ii C_jj))
    rel = (A @ A.T - cov) / (scale[:, None] * scale[None, :])
    assert float(rel.abs().max()) <= 1e-13
    # a zero variance gives a zero row: those draws are the mean
    cov[0, :] = cov[:, 0] = 0.0
    assert bool((sampling_factor(cov)[0] == 0).all())


def test_each_target_has_one_strategy_and_each_tag_one_class():
    assert {target: for_target(target) for target in TARGETS} == {
        "exact": ExactVariance,
        "nystrom": NystromVariance,
        "mean_only": NoVariance,
    }
    assert {tag: cls.kind for tag, cls in STRATEGIES.items()} == {tag: tag for tag in ("exact", "nystrom", "none")}
    with pytest.raises(ValueError, match="target: expected one of"):
        for_target("dtc")


@pytest.mark.parametrize(
    ("solver", "extra", "strategy"),
    [("exact", {}, ExactVariance), ("falkon", {"n_centers": 40}, NystromVariance), ("dsg", {}, NoVariance)],
)
def test_a_fit_holds_its_targets_strategy_and_a_model_file_restores_it(tmp_path, solver, extra, strategy):
    model = kgp.KernelRegressor("rbf", noise=1e-2, solver=solver, random_state=0, **extra).fit(X, Y)
    assert type(model.posterior_.variance) is strategy
    model.save(tmp_path / "m.pt")
    loaded = kgp.load(tmp_path / "m.pt")
    assert type(loaded.posterior_.variance) is strategy
    if strategy is NoVariance:
        with pytest.raises(ValueError, match=f"return_std=True: solver '{solver}' gives no predictive variance"):
            loaded.predict(NEAR, return_std=True)
        return
    np.testing.assert_allclose(
        loaded.predict(NEAR, return_std=True)[1], model.predict(NEAR, return_std=True)[1], rtol=1e-12
    )


def test_no_module_outside_kgp_variance_dispatches_on_the_variance_kind():
    """The kind is a model file's tag; only :mod:`kgp.variance` maps it (and the solver's target) to a class."""
    root = Path(kgp.__file__).parent
    files = [p for p in root.rglob("*.py") if "variance" not in p.relative_to(root).parts]
    files += list((root.parent / "plugins" / "kgp_builtins").rglob("*.py"))
    pattern = re.compile(
        r"""variance_kind\s*(==|!=|in\b)|(==|!=)\s*["'](nystrom|none)["']|["'](nystrom|none)["']\s*(==|!=)"""
    )
    hits = [f"{p}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_build_cost_says_what_a_first_std_would_cost():
    model = kgp.KernelRegressor("rbf", noise=1e-2, solver="exact").fit(X, Y)
    assert model.posterior_.variance.build_cost() == (0.0, 0)  # the solver's factor was adopted
    n = len(X)
    unbuilt = ExactVariance(model.kernel_, model.posterior_.predictor.centers, model.noise_)
    assert unbuilt.build_cost() == (n**3 / 3, 8 * n * n)
    falkon = kgp.KernelRegressor("rbf", noise=1e-2, solver="falkon", n_centers=40, random_state=0).fit(X, Y)
    assert falkon.posterior_.variance.build_cost() == (n * 40**2 + 40**3, 16 * 40**2)
    assert NoVariance("no reason").build_cost() is None


@pytest.mark.parametrize("entry", [(0, 1), (0, 1099), (511, 512), (600, 601), (1023, 1024), (1098, 1099)])
def test_check_cholesky_finds_one_nonzero_entry_above_the_diagonal_in_any_panel(entry):
    from kgp.variance.base import check_cholesky

    L = torch.tril(torch.rand(1100, 1100, dtype=torch.float64)) + torch.eye(1100, dtype=torch.float64)
    check_cholesky(L, "f")  # lower triangular, positive diagonal
    check_cholesky(L.mT.contiguous().mT, "f")  # a LAPACK (column-major) layout alike
    L[entry] = 1e-300
    with pytest.raises(PosteriorStateError, match="posterior.f: expected a lower-triangular Cholesky factor"):
        check_cholesky(L, "f")


def test_all_finite_against_isfinite():
    from kgp.validation import all_finite

    big = torch.full((3000,), 1e308, dtype=torch.float64)  # finite entries whose sum overflows
    assert all_finite(big) and all_finite(torch.empty(0))
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.zeros(5000, 3)
        t[4321, 2] = bad
        assert not all_finite(t) and not all_finite(t.mT)
