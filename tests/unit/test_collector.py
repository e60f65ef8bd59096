"""The daemon's garbage collection: what outlives a full collection is frozen (no later one
walks it), and frozen cycles are reclaimed every interval. These tests change the test
process's own collector and give it back as it was."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from kvpool_sidecar.collector import Collector, suits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Node:
    """An object that can be part of a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def collector(clock: Clock) -> Iterator[Collector]:
    c = Collector(60.0, clock=clock)
    c.start()
    try:
        yield c
    finally:
        c.stop()
        gc.collect()


def cycle() -> weakref.ref[Node]:
    """A cycle of two nodes that nothing else holds; a weak reference to one of them."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_what_is_alive_at_start_is_frozen_and_given_back_at_stop(clock: Clock) -> None:
    c = Collector(60.0, clock=clock)
    c.start()
    try:
        assert gc.get_freeze_count() > 1000  # (the test process's own modules, at least)
        assert c._observe in gc.callbacks  # noqa: SLF001
    finally:
        c.stop()
    assert gc.get_freeze_count() == 0
    assert c._observe not in gc.callbacks  # noqa: SLF001


def test_the_survivors_of_a_full_collection_are_frozen_as_it_ends(collector: Collector) -> None:
    frozen = gc.get_freeze_count()
    kept = [Node() for _ in range(5000)]
    collector.tick()  # (the reclaim is not due: a tick freezes nothing)
    # (<=: the count falls as frozen objects die, two of an earlier test's in a CI run)
    assert gc.get_freeze_count() <= frozen
    gc.collect(1)  # a younger generation's collection freezes nothing
    assert gc.get_freeze_count() <= frozen
    frozen = gc.get_freeze_count()
    gc.collect()
    assert gc.get_freeze_count() >= frozen + len(kept)
    assert collector.full_collections == 1


def test_garbage_made_after_a_full_collection_is_not_frozen_with_its_survivors(collector: Collector) -> None:
    gc.collect()
    ref = cycle()  # garbage from birth, after the collection that froze the survivors
    frozen = gc.get_freeze_count()
    collector.tick()
    assert gc.get_freeze_count() <= frozen
    gc.collect()
    assert ref() is None


def test_a_young_cycle_is_collected_as_ever(collector: Collector) -> None:
    ref = cycle()
    gc.collect()
    assert ref() is None


def test_a_frozen_cycle_waits_for_the_reclaim(collector: Collector, clock: Clock) -> None:
    ref = cycle()
    node = ref()
    assert node is not None
    gc.collect()  # survives (still held here), and is frozen as the collection ends
    del node  # now garbage, in a cycle
    gc.collect()
    assert ref() is not None  # frozen: not walked
    clock.now += 59.0
    collector.tick()
    assert ref() is not None and collector.reclaims == 0
    clock.now += 1.0
    collector.tick()
    assert ref() is None
    assert collector.reclaims == 1
    assert gc.get_freeze_count() > 1000  # frozen again once reclaimed


def test_an_interval_of_zero_never_reclaims(clock: Clock) -> None:
    c = Collector(0.0, clock=clock)
    c.start()
    try:
        ref = cycle()
        node = ref()
        gc.collect()
        del node
        clock.now += 1e9
        c.tick()
        gc.collect()
        assert ref() is not None and c.reclaims == 0
    finally:
        c.stop()
    gc.collect()
    assert ref() is None  # thawed at stop: collected as ever


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        Collector(-1.0)


@pytest.mark.parametrize("interval", [float("nan"), float("inf")])
def test_an_interval_that_is_no_finite_number_is_refused(interval: float) -> None:
    """``nan`` had been taken, and no reclaim was ever due (``now - last >= nan`` is false)."""
    with pytest.raises(ValueError, match="finite number of seconds"):
        Collector(interval)


def test_freezing_suits_uvloop_and_not_asyncios_own_loop() -> None:
    uvloop = pytest.importorskip("uvloop")
    own = asyncio.new_event_loop()
    uv = uvloop.new_event_loop()
    try:
        assert suits(uv) and not suits(own)
    finally:
        own.close()
        uv.close()



def test_a_reclaim_that_python_did_not_run_is_tried_again(collector: Collector, clock: Clock,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """(A collection another thread is running makes ``gc.collect`` here do nothing.)"""
    monkeypatch.setattr(gc, "collect", lambda *args: 0)
    clock.now += 60.0
    collector.tick()
    assert collector.reclaims == 0
    assert gc.get_freeze_count() > 1000  # frozen again
    monkeypatch.undo()
    collector.tick()
    assert collector.reclaims == 1
