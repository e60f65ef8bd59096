"""What one tenant's traffic does to another's retention: a tenant whose quota bounds its
room must not tune what the policy shares between tenants (the duel's choice of order,
each tier's split between blocks read once and blocks read again), or it turns them
against the others from within a few pages (a real store, its DRAM tier, two sessions)."""

from __future__ import annotations

import random

import pytest

from kvpool_sidecar.policy import POLICIES
from kvpool_sidecar.store import StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.store.leases import Session
from kvpool_sidecar.tiers.dram import DramTier

PAGE = 4096
BLOCKS = 512
HOT = 350
STEPS = 12_000


def key(tag: bytes, i: int) -> bytes:
    return tag + i.to_bytes(47, "big")


async def read_or_put(store: TieredStore, session: Session, k: bytes) -> bool:
    """A request of one block: a hit, or a put of it after the miss."""
    lease = await store.acquire(session, k)
    if lease is not None:
        store.release(session, lease.id)
        return True
    _, write = await store.allocate(session, k, PAGE, depth=0)
    if write is not None:
        store.commit(session, write.id, 0)
    return False


async def victims_hot_hit_rate(policy: str, attack: str) -> float:
    """The victim reads a hot set at random half the time and puts a block never read again
    the other half; the attacker, with a quota of 16 pages of the 512, makes two calls per
    victim call: ``fresh`` puts new blocks (the control), ``regrow`` puts each key twice, 20
    puts apart (its own quota evicted it meanwhile: a ghost hit), ``twice`` reads each new
    block at once."""
    rnd = random.Random(1)
    settings = StoreSettings(tenants={"v": TenantLimits(0, None), "a": TenantLimits(0, 16 * PAGE)})
    store = TieredStore([DramTier(BLOCKS * PAGE, PAGE, None)], POLICIES[policy](), settings)
    victim, attacker = store.open_session("v"), store.open_session("a")
    hits = asked = 0
    for step in range(1, STEPS + 1):
        if rnd.random() < 0.5:
            hit = await read_or_put(store, victim, key(b"H", rnd.randrange(HOT)))
            if step > STEPS // 3:
                hits, asked = hits + hit, asked + 1
        else:
            await read_or_put(store, victim, key(b"S", step))
        if attack == "regrow":
            await read_or_put(store, attacker, key(b"A", step))
            if step > 20:
                await read_or_put(store, attacker, key(b"A", step - 20))
        elif attack == "twice":
            await read_or_put(store, attacker, key(b"A", step))
            await read_or_put(store, attacker, key(b"A", step))
        else:
            await read_or_put(store, attacker, key(b"A", step))
            await read_or_put(store, attacker, key(b"B", step))
    return hits / asked


@pytest.mark.parametrize("policy", ["prefix", "prefix-arc"])
async def test_a_tenant_bounded_by_its_quota_cannot_turn_the_policy_against_another(policy: str) -> None:
    control = await victims_hot_hit_rate(policy, "fresh")
    assert control > 0.95
    for attack in ("regrow", "twice"):  # (they had brought it to .59 and .77)
        assert await victims_hot_hit_rate(policy, attack) > control - 0.03, attack


def test_a_bounded_tenants_blocks_move_no_estimate_the_others_share() -> None:
    """Nor its sizes (one 64 MiB put had made every other block a partial tail) or its counts;
    and its own blocks still go in order of recency (a node where every tenant has a quota)."""
    from kvpool_sidecar.policy import BlockMeta, PrefixAwarePolicy

    p = PrefixAwarePolicy()
    p.bounded(frozenset({"a"}))
    learning = p._learning
    assert learning is not None

    def put(meta: BlockMeta) -> None:
        p.admit("dram", meta)
        p.inserted("dram", meta)

    put(BlockMeta(key(b"V", 0), PAGE, tenant="v", depth=0))
    full, followed = learning.full, learning.estimator.followed
    put(BlockMeta(key(b"A", 0), 64 << 20, tenant="a", depth=0))
    assert learning.full == full and learning.estimator.followed == followed
    own = [BlockMeta(key(b"A", 10 + i), PAGE, tenant="a", depth=0) for i in range(3)]
    for meta in own:
        put(meta)
    p.accessed("dram", own[0])
    first = [m.key for m in p.victims("dram", "a") if m.key != key(b"A", 0)]
    assert first.index(own[1].key) < first.index(own[0].key)  # the one read last goes last
