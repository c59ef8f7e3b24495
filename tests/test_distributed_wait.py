"""``kgp.distributed._Channel.wait``: a peer's failure record against this rank's outstanding collective.

No process group: the channel's store and the collective's work handle are stand-ins with the methods
``wait`` calls, so the timing of a completion is set by the test.
"""

from __future__ import annotations

import time

import pytest

from kgp import distributed as kdist


class _Store:
    def __init__(self, record: str | None):
        self.record = record

    def check(self, keys):
        return self.record is not None

    def get(self, key):
        return self.record.encode()


class _Work:
    """Completes ``after`` seconds after creation (never, for None)."""

    def __init__(self, after: float | None):
        self.ready = None if after is None else time.monotonic() + after

    def is_completed(self) -> bool:
        return self.ready is not None and time.monotonic() >= self.ready

    def wait(self) -> None:
        pass


def _channel(record: str | None, timeout: float = 5.0) -> kdist._Channel:
    channel = object.__new__(kdist._Channel)  # the attributes wait() reads, without a process group
    channel.rank, channel.world_size, channel.timeout = 1, 2, timeout
    channel.key, channel.store, channel.group = "kgp/fit0/error", _Store(record), None
    return channel


def test_a_collective_that_completes_after_a_peer_recorded_its_error_is_not_a_failure():
    # rank 0 gathered, then raised on the gathered values and recorded it; this rank's completion lags by
    # 20 ms: it goes on (to raise the same error of its own), it does not report rank 0's
    start = time.monotonic()
    _channel("rank 0: ValueError: labels differ").wait(_Work(0.02), "gathering labels")
    assert time.monotonic() - start < kdist._GRACE + 1.0


def test_a_collective_that_does_not_complete_reports_the_peers_failure():
    start = time.monotonic()
    with pytest.raises(kdist.RankFailedError, match=r"rank 0: RuntimeError: boom .*waiting in all_reduce"):
        _channel("rank 0: RuntimeError: boom").wait(_Work(None), "all_reduce (3,)")
    # after the grace period, far before the channel's 5 s timeout
    assert kdist._GRACE <= time.monotonic() - start < 3.0


def test_without_a_failure_record_an_outstanding_collective_times_out():
    with pytest.raises(kdist.DistributedError, match="waited 0.3 s in all_reduce"):
        _channel(None, timeout=0.3).wait(_Work(None), "all_reduce (3,)")
