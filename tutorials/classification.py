"""Tutorial (b): multi-class classification on UCI pen-based digits — accuracy and a confusion matrix.

Run it with ``python tutorials/classification.py [OUTPUT_DIR]`` (under a minute on two CPU cores; the
test suite runs it with fewer rows and centers). It needs ``penbased.npz`` from the shared data
(10,992 handwritten digits as 8 (x, y) pen positions, 16 features 0..100, labels 0..9).

``kgp.KernelClassifier`` fits one kernel ridge regression per class on one-vs-all targets (+1 / -1)
with any solver (one solve, all classes as columns) and predicts the class with the largest score;
``predict_proba`` turns the scores into probabilities (softmax, docs/scikit-learn.md). Here:

1. a seeded 80/20 split, features scaled to [0, 1] by the known range 0..100 (no statistics
   needed), and the classifier through FALKON with M uniform centers;
2. test accuracy, per-class accuracy and the log loss of ``predict_proba``;
3. the confusion matrix, drawn to ``penbased_confusion.png`` (rows: true digit, columns: predicted).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import kgp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import pyplot, require  # noqa: E402


def confusion_matrix(true: np.ndarray, pred: np.ndarray, n_classes: int) -> np.ndarray:
    """``C[i, j]`` = number of test points of class i predicted as class j."""
    C = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(C, (true, pred), 1)
    return C


def run(
    output_dir: str | Path = "tutorials/output",
    *,
    n_train: int | None = None,
    n_centers: int = 2000,
    lengthscale: float = 0.3,
    noise: float = 1e-2,
) -> dict[str, object]:
    """Fit, print, plot; return accuracy, log loss and the confusion matrix."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    data = np.load(require("penbased.npz"))
    X, y = data["X"].astype(np.float64) / 100.0, data["y"].astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = perm[:cut], perm[cut:]
    if n_train is not None:
        tr = tr[:n_train]
    model = kgp.KernelClassifier(
        "rbf",
        lengthscale=lengthscale,
        noise=noise,
        solver="falkon",
        n_centers=min(n_centers, len(tr)),
        solver_options={"maxiter": 20},
        random_state=0,
    )
    model.fit(X[tr], y[tr])
    pred = model.predict(X[te])
    proba = model.predict_proba(X[te])
    accuracy = float(np.mean(pred == y[te]))
    log_loss = float(-np.mean(np.log(np.clip(proba[np.arange(len(te)), y[te]], 1e-15, None))))
    C = confusion_matrix(y[te], pred, 10)
    per_class = C.diagonal() / C.sum(1)
    print(f"penbased: {len(tr):,} training digits, M = {model.centers_.shape[0]:,}, {len(te):,} test digits")
    print(f"test accuracy {accuracy:.4f}, log loss {log_loss:.4f}")
    print("per-digit accuracy: " + " ".join(f"{d}:{a:.3f}" for d, a in enumerate(per_class)))
    worst = np.unravel_index(np.argmax(C - np.diag(C.diagonal())), C.shape)
    print(f"most frequent confusion: {worst[0]} predicted as {worst[1]} ({C[worst]} times)")

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    image = ax.imshow(C, cmap="Blues")
    for i in range(10):
        for j in range(10):
            if C[i, j]:
                ax.text(
                    j,
                    i,
                    str(C[i, j]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if C[i, j] > C.max() / 2 else "black",
                )
    ax.set_xticks(range(10))
    ax.set_yticks(range(10))
    ax.set_xlabel("predicted digit")
    ax.set_ylabel("true digit")
    ax.set_title(f"penbased, FALKON M={model.centers_.shape[0]}: accuracy {accuracy:.3f}")
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(output_dir / "penbased_confusion.png", dpi=120)
    plt.close(fig)
    return {"accuracy": accuracy, "log_loss": log_loss, "confusion": C}


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "tutorials/output")
