"""The selector conformance kit rejects selectors that break the contract, each with a message saying what
went wrong, and passes the built-in selectors.

Each broken selector below is a uniform sampler with one fault: it forms the n x n kernel matrix, forms a
dense n x M block above the memory budget, repeats some centers, returns one row M times, perturbs the rows
it promises, or declares an option without its valid range.
"""

from __future__ import annotations

import pytest
import torch

import kgp
from kgp.plugin import Centers, SelectionRequest
from kgp.testing import SELECTOR_CHECKS, SelectorConformance, check_selector, make_oracle_data
from kgp.testing.memory import MEMORY_SPEC


class FaultySelector:
    """Uniform sampling without replacement, with the fault named by ``fault`` (None: none)."""

    capabilities = kgp.Capabilities()

    def __init__(self, fault: str | None = None):
        self.fault = fault
        # a step option that must be > 1; the "unchecked_option" fault declares it without that range
        minimum = None if fault in ("unchecked_option", "vague_error") else 1.0
        self.option_defaults = {"step": kgp.Option.number(2.0, minimum=minimum, exclusive_minimum=True, help="step")}

    def select(self, request: SelectionRequest) -> Centers:
        X, n = request.X, request.n
        if self.fault == "vague_error" and request.options["step"] <= 1:
            raise ValueError("bad value")
        m = kgp.default_n_centers(n) if request.n_centers is None else request.n_centers
        idx = torch.randperm(n, generator=request.generator)[:m]
        if self.fault == "dense_n_by_n":
            scores = request.kernel_operator(X).to_dense().sum(dim=1)  # the n x n matrix, for its row sums
            idx = torch.argsort(scores)[:m]
        elif self.fault == "dense_n_by_m":
            idx = idx[torch.argsort(request.kernel_operator(X, X[idx]).to_dense().sum(dim=0))]
        elif self.fault == "duplicates":
            half = (m + 1) // 2
            idx = torch.cat([idx[:half], idx[: m - half]])
        elif self.fault == "same_row":
            idx = idx[:1].repeat(m)
        points = X[idx]
        if self.fault == "off_data":
            return Centers(points=points + 1e-3)
        return Centers(points=points, indices=idx)


class _Plugin:
    def __init__(self, selectors):
        self.selectors = selectors

    @kgp.hookimpl
    def register_selectors(self, register):
        for name, obj in self.selectors.items():
            register(name, obj)


@pytest.fixture
def faulty():
    """Register ``FaultySelector(fault)`` as selector ``faulty-<fault>`` for one test."""
    names = []

    def add(fault):
        plugin_name = f"faulty-selector-{fault}"
        kgp.register(_Plugin({f"faulty-{fault}": FaultySelector(fault)}), name=plugin_name)
        names.append(plugin_name)
        return f"faulty-{fault}"

    yield add
    for name in names:
        kgp.unregister(name)


@pytest.mark.parametrize(
    "fault, check, kwargs, message",
    [
        ("dense_n_by_n", "memory", {}, rf"formed a \({MEMORY_SPEC.n}, {MEMORY_SPEC.n}\) tensor .*never form the n x n"),
        ("dense_n_by_m", "memory", {}, rf"formed a \({MEMORY_SPEC.n}, {MEMORY_SPEC.n_centers}\) tensor .*stream n x M"),
        ("duplicates", "distinct", {}, r"returned duplicate centers \(20 of 40 repeat an earlier one"),
        ("same_row", "distinct", {}, "returned the same center 40 times"),
        ("off_data", "data_rows", {"data_rows": True}, "40 of 40 centers are not rows of X .*1.732e-03 from"),
        (
            "unchecked_option",
            "invalid_options",
            {"invalid_options": ({"step": 0.5},)},
            r"\{'step': 0.5\} were accepted",
        ),
    ],
)
def test_the_kit_rejects_a_faulty_selector(faulty, fault, check, kwargs, message):
    name = faulty(fault)
    with pytest.raises(AssertionError, match=message):
        SELECTOR_CHECKS[check](name, **kwargs)
    # the same selector without the fault passes that check
    SELECTOR_CHECKS[check](faulty(None), **kwargs)


def test_check_selector_lists_the_failed_checks(faulty):
    with pytest.raises(AssertionError) as info:
        check_selector(faulty("same_row"), skip=("device", "in_model"))
    text = str(info.value)
    assert "[distinct]" in text and "[contract]" not in text and "[memory]" not in text


def test_an_invalid_option_must_be_named_in_the_error(faulty):
    with pytest.raises(AssertionError, match=r"the error for \{'step': 0.5\} names none of \['step'\]: bad value"):
        SELECTOR_CHECKS["invalid_options"](faulty("vague_error"), invalid_options=({"step": 0.5},))


def test_the_checks_that_need_a_promise_skip_without_it(faulty):
    results = check_selector(faulty("off_data"), skip=("device", "in_model"))
    assert results["data_rows"].startswith("skipped (data_rows=False")
    assert results["invalid_options"] == "skipped (no invalid_options given)"


def test_the_memory_check_measures_the_largest_tensor(faulty):
    """Uniform sampling's largest tensor is its permutation of the n row numbers (n entries)."""
    result = SELECTOR_CHECKS["memory"](faulty(None))
    assert result["largest"] == MEMORY_SPEC.n and result["shape"] == (MEMORY_SPEC.n,)


@pytest.mark.parametrize("name", ["uniform", "bless", "bless-r"])
def test_builtin_selectors_return_distinct_data_rows_within_the_budget(name):
    # leverage-score sampling may merge draws into fewer centers (exact_count=False), never repeat one
    results = check_selector(
        name,
        exact_count=name == "uniform",
        data_rows=True,
        invalid_options=() if name == "uniform" else ({"q": 1.0}, {"q2": 0.0}),
        skip=("device", "in_model", "seed", "unknown_option"),
    )
    assert results["memory"]["largest"] < MEMORY_SPEC.n * MEMORY_SPEC.n_centers
    data = make_oracle_data()
    chosen = kgp.get_selector(name).select(
        SelectionRequest(
            X=data.X,
            n_centers=40,
            kernel=data.spec.make_kernel(data.X.dtype),
            noise=data.spec.noise,
            generator=torch.Generator().manual_seed(0),
            options=kgp.testing.options_for("selector", name),
        )
    )
    # an independent look at the same promise: the chosen rows are distinct rows of X
    rows = {tuple(row.tolist()) for row in data.X}
    assert len({tuple(p.tolist()) for p in chosen.points}) == chosen.points.shape[0]
    assert all(tuple(p.tolist()) in rows for p in chosen.points)


class TestBlessThroughTheBaseClass(SelectorConformance):
    """The base class's new attributes, as a plugin author sets them."""

    selector_name = "bless"
    exact_count = False
    data_rows = True
    invalid_options = ({"q": 1.0},)
    skip_checks = ("device", "in_model")
