"""Reading the ``kgp`` command's data files (.npz, .csv, .csv.gz) so that no column is ever mis-read.

Rules (every violation is a ValueError naming the flag, the file and what was expected):

- A CSV header is recognised when its first row has a non-numeric field (``--header auto``); a
  numeric first row that looks like column numbers (``0,1,...`` or ``1,2,...``) is ambiguous and
  refused unless ``--header yes`` or ``--header no`` says what it is.
- ``--target`` is a column name (CSV with a header) or an index in ``[-c, c)`` for ``c`` columns,
  or the name of an array in a .npz. Nothing wraps around.
- Feature names come from the header (minus the target) or from a .npz array ``feature_names``;
  ``kgp predict`` selects the model's features by name (:func:`align_features`), in any order,
  and refuses when one is missing.
- A CSV file is UTF-8 text (a byte-order mark is ignored); UTF-16, binary data and other encodings
  are refused naming the problem (the first byte that is not UTF-8, with its offset and line) and
  the remedy, to re-save the file as UTF-8.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Data", "NamedColumns", "align_features", "read_data"]

HEADER_CHOICES = ("auto", "yes", "no")


@dataclass(frozen=True)
class Data:
    """Features, optional target and optional feature names read from one file."""

    X: np.ndarray
    y: np.ndarray | None
    names: list[str] | None
    target: str | None = None  # the target's column name or array name, for messages
    path: str = ""
    ignored: list[str] = field(default_factory=list)  # columns not used (filled by align_features)


class NamedColumns:
    """A float array with column names: what the estimators read from a pandas DataFrame.

    ``kgp.KernelRegressor.fit`` stores ``columns`` as ``feature_names_in_`` (the model file keeps
    them), which is how ``kgp predict`` later finds the features by name.
    """

    def __init__(self, values: np.ndarray, columns: list[str]):
        self.values = values
        self.columns = list(columns)
        self.shape = values.shape

    def __array__(self, dtype=None, copy=None):
        return self.values if dtype is None else self.values.astype(dtype)

    def __len__(self) -> int:
        return len(self.values)


def read_data(path: str, target: str | None, *, want_target: bool, header: str = "auto") -> Data:
    """Read ``path``; the target is ``target`` (or the default when ``want_target``), else no target."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"--data: no such file {path}")
    if file.is_dir():
        raise ValueError(f"--data: {path} is a directory; expected a .npz, .csv or .csv.gz file")
    if file.suffix == ".npz":
        return _read_npz(file, target, want_target)
    return _read_csv(file, target, want_target, header)


