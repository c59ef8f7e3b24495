"""``kgp predict``: predictions (and with ``--std`` a standard deviation column) of a saved model on a data
file, scored when the file has the target, optionally with a calibration plot."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from .cli_data import NamedColumns, align_features, read_data
from .cli_parser import check_out, output_problem
from .io import atomic_write

__all__ = ["cmd_predict"]


def cmd_predict(args) -> int:
    import kgp

    inputs = {"--model": args.model, "--data": args.data}
    if args.out:
        check_out(args.out, inputs=inputs)
    if args.calibration_plot is not None:
        problem = output_problem(args.calibration_plot, "--calibration-plot", inputs=inputs)
        if problem is None and args.out and os.path.abspath(args.out) == os.path.abspath(args.calibration_plot):
            problem = f"--calibration-plot: {args.calibration_plot} is also --out; give the plot another path"
        if problem:
            raise ValueError(problem)
    # kgp.load moves tensors to the device without checking it: torch without CUDA raises a bare
    # AssertionError for "cuda:0"; the estimators' own check names the device
    from .fitting.plan import check_device

    check_device(args.device)
    if not Path(args.model).exists():
        raise FileNotFoundError(f"--model: no such file {args.model}")
    if Path(args.model).is_dir():
        raise ValueError(f"--model: {args.model} is a directory; expected a model file written by `kgp fit`")
    try:
        model = kgp.load(args.model, device=args.device)
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("--model") else f"--model: {message}") from None
    data = read_data(args.data, args.target, want_target=args.target is not None, header=args.header)
    data, note = align_features(data, getattr(model, "feature_names_in_", None), model.n_features_in_)
    if note:
        print(f"kgp predict: note: {note}", file=sys.stderr)
    names = getattr(model, "feature_names_in_", None)
    X = NamedColumns(data.X, list(names)) if names is not None else data.X
    want_std = args.std or args.calibration_plot is not None
    if want_std and hasattr(model, "classes_"):
        raise ValueError("--std: a classifier gives class labels, not a predictive standard deviation")
    if args.calibration_plot is not None and data.y is None:
        raise ValueError("--calibration-plot: needs --target (the observed values to compare the intervals with)")
    std = None
    if want_std:
        try:
            pred, std = model.predict(X, return_std=True, include_noise=True)
        except ValueError as exc:
            raise ValueError(f"--std: {exc}") from None
    else:
        pred = model.predict(X)
    if args.out:
        table, header = _prediction_table(pred, std)
        if Path(args.out).suffix == ".npy":  # the predictions as predict returns them; with --std, the table
            array = np.asarray(pred) if std is None else table
            write = lambda fh: np.save(fh, array)  # noqa: E731
        else:
            write = lambda fh: np.savetxt(  # noqa: E731
                fh, table, delimiter=",", fmt="%s", header=",".join(header), comments=""
            )
        try:
            atomic_write(args.out, write)
        except OSError as exc:
            raise OSError(f"--out: cannot write {args.out} ({exc.strerror or exc})") from None
        args.written = args.out
    summary = f"predicted {len(pred)} rows with solver {model.solver_name_}"
    if data.y is not None:
        metric = "accuracy" if hasattr(model, "classes_") else "R2"
        summary += f"; scored against {data.target}: {metric} {model.score(X, data.y):.4f}"
        if std is not None:
            y = np.asarray(data.y, dtype=np.float64).reshape(np.shape(pred))
            mean, sd = np.asarray(pred, dtype=np.float64), np.asarray(std, dtype=np.float64)
            covered = float(np.mean(np.abs(y - mean) <= 1.959964 * sd))
            nlpd = float(np.mean(0.5 * np.log(2 * np.pi * sd**2) + (y - mean) ** 2 / (2 * sd**2)))
            summary += f", 95% interval coverage {covered:.1%}, NLPD {nlpd:.4f}"
        if args.calibration_plot is not None:
            _save_calibration_plot(args.calibration_plot, np.asarray(data.y), pred, std)
            summary += f"; calibration plot saved to {args.calibration_plot}"
    if data.ignored:
        summary += f"; columns not used: {', '.join(data.ignored)}"
    print(summary + (f"; written to {args.out}" if args.out else ""))
    return 0


def _prediction_table(pred, std) -> tuple[np.ndarray, list[str]]:
    """The rows ``kgp predict --out`` writes and their column names."""
    table = np.asarray(pred)
    table = table.reshape(len(table), -1)
    k = table.shape[1]
    names = ["prediction"] if k == 1 else [f"prediction_{j}" for j in range(k)]
    if table.dtype.kind not in "fc":  # class labels
        return table, ["label"]
    if std is not None:
        std_table = np.asarray(std).reshape(len(table), -1)
        table = np.concatenate([table, std_table], axis=1)
        names += ["std"] if k == 1 else [f"std_{j}" for j in range(k)]
    return table, names


def _save_calibration_plot(path: str, y, mean, std) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--calibration-plot: needs matplotlib (pip install 'kgp[plot]')") from None
    from . import plot

    ax = plot.calibration(
        y=np.asarray(y, dtype=np.float64).reshape(-1),
        mean=np.asarray(mean).reshape(-1),
        std=np.asarray(std).reshape(-1),
    )
    try:
        ax.figure.savefig(path, dpi=120, bbox_inches="tight")
    except (OSError, ValueError) as exc:
        raise ValueError(f"--calibration-plot: cannot save {path} ({exc})") from None
    finally:
        plt.close(ax.figure)
