"""Data-parallel fitting on ``torch.distributed``: row shards, the collectives kgp needs, failure handling.

Each rank of an initialised process group holds its own rows of X and y (a *shard*); a fit with
``fit(X_local, y_local, distributed=True)`` fits the model of the concatenated rows. kgp needs only
these collectives (docs/scaling-out.md), all built on all-reduce and broadcast:

* **sum of partial results** (:meth:`Shard.all_reduce_`): every kernel pass over the data
  (``K^T u``, ``K^T (K v + w)``) computes its ``M x k`` partial sum on the local rows; the sums are
  added across ranks in the dtype they were accumulated in (float64 for FALKON's float32 passes);
* **broadcast** (:meth:`Shard.broadcast_`): the seed, and replicated results that turned out
  different on some rank (:meth:`Shard.replicate_`);
* **agreement** (:meth:`Shard.any`): a stop request of one rank's callback stops every rank;
* **shard bookkeeping** (:func:`shard_rows`): the global n and each rank's row offset, from the
  local row counts (one all-gather of a few integers);
* **agreement on the fit** (:func:`agree`): one SHA-256 digest per rank of a canonical description
  of the estimator (parameters, resolved plan, derived sizes), compared before the first collective
  whose size or meaning depends on them; on a mismatch every rank raises the same ``ValueError``
  naming the parameter and each rank's value.

Why explicit (``distributed=True``) and not automatic inside an initialised group: kgp cannot tell
whether ``X`` on each rank is a shard or a full replica (a group initialised for something else,
e.g. a network trained with DDP, with the same data on every rank). Treating replicas as shards
fits a silently wrong model (every row counted ``world_size`` times, so the regularisation is off by
that factor), and a rank that fits its own model (a hyperparameter search spread over ranks) would
wait forever for the others. The caller knows how its data are laid out; kgp asks.

Failures are bounded in time: collectives are issued asynchronously and polled. A rank whose fit
raises records ``"rank r: TypeName: message"`` in the group's key-value store; the other ranks see it
within tens of milliseconds while waiting and raise :class:`RankFailedError` quoting it. A rank that dies
breaks the group's connections, which the waiting ranks report as :class:`DistributedError`. A rank
that hangs makes the others raise after ``kgp.settings.distributed_timeout`` seconds. After any of
these the process group cannot be used again (torch's rule after a failed collective): destroy it.

Why one module of about 560 lines: the shard, its channel's timeouts and failure detection, the
collectives, the agreement check and ``differentiable_sum`` share one failure model (a dead rank must
surface as :class:`RankFailedError` from any of them), and splitting them would spread that contract
over modules; the progress monitor of a distributed fit lives in :mod:`kgp.distributed_monitor`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import pickle
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import settings

__all__ = [
    "DistributedError",
    "RankFailedError",
    "Shard",
    "agree",
    "is_initialized",
    "resolve_group",
    "shard_rows",
]

_FIT_COUNTER = itertools.count()
# polling of an outstanding collective: the first checks are fast and local (a pass's all-reduce is
# usually done by then); the key-value store (on rank 0's process, shared by all ranks) is asked only
# once a wait exceeds _STORE_AFTER, then every _MAX_POLL seconds at most
_FIRST_POLL = 5e-5
_STORE_AFTER = 1e-3
_MAX_POLL = 2e-2
# a failure record found while a collective is still outstanding: how long the collective may take to
# complete before this rank gives up on it. A peer that raised *after* the collective (a check every rank
# repeats on the gathered values) recorded its error while this rank's completion was still in flight
# (seen in CI: "rank 1 was waiting in gathering labels"); this rank then raises its own error instead.
_GRACE = 0.25


class DistributedError(RuntimeError):
    """A collective of a distributed fit failed or timed out (a rank died, hung, or the group broke)."""


class RankFailedError(DistributedError):
    """Another rank's fit raised; the message quotes that rank's exception."""


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is available and a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def resolve_group(distributed: Any) -> Any | None:
    """The process group a ``distributed=`` argument names: None for a local fit.

    Parameters
    ----------
    distributed:
        ``False`` / ``None``: local fit. ``True``: the default group. A ``ProcessGroup``: that group.

    Raises
    ------
    ValueError
        ``True`` or a group without an initialised ``torch.distributed``.
    TypeError
        Anything else.
    """
    if distributed is None or distributed is False:
        return None
    if distributed is not True and not (dist.is_available() and isinstance(distributed, dist.ProcessGroup)):
        raise TypeError(
            f"distributed: expected True, False or a torch.distributed ProcessGroup, got {type(distributed).__name__}"
        )
    if not is_initialized():
        raise ValueError(
            "distributed: a distributed fit needs an initialised torch.distributed process group "
            "(launch with torchrun and call torch.distributed.init_process_group first)"
        )
    return dist.group.WORLD if distributed is True else distributed


class _Channel:
    """Collectives of one distributed fit on one process group, with bounded-time waits."""

    def __init__(self, group: Any, timeout: float):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = float(timeout)
        # every rank calls fit the same number of times, so the counter names the same fit everywhere
        self.key = f"kgp/fit{next(_FIT_COUNTER)}/error"
        try:
            self.store = dist.distributed_c10d._get_process_group_store(group)
        except Exception:  # private API: without a store, failures are still bounded by the timeout
            self.store = None

    # ---------------------------------------------------------------- failure records
    def record_failure(self, exc: BaseException) -> None:
        """Tell the other ranks that this rank's fit raised ``exc`` (best effort)."""
        if self.store is None or isinstance(exc, DistributedError):
            return
        with contextlib.suppress(Exception):
            self.store.set(self.key, f"rank {self.rank}: {type(exc).__name__}: {exc}")

    def _failure(self) -> str | None:
        if self.store is None:
            return None
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode()
        except Exception:  # the store lives on rank 0's process: gone if that rank died
            return "the key-value store is unreachable (the rank hosting it may have died)"
        return None

    def wait(self, work: Any, what: str) -> None:
        """Wait for an asynchronous collective; raise instead of hanging when another rank failed."""
        deadline = time.monotonic() + self.timeout
        delay = _FIRST_POLL
        while not work.is_completed():
            failure = self._failure() if delay >= _STORE_AFTER else None
            if failure is not None and not _completes_within(work, _GRACE):
                raise RankFailedError(f"distributed fit: {failure} (rank {self.rank} was waiting in {what})")
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"distributed fit: rank {self.rank} waited {self.timeout:g} s in {what} "
                    "(kgp.settings.distributed_timeout); another rank hung or fell behind"
                )
            time.sleep(delay)
            delay = min(2 * delay, _MAX_POLL)
        try:
            work.wait()
        except Exception as exc:
            failure = self._failure()
            if failure is not None:
                raise RankFailedError(f"distributed fit: {failure} (rank {self.rank} was waiting in {what})") from exc
            raise DistributedError(
                f"distributed fit: {what} failed on rank {self.rank} ({exc}); another rank may have died"
            ) from exc


