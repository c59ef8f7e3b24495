"""Ranks that disagree: one check of every rank's parameters before the first collective.

Before the check only the feature count, output count and dtype size were compared: different ``noise``
on two ranks gave both the same wrong model (predictions from -44 to 7.9 for targets within +-1.5),
different lengthscales gave each rank its own model, and different ``n_centers`` or solvers killed one
rank with SIGABRT in gloo ("Received data size doesn't match"). Now every rank raises the same
``ValueError`` naming the parameter and each rank's value, and ranks that agree fit as before. The
harness (gloo ranks spawned on localhost, deadlines) is that of ``test_distributed.py``.
"""

from __future__ import annotations

import gpytorch
import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_distributed import _PARAMS, N, _data, _spawn, _split

import kgp
from kgp.distributed import _disagreement
from kgp.fitting.plan import resolve_plan
from kgp.fitting.rows import describe_fit

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


def _rbf(lengthscale: float) -> gpytorch.kernels.Kernel:
    kernel = gpytorch.kernels.RBFKernel()
    kernel.lengthscale = lengthscale
    return kernel


# rank 1's parameters where they differ from rank 0's (_PARAMS), and the words every rank's message holds
MISMATCHES = {
    "noise": ({"noise": 1e-1}, "noise differs: rank 0: 0.01, rank 1: 0.1"),
    "lengthscale": ({"lengthscale": 0.5}, "lengthscale differs: rank 0: 1, rank 1: 0.5"),
    "n_centers": ({"n_centers": 30}, "n_centers differs: rank 0: 40, rank 1: 30"),
    # (a rank whose own parameters are invalid, FALKON's options for EigenPro, raises its own error first)
    "solver": ({"solver": "eigenpro", "solver_options": None}, "solver differs: rank 0: 'falkon', rank 1: 'eigenpro'"),
    # one rank asks for a solver that is not distributed: the disagreement, not that rank's refusal
    "solver_exact": (
        {"solver": "exact", "centers": None, "n_centers": None, "solver_options": None},
        "solver differs: rank 0: 'falkon', rank 1: 'exact'",
    ),
    "solver_options": ({"solver_options": {"maxiter": 61, "tol": 1e-13}}, "solver_options differs: rank 0: {"),
    "learn": ({"learn": "sgpr"}, "learn differs: rank 0: None, rank 1: 'sgpr'"),
    "random_state": ({"random_state": 8}, "random_state differs: rank 0: 7, rank 1: 8"),
    "dtype": ({"dtype": "float32"}, "dtype differs: rank 0: None, rank 1: 'float32'"),
    "normalize_X": ({"normalize_X": True}, "normalize_X differs: rank 0: None, rank 1: True"),
    # a GPyTorch kernel object: its hyperparameter values are compared, not its identity
    "kernel_object": ({"kernel": _rbf(0.5)}, "kernel hyperparameter lengthscale differs: rank 0: float64 [1, 1] [0.99"),
}
# parameters every rank shares, and the relative tolerance against one process (the recipe's FALKON stops
# at its default tol, where the ranks' summation order moves the last CG iterate: measured 1.4e-5)
AGREEING = {
    "kernel_object": ({"kernel": _rbf(0.7)}, 1e-6),
    "auto": ({"solver": "auto", "n_centers": None, "centers": None, "solver_options": None}, 1e-3),
    "sgpr": ({"learn": "sgpr", "learn_options": {"iterations": 5}}, 1e-6),
}


def _kw(kw: dict) -> dict:
    kw = {**_PARAMS, **kw}
    kernel = kw.pop("kernel", "rbf")
    return {"kernel": kernel, **kw}


