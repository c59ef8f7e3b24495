"""The ``kgp`` command: demo, fit, predict, plugins."""

from __future__ import annotations

import argparse
import ast
import csv
import gzip
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, MemoryError) as exc:
        print(f"kgp {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kgp", description="Large-scale kernel regression with pluggable solvers.")
    sub = p.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="fit every installed solver on the shipped concrete data set")
    demo.add_argument("--solver", action="append", help="solver name (repeatable; default: every installed solver)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_cmd_demo)

    fit = sub.add_parser("fit", help="fit a model on a .npz (X, y) or .csv file and save it")
    _add_data_args(fit)
    fit.add_argument("--solver", default="exact", help="solver plugin name (see `kgp plugins`)")
    fit.add_argument("--centers", default=None, help="center-selector plugin name")
    fit.add_argument("--n-centers", type=int, default=None)
    fit.add_argument("--kernel", default="rbf", help="rbf, laplacian, matern32, matern52 or linear")
    fit.add_argument("--lengthscale", type=float, default=1.0)
    fit.add_argument("--noise", type=float, default=1e-2, help="GP noise variance sigma^2")
    fit.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="solver option (repeatable)")
    fit.add_argument(
        "--selector-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="center-selector option (repeatable; see `kgp plugins --options NAME`)",
    )
    fit.add_argument("--learn", default=None, help="learn the hyperparameters first with this objective (sgpr, exact)")
    fit.add_argument(
        "--learn-option", action="append", default=[], metavar="KEY=VALUE", help="learning option (repeatable)"
    )
    fit.add_argument("--ard", action="store_true", help="one lengthscale per feature (shortcut kernels)")
    fit.add_argument("--normalize-y", action="store_true", help="centre and scale the targets during the fit")
    fit.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--classify", action="store_true", help="fit a KernelClassifier instead of a regressor")
    fit.add_argument("--progress", action="store_true")
    fit.add_argument("--out", required=True, help="model file to write")
    fit.set_defaults(func=_cmd_fit)

    pred = sub.add_parser("predict", help="predict with a saved model")
    pred.add_argument("--model", required=True)
    _add_data_args(pred, target_required=False)
    pred.add_argument("--out", help="write predictions here (.csv or .npy); default: print a summary only")
    pred.set_defaults(func=_cmd_predict)

    plugins = sub.add_parser(
        "plugins",
        help="list installed solvers, selectors and predictor kinds; exit status 1 if a plugin failed to load "
        "or two plugins register the same name",
        description="List every usable solver, selector and predictor kind with the plugin (entry point) and "
        "distribution that registered it. SHADOWED lines: a third party registers a built-in's name (the built-in "
        "wins, the third party's registration is ignored); CONFLICT lines: two third parties register the same "
        "name (unusable); FAILED lines: a plugin that was skipped. Exit status: 0 when there is none of these, "
        "1 otherwise (so that CI and install scripts notice).",
    )
    plugins.add_argument("--traceback", action="store_true", help="print the traceback of each failed plugin")
    plugins.add_argument(
        "--options", metavar="NAME", default=None, help="print the options of the solver or selector NAME instead"
    )
    plugins.set_defaults(func=_cmd_plugins)
    return p


def _add_data_args(p: argparse.ArgumentParser, target_required: bool = True) -> None:
    p.add_argument("--data", required=True, help=".npz with arrays X and y, or .csv / .csv.gz")
    p.add_argument(
        "--target",
        default=None,
        help="target column of a CSV (name if it has a header, else index; default: last column). "
        "For .npz: the array name (default y).",
    )


