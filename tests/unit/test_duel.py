"""Shadow caches and the duel between eviction orders: exact hit counts on hand-made requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool_client.protocol import PutStatus
from kvpool_sidecar.duel import (CONFIDENCE, MIN_SAMPLED, SAMPLE_SHARE, VARIANCE_FLOOR, WITNESS_CONFIDENCE, Duel,
                                 ShadowCache)
from kvpool_sidecar.errors import ConfigError
from kvpool_sidecar.policy import BlockMeta, LRUPolicy, PrefixAwarePolicy
from kvpool_sidecar.store import StoreSettings, TieredStore
from kvpool_sidecar.tiers.dram import DramTier


def block(i: int, depth: int = 0, size: int = 1) -> BlockMeta:
    return BlockMeta(key=b"b%03d" % i, size=size, depth=depth, parent=b"b%03d" % (i - 1) if depth else None)


def request(*ids: int) -> list[tuple[BlockMeta, bool]]:
    """The touches of one request reading or writing the chain ``ids``."""
    return [(block(i, d), d == 0) for d, i in enumerate(ids)]


def fresh(meta: BlockMeta) -> BlockMeta:
    return BlockMeta(meta.key, meta.size, meta.tenant, meta.priority, meta.depth, meta.parent)


class RefusesAll(LRUPolicy):
    """Never admits: its shadow never hits."""

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        return False


def test_a_shadow_counts_prefix_hits_at_its_capacity() -> None:
    s = ShadowCache(LRUPolicy())
    s.capacity = 3
    hits = []
    for ids in ([1, 2], [3], [2], [4], [1, 2], [1, 2]):
        hits.append(sum(s.touch(m, fresh) for m, _ in request(*ids)))
    # [2] reads 2 as a root here (no parent), [4] evicts 1 (least recent); [1, 2] then misses
    # 1 (evicting 3), and 2, held behind it, is no hit for that request; the next one hits both.
    assert hits == [0, 0, 1, 0, 0, 2]
    assert s.hits == 3 and len(s) == 3 and b"b003" not in s and b"b002" in s


def test_a_shadow_copies_what_it_keeps() -> None:
    s = ShadowCache(LRUPolicy())
    s.capacity = 1
    original = block(1)
    s.touch(original, fresh)
    assert b"b001" in s and s.policy.resident("shadow", b"b001") is not original


def test_the_challenger_takes_over_only_when_surely_ahead() -> None:
    duel = Duel([RefusesAll(), LRUPolicy()], fresh)
    duel.resize(1000)
    for i in range(100):  # first sight of each block: no hits anywhere
        for m, new in request(i):
            duel.touch(m, new_request=new)
    # n requests with one hit only the challenger had: a lead of n, spread n; it takes over
    # at the first n with n^2 > z^2 (n + floor) (without the floor, five requests had done)
    needed = next(n for n in range(1, 1000) if n * n > CONFIDENCE * CONFIDENCE * (n + VARIANCE_FLOOR))
    assert needed > int(CONFIDENCE * CONFIDENCE) + 1
    for i in range(needed):
        for m, new in request(i):
            duel.touch(m, new_request=new)
    # a request counts once the next one starts
    assert duel.leader == 0 and duel.lead(1) == pytest.approx(needed - 1, rel=0.01)
    assert duel.variance(1) == pytest.approx(needed - 1, rel=0.01)
    for m, new in request(needed):
        duel.touch(m, new_request=new)
    assert duel.leader == 1 and duel.switches == 1


def test_the_evidence_is_per_request() -> None:
    # One request of 20 blocks, all hits for the challenger only: a lead of 20 but a variance
    # of 400, one request's worth of evidence, not twenty.
    duel = Duel([RefusesAll(), LRUPolicy()], fresh)
    duel.resize(1000)
    chain = list(range(20))
    for _ in range(2):
        for m, new in request(*chain):
            duel.touch(m, new_request=new)
    for m, new in request(99):
        duel.touch(m, new_request=new)
    assert (duel.lead(1), duel.variance(1)) == pytest.approx((20, 400), rel=0.01) and duel.leader == 0


def test_equal_shadows_never_switch() -> None:
    duel = Duel([LRUPolicy(), LRUPolicy()], fresh)
    duel.resize(4)
    for _ in range(50):
        for ids in ([1, 2, 3], [4, 5], [1, 2, 6]):
            for m, new in request(*ids):
                duel.touch(m, new_request=new)
    assert duel.leader == 0 and (duel.lead(1), duel.variance(1)) == (0.0, 0.0)
    assert duel.shadows[0].hits == duel.shadows[1].hits > 0


def test_interleaved_requests_count_each_chain_on_its_own() -> None:
    s = ShadowCache(LRUPolicy())
    s.capacity = 10
    for m, _ in request(1, 2, 3, 4, 5):
        s.touch(m, fresh)
    # A reads 1..3, B writes a new block, A reads 4 and 5: all five of A's are prefix hits.
    hits = [s.touch(m, fresh) for m, _ in request(1, 2, 3)]
    s.touch(block(50), fresh)
    hits += [s.touch(m, fresh) for m, _ in request(1, 2, 3, 4, 5)[3:]]
    assert hits == [True] * 5


def test_the_shadows_keep_the_largest_size_the_cache_had() -> None:
    p = PrefixAwarePolicy()
    duel = p._duel
    assert duel is not None
    chain = [block(i, depth=i) for i in range(4)]
    for m in chain:
        p.admit("dram", m)
        p.inserted("dram", m)
    p.removed("dram", chain[3])
    p.removed("dram", chain[2])
    assert {s.capacity for s in duel.shadows} == {4}  # a cache that evicted is full
    p.admit("dram", block(10))  # a new request puts a block: room for it is taken first
    assert {s.capacity for s in duel.shadows} == {4}


def test_the_policy_feeds_its_shadows_each_access_once() -> None:
    p = PrefixAwarePolicy()
    duel = p._duel
    assert duel is not None
    root, child = block(1), block(2, depth=1)
    for m in (root, child):
        assert p.admit("dram", m)
    # the shadows are sized for the blocks being put, not one block behind
    assert {s.capacity for s in duel.shadows} == {2} and all(len(s) == 2 for s in duel.shadows)
    assert p.admit("dram", child)  # its allocation failed and the put is retried: no new access
    p.inserted("dram", root)
    p.inserted("dram", child)
    assert duel._touches == 2
    p.accessed("dram", root)  # a new request reads the root, then writes the child again
    p.bypassed("dram", child)
    assert duel._touches == 2 and {s.hits for s in duel.shadows} == {2}
    p.bypassed("dram", block(9))  # not held here: nothing to see
    assert duel._touches == 2


async def test_the_store_reports_a_block_written_again(tmp_path: Path) -> None:
    seen: list[tuple[bytes, int, bytes | None]] = []

    class Watching(LRUPolicy):
        def bypassed(self, tier: str, meta: BlockMeta) -> None:
            seen.append((meta.key, meta.depth, meta.parent))

    bb = 64
    store = TieredStore([DramTier(8 * bb, bb)], Watching(), StoreSettings(block_max_bytes=bb), index_events=False)
    session = store.open_session("default")
    _, lease = await store.allocate(session, b"k" * 48, bb)  # stored without its place in a chain
    assert lease is not None
    store.commit(session, lease.id, 0)
    status, again = await store.allocate(session, b"k" * 48, bb, depth=3, parent=b"p" * 48)
    assert status is PutStatus.EXISTS and again is None
    assert seen == [(b"k" * 48, 3, b"p" * 48)]  # as this put places it


def test_the_best_of_several_takes_over() -> None:
    duel = Duel([RefusesAll(), RefusesAll(), LRUPolicy()], fresh)
    duel.resize(1000)
    for _ in range(2):  # every request reads a block the third shadow alone holds, once it has seen it
        for i in range(20):
            for m, new in request(i):
                duel.touch(m, new_request=new)
    assert duel.leader == 2 and duel.switches == 1
    assert duel.lead(0) < 0 and duel.lead(1) < 0 and duel.lead(2) == 0.0


def test_an_order_with_a_simpler_one_takes_over_only_when_also_surely_ahead_of_it() -> None:
    """The second and third orders gain the same over the first: the second, whose simpler
    order is the third, never surely leads it, so the third takes over."""
    duel = Duel([RefusesAll(), LRUPolicy(), LRUPolicy()], fresh, simpler={1: 2})
    duel.resize(1000)
    for _ in range(2):
        for i in range(20):
            for m, new in request(i):
                duel.touch(m, new_request=new)
    assert duel.leader == 2 and duel.switches == 1
    with pytest.raises(ConfigError):
        Duel([LRUPolicy(), LRUPolicy()], fresh, simpler={1: 1})
    with pytest.raises(ConfigError):
        Duel([LRUPolicy(), LRUPolicy()], fresh, simpler={1: 5})


def test_the_real_caches_evidence_hands_it_to_the_fallback_once_lru_is_surely_ahead() -> None:
    """LRU's lead over the real cache, every access followed: the fallback takes over at the
    first n with n^2 > z^2 (n + floor), requests of one hit each; the order it replaced must
    then prove itself again on the shadows."""
    duel = Duel([LRUPolicy(), LRUPolicy()], fresh, fallback=1)
    duel.resize(1000)
    for i in range(30):  # the shadows: the first order ahead by a request or two, not surely
        for m, new in request(i % 28):
            duel.touch(m, new_request=new)
    duel.sums[0] += 1.0
    assert duel.leader == 0 and not duel._surely_ahead(0, 1)
    needed = next(n for n in range(1, 100) if n * n > WITNESS_CONFIDENCE ** 2 * (n + VARIANCE_FLOOR))
    for _ in range(needed - 1):
        duel.witnessed(1, 1, 10)
    assert duel.leader == 0
    duel.witnessed(-1, 1, 10)  # the real cache ahead once: LRU's lead falls
    assert duel.leader == 0
    for _ in range(3):
        duel.witnessed(1, 1, 10)
    assert duel.leader == 1 and duel.switches == 1 and duel.sums[0] == duel.sums[1]
    for _ in range(needed + 5):  # the fallback leads: the evidence says nothing of the others
        duel.witnessed(1, 1, 10)
    assert duel.leader == 1 and duel.switches == 1


def test_the_real_caches_evidence_does_not_overrule_shadows_sure_of_their_leader() -> None:
    duel = Duel([LRUPolicy(), LRUPolicy()], fresh, fallback=1)
    duel.resize(1000)
    duel.sums[0] = 100.0  # the shadows are sure the first order is ahead
    for _ in range(100):
        duel.witnessed(1, 1, 10)
    assert duel.leader == 0
    duel.sums[0] = duel.sums[1]
    duel.witnessed(1, 1, 10)
    assert duel.leader == 1
    with pytest.raises(ConfigError):
        Duel([LRUPolicy(), LRUPolicy()], fresh, fallback=2)


def test_a_duel_without_a_fallback_weighs_no_evidence_from_the_real_cache() -> None:
    duel = Duel([LRUPolicy(), LRUPolicy()], fresh)
    for _ in range(100):
        duel.witnessed(5, 1, 10)
    assert duel.leader == 0 and duel.switches == 0


def test_a_sampled_duel_follows_a_share_of_the_blocks() -> None:
    duel = Duel([LRUPolicy(), LRUPolicy()], fresh, sampled=True)
    small = MIN_SAMPLED
    duel.resize(1000, small)  # a small cache: followed whole
    for i in range(small):
        for m, new in request(i):
            duel.touch(m, new_request=new)
    assert duel.share == 1.0 and all(len(s) == small for s in duel.shadows)
    blocks = 4 * int(MIN_SAMPLED / SAMPLE_SHARE)
    duel.resize(blocks, blocks)  # a large one: a share, in shadows of that share of the size
    assert duel.share == SAMPLE_SHARE and {s.capacity for s in duel.shadows} == {int(blocks * SAMPLE_SHARE)}
    kept = len(duel.shadows[0])
    assert 0 < kept < small // 2 and all(len(s) == kept for s in duel.shadows)  # the others are forgotten
    for i in range(small, small + blocks):
        for m, new in request(i):
            duel.touch(m, new_request=new)
    followed = len(duel.shadows[0])
    assert 0.7 * blocks * SAMPLE_SHARE <= followed <= blocks * SAMPLE_SHARE


def test_a_sampled_shadow_follows_blocks_without_their_parents() -> None:
    duel = Duel([LRUPolicy()], fresh, sampled=True)
    duel.resize(100, 10)
    for m, new in request(1, 2, 3):
        duel.touch(m, new_request=new)
    s = duel.shadows[0]
    held = [s.policy.resident("shadow", k) for k in s.policy.resident_keys("shadow")]
    assert held and all(m is not None and m.parent is None for m in held)
    for m, new in request(5, 2, 3):  # 2 and 3 are held behind a miss: plain hits here
        duel.touch(m, new_request=new)
    assert s.hits == 2


def test_a_cache_filling_block_by_block_scans_its_shadows_a_few_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shrink of the sample scans every shadow: a cache growing one block at a time must
    not pay one scan per block (a sidecar warming up a large DRAM tier would stall)."""
    scans = 0
    forget = ShadowCache.forget

    def counted(self: ShadowCache, keep: object) -> None:
        nonlocal scans
        scans += 1
        forget(self, keep)  # type: ignore[arg-type]

    monkeypatch.setattr(ShadowCache, "forget", counted)
    duel = Duel([LRUPolicy(), LRUPolicy()], fresh, sampled=True)
    for blocks in range(1, 50_000):
        duel.resize(blocks, blocks)
    assert duel.share == SAMPLE_SHARE
    assert scans <= 2 * 16  # two shadows, a dozen steps from all blocks down to the share