def _mismatch_task(rank, world, case):
    Xr, yr = _split([N // world] * world)[rank]
    kw = _kw({} if rank == 0 else MISMATCHES[case][0])
    if case == "kernel_object" and rank == 0:
        kw["kernel"] = _rbf(1.0)
    try:
        model = kgp.KernelRegressor(**kw).fit(Xr, yr, distributed=True)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "pred": model.predict(_data()[0][:20])}


def _width_task(rank, world):
    """Rank 1's rows have one column more than rank 0's: refused on every rank before any kernel work."""
    Xr, yr = _split([N // world] * world)[rank]
    if rank == 1:
        Xr = np.column_stack([Xr, Xr[:, 0]])
    try:
        kgp.KernelRegressor(**_kw({})).fit(Xr, yr, distributed=True)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def _agreeing_task(rank, world, case):
    Xr, yr = _split([130, 110])[rank]
    model = kgp.KernelRegressor(**_kw(AGREEING[case][0])).fit(Xr, yr, distributed=True)
    return {"pred": model.predict(_data()[0][:50]), "alpha": model.predictor_.alpha.clone()}


def _suite_task(rank, world, plan):
    out = {}
    for name, task, args in plan:
        try:
            out[name] = task(rank, world, *args)
        except Exception as exc:
            out[name] = {"error": type(exc).__name__, "message": str(exc)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # every mismatch raises after its collectives completed, so one process group serves the whole suite
    plan = [
        *((f"mismatch/{case}", _mismatch_task, (case,)) for case in MISMATCHES),
        *((f"agree/{case}", _agreeing_task, (case,)) for case in AGREEING),
        ("width", _width_task, ()),
    ]
    return _spawn(2, _suite_task, tmp_path_factory.mktemp("ranks"), plan)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_ranks_that_disagree_raise_the_same_value_error(runs, case):
    """No SIGABRT (both ranks ran to the end: _spawn checks the exit codes), no model, one message."""
    results = [res[f"mismatch/{case}"] for res in runs]
    words = MISMATCHES[case][1]
    for r, res in enumerate(results):
        assert res["error"] == "ValueError", (r, res)
        assert res["message"].startswith("distributed fit: every rank must fit the same model;"), res["message"]
        assert words in res["message"], res["message"]
        assert "Construct the estimator with the same parameters on every rank" in res["message"]
    assert results[0]["message"] == results[1]["message"]


def test_rows_of_different_widths_across_ranks_are_refused_naming_each_ranks_width(runs):
    for res in (r["width"] for r in runs):
        assert res["error"] == "ValueError", res
        assert res["message"] == (
            "distributed fit: every rank must have the same number of features, got rank 0: 3, rank 1: 4"
        ), res["message"]


@pytest.mark.parametrize("case", list(AGREEING))
def test_ranks_that_agree_fit_the_one_process_model(runs, case):
    """The check costs nothing in the model: each rank's prediction is that of one process on all rows."""
    X, y = _data()
    kw, rtol = AGREEING[case]
    single = kgp.KernelRegressor(**_kw(kw)).fit(X, y)
    expected = single.predict(X[:50])
    results = [res[f"agree/{case}"] for res in runs]
    for res in results:
        assert "error" not in res, res
        np.testing.assert_allclose(res["pred"], expected, rtol=0, atol=rtol * float(np.abs(expected).max()))
    assert torch.equal(results[0]["alpha"], results[1]["alpha"])


def _description(**kw):
    params = kgp.KernelRegressor(**_kw(kw)).get_params()
    plan = resolve_plan(params)
    X = torch.zeros(5, 3, dtype=torch.float64)
    model = kgp.KernelRegressor(**_kw(kw))
    return describe_fit(params, plan, model._build_kernel(X.dtype, X.device, 3, plan), X, X[:, :1])


def test_the_description_is_canonical():
    """Equal parameters give equal texts (no addresses: two kernel objects, callbacks, 1 and 1.0 alike)."""
    a = _description(kernel=_rbf(0.5), noise=1e-2, callback=lambda info: None)
    b = _description(kernel=_rbf(0.5), noise=np.float64(1e-2), progress=True, device="cpu")
    assert a.entries == b.entries
    assert _description(lengthscale=1).entries == _description(lengthscale=1.0).entries
    assert not any("0x" in text for _, text in a.entries)
    names = dict(_description(kernel="matern32").entries)
    assert names["kernel"] == "'matern32'" and "kernel hyperparameter lengthscale" in names
    assert _description(kernel=gpytorch.kernels.MaternKernel(nu=0.5)).entries != (
        _description(kernel=gpytorch.kernels.MaternKernel(nu=2.5)).entries
    )


def test_the_message_names_the_given_parameter_first_and_is_the_same_everywhere():
    ranks = [
        [("noise", "0.01"), ("solver option 'tol'", "1e-06"), ("n", "3")],
        [("noise", "0.1"), ("solver option 'tol'", "1e-07"), ("n", "3")],
        [("noise", "0.01"), ("solver option 'tol'", "1e-06"), ("n", "3")],
    ]
    message = _disagreement(ranks, [[], [], []], "Do X.", {"solver option 'tol'"})
    assert message == (
        "distributed fit: every rank must fit the same model; noise differs: ranks 0, 2: 0.01, rank 1: 0.1. Do X."
    )
    # a derived value alone is named when nothing given differs; context is named where it differs
    context = [[("kgp.settings.memory_budget", "1")], [("kgp.settings.memory_budget", "2")], [("x", "1")]]
    message = _disagreement([r[1:] for r in ranks], context, "", {"solver option 'tol'"})
    assert "solver option 'tol' differs: ranks 0, 2: 1e-06, rank 1: 1e-07" in message
    assert "kgp.settings.memory_budget differs too: rank 0: 1, rank 1: 2, rank 2: (not set)" in message
