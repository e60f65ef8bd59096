"""A put never makes its room from its own ancestors (store.lineage): a chain written a
round at a time into a full pool stays reachable, or its tail is refused."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from pathlib import Path

import pytest

from kvpool_client.integrity import checksum
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.policy import BlockMeta, make_policy
from kvpool_sidecar.store import Session, StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.store.lineage import MAX_WALK, WALK_BUDGET, Lineage
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from tests.unit.store_support import close_store, make_store

PAGE = 4096
BLOCKS = 100


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=48).digest() for i in range(n)]


class CountingEntries(dict[bytes, BlockMeta]):
    """Stored entries that count how often a walk reads them."""

    gets = 0

    def get(self, key: bytes, default: Any = None) -> Any:  # type: ignore[override]
        self.gets += 1
        return super().get(key, default)


def metas(keys: list[bytes]) -> dict[bytes, BlockMeta]:
    return {k: BlockMeta(k, PAGE, depth=i, parent=keys[i - 1] if i else None) for i, k in enumerate(keys)}


# --------------------------------------------------------------------------- the lineage itself
def test_a_request_writing_a_chain_in_order_adds_one_ancestor_a_block() -> None:
    keys = chain("a", 5)
    lin = Lineage({})
    assert set(lin.ancestors(keys[0], None)) == set() and not lin.ancestors(keys[0], None)
    for i in range(1, 5):
        assert set(lin.ancestors(keys[i], keys[i - 1])) == set(keys[:i])  # known from the request itself


def test_ancestors_are_found_only_when_asked_and_walk_up_the_stored_entries() -> None:
    a = chain("a", 8)
    stored = CountingEntries(metas(a[:5]))
    lin = Lineage(stored)
    lazy = [lin.ancestors(a[i], a[i - 1]) for i in range(5, 8)]
    assert stored.gets == 0  # nothing walked until a put has to evict
    assert a[4] in lazy[0] and stored.gets == 0  # the parent needs no walk
    assert a[0] in lazy[0] and stored.gets == 5
    assert set(lazy[1]) == set(a[:6]) and set(lazy[2]) == set(a[:7])
    assert stored.gets == 5  # the next ones of the chain: one key each, no walk
    assert chain("b", 1)[0] not in lazy[1]


def test_the_walk_goes_up_through_blocks_another_request_has_pending() -> None:
    """A chain put in pieces: its earlier pieces are allocated, not committed, when a later
    piece is allocated in a request of its own; their parents lead on to the stored head."""
    a = chain("a", 9)
    stored = metas(a[:3])
    pending = {k: a[i - 1] for i, k in enumerate(a) if 3 <= i < 6}
    assert set(Lineage(stored, pending).ancestors(a[6], a[5])) == set(a[:6])
    assert set(Lineage(stored).ancestors(a[6], a[5])) == {a[5]}  # (without them the walk stopped there)


def walk(parent: bytes, entries: dict[bytes, BlockMeta]) -> set[bytes]:
    """The ancestors a fresh request's lineage finds for a new block under ``parent``."""
    return set(Lineage(entries).ancestors(b"\xff" * 48, parent))


def test_walks_end_at_a_cycle_an_unknown_block_or_the_walk_limit() -> None:
    x, y = chain("c", 2)
    cycle = {x: BlockMeta(x, PAGE, depth=1, parent=y), y: BlockMeta(y, PAGE, depth=1, parent=x)}
    assert walk(x, cycle) == {x, y}
    keys = chain("unknown", 4)
    assert walk(keys[3], metas(keys[2:])) == {keys[2], keys[3]}  # keys[1] is not stored
    deep = chain("deep", MAX_WALK + 50)
    assert walk(deep[-1], metas(deep)) == set(deep[-MAX_WALK:])  # the nearest ancestors