def _completes_within(work: Any, seconds: float) -> bool:
    """Whether the outstanding collective ``work`` completes within ``seconds`` (polled)."""
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(_FIRST_POLL)
    return True


@dataclass(frozen=True)
class Shard:
    """This rank's part of a row-sharded data set, and the collectives over its process group.

    Attributes
    ----------
    counts:
        Rows held by each rank, in rank order (the global row order is rank 0's rows, then rank 1's...).
    rank, world_size:
        This rank in the group, and the group's size.
    """

    channel: _Channel
    counts: tuple[int, ...]

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def world_size(self) -> int:
        return self.channel.world_size

    @property
    def n_local(self) -> int:
        """Rows on this rank."""
        return self.counts[self.rank]

    @property
    def n_total(self) -> int:
        """Rows on all ranks: the n of the global problem."""
        return sum(self.counts)

    @property
    def offset(self) -> int:
        """Global index of this rank's first row."""
        return sum(self.counts[: self.rank])

    def all_reduce_(self, t: Tensor) -> Tensor:
        """Sum ``t`` over ranks in place, in ``t``'s dtype (pass partial sums in the accumulation dtype)."""
        if self.world_size > 1:
            work = dist.all_reduce(t, group=self.channel.group, async_op=True)
            self.channel.wait(work, f"all_reduce {tuple(t.shape)}")
        return t

    def broadcast_(self, t: Tensor, src: int = 0) -> Tensor:
        """Overwrite ``t`` with rank ``src``'s ``t`` (group rank)."""
        if self.world_size > 1:
            group = self.channel.group
            src_global = src if group is dist.group.WORLD else dist.get_global_rank(group, src)
            work = dist.broadcast(t, src=src_global, group=self.channel.group, async_op=True)
            self.channel.wait(work, f"broadcast {tuple(t.shape)}")
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on some rank (e.g. a callback asked to stop)."""
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self._device())
        return bool(self.all_reduce_(t).item() > 0)

    def gather_rows(self, values: Sequence[float]) -> Tensor:
        """``world_size x len(values)`` float64 table of every rank's ``values`` (small bookkeeping only)."""
        return _gather_rows(self.channel, values, self._device())

    def identical(self, tensors: Sequence[Tensor]) -> bool:
        """Whether ``tensors`` hold the same bits on every rank (checksums of their words, compared)."""
        sums = [float(x) for t in tensors for x in (t.numel(), *_checksum(t))]
        table = self.gather_rows(sums)
        return bool((table == table[0]).all())

    def replicate_(self, tensors: Sequence[Tensor]) -> bool:
        """Make replicated results identical: verify by checksum, broadcast from rank 0 if they differ.

        Returns whether a broadcast was needed. Replicated ``M x M`` work (the same deterministic
        factorization on every rank) is normally bitwise identical; different BLAS thread counts or
        CPUs can change the last bits, and then the fitted models would differ in rounding.
        """
        if self.world_size == 1 or self.identical(tensors):
            return False
        for t in tensors:
            if t.is_contiguous():
                self.broadcast_(t)
            else:  # LAPACK factors are column-major views: a contiguous copy travels and is written back
                c = t.contiguous()
                self.broadcast_(c)
                t.copy_(c)
        return True

    def sum_floats(self, *values: float) -> list[float]:
        """Sums over ranks of a few Python numbers (one float64 all-reduce): global losses and counts."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device())
        return [float(v) for v in self.all_reduce_(t).tolist()]

    def local_rows(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Which of the global row numbers ``idx`` this rank holds.

        Returns ``(positions, rows)``: the positions in ``idx`` of the rows held here (ascending) and
        their row numbers in this rank's ``X``. Every rank drawing the same ``idx`` from the shared
        seed and taking its own rows is how a minibatch or a row sample of the global data is split.
        """
        local = idx - self.offset
        mine = (local >= 0) & (local < self.n_local)
        positions = mine.nonzero().reshape(-1)
        return positions, local[positions]

    def take_rows(self, X: Tensor, idx: Tensor) -> Tensor:
        """Rows ``idx`` (global row numbers) of the global X on every rank: ``len(idx) x d``, one all-reduce.

        Each rank fills in the rows it holds and zeros elsewhere, so the sum is exact (no rounding):
        use it for small samples (centers, a few hundred rows for an estimate), never for the data.
        """
        out = torch.zeros(idx.numel(), *X.shape[1:], dtype=X.dtype, device=X.device)
        positions, rows = self.local_rows(idx.to(X.device))
        out[positions] = X[rows]
        return self.all_reduce_(out)

    def _device(self) -> torch.device:
        return _device_for(self.channel.group)


