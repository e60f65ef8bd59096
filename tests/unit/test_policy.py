"""Eviction policies: LRU order within priorities, tenant-restricted victims, the factory."""

from __future__ import annotations

import random

import pytest

from kvpool_sidecar.errors import ConfigError
from kvpool_sidecar.policy import BlockMeta, LRUPolicy, PrefixAwarePolicy, make_policy
from kvpool_sidecar.policy.tails import TailWatch


def meta(i: int, *, tenant: str = "default", priority: int = 0) -> BlockMeta:
    return BlockMeta(key=b"k%03d" % i, size=100, tenant=tenant, priority=priority)


def order(p: LRUPolicy, tier: str = "dram", tenant: str | None = None) -> list[bytes]:
    return [m.key for m in p.victims(tier, tenant)]


def test_lru_yields_oldest_first() -> None:
    p = LRUPolicy()
    ms = [meta(i) for i in range(5)]
    for m in ms:
        p.inserted("dram", m)
    assert order(p) == [m.key for m in ms]


def test_access_moves_a_block_to_the_most_recent_end() -> None:
    p = LRUPolicy()
    ms = [meta(i) for i in range(4)]
    for m in ms:
        p.inserted("dram", m)
    p.accessed("dram", ms[0])
    p.accessed("dram", ms[2])
    assert order(p) == [ms[1].key, ms[3].key, ms[0].key, ms[2].key]
    p.accessed("dram", ms[1])
    assert order(p)[-1] == ms[1].key


def test_access_of_a_block_not_resident_changes_nothing() -> None:
    p = LRUPolicy()
    a, b = meta(1), meta(2)
    p.inserted("dram", a)
    p.accessed("dram", b)
    p.accessed("disk", a)
    assert order(p) == [a.key]
    assert order(p, "disk") == []


def test_lower_priority_goes_first_regardless_of_recency() -> None:
    p = LRUPolicy()
    old_hi = meta(1, priority=5)
    mid = meta(2, priority=1)
    new_lo = meta(3, priority=0)
    newer_lo = meta(4, priority=-2)
    for m in (old_hi, mid, new_lo, newer_lo):
        p.inserted("dram", m)
    p.accessed("dram", newer_lo)
    assert order(p) == [newer_lo.key, new_lo.key, mid.key, old_hi.key]


def test_tenant_restricted_victims() -> None:
    p = LRUPolicy()
    a = [meta(i, tenant="a", priority=0) for i in range(3)]
    b = [meta(10 + i, tenant="b", priority=1) for i in range(3)]
    for x, y in zip(a, b):
        p.inserted("dram", y)
        p.inserted("dram", x)
    p.accessed("dram", b[0])
    assert order(p, tenant="b") == [b[1].key, b[2].key, b[0].key]
    assert order(p, tenant="a") == [m.key for m in a]
    assert order(p, tenant="nobody") == []
    assert order(p, tier="disk", tenant="a") == []


def test_removed_blocks_are_never_yielded() -> None:
    p = LRUPolicy()
    ms = [meta(i, tenant="t" if i % 2 else "u", priority=i % 3) for i in range(9)]
    for m in ms:
        p.inserted("dram", m)
    gone = {ms[0].key, ms[4].key, ms[7].key}
    for m in ms:
        if m.key in gone:
            p.removed("dram", m)
    assert not gone & set(order(p))
    assert not gone & set(order(p, tenant="t")) and not gone & set(order(p, tenant="u"))
    assert len(order(p)) == 6
    # Removing twice, or from a tier it never was in, is harmless.
    p.removed("dram", ms[0])
    p.removed("disk", ms[1])
    assert len(order(p)) == 6


def test_tiers_are_independent() -> None:
    p = LRUPolicy()
    a, b = meta(1), meta(2)
    p.inserted("dram", a)
    p.inserted("disk", b)
    p.inserted("disk", a)
    p.removed("dram", a)
    assert order(p) == []
    assert order(p, "disk") == [b.key, a.key]


def test_reinsert_moves_to_the_recent_end() -> None:
    p = LRUPolicy()
    ms = [meta(i) for i in range(3)]
    for m in ms:
        p.inserted("dram", m)
    p.removed("dram", ms[0])
    p.inserted("dram", ms[0])
    assert order(p) == [ms[1].key, ms[2].key, ms[0].key]


