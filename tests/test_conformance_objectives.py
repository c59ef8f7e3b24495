"""The objective checks of the conformance kit: kgp's three objectives and a third party's pass, and
deliberately broken objectives are caught, each by the check meant for its defect."""

from __future__ import annotations

import math

import pytest
import torch

import kgp
from kgp.learning import LearningProblem
from kgp.testing import (
    OBJECTIVE_CHECKS,
    ObjectiveConformance,
    OracleSpec,
    check_objective,
    exact_nll,
    make_oracle_data,
    objective_problem,
)
from kgp.testing.oracles import dense_kernel


# ---------------------------------------------------------------------------------------------
# kgp's built-in objectives (plugins/kgp_builtins/objectives)
# ---------------------------------------------------------------------------------------------
class TestExactObjective(ObjectiveConformance):
    objective_name = "exact"
    oracle = "exact_nll"
    rtol = 1e-10  # a Cholesky against GPyTorch's log_prob: measured 7.5e-16
    invalid_options = ({"subset": 1}, {"subset": "all"})
    memory_options = {"subset": 80}  # on all 2,000 rows it refuses (n > max_exact_size), also checked below


def test_exact_objective_refuses_the_dense_matrix_above_max_exact_size():
    result = OBJECTIVE_CHECKS["memory"]("exact")
    assert "max_exact_size=100" in result["refused"]


class TestSGPRObjective(ObjectiveConformance):
    objective_name = "sgpr"
    oracle = "sgpr_bound"
    rtol = 1e-9  # Titsias' bound by Woodbury and two Cholesky factors against a dense log_prob: measured 2.6e-13
    invalid_options = ({"batch_rows": 0},)


def _with_jitter(A: torch.Tensor) -> torch.Tensor:
    return A + math.sqrt(torch.finfo(A.dtype).eps) * A.diagonal().mean() * torch.eye(A.shape[0], dtype=A.dtype)


def _dtc_heldout(problem: LearningProblem, noise, mean, score: str) -> float:
    """The held-out NLPD (or MSE) of the Nystrom predictor, densely: Rasmussen & Williams 2006, eq. 8.27.

    The rows are split as ``holdout`` documents (one permutation from ``problem.generator``, 20% held
    out); the mean ``K_VZ S^-1 K_ZT r_T`` and the DTC variance ``s^2 + k_vv - Q_vv + s^2 K_VZ S^-1 K_ZV``
    with ``S = K_ZT K_TZ + s^2 K_ZZ`` are formed from dense float64 matrices by least squares. ``S`` and
    ``K_ZZ`` carry the objective's fixed jitter, ``sqrt(eps)`` times their mean diagonal (its definition).
    """
    kernel, n, s2 = problem.kernel, problem.n, float(noise)
    perm = torch.randperm(n, generator=problem.generator)
    n_hold = min(round(0.2 * n), 5000)
    hold, fit = perm[:n_hold], perm[n_hold:]
    X, R = problem.X.double(), problem.y.double() - mean.double()
    Z = problem.centers.points.double()
    Kzt, Kzv, Kzz = dense_kernel(kernel, Z, X[fit]), dense_kernel(kernel, Z, X[hold]), dense_kernel(kernel, Z, Z)
    S = _with_jitter(Kzt @ Kzt.T + s2 * Kzz)
    Kzz = _with_jitter(Kzz)
    err = R[hold] - Kzv.T @ torch.linalg.lstsq(S, Kzt @ R[fit]).solution
    if score == "mse":
        return float(err.square().mean())
    Q = Kzv.T @ torch.linalg.lstsq(Kzz, Kzv).solution
    kvv = dense_kernel(kernel, X[hold], X[hold]).diagonal()
    var = s2 + (kvv - Q.diagonal()).clamp_min(0) + s2 * (Kzv.T @ torch.linalg.lstsq(S, Kzv).solution).diagonal()
    var = var.unsqueeze(-1)
    return float((0.5 * torch.log(2 * math.pi * var) + err.square() / (2 * var)).mean())


class TestHoldoutObjective(ObjectiveConformance):
    objective_name = "holdout"
    objective_options = {"min_held_out": 1}  # the kit's problems are small (24 rows for gradcheck)
    rtol = 1e-8  # measured 5.6e-13 (K_ZZ's condition number enters through the variance)
    invalid_options = ({"holdout_fraction": 1.0}, {"score": "mae"}, {"max_holdout_rows": 0})

    @staticmethod
    def oracle(problem, noise, mean):
        return _dtc_heldout(problem, noise, mean, "nlpd")


