"""The model file format: plain tensors and values, loadable with ``torch.load(weights_only=True)``.

This module knows the container (format tag, version, checksum, how to read and write it), not
the estimators: :meth:`kgp.KernelRegressor.save` builds the contents and :func:`kgp.load` checks
and rebuilds the estimator from them.

Every problem with a file's contents is a :class:`ModelFileError` (a ValueError) with one line
naming the file and what is wrong: empty, truncated or foreign files, files holding Python objects
(never unpickled: ``torch.load(weights_only=True)`` refuses them and kgp says so without torch's
advice to disable that protection), unsupported versions, and contents changed after saving
(format version 2 and later store a SHA-256 over every tensor and value).

Writes are atomic (:func:`atomic_write`): the file is written beside its destination under a
temporary name, flushed to disk, then renamed over the destination. An interrupted or failed save
leaves the previous file as it was and no temporary file behind, and a process reading the file
while another re-saves it gets the old model or the new one, never a part of either (in-place writes
lose the previous file to a Ctrl-C in 2 of 5 tries and give concurrent readers an empty file on 17-23%
of loads).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import secrets
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ModelFileError",
    "atomic_write",
    "checksum",
    "one_line",
    "read_model",
    "to_device",
    "write_model",
]

FORMAT = "kgp-model"
# 2: adds "checksum"; 3: the Posterior layout (kgp.models.persistence); 4: the Nystrom variance's two factors in
# one array (kgp.variance.nystrom.NystromFactors). Versions 1-3 still read.
FORMAT_VERSION = 4
_READABLE = (1, 2, 3, 4)


class ModelFileError(ValueError):
    """A model file that cannot be used: empty, truncated, foreign, tampered with or inconsistent."""


_BLOCK_BYTES = 16 * 2**20
"""Bytes per block of a large tensor's hash in format version 4 (:func:`checksum`): a few hundred blocks share
the threads at 1 GB, and a block's SHA-256 call (~20 ms) dwarfs the thread pool's overhead."""


def checksum(contents: dict[str, Any]) -> str:
    """SHA-256 over every tensor (dtype, shape, bytes) and plain value of ``contents``, keys sorted.

    Detects bytes changed after saving (a flipped bit, an edited value); it is not a signature:
    whoever can write the file can recompute it, which is why :func:`kgp.load` also validates the
    contents themselves.

    From format version 4 (``contents["format_version"]``), a tensor larger than 16 MiB enters the hash as
    the SHA-256 digests of its 16 MiB blocks, computed on torch's threads at once (the hash releases the
    interpreter lock): the checksum of a 1.35 GB model file took 1.9 s on one thread of a 2-core host
    (docs/benchmarks/large-data.md, "Serving the 1e7 model"). Versions 2 and 3 hash every byte in one stream.
    """
    version = contents.get("format_version")
    blocked = isinstance(version, int) and not isinstance(version, bool) and version >= 4
    tokens = list(_tokens({k: v for k, v in contents.items() if k != "checksum"}))
    large = [t for t in tokens if blocked and not isinstance(t, bytes) and t.nbytes > _BLOCK_BYTES]
    blocks = dict(zip(map(id, large), _block_digests(large)))
    digest = hashlib.sha256()
    for token in tokens:
        digest.update(blocks.get(id(token), token))
    return ("sha256-blocks:" if blocked else "sha256:") + digest.hexdigest()


def _block_digests(buffers: list[memoryview]) -> list[bytes]:
    """Per buffer: the concatenated SHA-256 digests of its ``_BLOCK_BYTES`` blocks, hashed on torch's threads."""
    if not buffers:
        return []
    jobs = [(i, start) for i, buffer in enumerate(buffers) for start in range(0, buffer.nbytes, _BLOCK_BYTES)]

    def block(job: tuple[int, int]) -> bytes:
        i, start = job
        return hashlib.sha256(buffers[i][start : start + _BLOCK_BYTES]).digest()

    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        digests = list(pool.map(block, jobs))
    out: list[list[bytes]] = [[] for _ in buffers]
    for (i, _), d in zip(jobs, digests):
        out[i].append(d)
    return [b"".join(parts) for parts in out]


