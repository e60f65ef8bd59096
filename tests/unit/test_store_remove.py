"""The store's remove: a client's explicit delete of blocks from every tier of its node."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvpool_client.protocol import PutStatus
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.store import TenantLimits, TieredStore
from kvpool_sidecar.store import threads as threads_module
from kvpool_sidecar.tiers import disk as disk_module
from kvpool_sidecar.tiers import segtable
from tests.unit.store_support import disk, dram, dram_place, in_tier, until
from tests.unit.test_store import (  # noqa: F401 - fixture
    PAGE,
    PAGES,
    Harness,
    check_accounts,
    file_of,
    fill,
    first_on_disk,
    get,
    harness,
    key,
    payload,
    put,
    tiers,
)

#: Bound on every wait for a thread the test holds (never reached when the store is right).
WAIT_S = 10.0


def _gate(st: TieredStore, name: str) -> tuple[threading.Event, threading.Event]:
    """Hold the disk tier's ``name`` call (run in a worker thread) until the test says go:
    returns (entered, go)."""
    entered, go = threading.Event(), threading.Event()
    real: Callable[..., Any] = getattr(disk(st), name)

    def held(*args: Any) -> Any:
        entered.set()
        go.wait(WAIT_S)
        return real(*args)

    setattr(disk(st), name, held)
    return entered, go


async def _entered(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, WAIT_S), "the disk call never started"


async def test_remove_drops_a_dram_block_everywhere(harness: Harness) -> None:
    st = await harness.store()
    s = st.open_session()
    keys = await fill(st, s, 0, 3)
    used = dram(st).used_bytes
    st.index_events.clear()
    assert st.remove(s, [keys[1], key("never stored")]) == 1
    assert not st.contains(keys[1]) and await st.acquire(s, keys[1]) is None
    assert st.lookup(keys)[0] == 1
    assert st.index_events.items == [IndexEvent(False, "dram", keys[1])]
    assert dram(st).used_bytes == used - PAGE
    assert keys[1] not in [m.key for m in st.policy.victims("dram")]
    assert st.remove(s, [keys[1]]) == 0  # gone already
    # the key is free for a new block; the others are untouched
    assert await put(st, s, keys[1], payload("new")) == PutStatus.STORED
    assert await get(st, s, keys[1]) == payload("new")
    assert await get(st, s, keys[0]) == payload(0)
    check_accounts(st)


async def test_a_reader_keeps_its_bytes_until_it_releases_them(harness: Harness) -> None:
    st = await harness.store()
    reader, writer = st.open_session(), st.open_session()
    k = (await fill(st, writer, 0, 1))[0]
    lease = await st.acquire(reader, k)
    assert lease is not None
    assert st.remove(writer, [k]) == 1
    assert await st.acquire(writer, k) is None  # gone for everyone else at once
    # a new block under the same key takes other pages: the reader's stay as they were
    assert await put(st, writer, k, payload("next")) == PutStatus.STORED
    assert b"".join(bytes(v) for v in st.host.views(lease.place)) == payload(0)
    assert dram(st).used_bytes == 2 * PAGE
    check_accounts(st)
    st.release(reader, lease.id)
    assert dram(st).used_bytes == PAGE  # freed by the last reader
    assert await get(st, reader, k) == payload("next")
    check_accounts(st)


async def test_remove_deletes_the_disk_copy(harness: Harness) -> None:
    st, s, keys = await first_on_disk(harness)
    assert file_of(harness.tmp_path, keys[0]).exists()
    st.index_events.clear()
    assert st.remove(s, [keys[0]]) == 1
    assert disk(st) is not None and not disk(st).contains(keys[0])
    assert await until(lambda: not file_of(harness.tmp_path, keys[0]).exists())  # (unlinked in a thread)
    assert st.index_events.items == [IndexEvent(False, "disk", keys[0])]
    assert await st.acquire(s, keys[0]) is None
    check_accounts(st)


async def test_remove_of_a_block_in_dram_and_on_disk(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.5)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    await st.write_ahead()  # the coldest go to disk and stay in DRAM
    both = keys[0]
    assert in_tier(st, both, 'disk') and in_tier(st, both, 'dram')
    st.index_events.clear()
    assert st.remove(s, [both]) == 1
    assert set(st.index_events.items) == {IndexEvent(False, "dram", both), IndexEvent(False, "disk", both)}
    assert await until(lambda: not file_of(harness.tmp_path, both).exists())
    assert dram(st).used_bytes == (PAGES - 1) * PAGE
    check_accounts(st)


async def test_pins_of_every_session_go_with_the_block(harness: Harness) -> None:
    st = await harness.store(session_share=0.5)
    pinner, remover = st.open_session(), st.open_session()
    keys = await fill(st, remover, 0, 2)
    assert st.pin(pinner, keys) == 2 and pinner.held_bytes == 2 * PAGE
    assert st.remove(remover, keys[:1]) == 1
    assert pinner.held_bytes == PAGE and keys[0] not in pinner.pins
    assert st.unpin(pinner, keys[:1]) == 0
    assert st._quotas._held["default"] == PAGE
    st.close_session(pinner)
    assert st._quotas._held["default"] == 0
    check_accounts(st)


async def test_a_block_being_promoted_stays_until_the_promotion_is_done(harness: Harness) -> None:
    st, s, keys = await first_on_disk(harness)

    entered, go = _gate(st, "read_into")
    reading = asyncio.ensure_future(st.acquire(s, keys[0]))
    await _entered(entered)
    try:
        assert st.remove(s, [keys[0]]) == 0  # not counted: ask again
    finally:
        go.set()
    lease = await reading
    assert lease is not None
    assert b"".join(bytes(v) for v in st.host.views(lease.place)) == payload(0)
    st.release(s, lease.id)
    assert st.remove(s, [keys[0]]) == 1
    assert not st.contains(keys[0])
    assert await until(lambda: not file_of(harness.tmp_path, keys[0]).exists())
    check_accounts(st)


async def test_a_block_removed_while_it_is_written_to_disk_leaves_no_copy(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.1)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    entered, go = _gate(st, "write")
    writing = asyncio.ensure_future(st.write_ahead())
    await _entered(entered)
    try:
        assert st.remove(s, [keys[0]]) == 1  # the coldest: the one being written
    finally:
        go.set()
    await writing
    assert disk(st) is not None and not disk(st).contains(keys[0])
    assert await until(lambda: not file_of(harness.tmp_path, keys[0]).exists())
    assert not st.contains(keys[0]) and await st.acquire(s, keys[0]) is None
    check_accounts(st)
    assert dram(st).used_bytes == (PAGES - 1) * PAGE


async def test_quota_accounting_follows_a_removal(harness: Harness) -> None:
    st = await harness.store(tenants={"default": TenantLimits(), "t": TenantLimits(quota_bytes=2 * PAGE)})
    s = st.open_session("t")
    keys = await fill(st, s, 0, 2)
    assert st.remove(s, keys[:1]) == 1
    # the quota's room came back: a new block fits without evicting the other
    assert await put(st, s, key("third"), payload("third")) == PutStatus.STORED
    assert st.contains(keys[1])
    check_accounts(st)


async def test_a_tenant_removes_only_blocks_it_wrote(harness: Harness) -> None:
    """Tenants may share a key space (and so blocks); one cannot delete what another wrote."""
    st = await harness.store(tenants={"default": TenantLimits(), "t": TenantLimits()})
    mine, theirs = st.open_session("t"), st.open_session("default")
    keys = await fill(st, theirs, 0, 2)
    assert st.remove(mine, keys) == 0
    assert all(st.contains(k) for k in keys)
    assert st.remove(theirs, keys[:1]) == 1 and not st.contains(keys[0])
    check_accounts(st)


async def test_a_corrupt_block_gives_back_what_other_sessions_pinned(harness: Harness) -> None:
    """A block found corrupt goes with its pins; the sessions that pinned it hold nothing for
    it any more (their share of DRAM is free for other pins)."""
    st = await harness.store()
    reader, pinner = st.open_session(), st.open_session()
    keys = await fill(st, reader, 0, 2)
    assert st.pin(pinner, keys[:1]) == 1 and pinner.held_bytes == PAGE
    lease = await st.acquire(reader, keys[0])
    assert lease is not None
    view = st.host.views(lease.place)[0]
    view[0] ^= 0xFF  # the bytes in DRAM went bad
    st.release(reader, lease.id, corrupt=True)  # and the reader found so
    assert not st.contains(keys[0])
    assert pinner.held_bytes == 0 and not pinner.pins and not pinner.pinned_sizes
    check_accounts(st)


async def test_a_block_killed_while_it_is_promoted_does_not_come_back(harness: Harness) -> None:
    st, s, keys = await first_on_disk(harness)

    # hold the promotion after its read is done, before it takes the block into DRAM
    entered, go = threading.Event(), threading.Event()
    assert disk(st) is not None
    real = disk(st).read_into

    def read_then_wait(*args: Any) -> Any:
        out = real(*args)
        entered.set()
        go.wait(WAIT_S)
        return out

    disk(st).read_into = read_then_wait  # type: ignore[method-assign]
    reading = asyncio.ensure_future(st.acquire(s, keys[0]))
    await _entered(entered)
    e = st._entries[keys[0]]
    try:
        st._ledger.kill(e)  # as a reader that found another copy corrupt would
    finally:
        go.set()
    assert await reading is None
    assert dram_place(st, e) is None and not st.contains(keys[0])
    check_accounts(st)  # the pages the promotion reserved are free again


async def test_a_block_that_went_earlier_leaves_the_pins_of_the_one_now_under_its_key(harness: Harness) -> None:
    """The pins of a key are the current block's: a late end of an older block under that key
    (a copy of it landing corrupt after it went, say) takes none of them."""
    st = await harness.store()
    s = st.open_session()
    keys = await fill(st, s, 0, 1)
    old = st._entries[keys[0]]
    assert st.remove(s, keys) == 1
    assert await put(st, s, keys[0], payload(0)) == PutStatus.STORED and st.pin(s, keys) == 1
    st._ledger.kill(old)
    assert s.pins[keys[0]] == 1 and st._entries[keys[0]].pins == 1 and old.pins == 0
    assert st._pins.pinners == {keys[0]: {s.id}}
    check_accounts(st)


@pytest.mark.parametrize("layout", ["segments", "files"])
async def test_a_remove_frees_disk_room_off_the_event_loop(harness: Harness, layout: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A hole punch (165 us on a filesystem mounted with discard) or an unlink per block had
    run on the event loop: one REMOVE of 4,096 blocks on disk held every other client 0.3 s.
    The tier forgets the copies at once and frees their room in a thread."""
    st = await harness.store(disk=True, layout=layout)
    s = st.open_session()
    keys = await fill(st, s, 0, 2 * PAGES)  # the first PAGES went to disk
    on_disk = [k for k in keys if in_tier(st, k, "disk")]
    assert len(on_disk) >= PAGES - 1
    loop_thread = threading.get_ident()
    freed_in: list[int] = []
    module = segtable if layout == "segments" else disk_module
    name = "punch_hole" if layout == "segments" else "os"
    real = getattr(module, name)
    if layout == "segments":
        def punch(*args: Any) -> None:
            freed_in.append(threading.get_ident())
            real(*args)

        monkeypatch.setattr(module, name, punch)
    else:
        class Os:
            def __getattr__(self, attr: str) -> Any:
                return getattr(real, attr)

            def unlink(self, path: Any) -> None:
                freed_in.append(threading.get_ident())
                real.unlink(path)

        monkeypatch.setattr(module, name, Os())
    used = disk(st).used_bytes
    assert st.remove(s, on_disk) == len(on_disk)
    assert disk(st).used_bytes < used and not any(disk(st).contains(k) for k in on_disk)  # forgotten at once
    await st._mover.threads.settle()  # noqa: SLF001
    assert len(freed_in) >= len(on_disk) and loop_thread not in freed_in
    assert len({t for t in freed_in}) == 1  # one hop to a thread for the whole request
    for k in keys:
        if k not in on_disk:
            assert await get(st, s, k) == payload(keys.index(k))
    check_accounts(st)