class TestHoldoutMSEObjective(TestHoldoutObjective):
    objective_options = {"score": "mse", "min_held_out": 1}
    skip_checks = ("invalid_options", "unknown_option", "device")

    @staticmethod
    def oracle(problem, noise, mean):
        return _dtc_heldout(problem, noise, mean, "mse")


# ---------------------------------------------------------------------------------------------
# A third party's objective
# ---------------------------------------------------------------------------------------------
class LeaveOneOut:
    """Negative leave-one-out log predictive probability per data point (Rasmussen & Williams 2006, eq. 5.10-5.12).

    With ``C = K + s^2 I``: ``mu_i - y_i = -[C^-1 r]_i / [C^-1]_ii``, ``sigma_i^2 = 1 / [C^-1]_ii``, in
    closed form from one factorisation; on the rows of ``subset`` drawn from ``problem.generator``, or
    all rows. It needs the dense matrix, so it refuses more rows than ``kgp.settings.max_exact_size``.
    """

    capabilities = kgp.Capabilities(loop_defaults={"optimizer": "lbfgs", "iterations": 30})
    option_defaults = {
        "subset": kgp.Option.integer(None, minimum=2, allow_none=True, help="rows drawn at random (None: all)")
    }

    def prepare(self, problem):
        size = problem.n if problem.options["subset"] is None else min(problem.options["subset"], problem.n)
        limit = kgp.settings.max_exact_size.value()
        if size > limit:
            raise ValueError(f"objective 'loo': {size} rows exceed kgp.settings.max_exact_size={limit}; pass a subset")
        rows = torch.randperm(problem.n, generator=problem.generator)[:size].to(problem.device)
        X, Y = problem.X[rows], problem.y[rows]

        def loss(noise, mean):
            C = problem.kernel_operator(X).to_dense() + noise * torch.eye(size, dtype=X.dtype, device=X.device)
            inverse = torch.cholesky_inverse(torch.linalg.cholesky(C))
            precision = inverse.diagonal().unsqueeze(-1)
            err = (inverse @ (Y - mean)) / precision
            return (0.5 * torch.log(2 * math.pi / precision) + 0.5 * err.square() * precision).mean()

        return loss


def brute_force_loo(problem, noise, mean) -> float:
    """The same value by n separate GP fits, each on all rows but one (dense float64 solves)."""
    size = problem.n if problem.options["subset"] is None else min(problem.options["subset"], problem.n)
    rows = torch.randperm(problem.n, generator=problem.generator)[:size]
    X, R = problem.X[rows].double(), problem.y[rows].double() - mean.double()
    K = dense_kernel(problem.kernel, X, X)
    total = 0.0
    for i in range(size):
        keep = torch.arange(size) != i
        C = K[keep][:, keep] + float(noise) * torch.eye(size - 1, dtype=torch.float64)
        k = K[keep, i]
        mu = k @ torch.linalg.solve(C, R[keep])
        var = K[i, i] - k @ torch.linalg.solve(C, k) + float(noise)
        total += float((0.5 * torch.log(2 * math.pi * var) + (R[i] - mu).square() / (2 * var)).sum())
    return total / (size * R.shape[1])


class _Plugin:
    def __init__(self, **objectives):
        self.objectives = objectives

    @kgp.hookimpl
    def register_objectives(self, register):
        for name, objective in self.objectives.items():
            register(name, objective)


@pytest.fixture(scope="module")
def loo_plugin():
    kgp.register(_Plugin(loo=LeaveOneOut()), name="loo-plugin")
    yield
    kgp.unregister("loo-plugin")


@pytest.mark.usefixtures("loo_plugin")
class TestThirdPartyLeaveOneOut(ObjectiveConformance):
    objective_name = "loo"
    oracle = staticmethod(brute_force_loo)
    rtol = 1e-9  # closed form against 150 refits: measured 3.3e-16
    invalid_options = ({"subset": 1},)
    memory_options = {"subset": 60}


@pytest.mark.usefixtures("loo_plugin")
def test_third_party_subset_draw_is_checked_against_the_oracle_with_the_same_seed():
    results = check_objective("loo", oracle=brute_force_loo, objective_options={"subset": 40}, rtol=1e-9)
    assert results["value"]["max_error"] < 1e-9 and results["device"].startswith("skipped")
    assert results["memory"]["largest"] <= 100 * 100  # 40 of 2,000 rows: within max_exact_size, never n x n