def _tokens(value: Any) -> Iterator[bytes | memoryview]:
    """The byte strings the checksum hashes, in order: tags and plain values as bytes, tensors' bytes as views."""
    if torch.is_tensor(value):
        flat = value.detach().cpu().contiguous().reshape(-1)
        yield f"T{flat.dtype}{tuple(value.shape)}".encode()
        # the buffer itself, not a copy
        yield memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""
    elif isinstance(value, dict):
        yield f"D{len(value)}".encode()
        for key in sorted(value, key=repr):
            yield from _tokens(key)
            yield from _tokens(value[key])
    elif isinstance(value, (list, tuple)):
        yield f"{type(value).__name__[0]}{len(value)}".encode()
        for item in value:
            yield from _tokens(item)
    elif isinstance(value, np.ndarray):
        yield from _tokens(
            torch.from_numpy(np.ascontiguousarray(value)) if value.dtype.kind in "biuf" else value.tolist()
        )
    elif isinstance(value, np.generic):
        yield from _tokens(value.item())
    elif value is None or isinstance(value, (bool, int, float, str)):
        yield f"{type(value).__name__}:{value!r};".encode()
    else:
        raise TypeError(f"model file contents: {type(value).__name__} is not a tensor or plain value")


def write_model(contents: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``contents`` (tensors and plain values only) with the format tag, version and checksum.

    Atomic (:func:`atomic_write`): ``path`` holds the previous file or the complete new one.
    """
    full = {"format": FORMAT, "format_version": FORMAT_VERSION, **contents}
    full["checksum"] = checksum(full)
    atomic_write(path, lambda fh: torch.save(full, fh))


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """Call ``write(fh)`` on a new file beside ``path``, flush it to disk, then rename it over ``path``.

    The rename (``os.replace``) is atomic on POSIX and Windows file systems: readers see the old file
    or the new one. The file gets the permissions an ordinary new file would (the umask's), or those
    of the file it replaces; a symbolic link at ``path`` keeps pointing where it did and its target is
    replaced. On any exception, ``KeyboardInterrupt`` included, the temporary file is removed and
    ``path`` is untouched.

    A failure of the file system (a full disk, a quota, an I/O error, a read-only folder) is raised as
    the ``OSError`` of its ``errno`` (``str``: ``[Errno 28] No space left on device: 'PATH'``) naming
    ``path``, never as the serialiser's own error: ``torch.save`` turns a failed write into
    ``RuntimeError: [enforce fail at inline_container.cc:672] unexpected pos 16128 vs 16080``,
    so every write goes through a recorder that keeps the first ``OSError`` and that error is raised.

    Raises
    ------
    IsADirectoryError
        If ``path`` is a directory.
    FileNotFoundError
        If the folder of ``path`` does not exist.
    OSError
        If the folder is not writable, the disk is full, ...: ``errno`` and ``strerror`` those of the
        failure, ``filename`` the ``path`` given, and a note that the previous file is unchanged.
    """
    target = Path(os.path.realpath(path))  # a link's target: renaming over the link would replace the link
    if target.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{path}: the folder {folder} does not exist")
    # in the destination's folder: a rename across file systems would not be atomic
    temporary = folder / f".{target.name}.{secrets.token_hex(6)}.tmp"
    # O_EXCL: never write through someone else's file; mode 0o666 lets the umask apply as for any new file
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    created = False
    sink = None
    try:
        fd = os.open(temporary, flags, 0o666)
        created = True
        fh = os.fdopen(fd, "wb")
        try:
            sink = _RecordingWriter(fh)
            try:
                write(sink)
            except Exception as exc:
                if sink.error is None or sink.error is exc:
                    raise
                raise sink.error from None  # the failed write, not the serialiser's report of it
            if sink.error is not None:  # a serialiser that swallowed the failed write
                raise sink.error
            sink.flush()
            os.fsync(fh.fileno())  # the data is on disk before the name points at it
        except BaseException:
            with contextlib.suppress(OSError):  # closing flushes what is buffered: on a full disk, fails again
                fh.close()
            raise
        fh.close()
        with contextlib.suppress(FileNotFoundError):
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temporary, target)
    except BaseException as exc:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        if isinstance(exc, OSError) and exc.errno is not None:
            written = 0 if sink is None else sink.written
            raise _naming(exc, path, replaced=target.exists(), written=written) from None
        raise
    _sync_folder(folder)


class _RecordingWriter:
    """A binary file's ``write`` and ``flush`` that keep the first ``OSError`` they raise (and count bytes).

    ``torch.save`` calls ``write`` from C++ and may report a failed write as its own ``RuntimeError``
    (``unexpected pos``); :func:`atomic_write` raises the recorded error instead.
    """

    def __init__(self, fh: IO[bytes]):
        self._fh = fh
        self.error: OSError | None = None
        self.written = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):  # a raw file may write part (a disk filling up): write the rest
                n = self._fh.write(view[done:])
                if n is None:  # a buffered file takes everything or raises
                    done = len(view)
                elif n == 0:  # (a full disk raises ENOSPC instead): never loop on it
                    raise OSError(errno.EIO, f"the file system took 0 of {len(view) - done:,} bytes")
                else:
                    done += n
        except OSError as exc:
            self.error = self.error or exc
            self.written += done
            raise
        self.written += done
        return done

    def flush(self) -> None:
        try:
            self._fh.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # mode, name, closed, ... of the file
        return getattr(self._fh, name)


def _naming(exc: OSError, path: Any, *, replaced: bool, written: int) -> OSError:
    """``exc``'s errno and strerror with ``path`` (not the temporary file) as its file name, and a note."""
    strerror = exc.strerror or os.strerror(exc.errno)
    out = OSError(exc.errno, strerror, os.fspath(path))  # OSError(errno.EACCES, ...) is a PermissionError
    what = "the previous file is unchanged" if replaced else "nothing was written there"
    after = f" after {written:,} bytes" if written else ""
    out.add_note(f"kgp: saving {os.fspath(path)} failed{after} ({strerror.lower()}); {what}")
    return out


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entry for the renamed file (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_model(path: str | os.PathLike) -> dict[str, Any]:
    """Read a model file written by :func:`write_model`; no code in the file is ever executed.

    Raises
    ------
    FileNotFoundError
        If there is no such file.
    ModelFileError
        If the file is empty, unreadable, not a kgp model file, of an unsupported format version,
        or its checksum does not match its contents.
    """
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if file.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a model file")
    info = file.stat()
    if not stat.S_ISREG(info.st_mode):
        # never opened: reading a FIFO blocks until a writer comes, and a device may never end
        raise ModelFileError(
            f"{path}: not a regular file but {_file_kind(info.st_mode)}; a model file is a file that kgp saved "
            "(a zip archive read by seeking, never a stream): save the model to a file and give its path"
        )
    if info.st_size == 0:
        raise ModelFileError(f"{path}: empty file, not a kgp model file")
    # one open file for every read below: a save that renames a new file over the path meanwhile (kgp's own,
    # atomic) must not give the size check one file and torch another
    with open(file, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":  # torch.save writes a zip archive; anything else is someone else's file
            raise ModelFileError(f"{path}: not a kgp model file (not a torch zip archive)")
        _check_declared_sizes(fh, path)
        fh.seek(0)
        state = _load_archive(fh, path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ModelFileError(f"{path}: not a kgp model file (no '{FORMAT}' format tag)")
    version = state.get("format_version")
    if version not in _READABLE:
        raise ModelFileError(
            f"{path}: model format version {version!r} is not supported "
            f"(this kgp reads versions {', '.join(map(str, _READABLE))})"
        )
    if version >= 2:
        try:
            expected = checksum(state)
        except TypeError as exc:
            raise ModelFileError(f"{path}: {exc}") from None
        if state.get("checksum") != expected:
            raise ModelFileError(
                f"{path}: checksum mismatch: the file was changed or corrupted after it was saved; refit and save again"
            )
    return state


_OPEN_FILE_PATH = "/proc/self/fd/{}"
"""A name of an open file descriptor (Linux); where it does not exist the archive is read, not mapped."""


def _load_archive(fh: IO[bytes], path: Any) -> Any:
    """``torch.load`` of the open model file ``fh``, tensors only, its errors as :class:`ModelFileError`.

    Mapped where the open file has a path of its own (``/proc/self/fd``, Linux): torch maps a file by name, and
    that name reopens the file ``fh`` holds whatever has been renamed over ``path`` since. Mapping, then copying
    every tensor (:func:`_copied`), reads 2.7 GB in 0.95 s against 2.2 s through torch's reads of the records,
    and no tensor stays backed by the file, which another program may rewrite in place while the model is in
    use. Elsewhere torch reads the open file.
    """
    same_file = Path(_OPEN_FILE_PATH.format(fh.fileno()))
    mapped = same_file.exists()
    try:
        if mapped:
            state = torch.load(same_file, map_location="cpu", weights_only=True, mmap=True)
        else:
            state = torch.load(fh, map_location="cpu", weights_only=True)  # already in memory of its own
    except pickle.UnpicklingError:
        # torch's message suggests weights_only=False, i.e. running the file's code: never pass that on
        raise ModelFileError(
            f"{path}: refused: the file holds Python objects other than tensors and plain values (possibly code); "
            "kgp model files never do, and kgp never unpickles them"
        ) from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, OSError, ... for damaged archives
        raise ModelFileError(
            f"{path}: cannot be read as a kgp model file: not one, or truncated or corrupted "
            f"({type(exc).__name__}: {one_line(exc)})"
        ) from None
    # outside the handlers above: a file nested too deeply fails here with RecursionError (kgp.load names it)
    return _copied(state) if mapped else state


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it copied into memory of its own (dicts, lists and tuples rebuilt)."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_copied(item) for item in value)
    return value


def _file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words (``stat``'s file type)."""
    kinds = [
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((name for test, name in kinds if test(mode)), "a special file")


# torch.save stores every entry uncompressed; an entry that inflates more than this is no kgp file's
_MAX_INFLATION = 16
# entries a model file holds: one per tensor storage plus a few records (a few dozen in practice)
_MAX_ENTRIES = 100_000


def _check_declared_sizes(file: IO[bytes], path: Any) -> None:
    """Refuse an archive whose entries declare more bytes than a kgp model file can hold, before reading them.

    ``torch.save`` stores every entry uncompressed, so an entry's declared size equals its stored size and
    the entries together are no larger than the file. A compressed entry that inflates many times over (a
    zip bomb: a 1.5 MB file whose entries decompress to gigabytes) is refused from the sizes the central
    directory declares, as is an archive that would decompress to more than the machine's available
    memory (:func:`kgp.safeguards.available_memory`), before ``torch.load`` reads any entry.
    """
    import zipfile

    from .safeguards import available_memory, format_bytes

    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise ModelFileError(
            f"{path}: cannot be read as a kgp model file: not one, or truncated or corrupted "
            f"({type(exc).__name__}: {one_line(exc)})"
        ) from None
    if len(entries) > _MAX_ENTRIES:
        raise ModelFileError(f"{path}: not a kgp model file: its archive lists {len(entries):,} entries")
    declared = 0
    for entry in entries:
        declared += entry.file_size
        if entry.file_size > _MAX_INFLATION * entry.compress_size + 4096:
            raise ModelFileError(
                f"{path}: refused: archive entry {entry.filename!r} declares {format_bytes(entry.file_size)} "
                f"({entry.file_size:,} bytes) from {entry.compress_size:,} stored bytes; kgp model files store "
                "their entries uncompressed, so this is not one (a decompression bomb?), and nothing was read"
            )
    available = available_memory()
    if available is not None and declared > available:
        raise ModelFileError(
            f"{path}: refused: its entries declare {format_bytes(declared)} ({declared:,} bytes), more than the "
            f"available memory ({format_bytes(available)}); nothing was read"
        )


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (at most 300 characters), never torch's weights_only advice."""
    line = " ".join(str(exc).split()) or "no details"
    if "weights_only" in line:
        return "unsupported contents"
    return line if len(line) <= 300 else line[:297] + "..."


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Move every tensor inside nested dicts / lists to ``device``; floating ones also to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(device=device, dtype=dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value
