"""Tutorial (e): the same FALKON fit on a GPU (``device="cuda"``) and on several processes (torchrun).

Run it with ``python tutorials/gpu_and_distributed.py [OUTPUT_DIR]``. It needs ``uci/kin40k.csv.gz``
from the shared data. The companion page ``tutorials/gpu_and_distributed.md`` has the install
commands and what has been measured (and what has not: **no CUDA run has been made yet**).

1. **Device.** ``KernelRegressor(..., device="cuda")`` fits on the GPU (or pass torch tensors that
   are already there); the CLI flag is ``--device cuda``. This script uses CUDA when torch sees
   one and otherwise runs the same code on the CPU, saying so.
2. **Data parallel.** It writes the training rows as one ``.npy`` table (``n x (d + 1)``, target
   last), fits it with ``torchrun --nproc-per-node 2 -m kgp fit --distributed`` (two gloo processes
   on this machine, each memory-mapping the table and reading only its half of the rows), fits the
   same rows with one plain ``kgp fit`` (from an ``.npz``), and compares the two saved models' predictions.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import kgp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import uci_split  # noqa: E402


def run(
    output_dir: str | Path = "tutorials/output", *, n_train: int = 8000, n_centers: int = 1000, timeout: float = 600.0
) -> dict:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    X, y, X_test, y_test = uci_split("kin40k")
    X, y = X[:n_train], y[:n_train]

    # 1. one process, on the GPU when there is one
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("torch sees no CUDA device: running the device example on the CPU (same code)")
    model = kgp.KernelRegressor(
        "rbf", lengthscale=1.0, noise=1e-2, solver="falkon", n_centers=n_centers, device=device, random_state=0
    )
    start = time.perf_counter()
    model.fit(X.astype(np.float32), y.astype(np.float32))  # float32: the GPU's precision
    rmse_device = float(np.sqrt(np.mean((model.predict(X_test.astype(np.float32)) - y_test) ** 2)))
    print(
        f"{device}: float32 FALKON, n={n_train:,}, M={n_centers:,}: test RMSE {rmse_device:.4f} "
        f"({time.perf_counter() - start:.1f} s)"
    )

    # 2. two processes with torchrun against one process, through the command line
    table = output_dir / "kin40k_train.npy"
    np.save(table, np.column_stack([X, y]))
    archive = output_dir / "kin40k_train.npz"  # the one-process CLI reads .npz / CSV, not .npy tables
    np.savez(archive, X=X, y=y)
    common = ["fit", "--solver", "falkon", "--centers", "uniform", "--n-centers", str(n_centers), "--seed", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    with socket.socket() as sock:  # a free local port for the rendezvous of the two ranks
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    commands = {
        "2 ranks": [
            *torchrun,
            "-m",
            "kgp",
            *common,
            "--distributed",
            "--data",
            str(table),
            "--out",
            str(output_dir / "two.kgp"),
        ],
        "1 process": [
            sys.executable,
            "-m",
            "kgp",
            *common,
            "--data",
            str(archive),
            "--out",
            str(output_dir / "one.kgp"),
        ],
    }
    seconds = {}
    for label, command in commands.items():
        print("$", " ".join(Path(c).name if c == sys.executable else c for c in command))
        start = time.perf_counter()
        subprocess.run(command, env=env, check=True, timeout=timeout)
        seconds[label] = time.perf_counter() - start
    two, one = kgp.load(output_dir / "two.kgp"), kgp.load(output_dir / "one.kgp")
    p2, p1 = two.predict(X_test), one.predict(X_test)
    difference = float(np.max(np.abs(p2 - p1)) / np.max(np.abs(p1)))
    rmse_two = float(np.sqrt(np.mean((p2 - y_test) ** 2)))
    print(
        f"2 ranks vs 1 process: test RMSE {rmse_two:.4f} vs {np.sqrt(np.mean((p1 - y_test) ** 2)):.4f}, "
        f"largest relative difference of the predictions {difference:.1e}"
    )
    return {
        "device": device,
        "rmse_device": rmse_device,
        "rmse_two_ranks": rmse_two,
        "relative_difference": difference,
        "seconds": seconds,
    }


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "tutorials/output")
