"""Make the plugin testable both installed and from a source checkout.

Installed (``pip install .``), kgp finds the plugin through its entry points and nothing happens
here. From a bare checkout the package directory is put on ``sys.path`` and its two modules are
registered at runtime with :func:`kgp.register`, exactly what the entry points would load.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (shared, busy machines)

ROOT = Path(__file__).resolve().parents[1]

try:
    import kgp_example  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT))

import kgp  # noqa: E402
from kgp.registry import registry  # noqa: E402

if "nystrom-direct" not in registry.names("solver"):
    from kgp_example import kmeanspp, nystrom

    kgp.register(nystrom, name="nystrom-direct")
    kgp.register(kmeanspp, name="kmeanspp")