@pytest.mark.usefixtures("loo_plugin")
def test_leave_one_out_learns_hyperparameters_through_the_model():
    data = make_oracle_data(OracleSpec(n=80))
    model = kgp.KernelRegressor(learn="loo", noise=0.5, lengthscale=3.0).fit(data.X, data.y[:, 0])
    assert len(model.learn_history_) <= 30 and model.learn_history_[-1] < model.learn_history_[0]


# ---------------------------------------------------------------------------------------------
# Broken objectives: each defect caught by its check
# ---------------------------------------------------------------------------------------------
class Broken(LeaveOneOut):
    def __init__(self, bug: str):
        self.bug = bug

    def prepare(self, problem):
        if self.bug == "global_rng":
            X, Y = problem.X[torch.randperm(problem.n)[: problem.n // 2]], problem.y
            Y = problem.y[: X.shape[0]]
        else:
            X, Y = problem.X, problem.y

        def loss(noise, mean):
            if self.bug == "n_by_m":  # K_nM held whole: fine at n = 150, not under a memory budget
                knm = problem.kernel_operator(X, X[:20]).to_dense()
                return (knm.sum() * noise + mean.sum()) / knm.numel()
            if self.bug == "detached_noise":
                noise = float(noise.detach())
            C = problem.kernel_operator(X).to_dense() + noise * torch.eye(X.shape[0], dtype=X.dtype)
            nll = 0.5 * ((Y - mean) * torch.cholesky_solve(Y - mean, torch.linalg.cholesky(C))).sum()
            nll = nll + Y.shape[1] * (
                torch.linalg.cholesky(C).diagonal().log().sum() + 0.5 * len(X) * math.log(2 * math.pi)
            )
            if self.bug == "wrong_gradient":
                nll = _HalfGradient.apply(nll)
            return nll * (2.0 if self.bug == "doubled" else 1.0) / Y.numel()

        return loss


class _HalfGradient(torch.autograd.Function):
    """Identity forward, half the gradient backward: a hand-written backward with a slip."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 0.5 * grad


@pytest.mark.parametrize(
    "bug, check, message",
    [
        ("doubled", "value", "the dense oracle gives"),
        ("wrong_gradient", "gradcheck", "disagrees with finite differences"),
        ("detached_noise", "protocol", "no finite gradient with respect to noise"),
        ("global_rng", "seed", "draw every random number from problem.generator"),
        ("n_by_m", "memory", "stream n x M products over row blocks"),
        (None, "memory", "never n x n"),  # the exact NLL on every row, no max_exact_size check
    ],
)
def test_the_kit_catches_broken_objectives(bug, check, message):
    kgp.register(_Plugin(broken=Broken(bug)), name="broken-objective")
    try:
        with pytest.raises(AssertionError, match=message):
            OBJECTIVE_CHECKS[check]("broken", oracle=exact_nll)
    finally:
        kgp.unregister("broken-objective")


def test_objective_problem_prepares_what_the_model_would():
    data = make_oracle_data(OracleSpec(n=30, n_centers=5))
    problem = objective_problem("sgpr", data)
    assert problem.centers.points.shape == (5, 3) and problem.options == {"batch_rows": None}
    assert all(p.requires_grad for p in problem.kernel.parameters())
    assert objective_problem("exact", data).centers is None  # only for objectives declaring uses_centers


class _LikelihoodWithoutTerms(Broken):
    """Declares a likelihood but does not say how many terms its value averages."""

    capabilities = kgp.Capabilities(likelihood=True)


class _LikelihoodWithTerms(_LikelihoodWithoutTerms):
    def prepare(self, problem):
        loss = super().prepare(problem)
        loss.terms = problem.y.numel()
        return loss


def test_the_kit_asks_a_likelihood_objective_for_its_terms():
    """-value * loss.terms is log_marginal_likelihood_value_: a likelihood objective must carry it."""
    kgp.register(_Plugin(bare=_LikelihoodWithoutTerms(None), counted=_LikelihoodWithTerms(None)), name="lik")
    try:
        with pytest.raises(AssertionError, match=r"must carry loss.terms.*got None"):
            OBJECTIVE_CHECKS["protocol"]("bare")
        OBJECTIVE_CHECKS["protocol"]("counted")
    finally:
        kgp.unregister("lik")