def test_random_operations_match_a_reference_model() -> None:
    rnd = random.Random(5)
    p = LRUPolicy()
    metas = [meta(i, tenant=rnd.choice("xyz"), priority=rnd.randint(0, 2)) for i in range(40)]
    resident: list[BlockMeta] = []  # oldest first
    for _ in range(2000):
        m = rnd.choice(metas)
        op = rnd.random()
        if op < 0.4 and m not in resident:
            p.inserted("dram", m)
            resident.append(m)
        elif op < 0.8:
            p.accessed("dram", m)
            if m in resident:
                resident.remove(m)
                resident.append(m)
        else:
            p.removed("dram", m)
            if m in resident:
                resident.remove(m)
        expect = [x.key for x in sorted(resident, key=lambda x: x.priority)]  # stable sort
        assert order(p) == expect
        for t in "xyz":
            assert order(p, tenant=t) == [x.key for x in resident if x.tenant == t]


def test_admits_everything() -> None:
    assert LRUPolicy().admit("dram", meta(1)) is True


def test_make_policy() -> None:
    p = make_policy("lru")
    assert isinstance(p, LRUPolicy) and p.name == "lru"
    assert make_policy("lru") is not p  # a fresh policy each time


@pytest.mark.parametrize("name", ["", "LRU", "belady", "lfu"])
def test_make_policy_unknown_name(name: str) -> None:
    with pytest.raises(ConfigError, match="policy.name"):
        make_policy(name)


def test_a_tiers_level_and_tenant_orders_share_one_list_only_while_they_are_the_same() -> None:
    from kvpool_sidecar.policy.tierstate import TierState

    rng = random.Random(7)
    st = TierState(1)
    held: dict[tuple[int, int, int, int, bytes], tuple[int, str]] = {}
    shared = 0
    for n in range(3000):
        if held and rng.random() < 0.48:
            sort = rng.choice(list(held))
            priority, tenant = held.pop(sort)
            st.discard(sort, priority, tenant)
        else:
            # mostly one tenant at priority 0, now and then others, which later leave
            priority = 0 if rng.random() < 0.9 else rng.choice([1, 2])
            tenant = "a" if rng.random() < 0.85 else rng.choice(["b", "c"])
            sort = (rng.randrange(5), rng.randrange(100), 0, n, b"%d" % n)
            held[sort] = (priority, tenant)
            st.add(sort, priority, tenant)
        for p, order in st.levels.items():
            assert list(order) == sorted(s for s, (q, _) in held.items() if q == p)
        for t, order in st.tenants.items():
            assert list(order) == sorted(s for s, (_, u) in held.items() if u == t)
        assert set(st.levels) == {p for p, _ in held.values()} and set(st.tenants) == {t for _, t in held.values()}
        one = len(st.levels) == 1 and len(st.tenants) == 1
        if one and next(iter(st.levels.values())) is next(iter(st.tenants.values())):
            shared += 1
        elif len(st.levels) > 1 or len(st.tenants) > 1:
            assert all(level is not own for level in st.levels.values() for own in st.tenants.values())
    assert shared > 20  # the shared case was met (and left) many times


def test_a_tenant_whose_one_block_comes_and_goes_does_not_copy_the_tiers_list_each_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_sidecar.policy import tierstate

    copies = []

    class Counted(tierstate.SortedList):  # type: ignore[misc]
        def __init__(self, iterable: object = None, key: object = None) -> None:
            if iterable is not None:
                copies.append(1)
            super().__init__(iterable)

    monkeypatch.setattr(tierstate, "SortedList", Counted)
    st = tierstate.TierState(1)
    for n in range(500):
        st.add((3, n, 0, n, b"a%d" % n), 0, "a")
    for n in range(200):  # another tenant's block arrives and leaves, again and again
        sort = (3, 1000 + n, 0, 1000 + n, b"b%d" % n)
        st.add(sort, 0, "b")
        st.discard(sort, 0, "b")
    assert len(copies) == 1  # one split; no merge back while the flapping goes on
    assert st.tenants["a"] is not st.levels[0]
    for n in range(500, 1200):  # then tenant a alone for as many changes as the list holds
        st.add((3, n, 0, n, b"a%d" % n), 0, "a")
    assert st.tenants["a"] is st.levels[0] and list(st.levels[0]) == sorted(st.levels[0])


