"""The ``kgp`` console script's entry point, outside the ``kgp`` package on purpose.

A console script that names ``kgp.cli:main`` imports the package ``kgp`` (torch, gpytorch, linear_operator:
about 5 s on a busy 2-core host) before any line of ``kgp.cli`` runs, where a Ctrl-C would print a raw
traceback. This module imports nothing heavy itself: it catches an
interrupt during the imports (one line, exit status 130, as the commands do once running), and it
sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment says otherwise, which must happen before
torch is imported: torch's OpenMP threads otherwise spin while waiting, and small parallel routines
ran 10-100x slower beside another busy process (measured; see ../shared/notes/machine.md and
docs/guarantees.md). ``python -m kgp`` imports the package first and keeps neither benefit.

Once the command has returned, its work is done and its files are written: :func:`console` then ignores
Ctrl-C, which would otherwise interrupt the interpreter's shutdown (joining worker threads) and end the
process by signal 2, with no message and no exit status of the command's.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """Run the ``kgp`` command; 130 after a Ctrl-C at any point, with one line on stderr."""
    try:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from kgp.cli import main as run
    except KeyboardInterrupt:
        print("kgp: interrupted while starting; nothing was done", file=sys.stderr)
        return 130
    try:
        return run(argv)
    except KeyboardInterrupt:  # before or after a command's own handler (argument parsing, exit)
        print("kgp: interrupted; nothing was written", file=sys.stderr)
        return 130


def console(argv: list[str] | None = None) -> int:
    """The console script: :func:`main`, then Ctrl-C ignored while the process exits."""
    status = main(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(console())
