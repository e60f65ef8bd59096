"""Reads skip an index that failed them, for a while (IndexWatch), alone and in PeerReader."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import pytest

from kvpool_sidecar.errors import IndexDataError, IndexUnavailableError
from kvpool_sidecar.indexwatch import IndexWatch
from kvpool_sidecar.peers import PeerReader
from tests.unit.store_support import make_store
from tests.unit.test_peers import KEYS, NODES, Index, Transport


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Ahead:
    """The monotonic clock, moved on by ``offset`` seconds (time passes as well)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def fail(watch: IndexWatch) -> None:
    with pytest.raises(IndexUnavailableError), watch.asking():
        raise IndexUnavailableError("down")


def ends_failing(read: contextlib.AbstractContextManager[None]) -> None:
    """End ``read`` (an :meth:`IndexWatch.asking` entered earlier) with the index's failure."""
    error = IndexUnavailableError("stalled")
    assert read.__exit__(type(error), error, None) is False  # (not swallowed: it goes on to the caller)


def test_a_value_no_member_writes_fails_its_read_alone() -> None:
    """A reply that is not UTF-8 (one value a writer to Redis planted under a key anyone can
    compute) is an answer: that read fails, the index is not taken for down. It had started
    the back-off for every tenant of the node, and nine reads in ten of intact blocks of a
    healthy member missed (a review: 61 of 366 hits)."""
    clock = Clock()
    w = IndexWatch(0.2, backoff_s=(0.5, 2.0), clock=clock)
    for _ in range(3):
        with pytest.raises(IndexDataError), w.asking():
            raise IndexDataError("redis index: lookup: a reply is not UTF-8")
        assert not w.skipping() and not w.down
    fail(w)
    assert w.skipping()
    clock.now += 0.51
    assert not w.skipping()
    with pytest.raises(IndexDataError), w.asking():  # (and a probe it answers ends the back-off)
        raise IndexDataError("redis index: lookup: a reply is not UTF-8")
    assert not w.down and not w.skipping()


def test_a_failure_skips_the_index_for_a_back_off_that_doubles_and_an_answer_ends_it() -> None:
    clock = Clock()
    w = IndexWatch(0.2, backoff_s=(0.5, 2.0), clock=clock)
    assert not w.skipping() and not w.down
    fail(w)
    assert w.skipping() and w.down
    clock.now += 0.49
    assert w.skipping()
    clock.now += 0.02
    assert not w.skipping()  # the back-off is over: one read asks again ...
    fail(w)  # ... and fails: twice as long now
    clock.now += 0.9
    assert w.skipping()
    clock.now += 0.2
    assert not w.skipping()
    fail(w)
    fail(w)  # (a read begun before the back-off began fails too)
    clock.now += 1.99
    assert w.skipping()  # 0.5, 1, 2, then no longer than 2
    clock.now += 0.02
    assert not w.skipping()
    with w.asking():
        pass
    assert not w.down and not w.skipping()
    fail(w)
    clock.now += 0.51
    assert not w.skipping()  # an answer set the back-off to its first length again


def test_after_a_back_off_one_read_asks_and_the_others_skip_until_it_is_answered() -> None:
    clock = Clock()
    w = IndexWatch(0.2, backoff_s=(0.5, 8.0), clock=clock)
    fail(w)
    clock.now += 1.0
    assert not w.skipping()
    with w.asking():
        assert w.skipping()  # another read, while the first one asks
    assert not w.skipping()


def test_reads_that_fail_together_are_one_failure() -> None:
    """A stall that fails the reads then in flight backs the index off once: each of them
    had doubled the back-off, and a 0.3 s stall of Redis with 8 lookups in flight had made
    every read skip the index for 8 s (a review's ``watch_concurrent.py``)."""
    clock = Clock()
    w = IndexWatch(0.2, backoff_s=(0.5, 8.0), clock=clock)
    reads = [w.asking() for _ in range(8)]
    for r in reads:  # all begun while the index answered
        r.__enter__()
    clock.now += 0.3
    for r in reads:  # and all failed by the stall
        ends_failing(r)
    clock.now += 0.51
    assert not w.skipping()  # one back-off of 0.5 s, not 8 s
    fail(w)  # the read that asks after it fails: that is a failure in a row, and doubles it
    clock.now += 0.99
    assert w.skipping()
    clock.now += 0.02
    assert not w.skipping()