def _read_npz(file: Path, target: str | None, want_target: bool) -> Data:
    try:
        with np.load(file, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except ValueError as exc:  # object arrays need pickle, which is never allowed
        raise ValueError(f"--data: cannot read {file}: {exc}") from None
    except (OSError, EOFError) as exc:
        raise ValueError(f"--data: {file} is not a readable .npz file ({type(exc).__name__}: {exc})") from None
    listed = ", ".join(arrays) or "(none)"
    if "X" not in arrays:
        raise ValueError(f"--data: {file} has no array 'X' (arrays: {listed})")
    X = arrays["X"]
    names = None
    if "feature_names" in arrays:
        names = [str(v) for v in np.asarray(arrays["feature_names"]).ravel()]
        if X.ndim != 2 or len(names) != X.shape[1]:
            raise ValueError(
                f"--data: {file} has {len(names)} feature_names for X of shape {X.shape}; they must match X's columns"
            )
    if target is None and not want_target:
        return Data(X, None, names, path=str(file))
    key = "y" if target is None else target
    if key not in arrays:
        what = "the target array" if target is None else f"--target {target!r}"
        hint = " (for a .npz, --target names an array, not a column)" if target is not None else ""
        raise ValueError(f"--target: {file} has no array {key!r} for {what}{hint}; arrays: {listed}")
    return Data(X, arrays[key], names, target=key, path=str(file))


def _read_csv(file: Path, target: str | None, want_target: bool, header: str) -> Data:
    if header not in HEADER_CHOICES:
        raise ValueError(f"--header: expected one of {', '.join(HEADER_CHOICES)}, got {header!r}")
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rb") as raw:
            # UTF-16 and binary files are recognised before they are parsed, from bytes peeked at (not
            # consumed: a pipe, such as bash's <(...), can be read once)
            problem = _not_text(raw.peek(_SNIFF)[:_SNIFF], " of the decompressed text" if file.suffix == ".gz" else "")
            if problem is not None:
                raise ValueError(f"--data: {file} {problem}")
            # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first column's name
            with io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as fh:
                rows = [row for row in csv.reader(fh) if row and any(cell.strip() for cell in row)]
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data: {file} {_encoding_problem(file, opener, exc)}") from None
    except (OSError, EOFError, csv.Error) as exc:
        raise ValueError(f"--data: cannot read {file} as CSV ({type(exc).__name__}: {exc})") from None
    if not rows:
        raise ValueError(f"--data: {file} is empty")
    names = _header(rows[0], header, file)
    body = rows[1:] if names is not None else rows
    if not body:
        raise ValueError(f"--data: {file} has a header but no data rows")
    width = len(rows[0])
    table = np.empty((len(body), width))
    for i, row in enumerate(body):
        line = i + (2 if names is not None else 1)
        if len(row) != width:
            raise ValueError(f"--data: {file} line {line} has {len(row)} fields, expected {width} like the first row")
        for j, cell in enumerate(row):
            try:
                table[i, j] = float(cell)
            except ValueError:
                column = repr(names[j]) if names is not None else str(j)
                raise ValueError(f"--data: {file} line {line}, column {column}: {cell!r} is not a number") from None
    if target is None and not want_target:
        return Data(table, None, names, path=str(file))
    col = width - 1 if target is None else _target_column(target, names, width, file)
    label = names[col] if names is not None else f"column {col}"
    features = np.delete(table, col, axis=1)
    feature_names = None if names is None else [n for k, n in enumerate(names) if k != col]
    return Data(features, table[:, col], feature_names, target=label, path=str(file))


_UTF16_MARKS = {codecs.BOM_UTF16_LE: "FF FE", codecs.BOM_UTF16_BE: "FE FF"}
_SNIFF = 4096  # leading bytes looked at for NUL bytes (UTF-16 text or binary data)
_CHUNK = 1 << 20


def _encoding_problem(file: Path, opener, error: UnicodeDecodeError) -> str:
    """Why a CSV file is not UTF-8 text, in words: UTF-16, binary data, or the first byte that is not UTF-8.

    Called once decoding failed (``error``): a regular file is read again as bytes (decompressed for
    .gz), block by block, to find the offset and line of the first byte that is not UTF-8; a pipe, which
    cannot be read again, is described by ``error``'s byte alone. The remedy is to re-save the file as
    UTF-8 (kgp reads UTF-8, with or without a byte-order mark, as Excel's "CSV UTF-8" writes it).
    """
    where = " of the decompressed text" if file.suffix == ".gz" else ""
    legacy = f"the file is probably in a legacy encoding such as Latin-1 or Windows-1252; {_REMEDY.format('LATIN1')}"
    if not file.is_file():
        if error.reason == "unexpected end of data":
            return f"is not UTF-8 text (it ends inside a character); {_REMEDY.format('<its encoding>')}"
        return f"is not UTF-8 text: byte 0x{error.object[error.start]:02x} is not valid UTF-8; {legacy}"
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0
    with opener(file, "rb") as fh:
        block = fh.read(_SNIFF)
        problem = _not_text(block, where)
        if problem is not None:
            return problem
        while block:
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                # exc.object is the decoder's unfinished character from the block before (<= 3 bytes) + block
                start = offset + exc.start - len(exc.object) + len(block)
                line = lines + exc.object[: exc.start].count(b"\n") + 1
                return (
                    f"is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {start:,}{where} "
                    f"(line {line:,}) is not valid UTF-8; {legacy}"
                )
            offset += len(block)
            lines += block.count(b"\n")
            block = fh.read(_CHUNK)
    return f"is not UTF-8 text (it ends inside a character); {_REMEDY.format('<its encoding>')}"


_REMEDY = "re-save the file as UTF-8 (e.g. Excel's 'CSV UTF-8', or iconv -f {} -t UTF-8)"


def _not_text(head: bytes, where: str = "") -> str | None:
    """What the leading bytes of a CSV file say it is when it is not UTF-8 text: UTF-16, or binary data.

    UTF-16 text of ASCII characters decodes as UTF-8 (every other byte a NUL), so it is recognised here,
    before any parsing, by its byte-order mark or by NUL bytes at every other position; other NUL bytes
    mean binary data. None for anything else.
    """
    for mark, hexes in _UTF16_MARKS.items():
        if head.startswith(mark):
            return f"is UTF-16 text (byte-order mark {hexes}), not UTF-8; {_REMEDY.format('UTF-16')}"
    if b"\0" not in head:
        return None
    even, odd = head[0::2].count(0), head[1::2].count(0)
    if max(even, odd) > 0.3 * len(head) / 2 and min(even, odd) == 0:
        order = "BE" if even else "LE"
        return (
            f"looks like UTF-16{order} text (no byte-order mark: a NUL byte in every other position), not UTF-8; "
            + _REMEDY.format(f"UTF-16{order}")
        )
    first = head.index(b"\0")
    return (
        f"is not a text CSV file: it holds binary data (byte 0x00 at offset {first:,}{where}); "
        "expected .npz, .csv or .csv.gz"
    )


def _header(first: list[str], header: str, file: Path) -> list[str] | None:
    if header == "no":
        return None
    if header == "yes":
        return _checked_names(first, file)
    try:
        values = [float(v) for v in first]
    except ValueError:
        return _checked_names(first, file)
    width = len(values)
    if values in ([float(k) for k in range(width)], [float(k + 1) for k in range(width)]):
        raise ValueError(
            f"--data: the first row of {file} ({','.join(first)}) looks like column numbers; say whether it is a "
            "header (--header yes) or data (--header no)"
        )
    return None


def _checked_names(first: list[str], file: Path) -> list[str]:
    names = [v.strip() for v in first]
    if any(not n for n in names):
        raise ValueError(f"--data: the header of {file} has an empty column name (column {names.index('')})")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--data: the header of {file} repeats column name(s) {', '.join(map(repr, duplicates))}")
    return names


def _target_column(target: str, names: list[str] | None, width: int, file: Path) -> int:
    if names is not None and target in names:
        return names.index(target)
    try:
        index = int(target)
    except ValueError:
        listed = f"its columns: {', '.join(names)}" if names is not None else "it has no header"
        raise ValueError(f"--target: {target!r} is not a column of {file} ({listed})") from None
    if not -width <= index < width:
        raise ValueError(
            f"--target: column index {index} is out of range; {file} has {width} columns (0..{width - 1}, "
            "or -1 for the last)"
        )
    return index % width


def align_features(data: Data, model_names: np.ndarray | None, n_features: int) -> tuple[Data, str | None]:
    """Pick the model's feature columns from ``data``: by name when both have names, else by position.

    Returns the aligned data and, if the columns were taken by position although the model knows
    names, a note for the user.
    """
    X = data.X
    if X.ndim != 2:
        raise ValueError(f"--data: expected a 2-D table of features in {data.path}, got shape {X.shape}")
    if model_names is not None and data.names is not None:
        wanted = [str(n) for n in model_names]
        missing = [n for n in wanted if n not in data.names]
        if missing:
            raise ValueError(
                f"--data: {data.path} lacks the model's feature column(s) {', '.join(map(repr, missing))} "
                f"(its columns: {', '.join(data.names)})"
            )
        index = [data.names.index(n) for n in wanted]
        ignored = [n for n in data.names if n not in wanted]
        aligned = Data(X[:, index], data.y, wanted, data.target, data.path, ignored)
        return aligned, None
    if X.shape[1] != n_features:
        hint = ""
        if X.shape[1] == n_features + 1 and data.y is None:
            hint = "; if one of them is the target, name it with --target"
        raise ValueError(
            f"--data: {data.path} has {X.shape[1]} feature column(s) but the model expects {n_features}{hint}"
        )
    note = None
    if model_names is not None:
        note = (
            f"{data.path} has no column names; taking its {n_features} columns by position as the model's "
            f"features {', '.join(map(str, model_names))}"
        )
    return data, note
