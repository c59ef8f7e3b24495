"""The README's first example (the recommended GP) runs and prints what the README says it measured."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_gp_example_prints_its_measured_result():
    text = README.read_text(encoding="utf-8")
    use = text[text.index("## Use") :]
    block = use[use.index("```python") + len("```python") : use.index("```", use.index("```python") + 9)]
    measured = re.search(r"# measured: ([\d.]+) ([\d.]+)", block)
    assert measured, "the example states its measured result"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    rmse, coverage = (float(v) for v in out.getvalue().split())
    # the learning is deterministic (seeded); other BLAS code paths move the learned values in the last digits
    assert abs(rmse - float(measured.group(1))) <= 0.01 * float(measured.group(1))
    assert abs(coverage - float(measured.group(2))) <= 2 / 206  # two of the 206 test rows