def _device_for(group: Any) -> torch.device:
    # NCCL collectives need CUDA tensors; gloo takes CPU ones
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checksum(t: Tensor) -> tuple[int, int]:
    """Two order-independent sums of ``t``'s machine words (wrapping integer arithmetic)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0, 0
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()]
    words = flat.view(word).to(torch.int64)
    # float64 cannot hold an int64 exactly: report the sums modulo 2**52 (still bit-sensitive)
    mask = (1 << 52) - 1
    return int(words.sum()) & mask, int((words * words).sum()) & mask


def _gather_rows(channel: _Channel, values: Sequence[float], device: torch.device) -> Tensor:
    table = torch.zeros(channel.world_size, len(values), dtype=torch.float64, device=device)
    table[channel.rank] = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if channel.world_size > 1:
        channel.wait(dist.all_reduce(table, group=channel.group, async_op=True), "shard bookkeeping")
    return table


def differentiable_sum(shard: Shard, compute: Any, inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The tensors ``compute()`` returns, summed over the ranks, differentiable w.r.t. ``inputs``.

    For losses that are replicated functions of row sums, ``f(theta, sum_r s_r(theta))`` (the SGPR
    bound: ``K_nM^T K_nM``, ``K_nM^T r``, ``r^T r``, ``tr K_nn``): every rank computes ``f`` on the
    summed values, and the gradient ``df/dtheta`` must include every rank's ``ds_r/dtheta``. The
    backward pass therefore computes this rank's vector-Jacobian product ``(ds_r/dtheta)^T g`` and
    all-reduces it (one collective, flattened), so that ``loss.backward()`` leaves the full, identical
    gradient on every rank. (A plain all-reduce in the graph would leave each rank with its own rows'
    part only; summing the parameters' gradients afterwards would count the replicated terms of
    ``f`` ``world_size`` times.)

    Parameters
    ----------
    shard:
        The fit's shard.
    compute:
        ``compute() -> tuple of tensors``: this rank's partial sums, a differentiable function of
        ``inputs`` (run with autograd on).
    inputs:
        The leaves to differentiate (those without ``requires_grad`` are ignored).
    """
    targets = [t for t in inputs if t.requires_grad]
    return _SumOverRanks.apply(shard, compute, targets, *targets)


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, compute, targets, *inputs):
        with torch.enable_grad():
            local = tuple(compute())
        ctx.shard, ctx.local, ctx.targets = shard, local, targets
        return tuple(shard.all_reduce_(t.detach().clone()) for t in local)

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(t, g) for t, g in zip(ctx.local, grads) if g is not None and t.requires_grad]
        got: Sequence[Tensor | None] = [None] * len(ctx.targets)
        if pairs and ctx.targets:
            outs, gs = zip(*pairs)
            got = torch.autograd.grad(outs, ctx.targets, gs, allow_unused=True)
        parts = [torch.zeros_like(x) if g is None else g for x, g in zip(ctx.targets, got)]
        if parts:  # every rank's part of the gradient, summed: one all-reduce
            flat = ctx.shard.all_reduce_(torch.cat([p.reshape(-1) for p in parts]))
            parts = [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in parts]), parts)]
        ctx.local = None
        return (None, None, None, *parts)