@pytest.mark.parametrize("layout", ["segments", "files"])
async def test_a_late_release_never_frees_the_block_put_under_its_key_since(harness: Harness, layout: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A block removed while the write-ahead copied it to disk: its copy lands, and its room
    is given back in a thread. That release had looked the key up when it ran, so where the
    block was put again and written to disk before it, it freed the new block's copy (the
    new block lost, as a miss). The copy is forgotten when it lands; its release frees it alone."""
    st = await harness.store(disk=True, layout=layout, clean_share=0.5)
    mover = st._mover  # noqa: SLF001
    tier = disk(st)
    in_write, write_go, release_go = asyncio.Event(), asyncio.Event(), asyncio.Event()
    real = mover.threads.in_thread

    async def gated(fn: Callable[..., Any], *args: Any) -> Any:
        if fn == tier.write_copies:  # the write-ahead's batch: held while the block is removed
            in_write.set()
            await write_go.wait()
        elif getattr(fn, "__name__", "") in ("_free_all", "_release_all"):  # a busy executor
            await release_go.wait()
        return await real(fn, *args)

    mover.threads.in_thread = gated  # type: ignore[method-assign]
    free_go = threading.Event()
    free_all = getattr(threads_module, "_free_all", None)
    if free_all is not None:  # the releases' thread, where it is not one of in_thread's
        def held(*args: Any) -> None:
            free_go.wait(WAIT_S)
            free_all(*args)

        monkeypatch.setattr(threads_module, "_free_all", held)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    k = keys[0]  # the coldest: the write-ahead copies it first
    ahead = asyncio.ensure_future(st.write_ahead())
    await asyncio.wait_for(in_write.wait(), WAIT_S)
    assert st.remove(s, [k]) == 1
    write_go.set()
    assert await until(lambda: not mover.writes[1].locked())  # the batch landed; k's release waits
    assert await put(st, s, k, payload(0)) == PutStatus.STORED  # the same block again
    e = st._entries[k]  # noqa: SLF001
    await mover.room.evict(mover.host, e)  # demoted to disk (its DRAM copy goes)
    assert tiers(st, [k]) == ["disk"]
    release_go.set()
    free_go.set()
    await ahead
    await mover.threads.settle()
    assert tier.contains(k)
    assert await get(st, s, k) == payload(0)
    check_accounts(st)
