"""Seeded fits give the recorded predictions and std.

The record (``tests/data/fingerprints.npz``) is written by ``python tests/fingerprints.py --record``; that
module lists the cases and says how a deliberate numerical change re-records the entries it moves (its
commit says which and why). Each case carries the host configuration that recorded it
(``__host__/<case>``: CPU family, model and stepping, vector code path, BLAS settings, threads, torch); the
file's ``__host__`` is the default for cases without one. The ``learn_*`` cases follow rounding through an
argmin, so they are recorded on one host (an AMD EPYC, family 25, model 17) and compared there at full
precision.

Tolerance, relative to the largest value of each array, in float64:

- on the host configuration that recorded them (same CPU, vector code path, BLAS settings, threads and
  torch: :func:`fingerprints.host_signature`), every case to 1e-10: the guard for refactors of the fit path;
- elsewhere, the direct solves still to 1e-10 (they move by about 1e-13 across BLAS code paths), and
  the cases in :data:`fingerprints.SENSITIVE` (an argmin or a random decision inside) to 1e-4, above
  the 2.4e-5 measured across MKL_CBWR code paths and thread counts, far below what a wrong fit moves.
"""

from __future__ import annotations

import fingerprints
import numpy as np
import pytest

RTOL = 1e-10
RTOL_OTHER_HOST = 1e-4

recorded = dict(np.load(fingerprints.RECORD)) if fingerprints.RECORD.is_file() else {}
HOSTS = {key.split("/", 1)[1]: str(recorded.pop(key)) for key in list(recorded) if key.startswith("__host__/")}
DEFAULT_HOST = str(recorded.pop("__host__", ""))
HERE = fingerprints.host_signature()


def _same_host(case: str) -> bool:
    """Whether ``case`` was recorded on this host configuration (its own stamp, else the file's)."""
    return HOSTS.get(case, DEFAULT_HOST) == HERE


def _compare(results: dict[str, np.ndarray]) -> None:
    for key, value in results.items():
        case = key.split("/")[0]
        tol = RTOL if _same_host(case) or case not in fingerprints.SENSITIVE else RTOL_OTHER_HOST
        assert key in recorded, f"{key} was never recorded: run python tests/fingerprints.py --record"
        ref = recorded[key]
        assert value.shape == ref.shape, key
        scale = max(float(np.abs(ref).max()), 1e-300)
        err = float(np.abs(value - ref).max()) / scale
        assert err <= tol, f"{key}: relative difference {err:.3g} from the recorded fit (tolerance {tol:g})"


@pytest.mark.parametrize("name", list(fingerprints.CASES))
def test_seeded_fit_matches_the_record(name):
    _compare({f"{name}/{k}": v for k, v in fingerprints.run(name).items()})


def test_classifier_matches_the_record():
    _compare({f"classifier/{k}": v for k, v in fingerprints.classifier().items()})


def test_every_recorded_entry_is_still_a_case():
    names = set(fingerprints.CASES) | {"classifier"}
    stale = sorted(k for k in recorded if k.split("/")[0] not in names) + sorted(set(HOSTS) - names)
    assert not stale, f"recorded entries without a case: {stale}"
