"""The ``kgp`` command: demo, fit, predict, plugins."""

from __future__ import annotations

import ast
import os
import re
import sys
import time

import numpy as np

from .cli_data import NamedColumns, read_data
from .cli_parser import apply_threads, build_parser, check_out
from .cli_predict import cmd_predict

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_cmd_fit, cmd_predict, _cmd_demo, _cmd_plugins)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        apply_threads(args)
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, MemoryError, OSError) as exc:
        message = cli_words(str(exc), getattr(args, "fit_dtype", None))
        print(f"kgp {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        written = getattr(args, "written", None)
        outcome = f"{written} was already written" if written else "nothing was written"
        print(f"kgp {args.command}: interrupted; {outcome}", file=sys.stderr)
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
    (re.compile(r"\blearn_options\['(\w+)'\]"), r"--learn-option \1=VALUE"),
    (re.compile(r"\brandom_state\b"), "--seed"),
    (re.compile(r"^(noise|lengthscale|kernel|dtype|device|centers):"), r"--\1:"),
    # messages that start with the part at fault: name its flag first
    (re.compile(r"^solver '([^']*)' option '([^']*)'"), r"--option \2 (solver \1)"),
    (re.compile(r"^selector '([^']*)' option '([^']*)'"), r"--selector-option \2 (selector \1)"),
    (re.compile(r"^(?:learn|objective) '([^']*)' option '([^']*)'"), r"--learn-option \2 (learn \1)"),
    (re.compile(r"^(unknown option\(s\) .*? for solver ')"), r"--option: \1"),
    (re.compile(r"^(unknown option\(s\) .*? for selector ')"), r"--selector-option: \1"),
    (re.compile(r"^(unknown option\(s\) .*? for (?:learn|objective) ')"), r"--learn-option: \1"),
    (re.compile(r"^unknown solver '"), "--solver: unknown solver '"),
    (re.compile(r"^unknown selector '"), "--centers: unknown selector '"),
    (re.compile(r"^unknown objective '"), "--learn: unknown objective '"),
    (re.compile(r"^solver '([^']*)'"), r"--solver \1"),
    (re.compile(r"^selector '([^']*)'"), r"--centers \1"),
    (re.compile(r"^(?:learn|objective) '([^']*)'"), r"--learn \1"),
    (re.compile(r"^learn_options:"), "--learn-option:"),
    (re.compile(r"\bwithout learn\b"), "without --learn"),
    (re.compile(r"\blearn='(\w+)'"), r"--learn \1"),
    (re.compile(r"^X:"), "--data:"),
    (re.compile(r"^y:"), "--target:"),
    (re.compile(r"\buse KernelRegressor for continuous targets"), "leave out --classify for continuous targets"),
]

# Advice to use float64 as the plugins' numerical errors give it ("..., or float64", "... or use float64",
# "; use float64"): wrong after a float64 fit (`--learn holdout` on 3 rows would advise it), and
# spelled as the flag after a float32 one.
_FLOAT64_ADVICE = re.compile(r",? or (?:use )?float64\b|;? ?\buse float64\b")


