"""Shared test fixtures. Environment is fixed before torch is imported (see ../shared/notes/machine.md)."""

import os

# Spin-waiting OpenMP threads collapse small LAPACK calls 10-100x on a shared 2-core host.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Only kgp's own plugins, whatever else is installed: reproducible tests.
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data next to the checkout; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real-data test: {SHARED_DATA} is absent (it ships beside the repository, not in it)")
    return SHARED_DATA


@pytest.fixture(params=["blocked", "torch", "direct"])
def cholesky_path(request, monkeypatch) -> str:
    """Run the test once per path of ``kgp.linalg.cholesky_in_place`` (test matrices have more than 128 rows):
    the blocked loop, torch's potrf (where LAPACK cannot be called directly, up to ``POTRF_MAX``), and LAPACK
    on the matrix's memory (under flush-to-zero when subnormal numbers must be kept out)."""
    import kgp.linalg.cholesky

    if request.param != "direct":
        monkeypatch.setattr(kgp.linalg.cholesky, "potrf_applies", lambda A: False)
    if request.param == "blocked":
        monkeypatch.setattr(kgp.linalg.cholesky, "POTRF_MAX", 128)
    return request.param


def load_uci(shared: Path, name: str):
    """Load ``uci/NAME.csv.gz`` as float64 (X, y)."""
    import gzip

    import numpy as np

    with gzip.open(shared / "uci" / f"{name}.csv.gz", "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",")
    return raw[:, :-1], raw[:, -1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns (memory-budget tests).

    ``with LargestOutput() as rec: ...`` then ``rec.largest`` (elements) and ``rec.op`` (the op that
    returned it): deterministic, unlike a peak-RSS reading, so a test can assert that no n x M block
    was formed.
    """

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out
