"""A put never makes its room from its own ancestors (store.lineage): a chain written a
round at a time into a full pool stays reachable, or its tail is refused."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_client.integrity import checksum
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.policy import BlockMeta, make_policy
from kvpool_sidecar.store import Session, StoreSettings, TieredStore
from kvpool_sidecar.store.lineage import MAX_KEEP, MAX_WALK, Lineage, walk
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from tests.unit.store_support import close_store, make_store

PAGE = 4096
BLOCKS = 100


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=48).digest() for i in range(n)]


def metas(keys: list[bytes]) -> dict[bytes, BlockMeta]:
    return {k: BlockMeta(k, PAGE, depth=i, parent=keys[i - 1] if i else None) for i, k in enumerate(keys)}


# --------------------------------------------------------------------------- the lineage itself
def test_a_session_writing_a_chain_in_order_adds_one_ancestor_a_block() -> None:
    keys = chain("a", 5)
    lin = Lineage()
    assert lin.ancestors(keys[0], None, {}) == set()
    for i in range(1, 5):
        assert lin.ancestors(keys[i], keys[i - 1], {}) == set(keys[:i])  # nothing stored: no walk needed


def test_a_block_that_starts_mid_chain_walks_up_the_stored_entries() -> None:
    a, b = chain("a", 6), chain("b", 3)
    lin = Lineage()
    lin.ancestors(b[1], b[0], {})
    assert lin.ancestors(a[4], a[3], metas(a)) == set(a[:4])
    assert lin.ancestors(a[5], a[4], metas(a)) == set(a[:5])
    assert lin.ancestors(b[0], None, metas(a)) == set()


def test_walks_end_at_a_cycle_an_unknown_block_or_the_walk_limit() -> None:
    x, y = chain("c", 2)
    cycle = {x: BlockMeta(x, PAGE, depth=1, parent=y), y: BlockMeta(y, PAGE, depth=1, parent=x)}
    assert walk(x, cycle) == {x, y}
    keys = chain("unknown", 4)
    assert walk(keys[3], metas(keys[2:])) == {keys[2], keys[3]}  # keys[1] is not stored
    deep = chain("deep", MAX_WALK + 50)
    assert walk(deep[-1], metas(deep)) == set(deep[-MAX_WALK:])  # the nearest ancestors


def test_a_session_keeps_at_most_max_keep_ancestors_the_head_first() -> None:
    keys = chain("long", MAX_KEEP + 10)
    lin = Lineage()
    lin.ancestors(keys[0], None, {})
    for i in range(1, len(keys)):
        got = lin.ancestors(keys[i], keys[i - 1], {})
    assert len(got) == MAX_KEEP and keys[0] in got and keys[-2] not in got


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
    for j in range(start, min(start + n, len(keys))):
        status, lease = await st.allocate(s, keys[j], PAGE, depth=j, parent=keys[j - 1] if j else None)
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


async def test_with_a_tier_below_a_long_chain_demotes_its_own_head_rather_than_refusing(tmp_path: Path) -> None:
    arena = SharedArena(16 * PAGE, populate=False)
    st = TieredStore([DramTier(16 * PAGE, PAGE, arena),
                      DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=1 << 20))],
                     make_policy("prefix"), StoreSettings())
    await st.open()
    try:
        keys = chain("spill", 40)
        s = st.open_session()
        statuses: list[PutStatus] = []
        for start in range(0, len(keys), 8):
            statuses += await put_round(st, s, keys, start, 8)
        assert statuses == [PutStatus.STORED] * 40
        assert st.lookup(keys)[0] == 40
    finally:
        close_store(st)