def test_an_old_read_failing_while_one_probes_leaves_the_others_skipping() -> None:
    clock = Clock()
    w = IndexWatch(0.2, backoff_s=(0.5, 8.0), clock=clock)
    old = w.asking()
    old.__enter__()  # begun while the index answered
    fail(w)
    clock.now += 0.6
    assert not w.skipping()
    with w.asking():  # the probe, slow to answer
        ends_failing(old)
        clock.now += 1.5
        assert w.skipping()  # still one read asking: the others skip (the old one had let a second ask)
    assert not w.down


def test_a_timeout_counts_only_where_the_read_gave_the_index_long_enough() -> None:
    clock = Clock()
    w = IndexWatch(0.2, clock=clock)
    with pytest.raises(TimeoutError), w.asking():
        clock.now += 0.05  # (its deadline was nearly spent waiting for a turn)
        raise TimeoutError
    assert not w.down
    with pytest.raises(TimeoutError), w.asking():
        clock.now += 0.2
        raise TimeoutError
    assert w.down and w.skipping()


def test_a_cancelled_probe_lets_the_next_read_ask() -> None:
    clock = Clock()
    w = IndexWatch(0.2, clock=clock)
    fail(w)
    clock.now += 1.0
    with pytest.raises(asyncio.CancelledError), w.asking():
        raise asyncio.CancelledError
    assert not w.skipping()  # no read is asking any more: not skipped for good
    assert w.down


class Hanging(Index):
    """An index that never answers while ``hang`` is set (a stopped Redis)."""

    def __init__(self) -> None:
        super().__init__({k: ["idle@dram"] for k in KEYS}, NODES)
        self.hang = True

    async def lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        if self.hang:
            self.lookups += 1
        while self.hang:
            await asyncio.sleep(0.01)
        return await super().lookup(keys)


async def test_lookups_skip_a_stopped_index_after_it_failed_one_and_ask_again_after_the_back_off() -> None:
    """With Redis stopped, every LOOKUP of a prompt not held here had waited out the peers'
    deadline (250 ms): only the first does now, until the back-off ends."""
    idx, clock = Hanging(), Ahead()
    pr = PeerReader(make_store(), idx, Transport(), "me", fetch_timeout_s=2.0, lookup_timeout_s=0.05)
    pr.index_watch = IndexWatch(0.8 * pr.lookup_timeout_s, clock=clock)
    for _ in range(5):
        assert await pr.remote_prefix(KEYS, pr.lookup_deadline()) == 0
    assert idx.lookups == 1
    assert await pr.fetch(KEYS) == 0  # a fetch skips it too
    assert idx.lookups == 1
    clock.offset += 0.6  # the back-off (0.5 s) is over, and the index answers again
    idx.hang = False
    assert await pr.remote_prefix(KEYS, pr.lookup_deadline()) == len(KEYS)
    assert await pr.remote_prefix(KEYS, pr.lookup_deadline()) == len(KEYS)
    assert idx.lookups == 3


async def test_a_fetch_the_index_fails_backs_the_index_off_for_lookups() -> None:
    idx, clock = Index({k: ["idle@dram"] for k in KEYS}, NODES), Ahead()
    pr = PeerReader(make_store(), idx, Transport(), "me", fetch_timeout_s=2.0)
    pr.index_watch = IndexWatch(0.2, clock=clock)
    idx.down = True
    assert await pr.fetch(KEYS) == 0
    assert await pr.remote_prefix(KEYS) == 0
    assert idx.lookups == 1
    idx.down = False
    clock.offset += 0.6
    assert await pr.fetch(KEYS) == len(KEYS)