def test_the_tail_watch_follows_a_bounded_number_of_evictions_whatever_comes_back() -> None:
    """A key evicted again before it came back (a copy demoted, promoted and evicted again)
    moves to the end of what is followed, so the oldest are dropped first and the number
    followed stays within the horizon."""
    watch = TailWatch()
    again = bytes(32)
    for i in range(5000):
        watch.evicted(again, True, 100)
        watch.evicted(i.to_bytes(4, "big") * 8, True, 100)
    assert len(watch.ghosts) <= 101 and len(watch._keys) <= 101


def test_the_tail_watch_drops_a_bounded_number_of_keys_when_its_horizon_shrinks() -> None:
    """A horizon that shrank at once (fewer, larger blocks in the tier) is reached over the
    next evictions, each dropping at most ``_TRIM`` more keys than it adds: one had dropped
    every key past it."""
    from kvpool_sidecar.policy.tails import _TRIM

    watch = TailWatch()
    for i in range(5000):
        watch.evicted(i.to_bytes(4, "big") * 8, True, 5000)
    followed = len(watch.ghosts)
    assert followed == 5000
    calls = 0
    while len(watch.ghosts) > 11:
        before = len(watch.ghosts)
        watch.evicted((5000 + calls).to_bytes(4, "big") * 8, True, 10)
        calls += 1
        assert before - len(watch.ghosts) <= _TRIM, (calls, before, len(watch.ghosts))
    assert calls <= followed // _TRIM + 2, calls


def test_the_tail_rule_comes_back_when_tails_stop_coming_back() -> None:
    """Tails that come back turn the rule off; tails evicted while it is off still count as
    tails, so once they stop coming back (and ordinary evictions do) it turns on again."""
    watch = TailWatch()
    ordinary = [bytes([0]) + i.to_bytes(4, "big") * 7 + bytes(3) for i in range(4000)]  # first byte 0: sampled
    for i in range(200):
        tail = b"t" + i.to_bytes(4, "big") * 7 + bytes(3)
        watch.evicted(tail, True, 1000)
        watch.arrived(tail)  # the next turn sends it again
    assert not watch.tails_first
    for i, key in enumerate(ordinary):
        watch.evicted(key, False, 1000)
        watch.evicted(b"u" + i.to_bytes(4, "big") * 7 + bytes(3), True, 1000)  # tails that never come back
        if i % 2:
            watch.arrived(key)
    assert watch.tails_first


def test_what_the_policy_remembers_of_a_key_is_not_public_under_a_fixed_hash_seed() -> None:
    """With ``PYTHONHASHSEED`` set, ``hash(key)`` is the same in every process, so a client
    could search offline for keys that share a ghost; each process hashes behind a secret."""
    import os
    import subprocess
    import sys

    code = "from kvpool_sidecar.keyhash import key_hash; print(key_hash(bytes(48)), hash(bytes(48)))"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert runs[0][1] == runs[1][1]  # the plain hash is public ...
    assert runs[0][0] != runs[1][0]  # ... what the policy keeps is not


def test_the_tail_rule_waits_for_evidence_and_stays_off_where_nothing_comes_back() -> None:
    """Tails go first only once enough of them went, and only while other evicted blocks come
    back more often than they do: where nothing but a few tails comes back (tool outputs read
    again once) the rule had evicted exactly those, from the first eviction on."""
    watch = TailWatch()
    assert not watch.tails_first  # no evidence yet
    for i in range(100):
        watch.evicted(bytes([0]) + i.to_bytes(4, "big") * 8, False, 1000)  # sampled, never back
        watch.evicted(b"t" + i.to_bytes(4, "big") * 8, True, 1000)  # tails, never back
    assert not watch.tails_first  # neither comes back: the rule gains nothing
    watch.arrived(bytes([0]) + (99).to_bytes(4, "big") * 8)  # an ordinary block comes back
    assert watch.tails_first


