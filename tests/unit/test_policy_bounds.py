"""What one writer's traffic may cost the default policy: puts that never land, a request
that read thousands of blocks, a parent of many children, one huge block first after a
start, a new session in every put, and another tenant's touches in the middle of a request
(the policy driven as the store drives it: admit, inserted, accessed, removed)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_sidecar.policy import BlockMeta, Hints, PrefixAwarePolicy, make_policy
from kvpool_sidecar.policy import accesses
from kvpool_sidecar.policy.ranks import Ranks
from kvpool_sidecar.reuse import _DEPTH, _SESSION

PAGE = 4096


def key(tag: bytes, i: int) -> bytes:
    return tag + i.to_bytes(47, "big")


def put(p: Any, m: BlockMeta, tier: str = "dram") -> None:
    assert p.admit(tier, m)
    p.inserted(tier, m)


def test_puts_admitted_that_never_land_are_followed_boundedly_whatever_the_depths() -> None:
    """A writer whose depths only grow never starts a request, and its puts (allocated, then
    aborted, or refused for its quota) never land: what the policy follows of them stays
    within MAX_ADMITTED, and a tenant a quota bounds sizes no shadow with them (500,000 such
    puts had held 94 MiB and grown the shadows from 1 MiB to 126 MiB)."""
    p = make_policy("prefix")
    assert isinstance(p, PrefixAwarePolicy)
    p.sized(256 * PAGE)
    p.bounded(frozenset({"q"}))
    for i in range(256):
        put(p, BlockMeta(key(b"v", i), PAGE, "v", depth=0))
    shadows = [s.capacity for s in p._duel.shadows]  # type: ignore[union-attr]
    for i in range(3 * accesses.MAX_ADMITTED):
        assert p.admit("dram", BlockMeta(key(b"q", i), 1 << 20, "q", depth=i))
        assert len(p._admitted) <= accesses.MAX_ADMITTED
    assert [s.capacity for s in p._duel.shadows] == shadows  # type: ignore[union-attr]


class _Counting(dict[bytes, Any]):
    """A tier's slots, counting the lookups a walk of its victims makes."""

    lookups = 0

    def __getitem__(self, k: bytes) -> Any:
        _Counting.lookups += 1
        return super().__getitem__(k)


@pytest.mark.parametrize("name", ["prefix-arc", "prefix"])
def test_a_request_that_read_thousands_of_blocks_is_not_walked_by_each_of_its_puts(name: str) -> None:
    """Under ARC's protected-first order, the blocks the current request read go after
    probation: they were collected by walking them all, on every put of that request (a
    request that read 30,000 blocks made each of its puts cost 3.6 ms). The first victim is
    found without walking them."""
    p = make_policy(name)
    assert isinstance(p, PrefixAwarePolicy)
    n = 4000
    p.sized(n * PAGE)
    chain = [BlockMeta(key(b"a", i), PAGE, depth=i, parent=key(b"a", i - 1) if i else None) for i in range(n)]
    for m in chain:
        put(p, m)
    probation = [BlockMeta(key(b"b", i), PAGE, depth=0) for i in range(10)]
    for m in probation:
        put(p, m)
    p.removed("dram", probation.pop())  # (an eviction: the tier's split is set)
    for m in chain:  # a first request reads them all, once
        p.accessed("dram", m)
    p.accessed("dram", chain[0])  # a second request reads them all again: protected, current
    for m in chain[1:]:
        p.accessed("dram", m)
    st = p._ranks.tiers["dram"]
    assert not st.segment_bytes[0] > (st.target or 0.0) and p.order == "arc"  # protected first
    st.slots = _Counting(st.slots)
    _Counting.lookups = 0
    first = next(p.victims("dram"))
    assert first.key == probation[0].key  # (nothing protected but what this request read)
    assert _Counting.lookups < 10, _Counting.lookups  # before: every block the request read


