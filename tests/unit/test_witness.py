"""The witness of what LRU would have served: its ring of bytes per tick against a plain sum,
its LRU hits against an LRU cache simulated block by block, and the policy's use of it."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvpool_sidecar.policy import BlockMeta, PrefixAwarePolicy
from kvpool_sidecar.policy.tierstate import ghost_fields, ghost_value
from kvpool_sidecar.witness import INITIAL_SPAN, LruWitness, TickBytes


def test_tick_bytes_sum_what_each_tick_holds_within_the_window() -> None:
    rnd = random.Random(5)
    t = TickBytes(16)
    held: dict[int, int] = {}  # tick -> bytes, the plain model
    now = 0
    for _ in range(3000):
        if rnd.random() < 0.3:
            now += rnd.choice((1, 1, 2, 7, 40))
            keep = rnd.choice((0, 0, 0, 500))  # now and then, widen rather than forget
            span = t.span
            t.advance(now, keep, 64)
            assert t.span == span or (keep and span < t.span <= 64)
            held = {k: v for k, v in held.items() if now - k < t.span}
        tick = now - rnd.randrange(20)
        delta = rnd.randrange(1, 100)
        t.add(tick, delta)
        if tick >= 0 and now - tick < t.span:
            held[tick] = held.get(tick, 0) + delta
        probe = now - rnd.randrange(70)
        want = sum(v for k, v in held.items() if k > probe) if probe >= 0 and now - probe < t.span else None
        assert t.since(probe) == want, (now, probe, t.span)
        assert t.total == sum(held.values())


def test_tick_bytes_refuse_a_span_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError):
        TickBytes(1000)


def exact_lru_hits(accesses: list[tuple[int, int]], capacity: int) -> int:
    """An LRU cache of ``capacity`` bytes, block by block: its hits on ``(key, size)``."""
    cache: OrderedDict[int, int] = OrderedDict()
    used = hits = 0
    for key, size in accesses:
        if key in cache:
            hits += 1
            used -= cache.pop(key)
        cache[key] = size
        used += size
        while used > capacity:
            used -= cache.popitem(last=False)[1]
    return hits


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_witness_counts_the_hits_of_an_lru_cache_of_its_size(seed: int) -> None:
    """One block per request, every last touch known: the witness's LRU hits are an LRU
    cache's, exactly, at a capacity whose horizon is longer than the first window."""
    rnd = random.Random(seed)
    sizes = {k: rnd.choice((1, 2, 3, 8)) for k in range(3000)}
    accesses = [(int(rnd.paretovariate(0.6)) % 3000, 0) for _ in range(20000)]
    accesses = [(k, sizes[k]) for k, _ in accesses]
    capacity = 4000
    w = LruWitness()
    w.capacity, w.blocks = capacity, len(accesses)  # (its window may span every tick)
    last: dict[int, int] = {}
    lru = 0
    for tick, (key, size) in enumerate(accesses, start=1):
        w.touch(tick, b"%d" % key, None, size, last=last.get(key), hit=False)
        ahead, touches = w.settle()
        assert touches == 1
        lru += ahead
        last[key] = tick
    assert w.ticks.span > INITIAL_SPAN  # it had to widen its window to see that far
    assert lru == exact_lru_hits(accesses, capacity)


def test_a_chain_counts_for_lru_only_as_far_as_its_first_miss() -> None:
    w = LruWitness()
    w.capacity, w.blocks = 100, 100
    meta = [BlockMeta(b"k%d" % i, 1, depth=i, parent=b"k%d" % (i - 1) if i else None) for i in range(3)]
    for m in meta:  # first sight: misses
        w.touch(1, m.key, m.parent, 1, last=None, hit=False)
    w.settle()
    # the root is unknown now (say, evicted without a ghost): its children are no LRU hits
    # either, though LRU would hold them, as a lookup stops at the first miss
    w.touch(2, meta[0].key, None, 1, last=None, hit=False)
    w.touch(2, meta[1].key, meta[0].key, 1, last=1, hit=False)
    w.touch(2, meta[2].key, meta[1].key, 1, last=1, hit=False)
    assert w.settle() == (0, 3)
    # all known: three LRU hits, against the real cache's two
    for m, hit in zip(meta, (True, True, False)):
        w.touch(3, m.key, m.parent, 1, last=2, hit=hit)
    assert w.settle() == (1, 3)
    # a block whose parent was not the last one touched (another client's request came
    # between) counts on its own
    w.touch(4, meta[0].key, None, 1, last=None, hit=False)
    w.touch(4, b"other", None, 1, last=None, hit=False)
    w.touch(4, meta[1].key, meta[0].key, 1, last=3, hit=True)
    assert w.settle() == (0, 3)


