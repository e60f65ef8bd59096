"""One contract for every retention policy (:class:`kvpool_sidecar.policy.EvictionPolicy`).

Every policy of the registry, alone and behind the wrappers the sidecar and the replay put
around it (the store's :class:`~kvpool_sidecar.store.accounting.DeferredPolicy`, outside and
inside an event loop, and the replay's :class:`~kvpool_bench.footprint.TimedPolicy`), is
driven by the same random notifications as the store sends them, against a model of what
is resident where. Whatever order a policy prefers, it must answer alike:

- ``victims(tier)`` yields every resident block of that tier once, and nothing else: a
  block removed (evicted or lost) is never offered again, a block held in two tiers is
  offered by each, notifications about blocks a tier does not hold change nothing;
- ``victims(tier, tenant)`` is that order restricted to the tenant's blocks, for a tenant
  without a quota; for one with a quota (``bounded``) it is each of the tenant's resident
  blocks once, its skipped ones last, in an order of the policy's own (its quota's
  evictions go by its own blocks: another tenant with a quota had moved the tier's split
  and chosen which of them went);
- lower priorities go first, and a block the store walked past (``skipped``) goes after
  every other block of every priority until it is ``restored`` or removed;
- what a policy keeps of blocks no longer resident is bounded, whatever hints and keys
  its writers send.
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

from kvpool_bench.footprint import TimedPolicy
from kvpool_sidecar.policy import POLICIES, BlockMeta, EvictionPolicy, Hints, ShadowPolicy, make_policy
from kvpool_sidecar.store.accounting import DeferredPolicy

TIERS = ("dram", "disk")
TENANTS = {"a": 0, "b": 0, "low": -1, "high": 3}  # tenant: its priority
#: The tenants with a quota.
BOUNDED = frozenset({"b"})
BLOCK = 4096


def _variants() -> dict[str, Callable[[], EvictionPolicy]]:
    out: dict[str, Callable[[], EvictionPolicy]] = {}
    for name in POLICIES:
        out[name] = lambda name=name: make_policy(name)  # type: ignore[misc]
        out["deferred:" + name] = lambda name=name: DeferredPolicy(make_policy(name))  # type: ignore[misc]
    out["timed:prefix"] = lambda: TimedPolicy(make_policy("prefix"))
    return out


VARIANTS = _variants()


class Model:
    """What the store has told the policy: the resident blocks of each tier, and the ones it
    walked past and has not restored."""

    def __init__(self, policy: EvictionPolicy, rnd: random.Random, keys: int) -> None:
        self.policy = policy
        self.rnd = rnd
        self.resident: dict[str, dict[bytes, BlockMeta]] = {t: {} for t in TIERS}
        self.held: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self.metas = [self._meta(i) for i in range(keys)]

    def _meta(self, i: int) -> BlockMeta:
        tenant = self.rnd.choice(sorted(TENANTS))
        depth = i % 8
        parent = None if depth == 0 else (i - 1).to_bytes(8, "big")
        hints = None if i % 3 else Hints(prompt_blocks=8, session=f"s{i // 24}", label="turn")
        return BlockMeta(key=i.to_bytes(8, "big"), size=BLOCK * (1 + i % 3), tenant=tenant,
                         priority=TENANTS[tenant], depth=depth, parent=parent, hints=hints)

    def step(self) -> None:
        p, rnd = self.policy, self.rnd
        m = rnd.choice(self.metas)
        tier = rnd.choice(TIERS)
        resident = self.resident[tier]
        op = rnd.random()
        if op < 0.30:
            if p.admit(tier, m) is True or m.key in resident:
                p.inserted(tier, m)  # (a put again of a resident block lands in place)
                resident[m.key] = m
        elif op < 0.55:
            p.accessed(tier, m, again=op >= 0.50)  # (again: the same read, told for another copy)
        elif op < 0.62:
            p.bypassed(tier, m)
        elif op < 0.75:
            p.removed(tier, m, evicted=rnd.random() < 0.8)
            resident.pop(m.key, None)
            self.held[tier].discard(m.key)
        elif op < 0.85:
            if m.key in resident:  # the store skips only blocks its walk met
                p.skipped(tier, m)
                self.held[tier].add(m.key)
        elif op < 0.93:
            if m.key in self.held[tier]:  # and restores only those it skipped
                p.restored(tier, m)
                self.held[tier].discard(m.key)
        else:  # a walk the store gives up part way
            walk = p.victims(tier)
            for _ in range(rnd.randint(0, 5)):
                if next(walk, None) is None:
                    break

    def check(self) -> None:
        for tier in TIERS:
            order = [m.key for m in self.policy.victims(tier)]
            assert len(order) == len(set(order)), f"{tier}: a block offered twice"
            assert set(order) == set(self.resident[tier]), f"{tier}: offered {len(order)} blocks, " \
                f"{len(self.resident[tier])} resident"
            held = self.held[tier]
            free = [k for k in order if k not in held]
            assert order[len(free):] == [k for k in order if k in held], f"{tier}: a skipped block before another"
            levels = [self.resident[tier][k].priority for k in free]
            assert levels == sorted(levels), f"{tier}: a higher priority before a lower one"
            for tenant in TENANTS:
                own = [m.key for m in self.policy.victims(tier, tenant)]
                theirs = [k for k in order if self.resident[tier][k].tenant == tenant]
                if tenant not in BOUNDED:
                    assert own == theirs, f"{tier}: tenant {tenant}'s order is not the tier's, restricted"
                    continue
                assert len(own) == len(set(own)) and set(own) == set(theirs), \
                    f"{tier}: tenant {tenant}'s order does not offer each of its blocks once"
                mine = [k for k in own if k not in held]
                assert own[len(mine):] == [k for k in own if k in held], \
                    f"{tier}: tenant {tenant}'s skipped block before another"


def _run(make: Callable[[], EvictionPolicy], seed: int, steps: int, *, in_loop: bool) -> None:
    def body() -> None:
        policy = make()
        policy.sized(64 * BLOCK)
        policy.bounded(BOUNDED)
        model = Model(policy, random.Random(seed), keys=48)
        for i in range(steps):
            model.step()
            if i % 7 == 0:
                model.check()
        model.check()

    if not in_loop:
        body()
        return

    async def main() -> None:  # notifications queue for later turns of the loop
        body()

    asyncio.run(main())


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_victims_are_the_resident_blocks_in_priority_order(variant: str, seed: int) -> None:
    _run(VARIANTS[variant], seed, 1500, in_loop=False)


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if v.startswith("deferred:")))
def test_notifications_deferred_in_an_event_loop_are_applied_before_any_choice(variant: str) -> None:
    _run(VARIANTS[variant], 4, 1500, in_loop=True)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_that_runs_a_shadow_says_what_each_tier_holds(name: str) -> None:
    """What a duel's shadow asks more of a policy (:class:`ShadowPolicy`): each tier's
    resident blocks, as inserted, and nothing else, through the same random notifications."""
    policy = make_policy(name)
    assert isinstance(policy, ShadowPolicy)  # every policy here may run a shadow
    policy.sized(64 * BLOCK)
    model = Model(policy, random.Random(5), keys=48)
    for _ in range(1500):
        model.step()
        for tier in TIERS:
            resident = model.resident[tier]
            keys = policy.resident_keys(tier)
            assert len(keys) == len(resident) and set(keys) == set(resident), tier
            assert all(policy.resident(tier, m.key) is resident.get(m.key) for m in model.metas), tier
    assert policy.resident("gpu", model.metas[0].key) is None and not policy.resident_keys("gpu")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_block_of_two_tiers_leaves_one_and_stays_in_the_other(variant: str) -> None:
    p = VARIANTS[variant]()
    a, b = (BlockMeta(key=bytes([i]) * 8, size=BLOCK) for i in (1, 2))
    for m in (a, b):
        assert p.admit("dram", m) is True
        p.inserted("dram", m)
    assert p.admit("disk", a) is True
    p.inserted("disk", a)
    p.removed("dram", a)
    assert [m.key for m in p.victims("dram")] == [b.key]
    assert [m.key for m in p.victims("disk")] == [a.key]
    p.removed("dram", a)  # gone from there already: nothing changes
    p.accessed("dram", a)
    p.skipped("dram", a)
    p.restored("dram", a)
    assert [m.key for m in p.victims("dram")] == [b.key]
    assert [m.key for m in p.victims("gpu")] == []  # a tier never told of
    assert [m.key for m in p.victims("disk", "nobody")] == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_admit_alone_makes_nothing_resident(variant: str) -> None:
    p = VARIANTS[variant]()
    m = BlockMeta(key=b"k" * 8, size=BLOCK)
    assert p.admit("dram", m) in (True, False)
    assert list(p.victims("dram")) == []


def _hostile(i: int) -> BlockMeta:
    """A block of its own session, label and chain, as a writer may send any number of."""
    return BlockMeta(key=i.to_bytes(8, "big") + b"\xff" * 24, size=BLOCK, tenant="t",
                     depth=i % 1000, parent=(i - 1).to_bytes(8, "big") + b"\xff" * 24 if i % 1000 else None,
                     hints=Hints(prompt_blocks=i, session=f"session-{i}", label=f"label-{i}"))


def _churn(p: EvictionPolicy, start: int, count: int, resident: list[BlockMeta]) -> None:
    """``count`` new blocks through a tier of 64: each admitted, inserted and read once, the
    first victim evicted; every fifth admitted only (its allocation failed)."""
    for i in range(start, start + count):
        m = _hostile(i)
        if not p.admit("dram", m):
            continue
        if i % 5 == 0:
            continue
        p.inserted("dram", m)
        p.accessed("dram", m)
        resident.append(m)
        if len(resident) > 64:
            victim: Iterator[BlockMeta] = p.victims("dram")
            gone = next(victim)
            p.removed("dram", gone)
            resident.remove(gone)


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if not v.startswith("deferred:")))
def test_what_a_policy_keeps_of_blocks_gone_is_bounded(variant: str) -> None:
    """64 blocks resident at most, each new block of its own session, label and prompt
    length: what the policy holds stops growing once its bounded tables are full (the
    sessions it remembers, its shadows, its estimates). Traced from the end of a warm-up:
    the next 12,000 blocks fill and renew those tables, and the 12,000 after them must leave
    it as it was, give or take; state kept per block gone, per session or per label would
    grow by hundreds of kilobytes."""
    p = VARIANTS[variant]()
    p.sized(64 * BLOCK)
    resident: list[BlockMeta] = []
    _churn(p, 0, 6000, resident)
    tracemalloc.start()
    try:
        _churn(p, 6000, 12000, resident)
        full = tracemalloc.get_traced_memory()[0]
        _churn(p, 18000, 12000, resident)
        grown = tracemalloc.get_traced_memory()[0] - full
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{variant}: {grown} bytes more after 12,000 more blocks came and went"
