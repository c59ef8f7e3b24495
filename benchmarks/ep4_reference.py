"""Run the EigenPro 4 reference code (github.com/EigenPro/EigenPro) from a local copy, for the peer columns of
``bench_eigenpro4.py`` and ``bench_eigenpro4_large.py``.

The reference is read from ``PATH/eigenpro/`` (e.g. ``git -C <mirror> archive HEAD eigenpro | tar -x -C
/tmp/ep4ref``); nothing of it is committed. It runs in this process, float32 on the CPU, with its own settings
apart from those passed here. Local shims, none changing the algorithm: ``tabulate`` and ``termcolor`` (used only
to print its configuration) get plain-text stand-ins when not installed, and its printed output is discarded.
Its time includes its own test evaluation after every epoch (on the rows passed as ``x_eval``).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import io
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

#: the reference example's Nystrom subsample and level, for the data and the model preconditioners
SUBSAMPLE, LEVEL = 2000, 100


def available(path: str | Path | None) -> Path | None:
    """``Path(path)`` when it holds ``eigenpro/solver.py``; None (with a printed SKIP line) otherwise."""
    if path is None:
        return None
    root = Path(path)
    if not (root / "eigenpro" / "solver.py").exists():
        print(f"SKIP reference: no eigenpro/solver.py under {root}")
        return None
    return root


def _shim_printing_modules() -> None:
    """Plain stand-ins for ``tabulate`` / ``termcolor`` (the reference prints its configuration with them)."""
    for name, attr, fn in (
        ("tabulate", "tabulate", lambda rows, *a, **k: "\n".join(str(r) for r in rows)),
        ("termcolor", "colored", lambda text, *a, **k: str(text)),
    ):
        try:
            __import__(name)
        except ImportError:
            module = types.ModuleType(name)
            # a spec, as an imported module has: importlib.util.find_spec(name) raises on a module without one
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            setattr(module, attr, fn)
            sys.modules[name] = module


def _import(path: Path):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    _shim_printing_modules()
    import eigenpro.kernels as kernels
    import eigenpro.models.sharded_kernel_machine as machine
    import eigenpro.solver as solver
    import eigenpro.utils.device as device

    return kernels, machine, solver, device


def kernel(path: Path, name: str, bandwidth: float) -> Callable:
    """The reference's kernel ``name`` (``"laplacian"``, ``"gaussian"``) at ``bandwidth`` (kgp's lengthscale)."""
    kernels = _import(path)[0]
    fn = getattr(kernels, name)
    return lambda a, b: fn(a, b, bandwidth=bandwidth)


def fit_reference(
    path: Path,
    kernel_fn: Callable,
    Z: torch.Tensor,
    X: torch.Tensor,
    Y: torch.Tensor,
    x_eval: torch.Tensor,
    y_eval: torch.Tensor,
    epochs: int,
    seed: int = 0,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], float]:
    """Fit the reference on centers ``Z`` and rows ``(X, Y)`` (``Y`` of shape ``n x k``), float32.

    Its settings: the example's s = 2,000 / q = 100 for the data and the model preconditioners (s capped at M,
    q at M / 2), ``tmp_centers_coeff`` 2, raised below M = 4,000 so that one of its batches fits its
    temporary-center buffer. Returns ``(predict, seconds)``; ``predict(x)`` evaluates the model in blocks.
    """
    _, machine, solver, device_mod = _import(path)
    np.random.seed(seed)
    torch.manual_seed(seed)
    M = Z.shape[0]
    # its temporary-center buffer holds (coeff - 1) M rows and one batch must fit it: with coeff = 2 its critical
    # batch (1,500 on letter) overflowed M = 1,000, so small models get more room (the period grows with it)
    coeff = 2 if M >= 4000 else 1 + -(-4000 // M)
    f32 = torch.float32
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        device = device_mod.Device.create(use_gpu_if_available=False)
        model = machine.create_sharded_kernel_machine(
            Z.to(f32).clone(), Y.shape[1], kernel_fn, device, dtype=f32, tmp_centers_coeff=coeff
        )
        model = solver.fit(
            model,
            X.to(f32),
            Y.to(f32),
            x_eval.to(f32),
            y_eval.to(f32),
            device,
            dtype=f32,
            kernel=kernel_fn,
            n_data_pcd_nyst_samples=SUBSAMPLE,
            n_model_pcd_nyst_samples=min(SUBSAMPLE, M),
            n_data_pcd_eigenvals=LEVEL,
            n_model_pcd_eigenvals=min(LEVEL, M // 2),
            epochs=epochs,
            tmp_centers_coeff=coeff,
        )
    seconds = time.perf_counter() - start

    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model(c) for c in x.to(f32).split(1024)])

    return predict, seconds
