"""kgp ``eigenpro`` against the EigenPro3 reference code, on the reference's own kind of setting.

Setting: UCI letter (``shared/data/letter.npz``, 26 classes, seeded 80/20 split,
z-scored), one-vs-all targets (one-hot columns), Laplacian kernel ``exp(-||x - z|| / 2)``,
p = 4,000 uniform random training points as centers (the same for both), 10 epochs, float32,
CPU. Both are timed in this one process run, one after the other; the table prints the fit
times, the test accuracies (argmax) and kgp's speed-up. Target: kgp >= 2x faster at equal or
better accuracy.

The reference runs with its defaults (``n_nystrom_samples=5000``, ``data_preconditioner_level=500``,
its inexact EigenPro 2.0 projection); its interpolation problem has no ridge, so kgp is run with
``regularization="none"`` as well (``--ridge`` gives kgp's default ridge with noise 1e-3 instead).

The reference code is not part of kgp and nothing of it is committed. Obtain it with::

    git clone https://github.com/EigenPro/EigenPro3 /path/to/EigenPro3
    git -C /path/to/EigenPro3 checkout a1da2d3

and pass the path with ``--reference PATH`` or ``EIGENPRO3_PATH=PATH`` (default ``/work/ref/EigenPro3``).
Its ``eigenpro3/utils/svd.py`` calls ``scipy.linalg.eigh(..., eigvals=(lo, hi))``, a keyword removed
from current SciPy; this script wraps ``scipy.linalg.eigh`` at run time to translate it to
``subset_by_index=[lo, hi]``, and stubs ``torchvision.datasets`` when torchvision is not installed (the
reference imports it for its own data loaders only); the reference's files are not modified. Without the checkout the
reference rows are skipped with a message.

Usage (one command)::

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_eigenpro_reference.py [--reference PATH] [--repeats 1]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KGP_DISABLE_ENTRYPOINTS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kgp  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "letter.npz"
BANDWIDTH = 2.0
P = 4000
EPOCHS = 10
SEED = 0


def load_letter():
    z = np.load(DATA if DATA.exists() else "/work/shared/data/letter.npz")
    X, labels = z["X"].astype(np.float64), z["y"]
    classes, y = np.unique(labels, return_inverse=True)
    perm = np.random.default_rng(SEED).permutation(X.shape[0])
    k = int(0.8 * X.shape[0])
    tr, te = perm[:k], perm[k:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    X = (X - mu) / sd
    Y = np.eye(len(classes))[y]
    f32 = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    return f32(X[tr]), f32(Y[tr]), f32(X[te]), y[te], len(classes)


def shim_scipy_eigh():
    """Translate the removed ``eigvals=`` keyword of ``scipy.linalg.eigh`` (the reference's svd.py uses it)."""
    import scipy.linalg

    original = scipy.linalg.eigh
    if getattr(original, "_kgp_shim", False):
        return

    def eigh(*args, eigvals=None, **kwargs):
        if eigvals is not None:
            kwargs["subset_by_index"] = list(eigvals)
        return original(*args, **kwargs)

    eigh._kgp_shim = True
    scipy.linalg.eigh = eigh


def stub_torchvision():
    """The reference imports torchvision's dataset classes (for its own loaders, unused here): stub them if absent."""
    try:
        import torchvision.datasets  # noqa: F401
    except ImportError:
        import types

        tv, ds = types.ModuleType("torchvision"), types.ModuleType("torchvision.datasets")
        for name in ("MNIST", "EMNIST", "FashionMNIST", "KMNIST", "CIFAR10"):
            setattr(ds, name, None)
        tv.datasets = ds
        sys.modules.setdefault("torchvision", tv)
        sys.modules.setdefault("torchvision.datasets", ds)


def run_reference(path, Xtr, Ytr, Xte, yte, n_classes, centers):
    sys.path.insert(0, str(path))
    shim_scipy_eigh()
    stub_torchvision()
    from eigenpro3.kernels import laplacian
    from eigenpro3.models import KernelModel

    kernel_fn = lambda x, z: laplacian(x, z, bandwidth=BANDWIDTH)  # noqa: E731
    torch.manual_seed(SEED)
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        model = KernelModel(n_classes, centers, kernel_fn, X=Xtr, y=Ytr, devices=[torch.device("cpu")])
        model.fit(model.train_loaders, epochs=EPOCHS)
    seconds = time.perf_counter() - start
    pred = torch.cat([kernel_fn(b, centers) @ model.weights for b in Xte.split(2000)])
    acc = float((pred.argmax(1).numpy() == yte).mean())
    info = [line for line in log.getvalue().splitlines() if "batch size" in line or "top_q" in line]
    return seconds, acc, "; ".join(s.strip() for s in info)


def run_kgp(Xtr, Ytr, Xte, yte, centers, ridge):
    kernel = kgp.kernels.make_kernel("laplacian", BANDWIDTH)
    options = {"epochs": EPOCHS} if ridge else {"epochs": EPOCHS, "regularization": "none"}
    model = kgp.KernelRegressor(
        kernel,
        noise=1e-3,
        solver="eigenpro",
        centers=centers,
        random_state=SEED,
        dtype=torch.float32,
        solver_options=options,
    )
    start = time.perf_counter()
    model.fit(Xtr, Ytr)
    seconds = time.perf_counter() - start
    pred = np.asarray(model.predict(Xte))
    acc = float((pred.argmax(1) == yte).mean())
    ex = model.history_[-1].extras
    info = f"batch {ex['batch_size']}, q {ex['q']}, s {ex['s']}, setup {ex['setup_time']:.1f} s"
    return seconds, acc, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", default=os.environ.get("EIGENPRO3_PATH", "/work/ref/EigenPro3"))
    parser.add_argument("--repeats", type=int, default=1, help="alternate kgp / reference this many times")
    parser.add_argument("--ridge", action="store_true", help="kgp with its default ridge (noise 1e-3)")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS')}"
    )
    Xtr, Ytr, Xte, yte, n_classes = load_letter()
    g = torch.Generator().manual_seed(SEED)
    centers = Xtr[torch.randperm(Xtr.shape[0], generator=g)[:P]].clone()
    print(f"letter: n_train {Xtr.shape[0]}, n_test {Xte.shape[0]}, d {Xtr.shape[1]}, p {P}, epochs {EPOCHS}, float32")
    ref_path = Path(args.reference)
    have_ref = (ref_path / "eigenpro3" / "models.py").exists()
    if not have_ref:
        print(f"SKIP reference: no EigenPro3 checkout at {ref_path} (see this script's docstring to obtain it)")
    rows = []
    for _ in range(args.repeats):
        rows.append(("kgp eigenpro", *run_kgp(Xtr, Ytr, Xte, yte, centers, args.ridge)))
        if have_ref:
            rows.append(("EigenPro3 reference", *run_reference(ref_path, Xtr, Ytr, Xte, yte, n_classes, centers)))
    print("| run | fit s | test accuracy | notes |")
    print("|---|---|---|---|")
    for name, sec, acc, info in rows:
        print(f"| {name} | {sec:.1f} | {100 * acc:.2f}% | {info} |")
    if have_ref:
        k = min(s for n, s, _, _ in rows if n.startswith("kgp"))
        r = min(s for n, s, _, _ in rows if n.startswith("EigenPro3"))
        ka = max(a for n, _, a, _ in rows if n.startswith("kgp"))
        ra = max(a for n, _, a, _ in rows if n.startswith("EigenPro3"))
        print(
            f"\nspeed-up (reference s / kgp s, best of {args.repeats}): {r / k:.2f}x; accuracy kgp - reference: "
            f"{100 * (ka - ra):+.2f} points (target: >= 2x at >= 0)"
        )


if __name__ == "__main__":
    main()
