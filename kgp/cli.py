"""The ``kgp`` command: demo, fit, predict, plugins."""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from ._version import __version__
from .cli_data import HEADER_CHOICES, NamedColumns, align_features, read_data

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, MemoryError, OSError) as exc:
        print(f"kgp {args.command}: error: {cli_words(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kgp {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


# Python spellings in messages from the estimators, and the flags a CLI user types instead.
_CLI_WORDS = [
    (re.compile(r"\bsolver='([^']*)'"), r"--solver \1"),
    (re.compile(r"\bsolver=<name>"), "--solver NAME"),
    (re.compile(r"\bcenters=<selector name or array>"), "--centers NAME"),
    (re.compile(r"\bleave centers and n_centers as None"), "leave out --centers and --n-centers"),
    (re.compile(r"\bn_centers=(\d+)"), r"--n-centers \1"),
    (re.compile(r"\bn_centers\b"), "--n-centers"),
    (re.compile(r"\bsolver_options\b"), "--option"),
    (re.compile(r"\bselector_options\b"), "--selector-option"),
    (re.compile(r"\brandom_state\b"), "--seed"),
    (re.compile(r"^(noise|lengthscale|kernel|dtype|device|centers):"), r"--\1:"),
]


def cli_words(message: str) -> str:
    """Rewrite the estimators' Python parameter spellings (``solver='falkon'``) as CLI flags (``--solver falkon``)."""
    for pattern, replacement in _CLI_WORDS:
        message = pattern.sub(replacement, message)
    return message


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kgp", description="Large-scale kernel regression with pluggable solvers.")
    p.add_argument("--version", action="version", version=f"kgp {__version__}")
    sub = p.add_subparsers(dest="command")
    defaults = argparse.ArgumentDefaultsHelpFormatter

    demo = sub.add_parser(
        "demo", help="fit every installed solver on the shipped concrete data set", formatter_class=defaults
    )
    demo.add_argument("--solver", action="append", help="solver name (repeatable; default: every installed solver)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the train/test split and of the solvers")
    demo.set_defaults(func=_cmd_demo)

    fit = sub.add_parser("fit", help="fit a model on a .npz (X, y) or .csv file and save it", formatter_class=defaults)
    _add_data_args(fit, predict=False)
    fit.add_argument("--solver", default="exact", help="solver plugin name (see `kgp plugins`)")
    fit.add_argument("--centers", default=None, help="center-selector plugin name (None: the default, uniform)")
    fit.add_argument("--n-centers", type=int, default=None, help="number of centers M (None: the selector's choice)")
    fit.add_argument("--kernel", default="rbf", help="rbf, laplacian, matern32, matern52 or linear")
    fit.add_argument("--lengthscale", type=float, default=1.0, help="kernel lengthscale")
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
    fit.add_argument("--dtype", default="float64", choices=["float32", "float64"], help="floating-point precision")
    fit.add_argument("--device", default=None, help="torch device to fit on, e.g. cuda or cuda:1 (None: CPU)")
    fit.add_argument("--seed", type=int, default=0, help="random seed (center selection, stochastic solvers)")
    fit.add_argument("--classify", action="store_true", help="fit a KernelClassifier instead of a regressor")
    fit.add_argument("--progress", action="store_true", help="show a progress bar for iterative solvers")
    fit.add_argument("--out", required=True, help="model file to write")
    fit.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel fit under torchrun: each rank memory-maps a .npy table and reads only its own "
        "rows; rank 0 saves (docs/scaling-out.md)",
    )
    fit.set_defaults(func=_cmd_fit)

    pred = sub.add_parser("predict", help="predict with a saved model", formatter_class=defaults)
    pred.add_argument("--model", required=True, help="model file written by `kgp fit`")
    _add_data_args(pred, predict=True)
    pred.add_argument("--device", default=None, help="torch device to predict on (None: CPU)")
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


def _add_data_args(p: argparse.ArgumentParser, *, predict: bool) -> None:
    p.add_argument("--data", required=True, help=".npz with arrays X and y (optional feature_names), or .csv / .csv.gz")
    if predict:
        target_help = (
            "score the predictions against this column (CSV: name, or index from 0; .npz: array name). "
            "Without it nothing is scored, whatever the file holds"
        )
    else:
        target_help = (
            "target column (CSV: name, or index from 0; default: the last column; .npz: array name, default y)"
        )
    p.add_argument("--target", default=None, help=target_help)
    p.add_argument(
        "--header",
        default="auto",
        choices=HEADER_CHOICES,
        help="whether a CSV's first row names the columns (auto: yes when it has a non-numeric field)",
    )


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