# ---------------------------------------------------------------------- data loading
def load_table(path: str, target: str | None, *, require_target: bool = True):
    """Load ``(X, y)`` from a .npz (arrays X and y) or a CSV (header optional); y may be None."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"--data: no such file {path}")
    if file.suffix == ".npz":
        with np.load(file, allow_pickle=False) as z:
            if "X" not in z.files:
                raise ValueError(f"--data: {path} has no array 'X' (arrays: {', '.join(z.files)})")
            key = target or "y"
            if key not in z.files:
                if require_target:
                    raise ValueError(f"--target: {path} has no array {key!r} (arrays: {', '.join(z.files)})")
                return z["X"], None
            return z["X"], z[key]
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt", newline="") as fh:
        rows = [row for row in csv.reader(fh) if row]
    if not rows:
        raise ValueError(f"--data: {path} is empty")
    header = None
    try:
        [float(v) for v in rows[0]]
    except ValueError:
        header, rows = rows[0], rows[1:]
    try:
        table = np.array(rows, dtype=np.float64)
    except ValueError as exc:
        raise ValueError(f"--data: {path} has non-numeric values ({exc})") from exc
    if target is None:
        if not require_target:
            return table, None
        col = table.shape[1] - 1
    elif header is not None and target in header:
        col = header.index(target)
    else:
        try:
            col = int(target) % table.shape[1]
        except ValueError:
            raise ValueError(f"--target: {target!r} is not a column name or index of {path}") from None
    return np.delete(table, col, axis=1), table[:, col]


def _parse_options(items: list[str], flag: str) -> dict:
    options = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        options[key.strip()] = value
    return options


# ---------------------------------------------------------------------- commands
def _cmd_demo(args) -> int:
    import torch

    import kgp
    from kgp.datasets import load_demo

    X, y = load_demo()
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(len(y))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    Xs = (X - mu) / sd
    ym, ys = y[tr].mean(), y[tr].std()
    yt = (y - ym) / ys
    solvers = args.solver or kgp.registry.registry.names("solver")
    print(
        "kgp demo: UCI concrete compressive strength (shipped with kgp), "
        f"{n_train} train / {len(te)} test, 8 features, RBF kernel, lengthscale 2, noise 0.05"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64")
    print(f"{'solver':<14}{'test RMSE (MPa)':>16}{'test R2':>10}{'fit time (s)':>14}")
    for name in solvers:
        model = kgp.KernelRegressor("rbf", lengthscale=2.0, noise=0.05, solver=name, random_state=args.seed)
        if model_needs_centers(name):
            model.set_params(n_centers=min(400, n_train))
        start = time.perf_counter()
        model.fit(Xs[tr], yt[tr])
        elapsed = time.perf_counter() - start
        pred = model.predict(Xs[te]) * ys + ym
        rmse = float(np.sqrt(np.mean((pred - y[te]) ** 2)))
        r2 = 1 - np.sum((pred - y[te]) ** 2) / np.sum((y[te] - y[te].mean()) ** 2)
        print(f"{name:<14}{rmse:>16.3f}{r2:>10.3f}{elapsed:>14.3f}")
    print(f"(predicting the training mean gives test RMSE {float(np.sqrt(np.mean((ym - y[te]) ** 2))):.3f} MPa)")
    return 0


def model_needs_centers(name: str) -> bool:
    import kgp

    return bool(getattr(kgp.get_solver(name), "uses_centers", False))


def _cmd_fit(args) -> int:
    import kgp

    X, y = load_table(args.data, args.target)
    estimator = kgp.KernelClassifier if args.classify else kgp.KernelRegressor
    model = estimator(
        args.kernel,
        lengthscale=args.lengthscale,
        noise=args.noise,
        solver=args.solver,
        centers=args.centers,
        n_centers=args.n_centers,
        solver_options=_parse_options(args.option, "--option"),
        selector_options=_parse_options(args.selector_option, "--selector-option"),
        dtype=args.dtype,
        random_state=args.seed,
        progress=args.progress,
        learn=args.learn,
        learn_options=_parse_options(args.learn_option, "--learn-option") or None,
        ard=args.ard,
        normalize_y=args.normalize_y,
    )
    model.fit(X, y)
    model.save(args.out)
    metric = "accuracy" if args.classify else "R2"
    print(
        f"solver {args.solver}: fitted {X.shape[0]} x {X.shape[1]} in {model.fit_time_:.3f} s; "
        f"training {metric} {model.score(X, y):.4f}; saved to {args.out}"
    )
    return 0


def _cmd_predict(args) -> int:
    import kgp

    model = kgp.load(args.model)
    X, y = load_table(args.data, args.target, require_target=args.target is not None)
    if X.shape[1] != model.n_features_in_ and y is None and X.shape[1] == model.n_features_in_ + 1:
        X = X[:, :-1]  # a CSV that still holds the target in its last column
    pred = model.predict(X)
    if args.out:
        out = Path(args.out)
        if out.suffix == ".npy":
            np.save(out, pred)
        else:
            np.savetxt(out, np.asarray(pred).reshape(len(pred), -1), delimiter=",", fmt="%s")
    summary = f"predicted {len(pred)} rows with solver {model.solver_name_}"
    if y is not None:
        metric = "accuracy" if hasattr(model, "classes_") else "R2"
        summary += f"; {metric} {model.score(X, y):.4f}"
    print(summary + (f"; written to {args.out}" if args.out else ""))
    return 0


def _cmd_plugins(args) -> int:
    import kgp

    if args.options is not None:
        return _print_options(args.options)

    registry = kgp.registry.registry
    infos = kgp.list_plugins()
    rows = [("name", "kind", "plugin", "distribution", "version")]
    rows += [(i.name, i.kind, i.plugin, i.distribution or "(runtime)", i.version or "-") for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    problems = registry.problems()
    for line in problems:
        print(line)
    if args.traceback:
        for failure in registry.load_failures:
            if failure.traceback:
                print(f"\nTraceback of plugin {failure.plugin!r}:\n{failure.traceback.rstrip()}")
    # Non-zero so that a broken install fails CI / install scripts instead of surfacing at first use.
    return 1 if problems else 0


def _print_options(name: str) -> int:
    from kgp.options import describe_options
    from kgp.registry import UnknownPluginError, registry

    found = []
    for kind in ("solver", "selector", "objective"):
        try:
            found.append((kind, registry.get(kind, name).obj))
        except UnknownPluginError:
            continue
    if not found:
        solvers, selectors = registry.names("solver"), registry.names("selector")
        raise ValueError(
            f"--options: no solver or selector named {name!r}; solvers: {', '.join(solvers) or '(none)'}; "
            f"selectors: {', '.join(selectors) or '(none)'}"
        )
    for kind, obj in found:
        rows = describe_options(getattr(obj, "option_defaults", {}))
        how = {"solver": "--option", "selector": "--selector-option", "objective": "--learn-option"}[
            kind
        ] + " KEY=VALUE"
        print(f"{kind} {name!r}: {len(rows)} option(s), set with {how}")
        table = [("option", "default", "accepts", "help"), *rows]
        widths = [max(len(r[c]) for r in table) for c in range(3)]
        for row in table:
            print("  " + "  ".join(v.ljust(w) for v, w in zip(row[:3], widths)) + "  " + row[3])
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