def test_one_request_walks_at_most_its_budget_then_sees_parents_alone() -> None:
    deep = chain("deep", MAX_WALK + 1)
    stored = CountingEntries(metas(deep))
    lin = Lineage(stored)
    others = chain("other", 10)
    for k in others:  # each block names the deepest stored block as its parent: a walk each
        found = lin.ancestors(k, deep[-1])
        assert deep[-1] in found and len(found) >= 1
    assert stored.gets <= WALK_BUDGET  # a hostile request's walks cost a bounded amount
    assert len(lin.ancestors(chain("x", 1)[0], deep[-2])) == 1  # past the budget: the parent alone


# --------------------------------------------------------------------------- in the store
#: After chain A (40 blocks, read five times) and chain B (90 blocks, written ten at a
#: time) in a pool of 100 without a disk: what each policy keeps of A and of B.
KEPT = {"prefix": (40, 60), "lru": (10, 90)}


@pytest.fixture(params=sorted(KEPT))
def store(request: pytest.FixtureRequest) -> Iterator[TieredStore]:
    st = make_store(BLOCKS * PAGE, PAGE, policy=make_policy(request.param))
    st.policy_name = request.param  # type: ignore[attr-defined]
    yield st
    close_store(st)


async def put_round(st: TieredStore, s: Session, keys: list[bytes], start: int, n: int) -> list[PutStatus]:
    """Blocks ``start`` to ``start + n`` of a chain in one round: every block allocated (its
    depth and parent given), then every block committed, as the local API does."""
    leases = []
    out = []
    lineage = st.lineage()  # one per request
    for j in range(start, min(start + n, len(keys))):
        status, lease = await st.allocate(s, keys[j], PAGE, depth=j, parent=keys[j - 1] if j else None,
                                          lineage=lineage)
        out.append(status)
        if lease is not None:
            leases.append(lease)
    for lease in leases:
        views = st.host.views(lease.place)
        for v in views:
            v[:] = lease.meta.key[:1] * v.nbytes
        st.commit(s, lease.id, checksum(views))
    return [PutStatus.STORED if s == PutStatus.ALLOCATED else s for s in out]


async def read_all(st: TieredStore, keys: list[bytes]) -> None:
    s = st.open_session()
    for k in keys:
        lease = await st.acquire(s, k)
        if lease is None:
            break
        st.release(s, lease.id)


def stored(st: TieredStore, keys: list[bytes]) -> int:
    return sum(1 for k in keys if k in st._entries)  # noqa: SLF001


async def test_a_chain_put_in_rounds_into_a_full_pool_never_evicts_its_own_head(store: TieredStore) -> None:
    """The policy still chooses: the default one keeps the chain read five times and
    refuses B's tail (each block of B is worth less than its parent, which it would have
    evicted); LRU keeps the newer chain whole. Neither stores a block it cannot reach."""
    await store.open()
    kept_a, kept_b = KEPT[store.policy_name]  # type: ignore[attr-defined]
    a, b = chain("a", 40), chain("b", 90)
    s = store.open_session()
    await put_round(store, s, a, 0, len(a))
    for _ in range(5):
        await read_all(store, a)  # A is worth more, block for block, than anything of B
    writer = store.open_session()
    for start in range(0, len(b), 10):
        await put_round(store, writer, b, start, 10)
    assert store.lookup(b)[0] == stored(store, b) == kept_b  # every block of B stored is reachable
    assert stored(store, a) == kept_a  # (LRU keeps A's last ten: another chain's head is fair game)


async def test_a_chain_longer_than_the_coldest_tier_is_refused_past_what_fits(store: TieredStore) -> None:
    await store.open()
    keys = chain("long", BLOCKS + 20)
    s = store.open_session()
    statuses: list[PutStatus] = []
    for start in range(0, len(keys), 16):
        statuses += await put_round(store, s, keys, start, 16)
    assert statuses[:BLOCKS] == [PutStatus.STORED] * BLOCKS
    assert statuses[BLOCKS:] == [PutStatus.FULL] * 20  # stored, they would have cost the head
    assert store.lookup(keys)[0] == BLOCKS


