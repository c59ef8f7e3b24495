"""The ``kgp`` command's flags: the argument parser, and the flags that set up the process (``--threads``).

Help texts that name plugins (solvers, selectors, objectives) are filled from the plugin registry
when help is printed, so that ``kgp fit --help`` lists exactly what is installed, third-party
plugins included, and building the parser for any other command loads no plugin.
"""

from __future__ import annotations

import argparse
import os

from ._version import __version__
from .cli_data import HEADER_CHOICES

__all__ = ["THREADS_ADVICE", "apply_threads", "build_parser"]

# measured with benchmarks/bench_threads.py on a 2-core host (docs/guarantees.md, "Threads")
THREADS_ADVICE = (
    "torch runs one thread per core by default; the kgp command sets OMP_WAIT_POLICY=PASSIVE unless the "
    "environment sets it, and with it that default was as fast as 1 thread beside another busy process "
    "(0.8-1.0x the time on 2 cores); with spinning threads (OMP_WAIT_POLICY unset, as in a Python script) "
    "the same busy process made it 2.0-2.5x slower than 1 thread. On a host whose cores other work keeps "
    "busy, try --threads 1"
)

_KINDS = {"{solvers}": "solver", "{selectors}": "selector", "{objectives}": "objective"}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, and ``{solvers}`` / ``{selectors}`` / ``{objectives}`` replaced by the installed names."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = super()._get_help_string(action) or ""
        for placeholder, kind in _KINDS.items():
            if placeholder in text:
                text = text.replace(placeholder, _installed(kind))
        return text


def _installed(kind: str) -> str:
    from .registry import registry

    names = registry.names(kind)
    return ", ".join(names) if names else "(none installed)"


def positive_int(flag: str):
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {raw!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {raw!r}")
        return value

    parse.__name__ = flag  # argparse names the type in its message: "invalid --threads value"
    return parse


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=positive_int("--threads"),
        default=None,
        metavar="N",
        help=f"torch threads (torch.set_num_threads; None: torch's default, one per core). {THREADS_ADVICE}",
    )


