"""A package of this repository as it was at a commit, imported beside the checkout's own (paired benchmarks).

:func:`load_package` copies the package's ``.py`` files at ``commit`` (``git show``) into a folder and imports them as
``<name>_at_<commit>``: its relative imports resolve inside that copy, everything else (``kgp``, other packages)
is this checkout's. :func:`unload` removes it from ``sys.modules`` again.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def git_show(commit: str, path: str) -> str:
    """The text of ``path`` (relative to the repository root) at ``commit``."""
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True)
    return shown.stdout


def load_package(commit: str, package: str, where: Path) -> ModuleType:
    """``package`` (a folder of the repository, e.g. ``plugins/kgp_builtins/eigenpro4``) at ``commit``, copied under
    ``where`` and imported as ``<folder name>_at_<commit>``."""
    name = f"{Path(package).name}_at_" + "".join(c for c in commit if c.isalnum())
    target = where / name
    target.mkdir(parents=True)
    files = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{commit}:{package}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    for file in files:
        if file.endswith(".py"):
            (target / file).write_text(git_show(commit, f"{package}/{file}"))
    sys.path.insert(0, str(where))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(where))


def load_module(commit: str, path: str, package: str, where: Path) -> ModuleType:
    """The module ``path`` (e.g. ``plugins/kgp_builtins/eigenpro/ep2.py``) at ``commit``, its ``from .x import`` lines
    made ``from <package>.x import`` (``package``: the dotted name of its package in this checkout), copied under
    ``where`` and imported as ``<stem>_at_<commit>``."""
    name = f"{Path(path).stem}_at_" + "".join(c for c in commit if c.isalnum())
    text = re.sub(r"^from \.(\w+) import", rf"from {package}.\1 import", git_show(commit, path), flags=re.M)
    file = where / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered before it runs: dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def unload(module: ModuleType) -> None:
    """Remove a module or package loaded here (and a package's submodules) from ``sys.modules``."""
    for name in [m for m in sys.modules if m == module.__name__ or m.startswith(module.__name__ + ".")]:
        del sys.modules[name]
