"""The tiered store over a small real arena and a real disk tier in a temporary directory."""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.integrity import checksum
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import QuotaError, UnknownLeaseError
from kvpool_sidecar.events import EngineEventQueue, EngineRef, IndexEvent
from kvpool_sidecar.policy import BlockMeta, Hints, LRUPolicy, make_policy
from kvpool_sidecar.store import leases
from kvpool_sidecar.store import Session, StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from kvpool_sidecar.tiers.segments import SegmentDiskTier
from tests.unit.store_support import HeldWrites, close_store, disk, dram, dram_place, entry, in_tier, make_store

PAGE = 4096
PAGES = 16
DISK_BYTES = 1 << 20


def key(i: int | str) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=48).digest()


def payload(i: int | str, size: int = PAGE) -> bytes:
    return random.Random(str(i)).randbytes(size)


class Harness:
    """Builds stores over one arena (and optionally one disk directory)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.arenas: list[SharedArena] = []

    async def store(
        self,
        *,
        disk: bool = False,
        disk_bytes: int = DISK_BYTES,
        tenants: dict[str, TenantLimits] | None = None,
        clock: Callable[[], float] | None = None,
        block_max_bytes: int = 8 * PAGE,
        demote: bool = True,
        session_share: float = 1.0,
        clean_share: float = 0.0,
        layout: str = "files",
        put_waits_for_disk: bool = True,
    ) -> TieredStore:
        arena = SharedArena(PAGES * PAGE, populate=False)
        self.arenas.append(arena)
        dram = DramTier(PAGES * PAGE, PAGE, arena)
        disk_settings = DiskSettings(path=str(self.tmp_path / "disk"), size_bytes=disk_bytes, layout=layout)
        tier = (DiskTier(disk_settings) if layout == "files" else SegmentDiskTier(disk_settings)) if disk else None
        settings = StoreSettings(
            tenants=tenants or {"default": TenantLimits()}, block_max_bytes=block_max_bytes, lease_timeout_s=30.0,
            demote=demote, session_share=session_share, clean_share=clean_share,
            put_waits_for_disk=put_waits_for_disk,
        )
        kw: dict[str, Any] = {}
        if clock is not None:
            kw["clock"] = clock
        st = TieredStore([dram, tier] if tier is not None else [dram], LRUPolicy(), settings, **kw)
        self.opened = await st.open()
        return st

    def close(self) -> None:
        for a in self.arenas:
            a.close()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.close()


async def put(st: TieredStore, s: Session, k: bytes, data: bytes, *, tenant: str | None = None) -> PutStatus:
    status, lease = await st.allocate(s, k, len(data), tenant=tenant)
    if lease is None:
        return status
    assert status == PutStatus.ALLOCATED
    views = st.host.views(lease.place)
    pos = 0
    for v in views:
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes
    assert pos == len(data)
    return st.commit(s, lease.id, checksum(views))


async def get(st: TieredStore, s: Session, k: bytes) -> bytes | None:
    lease = await st.acquire(s, k)
    if lease is None:
        return None
    data = b"".join(bytes(v) for v in st.host.views(lease.place))
    st.release(s, lease.id)
    return data


def tiers(st: TieredStore, keys: list[bytes]) -> list[str]:
    """Per-key tiers of the longest held prefix, whichever form ``lookup`` answers in."""
    n, where = st.lookup(keys)
    flat: list[str] = []
    for item in where:
        if isinstance(item, str):
            flat.append(item)
        else:
            tier, run = item
            flat += [tier] * run
    assert len(flat) == n
    return flat


def check_accounts(st: TieredStore) -> None:
    """DRAM in use is exactly the pages of resident blocks, writes in flight and dead blocks
    still being read (nothing leaks)."""
    live = [e for e in st._entries.values() if dram_place(st, e) is not None]
    writes = [w for x in st._sessions.values() for w in [*x.writes.values(), *x.lapsed.values()]]
    dead = {id(r.entry): r.entry for x in st._sessions.values() for r in x.reads.values() if r.entry.dead}
    expect = sum(dram(st).footprint(e.size) for e in live)
    expect += sum(dram(st).footprint(w.meta.size) for w in writes)
    expect += sum(dram(st).footprint(e.size) for e in dead.values() if dram_place(st, e) is not None)
    assert dram(st).used_bytes == expect
    for e in live:
        assert sum(n for _, n in dram_place(st, e) or []) == e.size
    # the pinners of each key are exactly the sessions that count pins on it
    pinning = {(k, x.id) for x in st._sessions.values() for k, n in x.pins.items() if n > 0}
    assert pinning == {(k, sid) for k, sids in st._pins.pinners.items() for sid in sids}
    assert all(st._pins.pinners.values())


def file_of(tmp_path: Path, k: bytes) -> Path:
    return tmp_path / "disk" / k[16:17].hex() / (k.hex() + ".kvb")


async def fill(st: TieredStore, s: Session, start: int, n: int, **kw: Any) -> list[bytes]:
    keys = []
    for i in range(start, start + n):
        assert await put(st, s, key(i), payload(i), **kw) == PutStatus.STORED
        keys.append(key(i))
    return keys


# ------------------------------------------------------------------------ put
async def test_two_phase_put_is_visible_only_after_commit(harness: Harness) -> None:
    st = await harness.store()
    s, other = st.open_session(), st.open_session()
    k, data = key(1), payload(1, 3 * PAGE + 5)
    status, lease = await st.allocate(s, k, len(data))
    assert status == PutStatus.ALLOCATED and lease is not None
    assert not st.contains(k)
    assert st.lookup([k])[0] == 0
    assert await st.acquire(other, k) is None
    assert (await st.allocate(other, k, len(data)))[0] == PutStatus.PENDING
    views = st.host.views(lease.place)
    pos = 0
    for v in views:
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes
    assert st.commit(s, lease.id, checksum(views)) == PutStatus.STORED
    assert st.contains(k)
    assert tiers(st, [k, key(2)]) == ["dram"]
    assert await get(st, other, k) == data
    assert (await st.allocate(other, k, len(data)))[0] == PutStatus.EXISTS
    with pytest.raises(UnknownLeaseError):
        st.commit(s, lease.id, 0)  # a lease commits once
    check_accounts(st)


async def test_too_large(harness: Harness) -> None:
    st = await harness.store(block_max_bytes=4 * PAGE)
    s = st.open_session()
    for size in (0, -1, 4 * PAGE + 1):
        assert (await st.allocate(s, key(size), size))[0] == PutStatus.TOO_LARGE
    big = await harness.store(block_max_bytes=1 << 30)
    s2 = big.open_session()
    assert (await big.allocate(s2, key(0), PAGES * PAGE + 1))[0] == PutStatus.TOO_LARGE
    assert (await big.allocate(s2, key(1), PAGES * PAGE))[0] == PutStatus.ALLOCATED
    assert dram(st).used_bytes == 0


async def test_abort_frees_space_and_clears_pending(harness: Harness) -> None:
    st = await harness.store()
    s = st.open_session()
    status, lease = await st.allocate(s, key(1), 2 * PAGE)
    assert lease is not None and dram(st).used_bytes == 2 * PAGE
    st.abort(s, lease.id)
    assert dram(st).used_bytes == 0 and not st.contains(key(1))
    assert (await st.allocate(s, key(1), PAGE))[0] == PutStatus.ALLOCATED
    with pytest.raises(UnknownLeaseError):
        st.abort(s, lease.id)


async def test_unknown_tenant_raises(harness: Harness) -> None:
    st = await harness.store()
    with pytest.raises(QuotaError):
        await st.allocate(st.open_session(), key(1), PAGE, tenant="nobody")
    with pytest.raises(QuotaError):
        await st.allocate(st.open_session("nobody"), key(1), PAGE)


# ------------------------------------------------------------------------ eviction
async def test_eviction_when_full_drops_the_lru_block(harness: Harness) -> None:
    st = await harness.store()
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    assert dram(st).free_bytes == 0
    assert await get(st, s, keys[0]) == payload(0)  # keys[1] is now the LRU block
    assert await put(st, s, key(100), payload(100)) == PutStatus.STORED
    assert not st.contains(keys[1])
    assert st.lookup([keys[0], keys[1], keys[2]])[0] == 1
    assert await st.acquire(s, keys[1]) is None
    assert await get(st, s, keys[0]) == payload(0)
    assert st.metrics.counts["evicted_dram"] == 1
    check_accounts(st)


async def first_on_disk(harness: Harness) -> tuple[TieredStore, Session, list[bytes]]:
    """A store with a disk tier whose full DRAM pushed its first block to disk on one more put."""
    st = await harness.store(disk=True)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    assert await put(st, s, key(100), payload(100)) == PutStatus.STORED
    assert tiers(st, keys[:1]) == ["disk"]
    return st, s, keys


async def test_demotion_to_disk_then_promotion_returns_identical_bytes(harness: Harness) -> None:
    st, s, keys = await first_on_disk(harness)
    assert st.contains(keys[0])
    assert tiers(st, keys[:2]) == ["disk", "dram"]
    assert disk(st) is not None and disk(st).contains(keys[0])
    assert file_of(harness.tmp_path, keys[0]).exists()
    assert st.metrics.counts["demote_ok"] == 1
    # The hit promotes it back (evicting the new LRU block to disk in turn).
    assert await get(st, s, keys[0]) == payload(0)
    assert tiers(st, keys[:2]) == ["dram", "disk"]
    assert st.metrics.counts["promote_ok"] == 1
    check_accounts(st)


async def test_promotion_into_scattered_extents(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    big, big_data = key("big"), payload("big", 2 * PAGE - 3)
    assert await put(st, s, big, big_data) == PutStatus.STORED  # pages 0-1
    small = await fill(st, s, 0, PAGES - 2)  # pages 2-15
    assert await put(st, s, key(100), payload(100)) == PutStatus.STORED  # demotes big
    assert tiers(st, [big]) == ["disk"]
    # Pin everything in DRAM but one single-page block: the free pages are not adjacent.
    spare = small[5]
    st.pin(s, [k for k in small if k != spare] + [key(100)])
    assert dram(st).free_bytes == PAGE
    lease = await st.acquire(s, big)
    assert lease is not None and len(lease.place) == 2
    assert b"".join(bytes(v) for v in st.host.views(lease.place)) == big_data
    st.release(s, lease.id)
    assert tiers(st, [spare]) == ["disk"]  # the one unpinned block made room
    check_accounts(st)


async def test_corrupt_dram_block_is_dropped_at_demotion(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    victim = st._entries[keys[0]]
    place = dram_place(st, victim)
    assert place is not None
    off = place[0][0]
    dram(st).arena.view[off + 10] ^= 0xFF  # type: ignore[union-attr]
    assert await put(st, s, key(100), payload(100)) == PutStatus.STORED
    assert not st.contains(keys[0])
    assert disk(st) is not None and not disk(st).contains(keys[0])
    assert not file_of(harness.tmp_path, keys[0]).exists()
    assert not list((harness.tmp_path / "disk").rglob("*.tmp"))
    assert st.metrics.counts["corrupt_dram"] == 1
    assert await st.acquire(s, keys[0]) is None
    assert IndexEvent(False, "dram", keys[0]) in st.index_events.items
    assert IndexEvent(True, "disk", keys[0]) not in st.index_events.items
    # The dropped block's pages are free again: nothing leaked.
    check_accounts(st)
    await fill(st, s, 200, PAGES)
    check_accounts(st)
    assert dram(st).used_bytes == PAGES * PAGE


async def test_corrupt_disk_file_is_a_miss_at_promotion(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES + 1)
    assert tiers(st, [keys[0]]) == ["disk"]
    f = file_of(harness.tmp_path, keys[0])
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01
    f.write_bytes(bytes(raw))
    assert await st.acquire(s, keys[0]) is None
    assert not st.contains(keys[0])
    assert disk(st) is not None and not disk(st).contains(keys[0])
    assert not f.exists()
    assert st.metrics.counts["corrupt_disk"] == 1
    assert IndexEvent(False, "disk", keys[0]) in st.index_events.items
    check_accounts(st)
    # The slot it was read into went back: a full arena of fresh blocks still fits.
    assert await put(st, s, key(300), payload(300)) == PutStatus.STORED
    check_accounts(st)


# ------------------------------------------------------------------------ pins and leases
async def test_pinned_blocks_are_never_evicted(harness: Harness) -> None:
    st = await harness.store()
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    assert st.pin(s, keys) == PAGES
    assert st.pin(s, [key("absent")]) == 0
    assert await put(st, s, key(100), payload(100)) == PutStatus.FULL
    assert all(st.contains(k) for k in keys)
    assert st.unpin(s, [keys[7]]) == 1
    assert st.unpin(s, [keys[7]]) == 0  # not pinned by this session any more
    assert await put(st, s, key(100), payload(100)) == PutStatus.STORED
    assert not st.contains(keys[7])
    assert all(st.contains(k) for i, k in enumerate(keys) if i != 7)
    check_accounts(st)


def count_walked_past(st: TieredStore, held_by: str) -> list[int]:
    """Count, in the list's one item, the blocks with ``held_by`` ("pins", "readers") that
    searches for victims look at from now on."""
    walked = [0]
    evictable = st._mover.room.evictable  # noqa: SLF001

    def counted(m: Any) -> bool:
        walked[0] += bool(getattr(m, held_by, 0))
        return evictable(m)

    st._mover.room.evictable = counted  # type: ignore[method-assign]  # noqa: SLF001
    return walked


async def test_a_put_walks_past_pinned_blocks_once_not_on_every_put(harness: Harness) -> None:
    """A client that pins the coldest blocks of the tier made every later put walk past all
    of them (20,000 pins: 4 to 5 ms a block allocated); the walk now moves them to the far
    end of the order, so the next puts find their victims at once."""
    st = await harness.store()
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    pinned = keys[: PAGES // 2]  # the coldest half
    assert st.pin(s, pinned) == len(pinned)
    walked = count_walked_past(st, "pins")
    for i in range(4):
        assert await put(st, s, key(100 + i), payload(100 + i)) == PutStatus.STORED
    assert walked[0] == len(pinned)  # before: 4 * len(pinned), once per put
    assert all(st.contains(k) for k in pinned)
    assert [st.contains(k) for k in keys[PAGES // 2 : PAGES // 2 + 5]] == [False] * 4 + [True]  # the coldest unpinned
    st.unpin(s, pinned)
    check_accounts(st)


@pytest.mark.parametrize("policy", ["lru", "prefix"])
async def test_a_put_walks_past_blocks_being_read_once_and_they_take_back_their_place(policy: str) -> None:
    """Read leases keep a block as pins do: a tenant may hold leases on half the host tier,
    and once those blocks drifted to the cold end every put on the node walked past all of
    them (16,000 leases: 3.4 to 11.6 ms a put). The walk holds them back as it does pins,
    and they take back their place (the coldest) with their last lease."""
    st = make_store(PAGES * PAGE, PAGE, policy=make_policy(policy))
    try:
        s = st.open_session()
        keys = await fill(st, s, 0, PAGES)
        await asyncio.sleep(0)  # (the policy learns of the puts after the callback)
        read = keys[: PAGES // 2]  # the coldest half
        leases = [await st.acquire(s, k) for k in read]
        for k in keys[PAGES // 2:]:  # read since: the blocks being read are the coldest again
            later = await st.acquire(s, k)
            assert later is not None
            st.release(s, later.id)
        await asyncio.sleep(0)
        walked = count_walked_past(st, "readers")
        for i in range(4):
            assert await put(st, s, key(100 + i), payload(100 + i)) == PutStatus.STORED
        assert walked[0] == len(read)  # before: 4 * len(read), once per put
        assert all(st.contains(k) for k in read)
        for lease in leases:
            assert lease is not None
            st.release(s, lease.id)
        assert await put(st, s, key(200), payload(200)) == PutStatus.STORED
        assert sum(not st.contains(k) for k in read) == 1  # their place back: one of them, the coldest, went
        check_accounts(st)
    finally:
        close_store(st)


async def test_pinned_blocks_walked_past_take_back_their_place_when_unpinned() -> None:
    """Under the default policy the pins walked past wait after every other block while they
    are pinned, and go back to their place (the coldest) with their last pin: the next put
    evicts the coldest of them, not a warmer block."""
    st = make_store(PAGES * PAGE, PAGE, policy=make_policy("prefix"))
    try:
        s = st.open_session()
        keys = await fill(st, s, 0, PAGES)
        await asyncio.sleep(0)  # (the policy learns of the puts after the callback)
        pinned = keys[:4]
        assert st.pin(s, pinned) == 4
        assert await put(st, s, key(100), payload(100)) == PutStatus.STORED  # walks past the pins
        assert [st.contains(k) for k in keys[:6]] == [True] * 4 + [False, True]
        other = st.open_session()
        assert st.pin(other, pinned[:1]) == 1
        assert st.unpin(s, pinned) == 4  # pinned[0] is still pinned by the other session
        assert await put(st, s, key(101), payload(101)) == PutStatus.STORED
        assert [st.contains(k) for k in keys[:6]] == [True, False, True, True, False, True]  # before: keys[5] went
        st.close_session(other)  # its pin goes with it
        assert await put(st, s, key(102), payload(102)) == PutStatus.STORED
        assert not st.contains(pinned[0])
    finally:
        close_store(st)


async def test_pins_on_a_block_whose_last_copy_was_lost_go_with_it(harness: Harness) -> None:
    """A pinned block is never evicted, but its last copy can be lost (unreadable, found
    corrupt on a copy between tiers): its pins go with it, as when it is removed. Before, the
    session kept its count and what it held, and its unpin took the pin another client had
    put on the next block stored under the key."""
    st = await harness.store()
    a, b = st.open_session(), st.open_session()
    keys = await fill(st, a, 0, 2)
    assert st.pin(a, keys[:1]) == 1
    held = a.held_bytes
    lost = st._entries[keys[0]]  # noqa: SLF001
    await st._ledger.drop(st._host, lost, evicted=False)  # noqa: SLF001 - its only copy, lost
    assert not st.contains(keys[0])
    assert keys[0] not in a.pins and a.held_bytes < held  # before: still counted and held
    assert await put(st, a, keys[0], payload(0)) == PutStatus.STORED
    assert st.pin(b, keys[:1]) == 1
    assert st.unpin(a, keys[:1]) == 0  # before: 1, and the new block lost b's pin
    assert st._entries[keys[0]].pins == 1  # noqa: SLF001
    check_accounts(st)


async def test_a_tenant_cannot_pin_another_tenants_blocks_in_a_shared_key_space(harness: Harness) -> None:
    """Tenants sharing a key space read each other's blocks, but one's PIN of the other's
    takes nothing: bob had pinned every block alice stored (within his share), and alice, at
    her quota, answered QUOTA to every put (her puts evict her own blocks only) until bob's
    connection closed (a review's ``shared_space_pins.py``). A REMOVE was refused already."""
    st = await harness.store(tenants={"alice": TenantLimits(quota_bytes=8 * PAGE), "bob": TenantLimits()})
    alice, bob = st.open_session("alice"), st.open_session("bob")
    keys = await fill(st, alice, 0, 8)  # her quota
    assert st.remove(bob, keys) == 0
    assert st.pin(bob, keys) == 0  # before: 8
    assert not bob.pins and bob.held_bytes == 0
    assert all(st._entries[k].pins == 0 for k in keys)  # noqa: SLF001
    assert [await put(st, alice, key(100 + i), payload(100 + i)) for i in range(4)] == [PutStatus.STORED] * 4
    assert st.pin(alice, [key(100)]) == 1  # her own: pinned
    assert await get(st, bob, key(101)) == payload(101)  # still shared for reading
    check_accounts(st)


async def test_pins_count_per_session(harness: Harness) -> None:
    st = await harness.store()
    a, b = st.open_session(), st.open_session()
    keys = await fill(st, a, 0, PAGES)
    st.pin(a, keys[:1])
    st.pin(b, keys)
    st.unpin(b, keys)
    # keys[0] is still pinned by a: the LRU victim is keys[1].
    assert await put(st, a, key(100), payload(100)) == PutStatus.STORED
    assert st.contains(keys[0]) and not st.contains(keys[1])


async def test_blocks_being_read_are_never_evicted(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    leases = [await st.acquire(s, k) for k in keys]
    assert all(lease is not None for lease in leases)
    assert await put(st, s, key(100), payload(100)) == PutStatus.FULL
    assert tiers(st, keys) == ["dram"] * PAGES
    st.release(s, leases[3].id)  # type: ignore[union-attr]
    assert await put(st, s, key(100), payload(100)) == PutStatus.STORED
    assert tiers(st, [keys[3]]) == ["disk"]
    # The other leases still read their original bytes.
    for i, lease in enumerate(leases):
        if i != 3:
            assert b"".join(bytes(v) for v in st.host.views(lease.place)) == payload(i)  # type: ignore[union-attr]


async def test_close_session_releases_everything(harness: Harness) -> None:
    st = await harness.store()
    a, b = st.open_session(), st.open_session()
    keys = await fill(st, b, 0, PAGES - 2)
    st.pin(a, keys[:4])
    lease = await st.acquire(a, keys[4])
    assert lease is not None
    status, wlease = await st.allocate(a, key("w"), 2 * PAGE)
    assert status == PutStatus.ALLOCATED and wlease is not None
    assert dram(st).free_bytes == 0
    st.pin(b, keys[5:])  # b pins the rest, so only a's leases and pins stand in the way
    assert await put(st, b, key(100), payload(100)) == PutStatus.FULL
    st.close_session(a)
    assert st.report.stats()["sessions"] == 1
    # The aborted write freed its pages; its key is no longer pending.
    assert dram(st).free_bytes == 2 * PAGE
    assert (await st.allocate(b, key("w"), PAGE))[0] == PutStatus.ALLOCATED
    with pytest.raises(UnknownLeaseError):
        st.release(a, lease.id)
    # a's pins and read are gone: those five blocks can be evicted now, and only they.
    for i in range(100, 106):
        assert await put(st, b, key(i), payload(i)) == PutStatus.STORED
    assert not any(st.contains(k) for k in keys[:5])
    assert all(st.contains(k) for k in keys[5:])
    assert await put(st, b, key(106), payload(106)) == PutStatus.STORED  # evicts key(100)
    check_accounts(st)


async def test_expire_leases_with_an_injected_clock(harness: Harness) -> None:
    now = [1000.0]
    st = await harness.store(clock=lambda: now[0])
    s = st.open_session()
    await fill(st, s, 0, 1)
    read = await st.acquire(s, key(0))
    status, write = await st.allocate(s, key(1), PAGE)
    assert read is not None and write is not None
    now[0] += 29.0
    assert st.expire_leases() == 0
    now[0] += 2.0
    assert st.expire_leases() == 1  # the write; a read lease never expires under its reader
    assert st.expire_leases() == 0
    assert not st.contains(key(1))
    # the key is free at once, the page is not: the stuck writer may still be copying into it
    assert dram(st).used_bytes == 2 * PAGE and s.held_bytes == 2 * PAGE
    check_accounts(st)
    other = st.open_session()
    status, again = await st.allocate(other, key(1), PAGE)
    assert again is not None and status == PutStatus.ALLOCATED
    assert again.place != write.place  # never the stuck writer's page (it had been reused)
    assert dram(st).used_bytes == 3 * PAGE and st.report.stats()["lapsed_writes"] == 1
    with pytest.raises(UnknownLeaseError):  # its late commit is refused, and says it is done
        st.commit(s, write.id, 0)
    assert dram(st).used_bytes == 2 * PAGE and s.held_bytes == PAGE and st.report.stats()["lapsed_writes"] == 0
    with pytest.raises(UnknownLeaseError):
        st.abort(s, write.id)
    assert dram(st).used_bytes == 2 * PAGE
    check_accounts(st)
    st.release(s, read.id)  # still valid
    st.abort(other, again.id)
    assert dram(st).used_bytes == PAGE
    assert st._entries[key(0)].readers == 0
    check_accounts(st)
    # another stuck write: its page stays until its session goes (or it aborts)
    _, stuck = await st.allocate(s, key(2), PAGE)
    assert stuck is not None
    now[0] += 31.0
    assert st.expire_leases() == 1 and dram(st).used_bytes == 2 * PAGE
    st.close_session(s)
    assert dram(st).used_bytes == PAGE and s.held_bytes == 0
    check_accounts(st)


async def test_only_client_sessions_expire(harness: Harness) -> None:
    now = [1000.0]
    st = await harness.store(clock=lambda: now[0])
    s, internal = st.open_session(), st.open_session(expiring=False)
    _, write = await st.allocate(s, key(1), PAGE)
    _, own = await st.allocate(internal, key(2), PAGE)
    assert write is not None and own is not None
    now[0] += 60.0
    assert st.expire_leases() == 1  # the sidecar's own sessions never expire
    assert dram(st).used_bytes == 2 * PAGE  # the expired write's page is held until its writer goes
    assert st.commit(internal, own.id, checksum(memoryview(bytes(PAGE)))) == PutStatus.STORED
    check_accounts(st)
    st.close_session(s)
    assert dram(st).used_bytes == PAGE
    check_accounts(st)


async def test_a_read_lease_outlives_the_timeout_and_its_bytes_stay(harness: Harness) -> None:
    now = [1000.0]
    st = await harness.store(clock=lambda: now[0])
    s, w = st.open_session(), st.open_session()
    await put(st, w, key(0), payload(0))
    lease = await st.acquire(s, key(0))
    assert lease is not None
    now[0] += 3600.0
    assert st.expire_leases() == 0
    await fill(st, w, 1, 2 * PAGES)  # churn the whole arena
    # the block being read is neither evicted nor overwritten under its reader
    assert b"".join(bytes(v) for v in st.host.views(lease.place)) == payload(0)
    st.release(s, lease.id)
    check_accounts(st)


async def test_a_block_found_corrupt_while_it_is_demoted_gets_no_disk_copy(harness: Harness) -> None:
    st = await harness.store(disk=True)
    assert disk(st) is not None
    s, reader = st.open_session(), st.open_session()
    keys = await fill(st, s, 0, PAGES)
    gate, entered = threading.Event(), threading.Event()
    real_write = disk(st).write

    def slow_write(*args: Any) -> int:
        entered.set()
        if not gate.wait(10):
            raise AssertionError("the test never opened the gate")
        return real_write(*args)

    disk(st).write = slow_write  # type: ignore[method-assign]
    putting = asyncio.create_task(put(st, s, key(100), payload(100)))  # demotes keys[0]
    assert await asyncio.to_thread(entered.wait, 10)
    lease = await st.acquire(reader, keys[0])
    assert lease is not None
    st.host.views(lease.place)[0][0] ^= 0xFF  # the bytes rot under the reader
    st.release(reader, lease.id, corrupt=True)  # the reader's checksum failed: dropped
    gate.set()
    assert await putting == PutStatus.STORED
    disk(st).write = real_write  # type: ignore[method-assign]
    assert lease.entry.dead and not in_tier(st, lease.entry, 'disk')
    assert not st.contains(keys[0]) and not disk(st).contains(keys[0])
    for i in range(200, 200 + 4 * PAGES):  # churn DRAM and disk: no stale record surfaces
        await put(st, s, key(i), payload(i))
    check_accounts(st)


async def test_release_corrupt_drops_the_block_after_the_last_reader(harness: Harness) -> None:
    st = await harness.store()
    a, b = st.open_session(), st.open_session()
    k, data = key(1), payload(1, 3 * PAGE)
    assert await put(st, a, k, data) == PutStatus.STORED
    la, lb = await st.acquire(a, k), await st.acquire(b, k)
    assert la is not None and lb is not None
    dram(st).views(la.place)[0][0] ^= 0xFF
    rotten = bytes([data[0] ^ 0xFF]) + data[1:]
    st.release(a, la.id, corrupt=True)
    assert not st.contains(k)
    assert await st.acquire(a, k) is None
    assert st.metrics.counts["corrupt_dram"] == 1
    assert IndexEvent(False, "dram", k) in st.index_events.items
    # b still reads: its extents are neither freed nor reused.
    assert dram(st).used_bytes == 3 * PAGE
    assert await put(st, a, key(2), payload(2, 8 * PAGE)) == PutStatus.STORED
    assert await put(st, a, key(22), payload(22, (PAGES - 11) * PAGE)) == PutStatus.STORED
    st.pin(a, [key(2), key(22)])
    assert await put(st, a, key(3), payload(3)) == PutStatus.FULL
    assert b"".join(bytes(v) for v in dram(st).views(lb.place)) == rotten
    st.release(b, lb.id)
    assert dram(st).used_bytes == (PAGES - 3) * PAGE
    assert st.metrics.counts["corrupt_dram"] == 1
    assert await put(st, a, key(3), payload(3)) == PutStatus.STORED
    check_accounts(st)


async def test_release_corrupt_by_the_only_reader_frees_at_once(harness: Harness) -> None:
    st = await harness.store()
    s = st.open_session()
    await fill(st, s, 0, 2)
    lease = await st.acquire(s, key(0))
    assert lease is not None
    st.host.views(lease.place)[0][0] ^= 0xFF
    st.release(s, lease.id, corrupt=True)
    assert dram(st).used_bytes == PAGE and not st.contains(key(0)) and st.contains(key(1))


async def test_one_session_holds_at_most_its_share_of_dram(harness: Harness) -> None:
    """Write leases, read leases and pins of one client count against its share (and its
    tenant's): past it a put is QUOTA, a get misses, a pin does not take; another tenant's
    client is not held up."""
    st = await harness.store(session_share=0.25, tenants={"default": TenantLimits(), "b": TenantLimits()})
    greedy, other = st.open_session(), st.open_session("b")
    quarter = PAGES // 4
    keys = await fill(st, greedy, 0, quarter + 2)  # (its own: a tenant pins no other's blocks)
    assert st.pin(greedy, keys) == quarter  # pins stop at a quarter of DRAM
    assert (await st.allocate(greedy, key(500), PAGE))[0] == PutStatus.QUOTA
    assert await st.acquire(greedy, keys[-1]) is None  # a hit it cannot hold is a miss
    assert await put(st, other, key(501), payload(501)) == PutStatus.STORED
    assert st.unpin(greedy, keys) == quarter
    status, lease = await st.allocate(greedy, key(502), PAGE)
    assert status == PutStatus.ALLOCATED and lease is not None
    got = await st.acquire(greedy, keys[0])
    assert got is not None
    st.release(greedy, got.id)
    st.abort(greedy, lease.id)
    # a second connection of the same tenant shares the tenant's share
    twin = st.open_session()
    assert st.pin(greedy, keys) == quarter
    assert st.pin(twin, keys) == 0 and await st.acquire(twin, keys[-1]) is None
    st.close_session(greedy)
    assert st.pin(twin, keys[:1]) == 1  # the share came back with the first one's close
    st.close_session(twin)
    assert st._quotas._held["default"] == 0  # noqa: SLF001
    check_accounts(st)


async def test_a_block_reported_corrupt_that_checks_out_is_kept(harness: Harness) -> None:
    """A client's report is not proof: the sidecar checks the bytes before dropping anything
    (a hostile client cannot evict its neighbours' blocks by crying wolf)."""
    st = await harness.store()
    s = st.open_session()
    await fill(st, s, 0, 2)
    lease = await st.acquire(s, key(0))
    assert lease is not None
    st.release(s, lease.id, corrupt=True)
    assert st.contains(key(0)) and st.metrics.counts["corrupt_dram"] == 0
    again = await st.acquire(s, key(0))
    assert again is not None
    st.release(s, again.id)


# ------------------------------------------------------------------------ tenants
async def test_higher_priority_tenant_is_evicted_last(harness: Harness) -> None:
    st = await harness.store(tenants={"lo": TenantLimits(priority=0), "hi": TenantLimits(priority=5)})
    s = st.open_session("lo")
    hi = await fill(st, s, 0, 8, tenant="hi")  # older
    lo = await fill(st, s, 100, 8, tenant="lo")  # newer
    for k in hi + lo:
        assert await get(st, s, k) is not None  # hi is least recently used
    new = await fill(st, s, 200, 8, tenant="lo")
    assert all(st.contains(k) for k in hi)
    assert not any(st.contains(k) for k in lo)
    assert all(st.contains(k) for k in new)
    # New low-priority blocks keep displacing each other, never the high-priority ones.
    await fill(st, s, 300, 20, tenant="lo")
    assert all(st.contains(k) for k in hi)
    assert st.metrics.counts["evicted_dram"] == 28


async def test_tenant_over_quota_evicts_its_own_blocks_first(harness: Harness) -> None:
    st = await harness.store(tenants={"a": TenantLimits(quota_bytes=4 * PAGE), "b": TenantLimits()})
    s = st.open_session("b")
    b_keys = await fill(st, s, 0, 4, tenant="b")  # older than every block of a
    a_keys = await fill(st, s, 100, 4, tenant="a")
    assert await put(st, s, key(104), payload(104), tenant="a") == PutStatus.STORED
    assert not st.contains(a_keys[0])
    assert all(st.contains(k) for k in b_keys)
    assert all(st.contains(k) for k in a_keys[1:])
    assert dram(st).used_bytes == 8 * PAGE  # free space remained, a was held to its quota
    check_accounts(st)


async def test_quota_status(harness: Harness) -> None:
    st = await harness.store(tenants={"a": TenantLimits(quota_bytes=4 * PAGE), "b": TenantLimits()})
    s = st.open_session("a")
    # One block larger than the whole quota.
    assert (await st.allocate(s, key(0), 4 * PAGE + 1))[0] == PutStatus.QUOTA
    assert (await st.allocate(s, key(0), 4 * PAGE))[0] == PutStatus.ALLOCATED
    # At quota with only pinned blocks: QUOTA, not an eviction of someone else's block.
    st2 = await harness.store(tenants={"a": TenantLimits(quota_bytes=2 * PAGE), "b": TenantLimits()})
    s2 = st2.open_session("a")
    b_keys = await fill(st2, s2, 0, 3, tenant="b")
    a_keys = await fill(st2, s2, 100, 2, tenant="a")
    st2.pin(s2, a_keys)
    assert await put(st2, s2, key(102), payload(102)) == PutStatus.QUOTA
    assert all(st2.contains(k) for k in a_keys + b_keys)
    assert st2.metrics.counts["put_quota"] == 1
    assert (await st2.allocate(s2, key(102), PAGE))[0] == PutStatus.QUOTA  # not left pending


@pytest.mark.parametrize("ending", ["room", "cancelled"])
async def test_the_room_a_put_evicts_for_counts_against_its_tenants_quota(harness: Harness, ending: str) -> None:
    """An ALLOCATE within its tenant's quota that evicts other tenants' blocks for its room
    (each waiting for its copy down) was charged only once it had all of it: the tenant's
    small ALLOCATEs meanwhile took the pages it freed, each within the quota, and the tenant
    held twice its quota (a review's ``quota_race.py``: 42 MiB of DRAM against 32). Now they
    wait for it; cancelled, its room stops counting and they go on."""
    quota = PAGES // 2 * PAGE
    st = await harness.store(disk=True, tenants={"a": TenantLimits(quota_bytes=quota), "b": TenantLimits()})
    a, b = st.open_session("a"), st.open_session("b")
    await fill(st, b, 0, PAGES, tenant="b")  # DRAM full of b's blocks
    lower = disk(st)
    assert lower is not None
    writes = HeldWrites(lower)
    big = asyncio.create_task(st.allocate(a, key("big"), quota))  # evicts 8 of b's blocks, each copied down
    smalls: list[asyncio.Task[Any]] = []
    for j in range(16):
        await writes.started_or(big)  # the big one is in a copy down (the pages freed so far free), or done
        if ending == "cancelled" and j == 4:
            break
        smalls.append(asyncio.create_task(st.allocate(a, key(200 + j), PAGE)))
        await asyncio.sleep(0)  # its first step: free room at once, or its turn after the big one
        writes.let_one_go()
    taken = [t for t in smalls if t.done()]
    if ending == "cancelled":
        assert not taken  # before: 3 of them had taken pages the big one freed
        big.cancel()
    writes.let_all_go()
    if ending == "room":
        assert (await big)[0] == PutStatus.ALLOCATED  # not refused: its room was within the quota
    else:
        with pytest.raises(asyncio.CancelledError):
            await big
    statuses = [(await t)[0] for t in smalls]
    held = sum(dram(st).footprint(w.meta.size) for w in a.writes.values())
    assert held <= quota  # before: 16 pages (the big block and 8 small ones) against 8
    if ending == "room":
        assert statuses == [PutStatus.QUOTA] * len(smalls)
    else:  # the big one's room stopped counting: the small ones got theirs
        assert statuses == [PutStatus.ALLOCATED] * len(smalls) and held == len(smalls) * PAGE
    assert not st._quotas._reserving  # noqa: SLF001
    check_accounts(st)


# ------------------------------------------------------------------------ restart and index
async def test_warm_restart_adopts_disk_blocks(harness: Harness) -> None:
    st = await harness.store(disk=True, tenants={"default": TenantLimits(), "t": TenantLimits()})
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES + 5, tenant="t")
    on_disk = [k for k in keys if disk(st) is not None and disk(st).contains(k)]
    assert len(on_disk) == 5
    st2 = await harness.store(disk=True, tenants={"default": TenantLimits(), "t": TenantLimits()})
    assert harness.opened == 5
    assert st2.report.stats()["blocks"] == 5
    s2 = st2.open_session()
    assert tiers(st2, on_disk) == ["disk"] * 5
    assert st2.lookup([key(5)])[0] == 0  # DRAM-only blocks did not survive
    assert IndexEvent(True, "disk", on_disk[0]) in st2.index_events.items
    for i, k in enumerate(on_disk):
        assert await get(st2, s2, k) == payload(i)
    assert tiers(st2, on_disk) == ["dram"] * 5
    assert all(st2._entries[k].tenant == "t" for k in on_disk)


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_a_restart_under_a_smaller_block_limit_drops_the_larger_blocks(harness: Harness, layout: str) -> None:
    """A block kept on disk from a run with a larger ``max_block_bytes`` is dropped at the
    next start (its room freed): no put could store it now, and clients size the answers
    they accept by the limit their sidecar says."""
    st = await harness.store(disk=True, layout=layout)
    s = st.open_session()
    big, small = key("big"), key("small")
    assert await put(st, s, big, payload("big", 4 * PAGE)) == PutStatus.STORED
    assert await put(st, s, small, payload("small", PAGE)) == PutStatus.STORED
    for k in (big, small):
        await st._mover.room.evict(st._mover.host, st._entries[k])  # noqa: SLF001 - onto disk
    assert tiers(st, [big, small]) == ["disk", "disk"]
    st.close()
    again = await harness.store(disk=True, layout=layout, block_max_bytes=2 * PAGE)
    assert harness.opened == 1
    s2 = again.open_session()
    assert await get(again, s2, big) is None
    assert await get(again, s2, small) == payload("small", PAGE)
    await again.settle()
    tier = disk(again)
    assert tier is not None and not tier.contains(big)
    again.close()


async def test_open_without_disk_adopts_nothing(harness: Harness) -> None:
    await harness.store()
    assert harness.opened == 0


async def test_index_events(harness: Harness) -> None:
    st = await harness.store()
    s = st.open_session()
    status, lease = await st.allocate(s, key(0), PAGE)
    assert lease is not None and st.index_events.items == []
    st.commit(s, lease.id, checksum(st.host.views(lease.place)))
    assert st.index_events.items == [IndexEvent(True, "dram", key(0))]
    await fill(st, s, 1, PAGES)  # evicts key(0)
    assert st.index_events.items[-2:] == [IndexEvent(False, "dram", key(0)), IndexEvent(True, "dram", key(PAGES))]
    publishes = [e.key for e in st.index_events.items if e.publish]
    assert publishes == [key(i) for i in range(PAGES + 1)]


async def test_index_events_on_demotion_and_promotion(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    await fill(st, s, 0, PAGES)
    st.index_events.clear()
    await fill(st, s, 100, 1)
    assert st.index_events.items == [
        IndexEvent(True, "disk", key(0)),
        IndexEvent(False, "dram", key(0)),
        IndexEvent(True, "dram", key(100)),
    ]
    st.index_events.clear()
    assert await get(st, s, key(0)) == payload(0)
    assert IndexEvent(True, "dram", key(0)) in st.index_events.items
    assert IndexEvent(False, "disk", key(0)) not in st.index_events.items  # still on disk too


async def test_concurrent_acquires_promote_once(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    await fill(st, s, 0, PAGES + 1)
    assert tiers(st, [key(0)]) == ["disk"]
    sessions = [st.open_session() for _ in range(6)]
    leases = await asyncio.gather(*(st.acquire(x, key(0)) for x in sessions))
    assert all(lease is not None for lease in leases)
    assert st.metrics.counts["promote_ok"] == 1
    assert len({tuple(lease.place) for lease in leases}) == 1  # type: ignore[union-attr]
    assert b"".join(bytes(v) for v in dram(st).views(leases[0].place)) == payload(0)  # type: ignore[union-attr]
    # Every reader holds the block: it cannot be evicted until all have released.
    st.pin(s, [key(i) for i in range(1, PAGES + 1)])
    assert await put(st, s, key(500), payload(500)) == PutStatus.FULL
    for x, lease in zip(sessions, leases):
        st.release(x, lease.id)  # type: ignore[union-attr]
    assert await put(st, s, key(500), payload(500)) == PutStatus.STORED
    check_accounts(st)


async def test_random_churn_keeps_the_accounts(harness: Harness) -> None:
    st = await harness.store(disk=True, disk_bytes=64 * (PAGE + 200))
    s = st.open_session()
    rnd = random.Random(11)
    written: dict[bytes, bytes] = {}
    for _ in range(400):
        i = rnd.randrange(60)
        k = key(i)
        if rnd.random() < 0.5:
            data = payload(i, rnd.randint(1, 3 * PAGE))
            if k in written:
                data = written[k]
            status = await put(st, s, k, data)
            assert status in (PutStatus.STORED, PutStatus.EXISTS)
            written.setdefault(k, data)
        else:
            got = await get(st, s, k)
            if got is not None:
                assert got == written[k]
        check_accounts(st)
    assert dram(st).used_bytes <= PAGES * PAGE


async def test_full_disk_evicts_its_lru_block_to_make_room(harness: Harness) -> None:
    st = await harness.store(disk=True, disk_bytes=2 * (PAGE + 200))
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES + 3)  # three demotions into room for two
    assert not st.contains(keys[0])
    assert tiers(st, keys[1:3]) == ["disk", "disk"]
    assert st.metrics.counts["evicted_disk"] == 1
    assert IndexEvent(False, "disk", keys[0]) in st.index_events.items
    assert not file_of(harness.tmp_path, keys[0]).exists()
    assert disk(st) is not None and disk(st).used_bytes <= disk(st).capacity_bytes
    check_accounts(st)


async def test_without_demotion_victims_are_dropped(harness: Harness) -> None:
    st = await harness.store(disk=True, demote=False)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES + 1)
    assert not st.contains(keys[0])
    assert disk(st) is not None and len(disk(st)) == 0


async def test_a_reader_arriving_during_demotion_keeps_the_block_in_dram(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s, reader = st.open_session(), st.open_session()
    keys = await fill(st, s, 0, PAGES)
    assert disk(st) is not None
    gate, entered = threading.Event(), threading.Event()
    real_write = disk(st).write

    def slow_write(*args: Any) -> int:
        entered.set()
        assert gate.wait(10)
        return real_write(*args)

    disk(st).write = slow_write  # type: ignore[method-assign]
    putting = asyncio.create_task(put(st, s, key(100), payload(100)))
    assert await asyncio.to_thread(entered.wait, 10)
    lease = await st.acquire(reader, keys[0])  # arrives while keys[0] is written out
    assert lease is not None
    gate.set()
    assert await putting == PutStatus.STORED
    # keys[0] stayed (now also on disk); the next victim made the room instead.
    assert tiers(st, keys[:2]) == ["dram", "disk"]
    assert disk(st).contains(keys[0])
    assert b"".join(bytes(v) for v in st.host.views(lease.place)) == payload(0)
    st.release(reader, lease.id)
    check_accounts(st)


# ------------------------------------------------------------ promotion edge cases
async def test_a_passing_disk_read_error_keeps_the_disk_copy(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import kvpool_sidecar.tiers.disk as disk_module

    st = await harness.store(disk=True)
    assert disk(st) is not None
    s = st.open_session()
    await fill(st, s, 0, PAGES + 1)  # key(0) is demoted to disk
    assert tiers(st, [key(0)]) == ["disk"]
    real_open = os.open
    failed = []

    def flaky_open(path: str, *args: Any, **kw: Any) -> int:
        if str(path).endswith(".kvb") and not failed:
            failed.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kw)

    monkeypatch.setattr(disk_module.os, "open", flaky_open)
    assert await get(st, s, key(0)) is None  # this read fails ...
    assert failed and st.contains(key(0)) and disk(st).contains(key(0))
    assert await get(st, s, key(0)) == payload(0)  # ... the next one is served
    check_accounts(st)


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_a_disk_copy_the_device_cannot_read_is_dropped(harness: Harness, monkeypatch: pytest.MonkeyPatch,
                                                            layout: str) -> None:
    """EIO from the device (a bad sector) is not a passing error: the copy stayed listed and
    offered by LOOKUP and the index, and every read of it cost a device read and then missed.
    It is dropped as lost at its first failed read, as a corrupt one is (the block goes with
    its last copy)."""
    st = await harness.store(disk=True, layout=layout)
    assert disk(st) is not None
    s = st.open_session()
    await fill(st, s, 0, PAGES + 1)  # key(0) is demoted to disk
    assert tiers(st, [key(0)]) == ["disk"]
    reads: list[int] = []

    def bad_sector(fd: int, bufs: Any, *args: Any) -> int:
        reads.append(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", bad_sector)  # (each layout reads a block with one or more preadv)
    assert await get(st, s, key(0)) is None
    tried = len(reads)
    assert tried and not st.contains(key(0)) and not disk(st).contains(key(0))
    assert st.lookup([key(0)])[0] == 0 and IndexEvent(False, "disk", key(0)) in st.index_events.items
    assert await get(st, s, key(0)) is None and len(reads) == tried  # a plain miss: no device read
    monkeypatch.undo()
    check_accounts(st)
    assert sorted(disk(st).keys()) == sorted(k for k, e in st._entries.items() if in_tier(st, e, "disk"))
    assert await put(st, s, key(0), payload(0)) == PutStatus.STORED  # stored afresh
    assert await get(st, s, key(0)) == payload(0)


async def test_blocks_the_disk_tier_lost_with_its_directory_leave_the_store_record(harness: Harness) -> None:
    """The segments' directory removed while the sidecar runs: the tier forgets what went with
    it, and so does the store, at its next copy to or from the tier (the store had kept them
    listed, counted in the tier's room and offered by LOOKUP, until a read of each missed)."""
    import shutil

    st = await harness.store(disk=True, layout="segments")
    tier = disk(st)
    assert tier is not None
    s = st.open_session()
    await fill(st, s, 0, PAGES + 8)  # the coldest 8 demoted
    demoted = [k for k in (key(i) for i in range(PAGES + 8)) if in_tier(st, k, "disk")]
    assert len(demoted) == 8
    shutil.rmtree(harness.tmp_path / "disk" / "segments")
    await fill(st, s, PAGES + 8, 4)  # more demotions: the first fails, the directory is made again
    assert sorted(tier.keys()) == sorted(k for k, e in st._entries.items() if in_tier(st, e, "disk"))
    assert not any(st.contains(k) for k in demoted)  # before: all 8 still offered
    assert st.lookup(demoted[:1])[0] == 0
    check_accounts(st)


async def test_a_block_read_out_of_a_segment_deleted_just_after_is_kept_where_it_went(harness: Harness) -> None:
    """A promotion batch reads its first block, then something deletes the segment before
    the second read: the tier forgets the first block's disk copy too. Its promotion had
    dropped that copy before placing the new one (its last copy then: the block left the
    store while its DRAM copy was placed, held by nothing that could find it)."""
    st = await harness.store(disk=True, layout="segments")
    tier = disk(st)
    assert isinstance(tier, SegmentDiskTier)
    s = st.open_session()
    await fill(st, s, 0, PAGES + 8)
    ids = [i for i in range(PAGES + 8) if tiers(st, [key(i)]) == ["disk"]]
    demoted = [key(i) for i in ids]
    assert len(demoted) >= 2
    tier.read_nowait = lambda k, d: False  # type: ignore[method-assign]  # (reads in a thread)
    real = tier.read_into
    reads = []

    def read_into(k: bytes, dest: Any) -> Any:
        got = real(k, dest)
        if not reads:
            os.unlink(tier._records.table[k].segment.path)  # noqa: SLF001  # something else deletes it now
        reads.append(k)
        return got

    tier.read_into = read_into  # type: ignore[method-assign]
    await st.prefetch(demoted[:2])
    await st.settle()
    assert await get(st, s, demoted[0]) == payload(ids[0])  # before: a miss, its bytes read
    check_accounts(st)


async def test_a_promotion_holds_its_disk_copy_from_the_start(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s, reader = st.open_session(), st.open_session()
    await fill(st, s, 0, PAGES + 1)
    e = st._entries[key(0)]
    assert tiers(st, [key(0)]) == ["disk"]
    reading = asyncio.ensure_future(st.acquire(reader, key(0)))
    await asyncio.sleep(0)  # the promotion task exists but has not run yet
    assert st._promoter.moving(e.key) and e.busy == 1  # so no disk eviction may pick this block now
    lease = await reading
    assert lease is not None and st.contains(key(0))
    st.release(reader, lease.id)
    check_accounts(st)


async def test_an_adopted_block_larger_than_dram_is_dropped_not_promoted(tmp_path: Path) -> None:
    """A block within max_block_bytes but larger than the DRAM tier (adopted from a disk written
    under a larger tier) is dropped when read, never promoted: DRAM is not flushed for it."""
    from kvpool_sidecar.tiers.base import BlockRecord

    path = str(tmp_path / "disk")
    writer = DiskTier(DiskSettings(path=path, size_bytes=1 << 22))
    writer.open()
    data = payload("big", 20 * PAGE)
    writer.write(BlockRecord(key("big"), len(data), checksum(memoryview(data))), [memoryview(data)])
    arena = SharedArena(PAGES * PAGE, populate=False)
    try:
        st = TieredStore([DramTier(PAGES * PAGE, PAGE, arena), DiskTier(DiskSettings(path=path, size_bytes=1 << 22))],
                         LRUPolicy(), StoreSettings(block_max_bytes=32 * PAGE))
        assert await st.open() == 1
        s = st.open_session()
        await fill(st, s, 0, PAGES)
        assert await get(st, s, key("big")) is None
        assert tiers(st, [key(i) for i in range(PAGES)]) == ["dram"] * PAGES  # DRAM was not flushed for it
        assert not st.contains(key("big")) and disk(st) is not None and not disk(st).contains(key("big"))
    finally:
        arena.close()


# ------------------------------------------------------------ what writers say
async def test_hints_reach_the_policy_and_engine_identity_stays_with_the_block(harness: Harness) -> None:
    st = await harness.store()
    st.engine_events = EngineEventQueue(1000, st.metrics.counts)  # identities are kept for KV events
    seen: list[tuple[str, Hints | None]] = []
    policy = st.policy
    for name in ("admit", "inserted", "bypassed"):
        real = getattr(policy, name)

        def spy(tier: str, meta: BlockMeta, _real: Callable[..., Any] = real, _name: str = name) -> Any:
            seen.append((_name, meta.hints))
            return _real(tier, meta)

        setattr(policy, name, spy)
    s = st.open_session()
    hints = Hints(prompt_blocks=40, session="c1", label="system")
    ref = EngineRef(hash=7, parent=None, token_ids=(1, 2, 3, 4), block_size=4)
    status, lease = await st.allocate(s, key(1), PAGE, hints=hints, engine=ref)
    assert status == PutStatus.ALLOCATED and lease is not None
    st.commit(s, lease.id, checksum(st.host.views(lease.place)))
    assert seen == [("admit", hints), ("inserted", hints)]
    assert st._entries[key(1)].hints == hints and st._entries[key(1)].engine == ref
    # a block stored without an engine identity takes the first one a writer states
    assert await put(st, s, key(2), payload(2)) == PutStatus.STORED
    assert st._entries[key(2)].engine is None
    ref2 = EngineRef(hash=b"\x01" * 32, parent=7, token_ids=(5,), block_size=1)
    assert (await st.allocate(s, key(2), PAGE, hints=hints, engine=ref2))[0] == PutStatus.EXISTS
    assert st._entries[key(2)].engine == ref2 and seen[-1] == ("bypassed", hints)
    # and keeps it: a later writer's word does not replace it
    assert (await st.allocate(s, key(2), PAGE, engine=ref))[0] == PutStatus.EXISTS
    assert st._entries[key(2)].engine == ref2


async def test_a_removed_blocks_last_lease_does_not_restore_the_block_put_since_under_its_key(
        harness: Harness) -> None:
    """Both held back while read: the removed block's last release had restored, by key, the
    block put again under its key, still read (every put walked past it again)."""
    st = await harness.store()
    s = st.open_session()
    k = key("K")
    await put(st, s, k, payload("K"))
    old_lease = await st.acquire(s, k)
    await fill(st, s, 0, PAGES)  # the walk passes it (read): held back
    assert st.remove(s, [k]) == 1
    await put(st, s, k, payload("K2"))
    new_lease = await st.acquire(s, k)
    await fill(st, s, 100, PAGES)
    new = entry(st, k)
    assert new.held_back
    assert old_lease is not None and new_lease is not None
    st.release(s, old_lease.id)
    st.policy.settle()  # type: ignore[attr-defined]
    assert next(iter(st.policy.victims("dram"))).key != k  # before: restored to the cold end, still read
    st.release(s, new_lease.id)
    check_accounts(st)


async def test_another_tenants_put_of_a_block_held_tells_the_policy_its_place_not_its_hints() -> None:
    """In a key space two tenants share, a put of a block another tenant stored says where it
    is in the writer's chain, not what the owner's requests are: the writer's hints do not
    reach the owner's classes, and a tenant a quota bounds moves nothing of the policy's
    through another's block."""
    settings = StoreSettings(tenants={"owner": TenantLimits(), "other": TenantLimits(),
                                      "bounded": TenantLimits(quota_bytes=64 * PAGE)})
    st = make_store(PAGES * PAGE, PAGE, settings=settings)
    try:
        seen: list[tuple[str, Hints | None]] = []
        real = st.policy.bypassed

        def spy(tier: str, meta: BlockMeta) -> None:
            seen.append((meta.tenant, meta.hints))
            real(tier, meta)

        st.policy.bypassed = spy  # type: ignore[method-assign]
        hints = Hints(prompt_blocks=40, session="c1", label="system")
        owner = st.open_session("owner")
        assert await put(st, owner, key(1), payload(1)) == PutStatus.STORED
        assert (await st.allocate(owner, key(1), PAGE, hints=hints))[0] == PutStatus.EXISTS
        assert seen == [("owner", hints)]
        assert (await st.allocate(st.open_session("other"), key(1), PAGE, depth=3, hints=hints))[0] \
            == PutStatus.EXISTS
        assert seen[-1] == ("owner", None)  # before: the writer's hints, under the owner's name
        assert (await st.allocate(st.open_session("bounded"), key(1), PAGE, hints=hints))[0] == PutStatus.EXISTS
        assert len(seen) == 2  # before: a third touch, of the bounded tenant's making
    finally:
        close_store(st)


async def test_engine_identities_take_memory_only_for_kv_events_and_never_past_the_block_held(
        harness: Harness) -> None:
    st = await harness.store()
    s = st.open_session()
    ref = EngineRef(hash=7, parent=None, token_ids=(1, 2, 3, 4), block_size=4)
    assert await put(st, s, key(1), payload(1)) == PutStatus.STORED
    status, lease = await st.allocate(s, key(2), PAGE, engine=ref)
    assert status == PutStatus.ALLOCATED and lease is not None
    st.commit(s, lease.id, checksum(st.host.views(lease.place)))
    assert st._entries[key(2)].engine is None  # no KV events: nobody would read it
    st.engine_events = EngineEventQueue(1000, st.metrics.counts)
    small = key(3)
    status, lease = await st.allocate(s, small, 16)
    assert status == PutStatus.ALLOCATED and lease is not None
    st.commit(s, lease.id, checksum(st.host.views(lease.place)))
    # a writer claims a block of a page for the key held with 16 bytes: its 8 token ids (32
    # bytes) fit the claim, not the block held, so they are not attached to it
    many = EngineRef(hash=8, parent=None, token_ids=tuple(range(8)), block_size=8)
    assert (await st.allocate(s, small, PAGE, engine=many))[0] == PutStatus.EXISTS
    assert st._entries[small].engine is None
    assert (await st.allocate(s, small, PAGE, engine=ref))[0] == PutStatus.EXISTS  # 16 bytes: they fit
    assert st._entries[small].engine == ref


async def test_a_batch_of_cold_blocks_is_copied_in_one_thread_call_and_shared_with_readers(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    for i in range(4):  # the four oldest go to disk
        assert await put(st, s, key(100 + i), payload(100 + i)) == PutStatus.STORED
    assert tiers(st, keys[:4]) == ["disk"] * 4
    ups: list[int] = []  # per call to a thread that copies into DRAM: its copies
    real = asyncio.to_thread

    async def counted(fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
        if getattr(fn, "__name__", "") == "_run_copies":
            into_dram = [c for c in args[0] if isinstance(c, functools.partial) and c.args[2] is dram(st)]
            if into_dram:
                ups.append(len(into_dram))
        return await real(fn, *args, **kw)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    promoted = st.metrics.counts["promote_ok"]
    started = asyncio.Event()
    bring_batch = st._promoter._bring_batch

    async def spy(*args: Any) -> None:
        started.set()
        await bring_batch(*args)

    st._promoter._bring_batch = spy  # type: ignore[method-assign]
    batch = asyncio.ensure_future(st.prefetch(keys[:3] + [keys[1]]))  # one of them asked twice
    await asyncio.wait_for(started.wait(), 10)  # the copy is under way (after the read-ahead hints)
    assert st._promoter.moving(keys[2])  # a reader of one of its blocks now waits for it
    assert await get(st, s, keys[2]) == payload(2)
    await batch
    assert ups == [3]  # three blocks up, in one hop to a thread
    assert st.metrics.counts["promote_ok"] == promoted + 3  # one copy each: the reader shared the batch's
    assert tiers(st, keys[:4]) == ["dram"] * 3 + ["disk"]
    for i in range(4):
        assert await get(st, s, keys[i]) == payload(i)
    check_accounts(st)


async def test_a_batch_about_to_be_read_prefetches_its_disk_only_blocks(harness: Harness) -> None:
    st = await harness.store(disk=True)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    for i in range(3):  # the three oldest go to disk
        assert await put(st, s, key(100 + i), payload(100 + i)) == PutStatus.STORED
    assert tiers(st, keys[:4]) == ["disk", "disk", "disk", "dram"]
    asked: list[list[bytes]] = []
    assert disk(st) is not None
    real = disk(st).prefetch

    def spy(ks: list[bytes]) -> int:
        asked.append(list(ks))
        return real(ks)

    disk(st).prefetch = spy  # type: ignore[method-assign]
    await st.prefetch([keys[3], keys[0], key(999), keys[2]])
    assert asked == [[keys[0], keys[2]]]  # disk-only ones, in order; DRAM and unknown ones are not
    await st.prefetch([keys[1]])  # one block: nothing to overlap
    assert len(asked) == 1
    assert await get(st, s, keys[0]) == payload(0)
    check_accounts(st)


async def test_corrupt_reports_past_a_tenants_budget_are_not_checked(harness: Harness,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check hashes the block on the event loop: a tenant's clients reporting every block
    corrupt get their reports checked up to a budget of bytes a second, the rest kept
    unchecked (and their neighbours are not stalled while the sidecar hashes all of DRAM); a
    new connection starts with what the tenant's last one left, not a fresh budget."""
    st = await harness.store()
    first = st.open_session()
    keys = await fill(st, first, 0, 2)
    monkeypatch.setattr(leases, "CHECK_BYTES_PER_S", PAGE)  # a block's worth a second
    budget = st.check_budget("default")
    budget.check_bytes, budget.checked_at = PAGE, time.monotonic()
    checked: list[bytes] = []
    real = st._mover.intact  # noqa: SLF001

    def intact(e: Any, *args: Any) -> bool:
        checked.append(e.key)
        return real(e, *args)

    st._mover.intact = intact  # type: ignore[method-assign]  # noqa: SLF001
    for k in keys:
        st.close_session(first)
        s = first = st.open_session()  # a client that reconnects for each report
        lease = await st.acquire(s, k)
        assert lease is not None
        st.host.views(lease.place)[0][0] ^= 0xFF  # both went bad
        st.release(s, lease.id, corrupt=True)
    assert checked == keys[:1]
    assert not st.contains(keys[0]) and st.contains(keys[1])  # the second report was not believed


async def test_a_block_larger_than_the_check_budget_is_checked_from_a_full_one(harness: Harness,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A corrupt report of a block larger than a second's budget is checked when the budget is
    full (it had never been: a corrupt block past the budget stayed, failing every read), and
    the budget then owes it: the next report waits for the refill."""
    st = await harness.store()
    s = st.open_session()
    keys = await fill(st, s, 0, 2)
    monkeypatch.setattr(leases, "CHECK_BYTES_PER_S", PAGE // 4)  # a quarter of a block a second
    budget = st.check_budget("default")
    budget.check_bytes, budget.checked_at = PAGE // 4, time.monotonic()
    for k in keys:
        lease = await st.acquire(s, k)
        assert lease is not None
        st.host.views(lease.place)[0][0] ^= 0xFF
        st.release(s, lease.id, corrupt=True)
    assert not st.contains(keys[0])  # checked, found corrupt, dropped
    assert st.contains(keys[1])  # the budget owes three quarters of a block: not believed yet
    assert budget.check_bytes < 0
    check_accounts(st)


async def test_removing_blocks_does_not_walk_every_session(harness: Harness) -> None:
    """A delete (or a corrupt release) of a block costs the same with a thousand clients
    connected as with one, pinned or not (a client that pins its own blocks and removes them
    had made each removal a walk of every session); a pinned one still loses its pins in
    every session that pinned it, and what they held."""
    st = await harness.store()
    sessions = [st.open_session() for _ in range(1000)]
    s = sessions[0]
    for i in range(4):
        assert await put(st, s, key(i), payload(i)) == PutStatus.STORED
    walks = 0

    class Counted(dict[int, Session]):
        def values(self) -> Any:
            nonlocal walks
            walks += 1
            return super().values()

    st._sessions = st._pins._sessions = Counted(st._sessions)
    assert st.remove(s, [key(0), key(1)]) == 2
    assert walks == 0
    assert st.pin(sessions[7], [key(2)]) == 1 and st.pin(sessions[9], [key(2), key(2), key(3)]) == 3
    assert st.pin(s, [key(2)]) == 1 and st.unpin(s, [key(2)]) == 1  # pinned, then not: no longer a pinner
    assert st.remove(s, [key(2)]) == 1
    assert walks == 0 and not sessions[7].pins and dict(sessions[9].pins) == {key(3): 1}
    assert sessions[7].held_bytes == 0 and sessions[9].held_bytes == sessions[9].pinned_sizes[key(3)] > 0
    assert st._pins.pinners == {key(3): {sessions[9].id}}
    st.close_session(sessions[9])
    assert not st._pins.pinners and sessions[9].held_bytes == 0
    check_accounts(st)


async def test_the_inventory_is_read_a_slice_per_turn_and_leaves_out_what_went_meanwhile() -> None:
    from tests.unit.store_support import put as put_block

    store = make_store()
    try:
        keys = [bytes([i]) * 32 for i in range(10)]
        for k in keys:
            await put_block(store, k, b"x" * 100)
        turns = 0

        async def meanwhile() -> None:
            nonlocal turns
            # first run: at the inventory's first turn, after 3 blocks (the last not reached)
            store.remove(store.open_session(), [keys[-1]])
            while True:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(meanwhile())
        try:
            inv = await store.report.inventory_soon(every=3)
            engine = await store.report.engine_inventory_soon(every=3)
        finally:
            task.cancel()
        assert inv == {k: ["dram"] for k in keys[:-1]}
        assert turns == 3 + 3  # a turn after every 3 blocks, twice over (9 blocks the second time)
        assert engine == []  # (no engine identities here)
        assert await store.report.inventory_soon() == inv  # read whole, nothing going meanwhile
    finally:
        close_store(store)


class _Unwalkable(dict):  # type: ignore[type-arg]
    """A session's write leases that may be looked up but not walked."""

    def items(self) -> Any:
        raise AssertionError("the expiry walked a session's leases")

    def __iter__(self) -> Any:
        raise AssertionError("the expiry walked a session's leases")


async def test_the_expiry_looks_at_the_leases_past_their_deadline_alone(harness: Harness) -> None:
    """Each second the sidecar ends the write leases past their deadline. It walked every
    session's every lease to find them: a client holding 262,144 leases stalled the event
    loop for 80 to 136 ms each second (a review). The leases are kept in the order they lapse."""
    now = [1000.0]
    st = await harness.store(clock=lambda: now[0])
    s, done = st.open_session(), st.open_session()
    leases = []
    for i in range(8):
        _, w = await st.allocate(s, key(i), PAGE)
        assert w is not None
        leases.append(w)
        now[0] += 1.0
    _, kept = await st.allocate(done, key(100), PAGE)
    assert kept is not None
    st.commit(done, kept.id, checksum(memoryview(bytes(PAGE))))  # ended before its deadline
    s.writes = _Unwalkable(s.writes)
    now[0] = 1000.0 + 30.0 + 2.5  # past the first three leases' deadlines (30 s each)
    assert st.expire_leases() == 3
    assert sorted(s.lapsed) == [w.id for w in leases[:3]] and st.contains(key(100))
    assert st.expire_leases() == 0
    st.abort(s, leases[3].id)  # ended by its writer: it never lapses
    now[0] += 10.0
    assert st.expire_leases() == 4 and len(s.lapsed) == 7 and not dict.__len__(s.writes)
    s.writes = dict(s.writes)
    check_accounts(st)
    st.close_session(s)
    check_accounts(st)


async def test_a_session_closes_a_slice_at_a_time(harness: Harness) -> None:
    """A session holding many leases and pins closes ``most`` of each kind a call (the
    sidecar's connections close their sessions so, a slice each step of the tenant's turns),
    and once it says it is closed every page and pin it held is back."""
    st = await harness.store()
    w, s = st.open_session(), st.open_session()
    await fill(st, w, 0, 8)
    for i in range(8):
        assert await st.acquire(s, key(i)) is not None
    st.pin(s, [key(i) for i in range(8)])
    for i in range(8, 12):
        _, lease = await st.allocate(s, key(i), PAGE)
        assert lease is not None
    steps = 0
    while not st.close_session(s, 3):
        steps += 1
        check_accounts(st)
        assert s.writes or s.reads or s.pins
    assert steps == 2  # (8 reads and pins, 3 a call: the third call closes it)
    assert s.held_bytes == 0 and not s.pins and not s.reads and not s.writes
    assert all(st._entries[key(i)].readers == 0 and st._entries[key(i)].pins == 0 for i in range(8))
    assert dram(st).used_bytes == 8 * PAGE
    check_accounts(st)