def test_a_parent_relinks_a_bounded_number_of_children_as_it_comes_and_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parent named by hundreds of children, put and removed in a loop: each arrival and
    departure relinks at most 32 of them (256 had cost 2.1 ms a put and remove)."""
    p = make_policy("prefix")
    assert isinstance(p, PrefixAwarePolicy)
    parent = BlockMeta(b"p" * 48, PAGE, depth=0)
    put(p, parent)
    for i in range(300):
        put(p, BlockMeta(key(b"c", i), PAGE, depth=1, parent=parent.key))
    relinked: list[object] = []
    real = Ranks.relink

    def count(self: Ranks, *a: Any) -> None:
        relinked.append(a)
        real(self, *a)

    monkeypatch.setattr(Ranks, "relink", count)
    p.removed("dram", parent)
    put(p, parent)
    assert 0 < len(relinked) <= 2 * 32


def test_one_huge_block_first_does_not_make_the_shadows_follow_every_block() -> None:
    """The duel samples keys in proportion to the blocks the cache holds; one block of 32 MiB
    first after a start had made the size allow 32 blocks, and the sample kept every key of
    the 16,384 that came after (2,502 bytes of shadows a resident block, against 205)."""
    p = make_policy("prefix")
    assert isinstance(p, PrefixAwarePolicy)
    p.sized(1 << 30)
    put(p, BlockMeta(b"B" * 48, 32 << 20, depth=0))
    for i in range(16384):
        put(p, BlockMeta(key(b"s", i), PAGE, depth=i % 64, parent=key(b"s", i - 1) if i % 64 else None))
    assert p._duel is not None
    assert p._duel.share < 0.5, p._duel.share


def test_the_sessions_remembered_follow_the_size_of_the_cache() -> None:
    """A writer naming a new session in every put: a cache of 256 blocks remembers about as
    many sessions (a fixed 4,096 had cost 684 KB, 2.6 KB a block of that cache)."""
    p = make_policy("prefix")
    assert isinstance(p, PrefixAwarePolicy)
    p.sized(256 * PAGE)
    resident: list[BlockMeta] = []
    for i in range(20_000):
        m = BlockMeta(key(b"s", i), PAGE, depth=0, hints=Hints(prompt_blocks=1, session=f"session-{i}"))
        put(p, m)
        resident.append(m)
        if len(resident) > 256:
            p.removed("dram", resident.pop(0))
    assert p._learning is not None and len(p._learning.sessions) <= 257  # (the most it held at once)


def _session_codes(interleave: str | None, tenant: str = "q") -> list[int]:
    p = make_policy("prefix")
    assert isinstance(p, PrefixAwarePolicy)
    p.sized(1 << 30)
    p.bounded(frozenset({"q"}))
    h = Hints(prompt_blocks=8, session="conversation")

    def touch(k: bytes, owner: str, depth: int, hints: Hints | None = None) -> int:
        put(p, BlockMeta(k, PAGE, owner, depth=depth, hints=hints))
        return (p._ranks.tiers["dram"].slots[k].cls // _DEPTH) % _SESSION  # 0 none, 1 first request, 2 returning

    touch(key(b"w", 0), "v", 0)
    touch(key(b"w", 1), "v", 1)
    touch(key(b"v", 0), "v", 0, h)  # the conversation's first request
    touch(key(b"v", 1), "v", 1, h)
    if interleave == "before":
        touch(key(b"q", 0), tenant, -1)
    codes = [touch(key(b"v", 10), "v", 0, h)]  # its second: a returning session
    if interleave == "within":
        touch(key(b"q", 1), tenant, -1)
    codes += [touch(key(b"v", 11), "v", 1, h), touch(key(b"v", 12), "v", 2, h)]
    return codes


@pytest.mark.parametrize("tenant", ["q", "other"])
@pytest.mark.parametrize("when", ["before", "within"])
def test_another_tenants_touch_does_not_change_what_a_request_is(when: str, tenant: str) -> None:
    """Each tenant's request is followed apart: another tenant's put in the middle of one
    (bounded by a quota or not) had told it that its session was new."""
    alone = _session_codes(None)
    assert alone == [2, 2, 2]
    assert _session_codes(when, tenant) == alone



def test_a_bound_on_ghosts_that_shrank_at_once_is_reached_over_later_evictions() -> None:
    """A tenant holds full blocks, whose evictions leave ghosts (twice its bytes), then
    swaps them for blocks of a byte (a page each in a tier): the ghosts' bound falls by
    almost all. One eviction had dropped every ghost past it (131,070 in 57 ms at 65,536
    pages); each now drops at most GHOST_TRIM more than it adds, and they reach the bound
    within as many evictions as that takes."""
    from kvpool_sidecar.policy.tierstate import GHOST_TRIM

    p = PrefixAwarePolicy()
    n = 1024
    full = [BlockMeta(key(b"F", i), PAGE, depth=0) for i in range(4 * n)]
    for i, m in enumerate(full):
        put(p, m)
        if i >= n:
            p.removed("dram", full[i - n])
    st = p._ranks.tiers["dram"]
    ghosts = len(st.ghosts)
    assert ghosts >= n  # (twice the resident bytes: 2n ghosts of a page)
    for m in full[3 * n:]:  # gone, not evicted: no ghosts, no trim
        p.removed("dram", m, evicted=False)
    tiny = [BlockMeta(key(b"T", i), 1, depth=0) for i in range(3 * n)]
    evictions = 0
    for i, m in enumerate(tiny):
        put(p, m)
        if i >= n:
            before = len(st.ghosts)
            p.removed("dram", tiny[i - n])
            evictions += 1
            assert before - len(st.ghosts) <= GHOST_TRIM, (evictions, before, len(st.ghosts))
            if sum(st.ghost_bytes) <= 2 * st.resident_bytes and len(st.ghosts) <= 4 * len(st.slots) + 64:
                break
    assert sum(st.ghost_bytes) <= 2 * st.resident_bytes and len(st.ghosts) <= 4 * len(st.slots) + 64
    assert evictions <= ghosts // GHOST_TRIM + 2, (evictions, ghosts)