def test_a_ghost_remembers_size_segment_and_last_touch() -> None:
    for size, protected, touched in ((1, 0, 0), (65536, 1, 7), ((1 << 40) - 1, 1, 1 << 45)):
        assert ghost_fields(ghost_value(size, bool(protected), touched)) == (size, protected, touched)


def test_the_policy_tells_the_witness_each_blocks_last_touch_through_demotions_and_ghosts() -> None:
    """A block's last touch is its last read or write, not its demotion; once it is gone,
    its ghost remembers it."""
    p = PrefixAwarePolicy()
    m = BlockMeta(b"blk", 10, depth=0)
    p.admit("dram", m)
    p.inserted("dram", m)
    touched = p._last_touch(b"blk")
    for _ in range(3):  # other requests
        other = BlockMeta(b"o%d" % _, 10, depth=0)
        p.admit("dram", other)
        p.inserted("dram", other)
    p.inserted("disk", m)  # demoted: a copy below, then the DRAM copy goes
    p.removed("dram", m)
    assert p._last_touch(b"blk") == touched
    p.removed("disk", m)
    assert p._last_touch(b"blk") == touched  # from a ghost
    assert p._last_touch(b"never") is None


def put(p: PrefixAwarePolicy, key: bytes, tier: str = "dram", tenant: str = "default") -> BlockMeta:
    m = BlockMeta(key, 10, tenant, depth=0)
    p.admit(tier, m)
    p.inserted(tier, m)
    return m


def clocked() -> tuple[PrefixAwarePolicy, LruWitness]:
    p = PrefixAwarePolicy()
    if p._witness is None:
        raise AssertionError("the default policy has a witness")
    return p, p._witness


def test_a_read_makes_every_copy_of_a_block_recent_and_so_does_a_write_again() -> None:
    """A block with a copy on disk read in DRAM, whose DRAM copy then goes: its last touch is
    the read, not the disk copy's older one; a write of a held block again is a touch too."""
    p, w = clocked()
    m = put(p, b"blk")
    p.inserted("disk", m)  # copied down ahead of need
    put(p, b"other")
    p.accessed("dram", m)  # a new request reads it in DRAM
    read = w.clock
    p.removed("dram", m)  # evicted from DRAM: the disk copy stays
    assert p._last_touch(b"blk") == read > 1
    put(p, b"third")
    p.bypassed("disk", m)  # written again (after a miss) while held
    assert p._last_touch(b"blk") == w.clock > read


def test_a_put_that_lands_after_another_request_began_has_no_known_last_touch() -> None:
    p, w = clocked()
    late = BlockMeta(b"late", 10, depth=0)
    p.admit("dram", late)
    put(p, b"other")  # another request begins before the first put lands
    p.inserted("dram", late)
    assert p._last_touch(b"late") is None and p._last_touch(b"other") == w.clock


def test_a_tenant_with_a_quota_neither_ticks_the_witnesss_clock_nor_counts_in_its_size() -> None:
    p, w = clocked()
    p.bounded(frozenset({"capped"}))
    put(p, b"a")
    clock = w.clock
    for i in range(50):
        put(p, b"c%d" % i, tenant="capped")
    assert w.clock == clock
    assert p._last_touch(b"c0") is None  # (the witness follows none of its blocks)
    put(p, b"b")
    assert w.clock == clock + 1
    assert w.capacity == p._size[0] - 500


def test_a_block_read_twice_in_a_request_counts_what_the_request_touched_before() -> None:
    w = LruWitness()
    w.capacity, w.blocks = 10, 100
    w.touch(1, b"a", None, 1, last=None, hit=False)
    w.settle()
    w.touch(2, b"a", None, 1, last=1, hit=True)
    for i in range(25):  # 25 bytes touched between the two reads of a, in one request
        w.touch(2, b"x%d" % i, None, 1, last=None, hit=False)
    w.touch(2, b"a", None, 1, last=2, hit=True)
    assert w.settle() == (1 - 2, 27)  # LRU: the first read only


def test_the_witnesss_window_stays_within_twice_the_most_blocks_held() -> None:
    w = LruWitness()
    w.capacity, w.blocks = 1 << 40, 1000  # a cache far larger than what it sees
    for tick in range(1, 20000):
        w.touch(tick, b"%d" % tick, None, 1, last=None, hit=False)
    assert INITIAL_SPAN < w.ticks.span <= 2000