def gather_objects(channel: _Channel, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, small: a class set), in rank order, on every rank.

    Two bounded-time all-reduces: the pickled sizes, then a ``world_size x max size`` byte table
    (each rank fills its own row, zeros elsewhere, so the sum is exact). Used for values that are
    not numbers (class labels of any sortable type).
    """
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    device = _device_for(channel.group)
    sizes = [int(s) for s in _gather_rows(channel, [len(payload)], device)[:, 0].tolist()]
    table = torch.zeros(channel.world_size, max(sizes), dtype=torch.uint8, device=device)
    table[channel.rank, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    if channel.world_size > 1:
        # uint8 sums: each byte has exactly one non-zero contribution, so nothing wraps
        channel.wait(dist.all_reduce(table, group=channel.group, async_op=True), "gathering labels")
    # the ranks of one job trust each other (they already run the same code on shared data)
    return [pickle.loads(table[r, :size].cpu().numpy().tobytes()) for r, size in enumerate(sizes)]


@contextlib.contextmanager
def guarded(group: Any, timeout: float | None = None) -> Iterator[_Channel]:
    """Open the channel of one distributed fit; an exception inside is recorded for the other ranks.

    Every rank must enter it once per distributed fit, before anything that can raise (input
    validation included), so that no rank waits for one that failed.
    """
    channel = _Channel(group, settings.distributed_timeout.value() if timeout is None else timeout)
    try:
        yield channel
    except BaseException as exc:
        channel.record_failure(exc)
        raise


def shard_rows(channel: _Channel, n_local: int, **agree: float) -> Shard:
    """Exchange the local row counts (global n, offsets) and check that ``agree`` matches on every rank.

    Parameters
    ----------
    channel:
        The fit's channel (:func:`guarded`).
    n_local:
        Rows of X on this rank (0 allowed).
    **agree:
        Numbers every rank must share (number of features, outputs, ...): a mismatch
        raises ValueError on every rank, naming the ranks.

    Raises
    ------
    ValueError
        If the ranks disagree on an ``agree`` value or hold no rows at all.
    """
    names = list(agree)
    table = _gather_rows(channel, [n_local, *(agree[k] for k in names)], _device_for(channel.group))
    for j, name in enumerate(names, start=1):
        column = table[:, j]
        if not bool((column == column[0]).all()):
            per_rank = ", ".join(f"rank {r}: {_plain(v)}" for r, v in enumerate(column.tolist()))
            raise ValueError(f"distributed fit: every rank must have the same {name}, got {per_rank}")
    counts = tuple(int(c) for c in table[:, 0].tolist())
    if sum(counts) == 0:
        raise ValueError("distributed fit: X has no rows on any rank")
    return Shard(channel, counts)


def _plain(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


# ---------------------------------------------------------------------- agreement on the fit
_DIGEST_BYTES = 32  # SHA-256
_LISTED_RANKS = 8  # a value held by more ranks is named by its first ranks and a count
_SHOWN_CHARS = 120  # a longer value is shortened in the message (the comparison uses all of it)


def agree(
    channel: _Channel,
    entries: Sequence[tuple[str, str]],
    context: Sequence[tuple[str, str]] = (),
    remedy: str = "",
    derived: Collection[str] = (),
) -> None:
    """Check that every rank holds the same ``entries``; raise the same ValueError on every rank if not.

    ``entries`` is this rank's canonical description of what must agree (name, text), in the order a
    message should name a difference first (the parameters the user set before what is derived from
    them). One all-reduce of a ``world_size x 32`` byte table compares the SHA-256 digests of the
    descriptions; only when they differ are the descriptions themselves gathered (two more all-reduces)
    to name the first entry that differs, with each rank's value. Every rank reaches the same verdict
    from the same gathered values, so all raise the same message and none waits for another.

    Parameters
    ----------
    channel:
        The fit's channel (:func:`guarded`).
    entries:
        ``(name, canonical text)`` pairs; the texts are compared as strings.
    context:
        ``(name, text)`` pairs not compared, but named in the message where they differ too (the
        settings a recipe chose the differing value from).
    remedy:
        The message's last sentence (what to do).
    derived:
        Names of entries that follow from others (a resolved option, a kernel built from a parameter):
        where a given entry differs too, the message names only the given ones.

    Raises
    ------
    ValueError
        ``distributed fit: every rank must fit the same model; <name> differs: rank 0: <value>, ...``.
    """
    entries = [(str(k), str(v)) for k, v in entries]
    if channel.world_size == 1:
        return
    digest = hashlib.sha256(json.dumps(entries).encode()).digest()
    device = _device_for(channel.group)
    table = torch.zeros(channel.world_size, _DIGEST_BYTES, dtype=torch.uint8, device=device)
    table[channel.rank] = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    # uint8 sums: each byte has exactly one non-zero contribution, so nothing wraps
    channel.wait(dist.all_reduce(table, group=channel.group, async_op=True), "checking that the ranks agree")
    if bool((table == table[0]).all()):
        return
    # every rank's derived names too: the union is the same on every rank, and so is the message
    described = gather_objects(channel, (entries, [(str(k), str(v)) for k, v in context], sorted(derived)))
    union = {k for *_, names in described for k in names}
    raise ValueError(_disagreement([e for e, *_ in described], [c for _, c, _ in described], remedy, union))


def _disagreement(
    per_rank: list[list[tuple[str, str]]], context: list[list[tuple[str, str]]], remedy: str, derived: set[str]
) -> str:
    """The message naming the first entry whose value differs between ranks (the same text on every rank)."""
    tables = [dict(e) for e in per_rank]
    names = list(dict.fromkeys(k for e in per_rank for k, _ in e))
    differing = [k for k in names if len({t.get(k) for t in tables}) > 1]
    if not differing:  # the same entries in another order: name the order
        differing = ["the order of the parameters"]
        tables = [{differing[0]: ", ".join(k for k, _ in e)} for e in per_rank]
    given = [k for k in differing if k not in derived]
    differing = given or differing  # a resolved value that differs because a given one does: name the cause
    first = differing[0]
    message = f"distributed fit: every rank must fit the same model; {first} differs: {_per_rank(tables, first)}"
    if len(differing) > 1:
        more = differing[1:]
        shown = ", ".join(more[:5]) + (f" and {len(more) - 5} more" if len(more) > 5 else "")
        message += f" (also differing: {shown})"
    contexts = [dict(c) for c in context]
    for name in dict.fromkeys(k for c in context for k, _ in c):
        if len({c.get(name) for c in contexts}) > 1:
            message += f"; {name} differs too: {_per_rank(contexts, name)}"
    return f"{message}. {remedy}".rstrip()


def _per_rank(tables: list[dict[str, str]], name: str) -> str:
    """``rank 0: a, rank 1: b`` (ranks with the same value grouped: ``ranks 0, 2: a``)."""
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(tables):
        groups.setdefault(t.get(name, "(not set)"), []).append(r)
    parts = []
    for value, ranks in groups.items():
        label = ", ".join(str(r) for r in ranks[:_LISTED_RANKS])
        if len(ranks) > _LISTED_RANKS:
            label += f" and {len(ranks) - _LISTED_RANKS} more"
        shown = value
        if len(value) > _SHOWN_CHARS:  # shortened: the digest tells apart values that start alike
            shown = f"{value[: _SHOWN_CHARS - 30]}... (sha256 {hashlib.sha256(value.encode()).hexdigest()[:12]})"
        parts.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {label}: {shown}")
    return ", ".join(parts)
