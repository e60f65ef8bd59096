"""The store's policy wrapper: reads and commits reach the policy after the answer, and no
choice of the policy changes for it."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from kvpool_sidecar.policy import BlockMeta, LRUPolicy, PrefixAwarePolicy
from kvpool_sidecar.store.accounting import DeferredPolicy


def chain(n: int, first: int = 0, size: int = 100) -> list[BlockMeta]:
    out: list[BlockMeta] = []
    for i in range(n):
        out.append(BlockMeta(b"k%05d" % (first + i), size, depth=i, parent=out[-1].key if out else None))
    return out


def order(p: object, tier: str = "dram") -> list[bytes]:
    return [m.key for m in p.victims(tier)]  # type: ignore[attr-defined]


async def test_reads_and_commits_wait_for_the_end_of_the_callback() -> None:
    inner = LRUPolicy()
    p = DeferredPolicy(inner)
    a, b = chain(2)
    assert p.admit("dram", a) and p.admit("dram", b)
    p.inserted("dram", a)
    p.inserted("dram", b)
    assert p.pending == 4 and order(inner) == []  # nothing reached the policy yet
    await asyncio.sleep(0)  # the loop turns: the queue is applied
    assert p.pending == 0 and order(inner) == [a.key, b.key]
    p.accessed("dram", a)
    assert order(inner) == [a.key, b.key]
    await asyncio.sleep(0)
    assert order(inner) == [b.key, a.key]


async def test_every_choice_first_applies_what_is_queued() -> None:
    inner = LRUPolicy()
    p = DeferredPolicy(inner)
    a, b = chain(2)
    p.inserted("dram", a)
    p.inserted("dram", b)
    p.accessed("dram", a)
    assert order(p) == [b.key, a.key]  # victims: the queue first, in order
    p.accessed("dram", b)
    p.removed("dram", a)  # applied after the read queued before it
    assert p.pending == 0 and order(inner) == [b.key]


def test_outside_an_event_loop_notifications_apply_at_once() -> None:
    inner = LRUPolicy()
    p = DeferredPolicy(inner)
    (a,) = chain(1)
    p.inserted("dram", a)
    assert p.pending == 0 and order(inner) == [a.key]


async def test_a_policy_that_may_refuse_is_asked_at_once() -> None:
    class Picky(LRUPolicy):
        admits_all = False

        def admit(self, tier: str, meta: BlockMeta) -> bool:
            return meta.key.endswith(b"1")

    p = DeferredPolicy(Picky())
    a, b = chain(2)
    assert (p.admit("dram", a), p.admit("dram", b)) == (False, True)


async def test_the_prefix_policy_chooses_the_same_victims_with_and_without_the_wrapper() -> None:
    """A random mix of puts, reads, removals and evictions on two prefix policies, one behind
    the wrapper with the loop turning only now and then: every victim order matches."""
    rnd = random.Random(11)
    bare, inner = PrefixAwarePolicy(), PrefixAwarePolicy()
    wrapped = DeferredPolicy(inner)
    blocks = [m for c in range(40) for m in chain(rnd.randint(1, 8), first=100 * c, size=rnd.choice((64, 100)))]
    resident: set[bytes] = set()
    for step in range(3000):
        m = rnd.choice(blocks)
        op = rnd.random()
        for p in (bare, wrapped):
            if m.key not in resident and op < 0.5:
                assert p.admit("dram", m)
                p.inserted("dram", m)
            elif m.key in resident and op < 0.85:
                p.accessed("dram", m)
            elif m.key in resident:
                p.removed("dram", m, evicted=op < 0.95)
        if m.key not in resident and op < 0.5:
            resident.add(m.key)
        elif m.key in resident and op >= 0.85:
            resident.discard(m.key)
        if len(resident) > 60:  # evict the first victim, as a full tier would
            victim = next(iter(bare.victims("dram")))
            assert next(iter(wrapped.victims("dram"))).key == victim.key
            bare.removed("dram", victim)
            wrapped.removed("dram", victim)
            resident.discard(victim.key)
        if step % 7 == 0:
            await asyncio.sleep(0)
        if step % 50 == 0:
            assert order(wrapped) == order(bare)
    assert order(wrapped) == order(bare) and len(order(bare)) == len(resident)


async def test_a_notification_that_raises_loses_none_of_the_others() -> None:
    class Fragile(LRUPolicy):
        def accessed(self, tier: str, meta: BlockMeta) -> None:
            if meta.key == b"k00000":
                raise RuntimeError("policy bug")
            super().accessed(tier, meta)

    inner = Fragile()
    p = DeferredPolicy(inner)
    a, b = chain(2)
    for m in (a, b):
        inner.inserted("dram", m)
    p.accessed("dram", a)
    p.accessed("dram", b)
    p.inserted("dram", (c := chain(1, first=7)[0]))
    with pytest.raises(RuntimeError, match="policy bug"):
        p.settle()
    assert p.pending == 2
    await asyncio.sleep(0)  # settled again once the loop turns
    assert p.pending == 0 and order(inner) == [a.key, b.key, c.key]


def queued(n: int) -> tuple[LRUPolicy, DeferredPolicy, list[Any]]:
    """An LRU policy behind a deferred one that has ``n`` insertions of a chain waiting."""
    inner = LRUPolicy()
    p = DeferredPolicy(inner)
    blocks = chain(n)
    for m in blocks:
        p.inserted("dram", m)
    return inner, p, blocks


async def test_a_long_queue_is_applied_a_slice_per_turn_and_whole_when_a_choice_needs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_sidecar.store import accounting

    monkeypatch.setattr(accounting, "SETTLE_SLICE", 4)
    inner, p, blocks = queued(10)
    assert p.pending == 10
    await asyncio.sleep(0)  # one turn: one slice, the oldest first
    assert p.pending == 6 and order(inner) == [m.key for m in blocks[:4]]
    await asyncio.sleep(0)
    assert p.pending == 2
    assert order(p) == [m.key for m in blocks]  # a choice applies the rest at once, in order
    assert p.pending == 0
    await asyncio.sleep(0)  # the slice still scheduled finds nothing to do
    assert p.pending == 0 and order(inner) == [m.key for m in blocks]


async def test_a_backlog_past_its_bound_is_applied_in_one_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices that fall behind a busy loop do not pile up for the next choice to apply."""
    from kvpool_sidecar.store import accounting

    monkeypatch.setattr(accounting, "SETTLE_SLICE", 2)
    monkeypatch.setattr(accounting, "MAX_BACKLOG", 5)
    inner, p, blocks = queued(20)
    await asyncio.sleep(0)
    assert p.pending == 5 and order(inner) == [m.key for m in blocks[:15]]
    await asyncio.sleep(0)
    assert p.pending == 3  # then a slice per turn