def test_a_parent_follows_a_bounded_number_of_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each arrival or departure of a parent relinks the children it follows: a client that
    names one parent for thousands of blocks, then puts and removes that parent in a loop,
    must not make each of those requests relink thousands of blocks."""
    from kvpool_sidecar import policy as policy_mod

    p = policy_mod.PrefixAwarePolicy()
    parent = BlockMeta(key=b"P" * 48, size=1)
    children = [BlockMeta(key=b"c%05d" % i + b"\0" * 42, size=1, depth=1, parent=parent.key)
                for i in range(policy_mod.MAX_CHILDREN + 100)]
    for m in [parent, *children]:
        p.admit("dram", m)
        p.inserted("dram", m)
    relinked: list[bytes] = []
    real = p._ranks.relink
    monkeypatch.setattr(p._ranks, "relink", lambda st, slot, place: relinked.append(slot.meta.key) or real(st, slot, place))
    p.removed("dram", parent)  # its children are orphans now
    assert len(relinked) == policy_mod.MAX_CHILDREN
    relinked.clear()
    p.admit("dram", parent)
    p.inserted("dram", parent)
    assert len(relinked) == policy_mod.MAX_CHILDREN
    assert {m.key for m in p.victims("dram")} == {parent.key} | {c.key for c in children}


def _requests_counted(p: object) -> int | None:
    """The default policy's clock of requests (LRU keeps none)."""
    return p._ranks.tick if isinstance(p, PrefixAwarePolicy) else None


@pytest.mark.parametrize("name", ["lru", "prefix"])
def test_a_skipped_block_goes_to_the_far_end_without_counting_as_an_access(name: str) -> None:
    """``skipped``: the store walked past a pinned block looking for a victim; the next walk
    must not meet it first again, and the policy must not take it for a read."""
    p = make_policy(name)
    ms = [meta(i) for i in range(4)]
    for m in ms:
        assert p.admit("dram", m)
        p.inserted("dram", m)
    ticks = _requests_counted(p)
    p.skipped("dram", ms[0])
    assert [m.key for m in p.victims("dram")] == [m.key for m in ms[1:]] + [ms[0].key]
    assert _requests_counted(p) == ticks  # no request was counted
    p.skipped("dram", meta(9))  # not resident: nothing happens
    p.skipped("disk", ms[1])
    assert [m.key for m in p.victims("dram")] == [m.key for m in ms[1:]] + [ms[0].key]


@pytest.mark.parametrize("name", ["prefix", "prefix-recency", "prefix-arc"])
def test_a_skipped_block_goes_after_every_class_and_back_to_its_place_when_restored(name: str) -> None:
    """The default policy ranks orphans (a parent held nowhere) before every other block: a
    pinned orphan skipped at the end of its class only would be walked past by every put. It
    goes after all of them, and ``restored`` gives it back its place."""
    p = make_policy(name)
    orphan = BlockMeta(key=b"orphan", size=100, depth=1, parent=b"nowhere")
    ms = [meta(i) for i in range(3)]
    for m in [orphan, *ms]:
        assert p.admit("dram", m)
        p.inserted("dram", m)
    before = order(p)  # type: ignore[arg-type]
    assert before[0] == b"orphan"
    p.skipped("dram", orphan)
    assert order(p) == before[1:] + [b"orphan"]  # type: ignore[arg-type]  # before: still first
    p.accessed("dram", orphan)  # read while pinned: still held back
    assert order(p)[-1] == b"orphan"  # type: ignore[arg-type]
    p.restored("dram", orphan)
    assert order(p)[0] == b"orphan"  # type: ignore[arg-type]
    p.removed("dram", ms[0])
    p.skipped("dram", ms[1])
    p.removed("dram", ms[1])  # held back, then gone: nothing of it stays
    assert order(p) == [b"orphan", ms[2].key]  # type: ignore[arg-type]
    p.inserted("dram", ms[1])  # the same key again: an ordinary block, not held back
    assert order(p) == [b"orphan", ms[2].key, ms[1].key]  # type: ignore[arg-type]
    p.skipped("dram", ms[2])
    assert order(p) == [b"orphan", ms[1].key, ms[2].key]  # type: ignore[arg-type]


def test_a_skipped_block_of_a_lower_priority_goes_after_the_higher_priorities_too() -> None:
    """Lower priorities go first; a block held back goes after all of them, or a tenant of a
    low priority that pins its blocks would have every put walk past them again."""
    p = make_policy("prefix")
    low, high = meta(1, priority=-1), meta(2, priority=5)
    for m in (low, high):
        assert p.admit("dram", m)
        p.inserted("dram", m)
    assert order(p) == [low.key, high.key]  # type: ignore[arg-type]
    p.skipped("dram", low)
    assert order(p) == [high.key, low.key]  # type: ignore[arg-type]
    p.restored("dram", low)
    assert order(p) == [low.key, high.key]  # type: ignore[arg-type]