def apply_threads(args: argparse.Namespace) -> None:
    """``--threads N``: torch.set_num_threads(N) for this process (no-op without the flag)."""
    threads = getattr(args, "threads", None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def build_parser(fit_cmd, predict_cmd, demo_cmd, plugins_cmd) -> argparse.ArgumentParser:
    """The ``kgp`` parser; the ``*_cmd`` callables run the subcommands (``args.func``)."""
    p = argparse.ArgumentParser(prog="kgp", description="Large-scale kernel regression with pluggable solvers.")
    p.add_argument("--version", action="version", version=f"kgp {__version__}")
    sub = p.add_subparsers(dest="command")

    demo = sub.add_parser(
        "demo", help="fit every installed solver on the shipped concrete data set", formatter_class=_HelpFormatter
    )
    demo.add_argument("--solver", action="append", help="solver name (repeatable; default: every one of {solvers})")
    demo.add_argument("--seed", type=int, default=0, help="seed of the train/test split and of the solvers")
    _add_threads(demo)
    demo.set_defaults(func=demo_cmd)

    fit = sub.add_parser(
        "fit", help="fit a model on a .npz (X, y) or .csv file and save it", formatter_class=_HelpFormatter
    )
    _add_data_args(fit, predict=False)
    fit.add_argument(
        "--solver",
        default="auto",
        help="solver plugin name: {solvers}; auto (the default): chosen from the data's size (see recipe_)",
    )
    fit.add_argument(
        "--centers", default=None, help="center-selector plugin name: {selectors} (None: the default, uniform)"
    )
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
    fit.add_argument(
        "--learn",
        default=None,
        help="learn the hyperparameters first: auto (the recommended GP: objective and budget chosen from the "
        "data's size) or an objective: {objectives}",
    )
    fit.add_argument(
        "--learn-option", action="append", default=[], metavar="KEY=VALUE", help="learning option (repeatable)"
    )
    fit.add_argument(
        "--ard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one lengthscale per feature (shortcut kernels); default: on with --learn",
    )
    fit.add_argument(
        "--normalize-y",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="centre and scale the targets during the fit; default: on with --learn",
    )
    fit.add_argument(
        "--normalize-X",
        dest="normalize_X",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="standardise the features with the training rows' mean and std; default: on with --learn",
    )
    fit.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float64"],
        help="floating-point precision; auto: the data's, as in the Python API (a CSV is read as float64, "
        "a .npz keeps its arrays' float type)",
    )
    fit.add_argument("--device", default=None, help="torch device to fit on, e.g. cuda or cuda:1 (None: CPU)")
    fit.add_argument("--seed", type=int, default=0, help="random seed (center selection, stochastic solvers)")
    fit.add_argument("--classify", action="store_true", help="fit a KernelClassifier instead of a regressor")
    fit.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar of the learning and the solver on stderr (None: on when stderr is a terminal)",
    )
    _add_threads(fit)
    fit.add_argument(
        "--out",
        required=True,
        help="model file to write (replaced atomically if it exists; never the --data file itself)",
    )
    fit.add_argument(
        "--keep-best-on-interrupt",
        action="store_true",
        help="a Ctrl-C during --learn ends the learning and the fit goes on with the best point found, saving "
        "it; without this flag a Ctrl-C stops the command (exit status 130) and --out is left untouched",
    )
    fit.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel fit under torchrun: each rank memory-maps a .npy table and reads only its own "
        "rows; rank 0 saves (docs/scaling-out.md)",
    )
    fit.set_defaults(func=fit_cmd)

    pred = sub.add_parser("predict", help="predict with a saved model", formatter_class=_HelpFormatter)
    pred.add_argument("--model", required=True, help="model file written by `kgp fit`")
    _add_data_args(pred, predict=True)
    pred.add_argument("--device", default=None, help="torch device to predict on (None: CPU)")
    _add_threads(pred)
    pred.add_argument(
        "--out",
        help="write predictions here (.csv with a header row, or .npy); default: print a summary only",
    )
    pred.add_argument(
        "--std",
        action="store_true",
        help="also the predictive standard deviation of a new observation (noise included): a std column, and "
        "with --target the 95%% interval coverage and the NLPD in the summary (regressors whose solver gives a "
        "variance: exact, falkon, eigenpro, and every --learn model)",
    )
    pred.add_argument(
        "--calibration-plot",
        metavar="FILE",
        default=None,
        help="with --target: save a calibration plot (predicted against empirical interval coverage) to FILE "
        "(.png, .pdf, .svg; needs matplotlib: pip install 'kgp[plot]'); implies --std",
    )
    pred.set_defaults(func=predict_cmd)

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
    plugins.set_defaults(func=plugins_cmd)
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


def output_problem(path: str, flag: str = "--out", inputs: dict[str, str] | None = None) -> str | None:
    """Why ``path`` cannot be written (checked before any work), or None.

    ``inputs`` maps the flags of the command's input files to their paths: an output that is one of them is
    refused, compared by device and inode (a second name, a hard link or a symbolic link is the same file).
    """
    if os.path.isdir(path):
        return f"{flag}: {path} is a directory; give a file name"
    for input_flag, input_path in (inputs or {}).items():
        if input_path is not None and _same_file(path, input_path):
            return (
                f"{flag}: {path} is the {input_flag} file {input_path} (the same file on disk); writing it would "
                f"replace the {input_flag} input: give another {flag} path"
            )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag}: the folder {folder} does not exist (for {path}); create it first"
    if not os.access(folder, os.W_OK):
        return f"{flag}: cannot write in the folder {folder} (permission denied)"
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (yet): not the same file
        return False


def check_out(path: str, inputs: dict[str, str] | None = None) -> None:
    """Refuse an ``--out`` that cannot be written, or that is one of the ``inputs`` (flag to path), before any
    work (not after a fit of minutes)."""
    problem = output_problem(path, inputs=inputs)
    if problem:
        raise ValueError(problem)