async def test_one_settling_callback_waits_at_a_time_however_often_a_choice_empties_the_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every put's eviction applies the queue at once, a callback had been scheduled
    for each block written; they all still ran, to find nothing to do."""
    runs = 0
    settle_some = DeferredPolicy._settle_some

    def counted(self: DeferredPolicy) -> None:
        nonlocal runs
        runs += 1
        settle_some(self)

    monkeypatch.setattr(DeferredPolicy, "_settle_some", counted)
    inner = LRUPolicy()
    p = DeferredPolicy(inner)
    blocks = chain(50)
    for m in blocks:
        p.inserted("dram", m)
        assert order(p)[-1] == m.key  # a choice: applied at once
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert runs == 1 and p.pending == 0
    p.accessed("dram", blocks[0])  # and the next notification schedules one again
    await asyncio.sleep(0)
    assert runs == 2 and p.pending == 0 and order(inner)[-1] == blocks[0].key


async def test_what_each_tenants_requests_queued_is_owed_by_that_tenant() -> None:
    """Told to (``charges``: the local API's turns), the wrapper says how long the
    notifications each tenant's requests queued took, wherever they were applied (a slice
    of the loop's, or a choice made in another tenant's request), one that raises included.
    The tenant whose request queued them, not the one whose block it is (in a key space
    tenants share, a tenant's reads of another's blocks would have been the other's to pay);
    queued outside any request (the write-ahead, promotions), they are no one's."""
    now = [0.0]

    class Slow(LRUPolicy):  # each notification takes a second of this clock
        def admit(self, tier: str, meta: BlockMeta) -> bool:
            now[0] += 1
            return super().admit(tier, meta)

        def inserted(self, tier: str, meta: BlockMeta) -> None:
            now[0] += 1
            super().inserted(tier, meta)

        def accessed(self, tier: str, meta: BlockMeta) -> None:
            now[0] += 1
            super().accessed(tier, meta)

    class Turns:
        payer: str | None = None

        def __init__(self) -> None:
            self.owed: dict[str, float] = {}
            self.relieved: dict[str | None, float] = {}

        def owe(self, tenant: str, seconds: float) -> None:
            self.owed[tenant] = self.owed.get(tenant, 0.0) + seconds

        def relieve(self, seconds: float) -> None:
            self.relieved[self.payer] = self.relieved.get(self.payer, 0.0) + seconds

    turns = Turns()
    p = DeferredPolicy(Slow())
    p.clock = lambda: now[0]
    p.charges = turns
    a = [BlockMeta(b"a%05d" % i, 100, tenant="a", depth=i) for i in range(3)]
    b = [BlockMeta(b"b%05d" % i, 100, tenant="b", depth=i) for i in range(2)]
    for payer, metas in (("a", a[:2]), ("b", b), ("a", a[2:])):
        turns.payer = payer
        for m in metas:
            p.admit("dram", m)
            p.inserted("dram", m)
    turns.payer = None
    await asyncio.sleep(0)  # a slice of the loop's
    assert turns.owed == {"a": 6.0, "b": 4.0}
    turns.payer = "a"  # a reads b's block (a key space they share)
    p.accessed("dram", b[0])
    turns.payer = "b"
    list(p.victims("dram"))  # a choice in b's request applies it at once
    assert turns.owed == {"a": 7.0, "b": 4.0}
    turns.payer = None  # the write-ahead's, a promotion's
    p.accessed("dram", a[1])
    p.accessed("dram", a[2])
    turns.payer = "b"
    list(p.victims("dram"))  # applied in b's request: not b's to pay either
    assert turns.owed == {"a": 7.0, "b": 4.0} and turns.relieved == {"b": 2.0}

    def broken(tier: str, meta: BlockMeta) -> None:
        now[0] += 1
        raise RuntimeError("a policy's bug")

    turns.payer = "a"
    p._later(broken, "dram", a[0])
    turns.payer = None
    with pytest.raises(RuntimeError):
        p.settle()
    assert turns.owed["a"] == 8.0