async def test_a_store_samples_for_the_blocks_its_tiers_can_hold() -> None:
    """A cache still filling, or kept nearly empty, samples at the rate of the size its tiers
    allow: its few blocks are not each followed by every shadow (three policies' work per
    access). A policy the store did not size samples by what it holds."""
    bb = 64
    room = 4 * int(MIN_SAMPLED / SAMPLE_SHARE)  # blocks the tier can hold
    told, untold = PrefixAwarePolicy(), PrefixAwarePolicy()
    store = TieredStore([DramTier(room * bb, bb)], told, StoreSettings(block_max_bytes=bb), index_events=False)
    session = store.open_session("default")
    for i in range(8):
        _, lease = await store.allocate(session, b"%048d" % i, bb, depth=i, parent=b"%048d" % (i - 1) if i else None)
        assert lease is not None
        store.commit(session, lease.id, 0)
        untold.admit("dram", BlockMeta(b"%048d" % i, bb, depth=i))
    store.policy.settle()
    assert told._duel is not None and untold._duel is not None
    assert told._duel.share == SAMPLE_SHARE and untold._duel.share == 1.0
    assert {s.capacity for s in told._duel.shadows} == {int(8 * bb * SAMPLE_SHARE)}  # shadows of the cache as it is
    told.sized(0)  # no size known: back to sampling by the blocks held (the sample never grows back)
    assert told._duel.share == SAMPLE_SHARE
    with pytest.raises(ConfigError):
        told.sized(-1)


def test_a_sampled_duel_follows_each_block_alone_and_keeps_no_chains() -> None:
    duel = Duel([LRUPolicy()], fresh, sampled=True)
    duel.resize(100, blocks=10)
    for _ in range(2):
        for m, new in request(1, 2, 3):
            duel.touch(m, new_request=new)
    shadow = duel.shadows[0]
    # the blocks come without their parents: every block held is a hit, and no set of the
    # blocks reached through their parents is kept for them
    assert shadow.hits == 3 and shadow._reached is None
    chained = ShadowCache(LRUPolicy())
    chained.capacity = 10
    for m, _ in request(1, 2):
        chained.touch(m, fresh)
    assert chained.touch(block(2, depth=1), fresh) is False and chained._reached == set()
