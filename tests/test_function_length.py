"""The learning loop, the option path and the DSG / EigenPro 3 fits stay in short functions.

A function over ``LIMIT`` lines (signature and docstring included) must say why in its docstring,
with the words "over 80 lines".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 80
MODULES = [
    *sorted((ROOT / "kgp" / "learning").glob("*.py")),
    ROOT / "kgp" / "options.py",
    ROOT / "kgp" / "fitting" / "plan.py",
    ROOT / "kgp" / "fitting" / "parameters.py",
    ROOT / "plugins" / "kgp_builtins" / "dsg" / "solver.py",
    ROOT / "plugins" / "kgp_builtins" / "eigenpro" / "ep3.py",
]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_long_function_without_a_reason(path):
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > LIMIT and "over 80 lines" not in (ast.get_docstring(node) or ""):
                long.append(f"{node.name} ({lines} lines)")
    assert not long, f"{path.name}: functions over {LIMIT} lines without a reason in their docstring: {long}"
