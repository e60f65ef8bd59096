"""KV events without sockets: what the store queues on every way a named block enters or
leaves a tier, the bounded queue, and how events merge and encode (tests/integration/
test_kv_events.py runs them through a real sidecar and a ZMQ subscriber)."""

from __future__ import annotations

from collections import Counter

from kvpool_client.integrity import checksum
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.events import EngineEvent, EngineEventQueue, EngineRef
from kvpool_sidecar.kvevents import MEDIA, encode_event, runs, take_batch
from kvpool_sidecar.store import Session, TieredStore
from kvpool_sidecar.tiers.base import TierKind
from tests.unit.test_store import PAGE, PAGES, Harness, harness, key, payload  # noqa: F401 - fixture


def ref(i: int, parent: int | None = None, **kw: object) -> EngineRef:
    return EngineRef(hash=i, parent=parent, token_ids=(i, i + 1), block_size=2, **kw)  # type: ignore[arg-type]


async def put_named(st: TieredStore, s: Session, i: int, engine: EngineRef | None, size: int = PAGE) -> PutStatus:
    status, lease = await st.allocate(s, key(i), size, engine=engine)
    if lease is None:
        return status
    views = st.host.views(lease.place)
    data = payload(i, size)
    pos = 0
    for v in views:
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes
    return st.commit(s, lease.id, checksum(views))


def seen(q: EngineEventQueue) -> list[tuple[bool, str, object]]:
    return [(e.stored, e.tier, e.engine.hash) for e in drain(q)]


def drain(q: EngineEventQueue) -> list[EngineEvent]:
    """Every event queued, oldest first (as the publisher takes them, a batch at a time)."""
    out: list[EngineEvent] = []
    while q.items:
        out += take_batch(q.items)
    return out


def test_every_tier_has_a_medium() -> None:
    assert set(MEDIA) == {TierKind.DRAM.value, TierKind.DISK.value}


async def test_the_store_queues_puts_evictions_demotions_promotions_and_corruption(harness: Harness) -> None:
    st = await harness.store(disk=True)
    q = st.engine_events = EngineEventQueue(1000, st.metrics.counts)
    s = st.open_session()
    for i in range(PAGES):
        assert await put_named(st, s, i, ref(i)) == PutStatus.STORED
    assert await put_named(st, s, 100, None) == PutStatus.STORED  # unnamed: evicts block 0, says nothing of itself
    assert seen(q) == [(True, "dram", i) for i in range(PAGES)] + [(True, "disk", 0), (False, "dram", 0)]
    lease = await st.acquire(s, key(0))  # promoted back
    assert lease is not None
    st.release(s, lease.id)
    assert (True, "dram", 0) in seen(q)
    # found corrupt: it leaves every tier it was in
    lease = await st.acquire(s, key(0))
    assert lease is not None
    st.host.views(lease.place)[0][0] ^= 0xFF
    st.release(s, lease.id, corrupt=True)
    assert seen(q) == [(False, "dram", 0), (False, "disk", 0)]
    assert st.metrics.counts["kvevents_dropped"] == 0


async def test_a_block_named_later_is_announced_where_it_is(harness: Harness) -> None:
    st = await harness.store()
    q = st.engine_events = EngineEventQueue(1000, st.metrics.counts)
    s = st.open_session()
    assert await put_named(st, s, 1, None) == PutStatus.STORED
    assert seen(q) == []
    assert await put_named(st, s, 1, ref(1)) == PutStatus.EXISTS
    assert seen(q) == [(True, "dram", 1)]
    assert await put_named(st, s, 1, ref(99)) == PutStatus.EXISTS  # the first name stays
    assert seen(q) == []
    assert [(e.tier, e.engine.hash) for e in await st.report.engine_inventory_soon()] == [("dram", 1)]


def test_a_full_queue_drops_counts_and_asks_for_everything_again() -> None:
    counts: Counter[str] = Counter()
    q = EngineEventQueue(2, counts, frozenset({"a"}))
    for i in range(4):
        q.put(True, "dram", "a", ref(i))
    q.put(True, "dram", "b", ref(9))  # another tenant: not announced, not counted
    assert counts["kvevents_dropped"] == 2 and q.lost and q.ready.is_set()
    assert [e.engine.hash for e in drain(q)] == [0, 1]


def test_a_chain_in_one_tier_is_one_block_stored_and_breaks_where_it_changes() -> None:
    evs = [EngineEvent(True, "dram", "t", ref(1)), EngineEvent(True, "dram", "t", ref(2, 1)),
           EngineEvent(True, "disk", "t", ref(3, 2)),  # another medium
           EngineEvent(True, "disk", "t", ref(5, 4)),  # not the previous block's child
           EngineEvent(True, "disk", "t", ref(6, 5, lora_id=3)),  # another adapter
           EngineEvent(False, "dram", "t", ref(1)), EngineEvent(False, "dram", "t", ref(2))]
    got = [(r.stored, r.medium, r.hashes, r.parent) for r in runs(evs)]
    assert got == [(True, "CPU", [1, 2], None), (True, "STORAGE", [3], 2), (True, "STORAGE", [5], 4),
                   (True, "STORAGE", [6], 5), (False, "CPU", [1, 2], None)]


def test_both_encodings_carry_the_same_fields_in_vllms_order() -> None:
    [stored] = runs([EngineEvent(True, "dram", "t", ref(1, extra_keys=("salt",))),
                     EngineEvent(True, "dram", "t", ref(2, 1))])
    [removed] = runs([EngineEvent(False, "disk", "t", ref(1))])
    assert encode_event(stored, array=False) == {
        "type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 2, 3],
        "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None, "extra_keys": [("salt",), None]}
    assert encode_event(stored, array=True) == \
        ["BlockStored", [1, 2], None, [1, 2, 2, 3], 2, None, "CPU", None, [("salt",), None]]
    assert encode_event(removed, array=False) == {"type": "BlockRemoved", "block_hashes": [1], "medium": "STORAGE"}
    assert encode_event(removed, array=True) == ["BlockRemoved", [1], "STORAGE"]
    assert encode_event(None, array=False) == {"type": "AllBlocksCleared"}
    assert encode_event(None, array=True) == ["AllBlocksCleared"]
