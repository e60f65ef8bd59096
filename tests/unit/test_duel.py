"""Shadow caches and the duel between eviction orders: exact hit counts on hand-made requests."""

from __future__ import annotations

import pytest

from kvpool_sidecar.duel import CONFIDENCE, Duel, ShadowCache
from kvpool_sidecar.policy import BlockMeta, LRUPolicy


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
        hits.append(sum(s.touch(m, new_request=new, copy=fresh) for m, new in request(*ids)))
    # [4] evicts 1 (least recent: 2 was read since); [1, 2] then misses 1 (evicting 3), and 2,
    # held behind it, is no hit for that request; the next one hits both.
    assert hits == [0, 0, 1, 0, 0, 2]
    assert s.hits == 3 and len(s) == 3 and b"b003" not in s and b"b002" in s


def test_a_shadow_copies_what_it_keeps() -> None:
    s = ShadowCache(LRUPolicy())
    s.capacity = 1
    original = block(1)
    s.touch(original, new_request=True, copy=fresh)
    assert b"b001" in s and s._resident[b"b001"] is not original


def test_the_challenger_takes_over_only_when_surely_ahead() -> None:
    duel = Duel(RefusesAll(), LRUPolicy(), fresh)
    duel.resize(1000)
    for i in range(100):  # first sight of each block: no hits anywhere
        for m, new in request(i):
            duel.touch(m, new_request=new)
    needed = int(CONFIDENCE * CONFIDENCE) + 1  # n hits only the challenger had: n^2 > z^2 n
    for i in range(needed - 1):
        for m, new in request(i):
            duel.touch(m, new_request=new)
    assert duel.leader == 0 and duel.only[0] == 0.0 and duel.only[1] == pytest.approx(needed - 1, rel=0.01)
    for m, new in request(needed - 1):
        duel.touch(m, new_request=new)
    assert duel.leader == 1


def test_equal_shadows_never_switch_and_a_touch_counts_once_per_request() -> None:
    duel = Duel(LRUPolicy(), LRUPolicy(), fresh)
    duel.resize(4)
    for _ in range(50):
        for ids in ([1, 2, 3], [4, 5], [1, 2, 6]):
            for m, new in request(*ids):
                duel.touch(m, new_request=new)
                duel.touch(m, new_request=False)  # a retried put: the same request again
    assert duel.leader == 0 and duel.only == [0.0, 0.0]
    assert duel.shadows[0].hits == duel.shadows[1].hits > 0


def test_the_shadows_grow_with_the_cache_and_never_shrink() -> None:
    duel = Duel(LRUPolicy(), LRUPolicy(), fresh)
    duel.resize(10)
    duel.resize(4)
    assert [s.capacity for s in duel.shadows] == [10, 10]