def cli_words(message: str, fit_dtype: str | None = None) -> str:
    """Rewrite the estimators' Python parameter spellings (``solver='falkon'``) as CLI flags (``--solver falkon``).

    ``fit_dtype`` (``"float32"`` / ``"float64"``: the precision the failed fit ran in) removes advice
    to use float64 from a float64 fit's message, and spells it ``--dtype float64`` for a float32 one.
    """
    for pattern, replacement in _CLI_WORDS:
        message = pattern.sub(replacement, message)
    if fit_dtype == "float64":
        message = _FLOAT64_ADVICE.sub("", message)
    elif fit_dtype == "float32":
        message = _FLOAT64_ADVICE.sub(lambda m: m.group(0).replace("float64", "--dtype float64"), message)
    return message


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
        f"kgp demo: UCI concrete compressive strength (shipped with kgp), {n_train} train / {len(te)} test, 8 features"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64")
    # the recommended GP: raw features and targets in, everything learned and chosen from the data's size
    start = time.perf_counter()
    gp = kgp.KernelRegressor("rbf", learn="auto", random_state=args.seed).fit(X[tr], y[tr])
    elapsed = time.perf_counter() - start
    mean, std = gp.predict(X[te], return_std=True, include_noise=True)
    rmse = float(np.sqrt(np.mean((mean - y[te]) ** 2)))
    covered = float(np.mean(np.abs(mean - y[te]) <= 1.96 * std))
    print(
        f"GP, KernelRegressor('rbf', learn='auto') on the raw data: test RMSE {rmse:.3f} MPa, 95% interval "
        f"coverage {covered:.1%}, fit {elapsed:.1f} s (solver {gp.solver_name_}, "
        f"noise std {float(np.sqrt(gp.noise_)) * float(gp._y_train_std[0]):.2f} MPa)"
    )
    print("every installed solver with fixed hyperparameters (RBF kernel, lengthscale 2, noise 0.05) on")
    print("features and targets standardised with the training rows' statistics:")
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

    return kgp.registry.registry.get("solver", name).capabilities.uses_centers


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
        dtype=None if args.dtype == "auto" else args.dtype,
        random_state=args.seed,
        progress=_progress(args),
        learn=args.learn,
        learn_options=_parse_options(args.learn_option, "--learn-option") or None,
        ard=args.ard,
        normalize_y=args.normalize_y,
        normalize_X=args.normalize_X,
    )


def _progress(args) -> bool:
    """``--progress`` / ``--no-progress``; without either, a bar when stderr is a terminal (a person watching)."""
    if args.progress is not None:
        return args.progress
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _fit_dtype(args, X: np.ndarray) -> str | None:
    """The precision the fit runs in (for the advice in error messages): ``--dtype``, else the data's."""
    if args.dtype != "auto":
        return args.dtype
    return {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}.get(np.asarray(X).dtype, "float64")


def _save(model, args) -> None:
    try:
        model.save(args.out)  # atomic: an interrupted or failed save leaves the previous file as it was
    except OSError as exc:
        raise OSError(f"--out: cannot write {args.out} ({exc.strerror or exc})") from None
    args.written = args.out


def _interrupt_rule(args):
    """The learning loop's Ctrl-C rule for ``kgp fit``: stop the command unless ``--keep-best-on-interrupt``."""
    import kgp

    return kgp.settings.interrupted_learning("keep_best" if args.keep_best_on_interrupt else "stop_fit")


def _cmd_fit(args) -> int:
    check_out(args.out, inputs={"--data": args.data})
    if getattr(args, "distributed", False):
        return _cmd_fit_distributed(args)
    data = read_data(args.data, args.target, want_target=True, header=args.header)
    X = NamedColumns(data.X, data.names) if data.names is not None else data.X
    model = _estimator_from_args(args)
    args.fit_dtype = _fit_dtype(args, data.X)
    with _interrupt_rule(args):
        model.fit(X, data.y)
    _save(model, args)
    metric = "accuracy" if args.classify else "R2"
    features = f"features {', '.join(data.names)}" if data.names is not None else f"{data.X.shape[1]} features"
    print(
        f"solver {model.solver_name_}: fitted {data.X.shape[0]} x {data.X.shape[1]} in {model.fit_time_:.3f} s "
        f"(target {data.target}; {features}); training {metric} {model.score(X, data.y):.4f}; saved to {args.out}"
    )
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
    with _interrupt_rule(args):
        model.fit(X, y, distributed=True)
    _save(model, args)  # rank 0 writes
    if rank == 0:
        what = "accuracy" if args.classify else "R2"
        local = f"; training {what} on rank 0's {X.shape[0]} rows {model.score(X, y):.4f}" if X.shape[0] > 1 else ""
        print(
            f"solver {model.solver_name_}: fitted {model.shard_['n_total']} x {X.shape[1]} on {world} ranks in "
            f"{model.fit_time_:.3f} s{local}; saved to {args.out}"
        )
    if created:  # only after a successful fit: after a failed collective the group cannot be torn down cleanly
        dist.destroy_process_group()
    return 0