def _estimator_from_args(args):
    """The estimator ``kgp fit`` configures from its flags (the same for one process and under torchrun)."""
    import kgp

    estimator = kgp.KernelClassifier if args.classify else kgp.KernelRegressor
    return estimator(
        args.kernel,
        lengthscale=args.lengthscale,
        noise=args.noise,
        solver=args.solver,
        centers=args.centers,
        n_centers=args.n_centers,
        solver_options=_parse_options(args.option, "--option"),
        selector_options=_parse_options(args.selector_option, "--selector-option"),
        device=args.device,
        dtype=args.dtype,
        random_state=args.seed,
        progress=args.progress,
        learn=args.learn,
        learn_options=_parse_options(args.learn_option, "--learn-option") or None,
        ard=args.ard,
        normalize_y=args.normalize_y,
    )


def _cmd_fit(args) -> int:

    if getattr(args, "distributed", False):
        return _cmd_fit_distributed(args)
    data = read_data(args.data, args.target, want_target=True, header=args.header)
    X = NamedColumns(data.X, data.names) if data.names is not None else data.X
    model = _estimator_from_args(args)
    model.fit(X, data.y)
    try:
        model.save(args.out)
    except OSError as exc:
        raise OSError(f"--out: cannot write {args.out} ({exc.strerror or exc})") from None
    metric = "accuracy" if args.classify else "R2"
    features = f"features {', '.join(data.names)}" if data.names is not None else f"{data.X.shape[1]} features"
    print(
        f"solver {args.solver}: fitted {data.X.shape[0]} x {data.X.shape[1]} in {model.fit_time_:.3f} s "
        f"(target {data.target}; {features}); training {metric} {model.score(X, data.y):.4f}; saved to {args.out}"
    )
    return 0


def _cmd_predict(args) -> int:
    import kgp

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
    pred = model.predict(X)
    if args.out:
        out = Path(args.out)
        try:
            if out.suffix == ".npy":
                np.save(out, pred)
            else:
                np.savetxt(out, np.asarray(pred).reshape(len(pred), -1), delimiter=",", fmt="%s")
        except OSError as exc:
            raise OSError(f"--out: cannot write {args.out} ({exc.strerror or exc})") from None
    summary = f"predicted {len(pred)} rows with solver {model.solver_name_}"
    if data.y is not None:
        metric = "accuracy" if hasattr(model, "classes_") else "R2"
        summary += f"; scored against {data.target}: {metric} {model.score(X, data.y):.4f}"
    if data.ignored:
        summary += f"; columns not used: {', '.join(data.ignored)}"
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


def _cmd_fit_distributed(args) -> int:
    """``kgp fit --distributed`` under torchrun: own rows of a .npy table, one fit over all ranks, rank 0 saves."""
    from datetime import timedelta

    import torch.distributed as dist

    import kgp

    from .shard_io import load_rows

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("--distributed: run under torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    created = not dist.is_initialized()
    if created:  # gloo: the CLI fits on CPUs; the group's own timeout bounds torch's collectives too
        dist.init_process_group("gloo", timeout=timedelta(seconds=kgp.settings.distributed_timeout.value()))
    rank, world = dist.get_rank(), dist.get_world_size()
    X, y = load_rows(args.data, args.target, rank, world)
    model = _estimator_from_args(args)  # a KernelClassifier with --classify (classes gathered from all ranks)
    model.fit(X, y, distributed=True)
    model.save(args.out)  # rank 0 writes
    if rank == 0:
        what = "accuracy" if args.classify else "R2"
        local = f"; training {what} on rank 0's {X.shape[0]} rows {model.score(X, y):.4f}" if X.shape[0] > 1 else ""
        print(
            f"solver {args.solver}: fitted {model.shard_['n_total']} x {X.shape[1]} on {world} ranks in "
            f"{model.fit_time_:.3f} s{local}; saved to {args.out}"
        )
    if created:  # only after a successful fit: after a failed collective the group cannot be torn down cleanly
        dist.destroy_process_group()
    return 0