@pytest.fixture
def spill(tmp_path: Path) -> Iterator[Callable[[int], Awaitable[TieredStore]]]:
    """Stores of 16 DRAM blocks over a disk tier of ``disk_bytes``."""
    made: list[TieredStore] = []

    async def make(disk_bytes: int) -> TieredStore:
        st = TieredStore([DramTier(16 * PAGE, PAGE, SharedArena(16 * PAGE, populate=False)),
                          DiskTier(DiskSettings(path=str(tmp_path / f"disk{len(made)}"), size_bytes=disk_bytes))],
                         make_policy("prefix"), StoreSettings())
        made.append(st)
        await st.open()
        return st

    yield make
    for st in made:
        close_store(st)


async def put_chain(st: TieredStore, keys: list[bytes], per_round: int = 8) -> list[PutStatus]:
    s = st.open_session()
    return [x for start in range(0, len(keys), per_round) for x in await put_round(st, s, keys, start, per_round)]


async def test_with_a_tier_below_a_long_chain_demotes_its_own_head_rather_than_refusing(
        spill: Callable[[int], Awaitable[TieredStore]]) -> None:
    st = await spill(1 << 20)
    keys = chain("spill", 40)
    assert await put_chain(st, keys) == [PutStatus.STORED] * 40
    assert st.lookup(keys)[0] == 40


async def test_with_a_full_tier_below_every_block_stored_stays_reachable(
        spill: Callable[[int], Awaitable[TieredStore]]) -> None:
    """DRAM demotes the chain's head to a disk that fills too: the disk's room is made from
    none of the put's ancestors either, and an ancestor whose demotion fails is not dropped."""
    st = await spill(96 * 1024)
    keys = chain("spill-full", 80)
    statuses = await put_chain(st, keys)
    held = stored(st, keys)
    assert 16 < held < 80 and PutStatus.FULL in statuses  # more than DRAM holds, less than asked
    assert st.lookup(keys)[0] == held  # and not one of them unreachable


async def test_a_tenant_at_its_quota_is_refused_full_rather_than_losing_its_head() -> None:
    st = make_store(BLOCKS * PAGE, PAGE, policy=make_policy("prefix"),
                    settings=StoreSettings(tenants={"default": TenantLimits(quota_bytes=10 * PAGE)}))
    await st.open()
    try:
        keys = chain("quota", 15)
        s = st.open_session()
        statuses = [x for start in (0, 5, 10) for x in await put_round(st, s, keys, start, 5)]
        assert statuses == [PutStatus.STORED] * 10 + [PutStatus.FULL] * 5
        assert st.lookup(keys)[0] == 10
    finally:
        close_store(st)


async def test_a_fetch_from_a_peer_spares_the_chain_it_completes() -> None:
    """A node full of a hot chain and the head of X fetches X's tail: the first fetched
    block's parent is the head's last block (which the transport cannot know; the request
    tells the sink), so the fetch never evicts X's head to store a tail it cuts off."""
    from kvpool_sidecar.peers import StoreSink

    st = make_store(BLOCKS * PAGE, PAGE, policy=make_policy("prefix"))
    await st.open()
    try:
        x, hot = chain("x", 50), chain("hot", 70)
        s = st.open_session()
        await put_round(st, s, x, 0, 30)
        await put_round(st, s, hot, 0, 70)
        for _ in range(5):
            await read_all(st, hot)
        sink = StoreSink(st)
        noted = sink.expect(x, x[30:])  # (without it, X's head is evicted and its tail unreachable)
        tail = x[30:]
        rooms = [await sink.reserve(k, PAGE, "default", depth=i, parent=tail[i - 1] if i else None)
                 for i, k in enumerate(tail)]  # as a transport reserves a fetch
        for room in rooms:
            if room is not None:
                lease, views = room
                for v in views:
                    v[:] = b"\x07" * v.nbytes
                sink.commit(lease, checksum(views))
        sink.forget(noted)
        assert not sink._before  # noqa: SLF001 - nothing of the fetch is kept
        held = stored(st, x)
        assert st.lookup(x)[0] == held >= 30  # the head stays; every block stored is reachable
    finally:
        close_store(st)