def test_a_skipped_protected_block_goes_after_probation_when_protected_goes_first() -> None:
    """ARC's order with probation under its target yields protected blocks first: a held
    protected block must still come after the probation blocks."""
    p = make_policy("prefix-arc")
    ms = [meta(i) for i in range(4)]
    for m in ms:
        assert p.admit("dram", m)
        p.inserted("dram", m)
    for m in ms[:2]:
        p.accessed("dram", m)  # protected
    p.removed("dram", ms[3])  # the first loss sets ARC's target
    # protected first, but the block the current request read goes last
    assert order(p) == [ms[0].key, ms[2].key, ms[1].key]  # type: ignore[arg-type]
    p.skipped("dram", ms[0])
    assert order(p) == [ms[2].key, ms[1].key, ms[0].key]  # type: ignore[arg-type]
    p.restored("dram", ms[0])
    assert order(p) == [ms[0].key, ms[2].key, ms[1].key]  # type: ignore[arg-type]


async def test_blocks_of_a_byte_each_leave_a_bounded_number_of_ghosts_and_shadow_entries() -> None:
    """A tenant within its quota puts distinct 1-byte blocks, evicting its own; another holds
    64 KiB blocks. The ghosts and the shadow caches were bounded in bytes, which the tiers
    charge a page a block: about one ghost per resident byte, and the sidecar's memory grew
    by 3.6 MB a second from one connection. They are bounded by count too."""
    import asyncio
    import os

    from kvpool_sidecar.duel import MIN_SAMPLED
    from kvpool_sidecar.policy import PrefixAwarePolicy
    from kvpool_sidecar.store import StoreSettings, TenantLimits
    from tests.unit.store_support import make_store

    policy = PrefixAwarePolicy()
    store = make_store(8 << 20, policy=policy, settings=StoreSettings(
        tenants={"good": TenantLimits(0, None), "evil": TenantLimits(0, 256 << 10)}, session_share=0.5))
    good, evil = store.open_session("good"), store.open_session("evil")
    for i in range(32):
        _, lease = await store.allocate(good, b"G" + i.to_bytes(31, "big"), 65536, depth=0)
        assert lease is not None
        store.commit(good, lease.id, 0)
    for i in range(5000):
        _, lease = await store.allocate(evil, os.urandom(32), 1, depth=0)
        assert lease is not None
        store.commit(evil, lease.id, 0)
        if i % 256 == 0:
            await asyncio.sleep(0)  # (the policy is told on the loop's next turns)
    store.policy.settle()
    tier = policy._ranks.tiers["dram"]  # noqa: SLF001
    resident = len(tier.slots)
    assert resident <= 32 + 64  # (the quota: 64 pages of 4 KiB)
    assert len(tier.ghosts) <= 4 * resident + 64, len(tier.ghosts)
    duel = policy._duel  # noqa: SLF001
    assert duel is not None
    assert all(len(s) <= max(MIN_SAMPLED, 2 * resident * duel.share) for s in duel.shadows), [len(s) for s in duel.shadows]


async def test_a_put_refused_for_its_quota_teaches_the_policy_nothing_of_block_sizes() -> None:
    """The largest block the policy had seen sized its learning (the horizon, which blocks are
    partial tails): a put refused for its quota (256 MiB, or 1 MiB here) had set it for the life of the
    process, cutting the horizon to its least and marking every real block a tail."""
    from kvpool_client.protocol import PutStatus
    from kvpool_sidecar.policy import PrefixAwarePolicy
    from kvpool_sidecar.store import StoreSettings, TenantLimits
    from tests.unit.store_support import make_store

    policy = PrefixAwarePolicy()
    store = make_store(8 << 20, policy=policy, settings=StoreSettings(
        tenants={"default": TenantLimits(0, None), "small": TenantLimits(0, 64 << 10)}))
    s = store.open_session()
    _, lease = await store.allocate(s, b"k" * 32, 16384, depth=0)
    assert lease is not None
    store.commit(s, lease.id, 0)
    store.policy.settle()
    learning = policy._learning  # noqa: SLF001
    assert learning is not None and learning.full == 16384
    status, lease = await store.allocate(store.open_session("small"), b"q" * 32, 1 << 20, depth=0)
    assert lease is None and status == PutStatus.QUOTA
    store.policy.settle()
    assert learning.full == 16384
