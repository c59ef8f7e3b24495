"""Serving a saved GP: ``kgp.load`` and the std of a few query rows, this checkout against an earlier commit.

One command, one table::

    python benchmarks/bench_model_file.py MODEL.kgp QUERY.npy --base 60ab3be

``MODEL.kgp`` is any model file both versions read (e.g. one written by ``benchmarks/bench_large.py --save``);
``QUERY.npy`` holds the query rows (the first ``--rows``, 1,000, are asked). The commit's ``kgp`` and
``kgp_builtins`` are extracted with ``git archive`` into a temporary folder and put first on ``PYTHONPATH``.
Each version first loads the model and saves it in its own layout (so each is timed on the file it writes);
then, ``--repeats`` times in turn, a fresh process per version imports kgp, loads its file and predicts the
std: the first round warms the page cache and is not scored, the table gives the median of the others. The
last column compares the two versions' std (largest relative difference). A row per version goes to
``--jsonl`` (default ``benchmarks/bench_model_file_runs.jsonl``) with the host, its load and the threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_large import LOAD_SCRIPT as SERVE  # noqa: E402  (import, load, std in a fresh process)
from bench_large import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

RESAVE = """
import sys, kgp
kgp.load(sys.argv[1]).save(sys.argv[2])
"""


def extract(commit: str, where: Path) -> Path:
    """``kgp/`` and ``plugins/`` of ``commit`` under ``where`` (``git archive``); returns the folder."""
    archive = where / "base.tar"
    subprocess.run(
        ["git", "archive", "--format=tar", "-o", str(archive), commit, "kgp", "plugins"], cwd=ROOT, check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(where / "base", filter="data")
    return where / "base"


def run(script: str, args: list[str], python_path: Path | None, cwd: Path) -> str:
    """``script`` in a fresh interpreter; ``python_path``: the base version's folder, put first on the path.

    ``cwd`` must not be the checkout: ``python -c`` puts the working folder first on the path, where the
    checkout's ``kgp`` would shadow the base's.
    """
    env = dict(os.environ)
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(python_path), str(python_path / "plugins")])
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{'base' if python_path else 'head'} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def measure(model: Path, query: np.ndarray, base: str, repeats: int, work: Path) -> dict[str, dict]:
    """Per version: file bytes and the median import / load / std seconds over ``repeats - 1`` scored rounds."""
    versions = {"base": extract(base, work), "head": None}
    np.save(work / "query.npy", query)
    files = {}
    for name, path in versions.items():
        files[name] = work / f"{name}.kgp"
        run(RESAVE, [str(model.resolve()), str(files[name])], path, work)
    seconds: dict[str, list[tuple[float, ...]]] = {name: [] for name in versions}
    for round_ in range(repeats):
        for name, path in versions.items():
            out = run(SERVE, [str(files[name]), str(work / "query.npy"), str(work / f"{name}_std.npy")], path, work)
            imported_from = Path(out.splitlines()[-2])
            if (path is not None) != imported_from.is_relative_to(work):
                raise RuntimeError(f"{name}: kgp was imported from {imported_from}, not the {name} version")
            if round_ > 0:
                seconds[name].append(tuple(float(v) for v in out.split()[-3:]))
    std = {name: np.load(work / f"{name}_std.npy") for name in versions}
    differ = float(np.max(np.abs(std["head"] / std["base"] - 1)))
    rows = {}
    for name in versions:
        import_s, load_s, std_s = (statistics.median(col) for col in zip(*seconds[name]))
        rows[name] = {
            "file_bytes": files[name].stat().st_size,
            "import_seconds": import_s,
            "load_seconds": load_s,
            "std_seconds": std_s,
            "load_std_seconds": load_s + std_s,
            "std_max_rel_diff": differ,
        }
    return rows


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a model file both versions read")
    parser.add_argument("query", type=Path, help=".npy of query rows")
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. 60ab3be)")
    parser.add_argument("--rows", type=int, default=1000, help="query rows asked (default 1,000)")
    parser.add_argument("--repeats", type=int, default=4, help="rounds per version, the first unscored (default 4)")
    parser.add_argument("--jsonl", type=Path, default=ROOT / "benchmarks" / "bench_model_file_runs.jsonl")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error(f"--repeats: expected at least 2 (the first round only warms the page cache), got {args.repeats}")
    query = np.load(args.query)[: args.rows]
    import torch

    host = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "load_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="bench_model_file_") as tmp:
        rows = measure(args.model, query, args.base, args.repeats, Path(tmp))
    host["load_after"] = os.getloadavg()[0]
    print(
        f"{host['cpu']}; model {args.model.name}, {query.shape[0]} query rows, {host['threads']} threads, "
        f"host load {host['load_before']:.2f} -> {host['load_after']:.2f}; medians of {args.repeats - 1} rounds"
    )
    print("| version | file | import s | load s | std s | load + std s | ratio to base | std max rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    base_total = rows["base"]["load_std_seconds"]
    for name, row in rows.items():
        label = f"base {args.base}" if name == "base" else "this checkout"
        print(
            f"| {label} | {row['file_bytes'] / 1e9:.2f} GB | {row['import_seconds']:.2f} | {row['load_seconds']:.2f} | "
            f"{row['std_seconds']:.2f} | {row['load_std_seconds']:.2f} | {row['load_std_seconds'] / base_total:.2f} | "
            f"{row['std_max_rel_diff']:.1e} |"
        )
    with open(args.jsonl, "a") as fh:
        for name, row in rows.items():
            record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": str(args.model), "version": name}
            fh.write(json.dumps({**record, "base": args.base, **host, **row}) + "\n")
    return rows


if __name__ == "__main__":
    main()
