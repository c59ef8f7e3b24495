"""Declared plugin options: validation, normalisation, one message format, help output."""

from __future__ import annotations

import numpy as np
import pytest

import kgp
from kgp.cli import main
from kgp.options import InvalidOptionError, Option, describe_options, merge_options

DECLARED = {
    "maxiter": Option.integer(20, minimum=1, help="iterations"),
    "tol": Option.number(1e-7, minimum=0.0, help="tolerance"),
    "rate": Option.number("auto", minimum=0.0, exclusive_minimum=True, keywords=("auto",)),
    "block": Option.integer(None, minimum=1, allow_none=True),
    "method": Option.choice("a", ("a", "b")),
    "flag": Option.boolean(False),
    "plain": {"anything": 1},
}


def test_defaults_and_normalisation():
    merged = merge_options("solver 't'", DECLARED, {"maxiter": np.int64(5), "tol": 1, "rate": 0.5})
    assert merged == {
        "maxiter": 5,
        "tol": 1.0,
        "rate": 0.5,
        "block": None,
        "method": "a",
        "flag": False,
        "plain": {"anything": 1},
    }
    assert type(merged["maxiter"]) is int and type(merged["tol"]) is float
    assert merge_options("solver 't'", DECLARED, None)["rate"] == "auto"


@pytest.mark.parametrize(
    "given,expected",
    [
        ({"maxiter": 0}, "expected an integer >= 1, got 0"),
        ({"maxiter": 2.0}, "expected an integer >= 1, got 2.0"),
        ({"maxiter": True}, "expected an integer >= 1, got True"),
        ({"tol": -1}, "expected a finite number >= 0, got -1"),
        ({"tol": float("nan")}, "expected a finite number >= 0, got nan"),
        ({"tol": "small"}, "expected a finite number >= 0, got 'small'"),
        ({"rate": 0.0}, "expected a finite number > 0 or 'auto', got 0.0"),
        ({"block": 0}, "expected an integer >= 1 or None, got 0"),
        ({"method": "c"}, "expected one of 'a', 'b', got 'c'"),
        ({"flag": "no"}, "expected True or False, got 'no'"),
        ({"flag": 1}, "expected True or False, got 1"),
    ],
)
def test_one_message_format(given, expected):
    name = next(iter(given))
    with pytest.raises(InvalidOptionError) as info:
        merge_options("solver 't'", DECLARED, given)
    assert str(info.value) == f"solver 't' option {name!r}: {expected}"
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


def test_unknown_and_non_mapping_options():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['maxiterr'\] for solver 't'; valid options: block"):
        merge_options("solver 't'", DECLARED, {"maxiterr": 3})
    with pytest.raises(TypeError, match=r"options for solver 't': expected a dict, got list"):
        merge_options("solver 't'", DECLARED, [("maxiter", 3)])


def test_describe_options_rows():
    rows = {r[0]: r for r in describe_options(DECLARED)}
    assert rows["maxiter"] == ("maxiter", "20", "an integer >= 1", "iterations")
    assert rows["plain"][2] == "any value (not declared)"


def test_builtin_options_are_declared_and_checked_before_work():
    X = np.random.default_rng(0).normal(size=(50, 2))
    y = X[:, 0]
    for solver, bad in (("falkon", {"maxiter": 0}), ("eigenpro", {"epochs": -1}), ("dsg", {"batch_size": 0})):
        with pytest.raises(InvalidOptionError, match=f"solver '{solver}' option"):
            kgp.KernelRegressor(solver=solver, solver_options=bad).fit(X, y)
    with pytest.raises(InvalidOptionError, match="selector 'bless' option 'q'"):
        kgp.KernelRegressor(solver="falkon", centers="bless", selector_options={"q": 0.5}).fit(X, y)


def test_cli_prints_options(capsys):
    assert main(["plugins", "--options", "falkon"]) == 0
    out = capsys.readouterr().out
    assert "solver 'falkon'" in out and "maxiter" in out and "an integer >= 1" in out
    assert main(["plugins", "--options", "nope"]) == 1
    assert "no solver or selector named 'nope'" in capsys.readouterr().err
