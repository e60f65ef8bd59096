"""The write-ahead: the coldest DRAM blocks go to disk before anyone needs their room, so a
put that needs room drops a clean block at once instead of waiting for a disk write."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest

from kvpool_client.integrity import checksum
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.errors import TierIOError
from kvpool_sidecar.peers import StoreSink
from kvpool_sidecar.store import TieredStore
from kvpool_sidecar.store.room import CLEAN_ROOM_PER_WALK
from kvpool_sidecar.store.writeahead import WAKE_SHARE
from tests.unit.test_store import PAGE, PAGES, Harness, fill, get, harness, key, payload, put  # noqa: F401 - fixture
from tests.unit.store_support import disk, dram_place, in_tier


def count_writes(st: TieredStore) -> list[bytes]:
    """Record the key of every block the store writes to its disk tier."""
    assert disk(st) is not None
    written: list[bytes] = []
    real = disk(st).write

    def write(record: Any, views: Any) -> Any:
        written.append(record.key)
        return real(record, views)

    disk(st).write = write  # type: ignore[method-assign]
    return written


async def test_the_coldest_blocks_are_written_ahead_and_stay_in_dram(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.1)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)  # DRAM full, nothing on disk
    assert st.room_wanted.is_set()  # free DRAM fell below the clean share
    written = count_writes(st)
    n = await st.write_ahead()
    want = -(-int(0.1 * PAGES * PAGE) // PAGE)  # pages that make up the clean share
    assert n == want * PAGE and written == keys[:want]  # the coldest first (LRU order)
    assert st.lookup(keys)[0] == PAGES and all(in_tier(st, k, 'dram') for k in keys)
    assert all(in_tier(st, k, 'disk') for k in keys[:want])
    assert await st.write_ahead() == 0  # the share is met: nothing more to write


async def test_a_put_that_needs_room_drops_a_clean_block_without_a_disk_write(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.1)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    await st.write_ahead()
    clean = [k for k in keys if in_tier(st, k, 'disk')]
    written = count_writes(st)
    more = await fill(st, s, PAGES, len(clean))  # each needs a page: a clean one goes
    assert written == []  # no put waited for a disk write
    assert [dram_place(st, k) for k in clean] == [None] * len(clean)  # gone from DRAM ...
    assert st.lookup(clean)[0] == len(clean)  # ... still held, on disk
    assert st.lookup(more)[0] == len(more)
    # with no clean block left, a put demotes on demand as before
    assert await put(st, s, key("last"), payload("last")) == PutStatus.STORED
    assert len(written) == 1


async def test_a_put_that_finds_the_tier_full_drops_the_clean_blocks_of_one_walk(harness: Harness) -> None:
    """Room for the next puts comes from the same walk: each walk goes past the blocks the
    write-ahead is copying at the cold end, and one a put had cost 13% of the sidecar's CPU
    in ``make demo``."""
    st = await harness.store(disk=True, clean_share=0.5)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    await st.write_ahead()
    clean = [k for k in keys if in_tier(st, k, 'disk')]
    assert len(clean) >= CLEAN_ROOM_PER_WALK
    walks = 0
    real = st.policy.victims

    def counted(*args: Any, **kw: Any) -> Any:
        nonlocal walks
        walks += 1
        return real(*args, **kw)

    st.policy.victims = counted  # type: ignore[method-assign]
    written = count_writes(st)
    more = await fill(st, s, PAGES, CLEAN_ROOM_PER_WALK)  # a page each
    assert walks == 1 and written == []  # one walk, no disk write
    assert sum(dram_place(st, k) is None for k in clean) == CLEAN_ROOM_PER_WALK
    assert st.lookup(clean)[0] == len(clean) and st.lookup(more)[0] == len(more)  # all still held


async def test_a_clean_block_read_since_it_was_written_is_not_dropped_ahead_of_need(harness: Harness) -> None:
    """The run of clean blocks a put drops ends at the first one not yet written: a clean
    block past it is a warmer one (here read since: the hottest of all) and stays."""
    st = await harness.store(disk=True, clean_share=0.1)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    await st.write_ahead()
    assert [k for k in keys if in_tier(st, k, 'disk')] == keys[:2]
    assert await get(st, s, keys[0]) == payload(0)  # clean, and now the hottest block
    await fill(st, s, PAGES, 1)  # a page: the coldest clean block goes, and only it
    assert dram_place(st, keys[1]) is None and dram_place(st, keys[0]) is not None


async def test_the_walk_of_a_put_ends_with_the_run_of_clean_blocks(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=1 / PAGES)
    s = st.open_session()
    await fill(st, s, 0, PAGES)
    await st.write_ahead()  # one clean block, the coldest
    seen = 0
    real = st.policy.victims

    def counted(*args: Any, **kw: Any) -> Any:
        nonlocal seen
        for m in real(*args, **kw):
            seen += 1
            yield m

    st.policy.victims = counted  # type: ignore[method-assign]
    await fill(st, s, PAGES, 1)
    assert seen == 2  # the clean block, then the first one not written: not the whole tier


async def test_nothing_is_written_ahead_without_a_disk_a_demotion_or_a_share(harness: Harness) -> None:
    for st in (await harness.store(clean_share=0.1), await harness.store(disk=True, demote=False, clean_share=0.1),
               await harness.store(disk=True)):
        s = st.open_session()
        await fill(st, s, 0, PAGES)
        assert await st.write_ahead() == 0


async def test_pinned_blocks_are_not_written_ahead(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.1)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    st.pin(s, keys[:4])
    written = count_writes(st)
    await st.write_ahead()
    assert written and not set(written) & set(keys[:4])


async def test_pinned_blocks_the_write_ahead_walks_past_are_held_back_until_unpinned(harness: Harness) -> None:
    """Each pass walks the coldest blocks: pins a client keeps at the cold end must not be
    walked past again by every pass (as a put's search holds them back; what the default
    policy does with a held-back block is test_store's and test_policy's)."""
    st = await harness.store(disk=True, clean_share=0.1)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    st.pin(s, keys[:4])
    await st.write_ahead()
    order = [m.key for m in st.policy.victims("dram")]
    assert order[-4:] == keys[:4] and set(order[:-4]) == set(keys[4:])  # (LRU: the recent end)


async def test_the_write_ahead_and_an_eviction_never_write_one_block_twice(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.5)
    s = st.open_session()
    await fill(st, s, 0, PAGES)
    written = count_writes(st)
    # the put evicts the coldest block and schedules its demotion; before that starts, the
    # write-ahead takes the same block: the demotion that comes second finds it done
    await asyncio.gather(fill(st, s, PAGES, 4), st.write_ahead())
    assert len(written) == len(set(written)) > 0


async def test_the_write_ahead_writes_in_batches_of_one_sync_each(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.5)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    assert disk(st) is not None
    batches: list[int] = []
    real = disk(st).write_many

    def write_many(items: Any) -> Any:
        batches.append(len(items))
        return real(items)

    disk(st).write_many = write_many  # type: ignore[method-assign]
    n = await st.write_ahead()
    assert batches == [PAGES // 2] and n == PAGES // 2 * PAGE  # all of it in one batch
    assert all(in_tier(st, k, 'disk') and in_tier(st, k, 'dram') for k in keys[:PAGES // 2])


async def test_a_pass_wakes_after_a_share_of_the_clean_share_not_after_every_put(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.5)
    s = st.open_session()
    await fill(st, s, 0, PAGES)  # DRAM full: half of it short of clean
    assert st.room_wanted.is_set()
    await st.write_ahead()  # the clean share is met again
    st.room_wanted.clear()
    slack = int(WAKE_SHARE * 0.5 * PAGES)  # in pages (a page is far below the batch bound)
    assert slack > 1
    await fill(st, s, PAGES, slack - 1)  # each takes a clean page: not enough to wake a pass
    assert not st.room_wanted.is_set()
    await fill(st, s, 2 * PAGES, 1)
    assert st.room_wanted.is_set()


async def test_a_put_that_waits_for_a_copy_down_wakes_a_pass_which_writes_a_batch(harness: Harness) -> None:
    st = await harness.store(disk=True, clean_share=0.5)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    await st.write_ahead()
    st.pin(s, [k for k in keys if in_tier(st, k, 'disk')])  # the clean blocks cannot go
    st.room_wanted.clear()
    written = count_writes(st)
    # one page taken is less than a pass waits for, but this put waits for a disk write;
    # the pass that runs meanwhile still writes a batch (one that stepped aside before its
    # first would be woken by the next such put, again and again, and write nothing)
    status, n = await asyncio.gather(put(st, s, key("waits"), payload("waits")), st.write_ahead())
    assert status == PutStatus.STORED and st.room_wanted.is_set()
    assert n > 0 and len(written) == len(set(written)) >= n // PAGE


async def _disk_of(harness: Harness, blocks: int, clean_share: float) -> TieredStore:
    probe = await harness.store(disk=True)
    footprint = disk(probe).footprint(PAGE)  # type: ignore[union-attr]
    return await harness.store(disk=True, disk_bytes=blocks * footprint, clean_share=clean_share)


async def test_a_pass_never_drops_the_copy_of_a_block_it_keeps_copied_down(harness: Harness) -> None:
    """The disk is full of the copies the last pass wrote. A block among them is read (it
    leaves the coldest share), so the share takes in a block with no copy: room for it
    comes from the copy of the block read, not from the copy of one still in the share
    (which only moved the write: the next pass wrote that one again, and so on)."""
    st = await _disk_of(harness, PAGES // 2, clean_share=0.5)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    await st.write_ahead()  # copies of keys[:8]: the disk is full
    for k in keys[6:8]:  # read: hot now, out of the coldest half
        assert await get(st, s, k) == payload(keys.index(k))
    written = count_writes(st)
    assert await st.write_ahead() == 2 * PAGE
    assert written == keys[8:10]
    assert [in_tier(st, k, 'disk') for k in keys[:10]] == [True] * 6 + [False] * 2 + [True] * 2
    assert await st.write_ahead() == 0 and written == keys[8:10]  # the share holds: nothing to write again


async def test_room_on_a_full_disk_is_made_in_one_walk_and_one_hop(harness: Harness, monkeypatch: Any) -> None:
    """A pass that finds the disk full evicts the disk's coldest blocks for all of its batch
    together: their room goes back in one call to a thread, not one per block."""
    st = await _disk_of(harness, PAGES // 2, clean_share=0.5)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    await st.write_ahead()  # the coldest half goes to disk and fills it
    assert all(in_tier(st, k, 'disk') for k in keys[: PAGES // 2])
    more = await fill(st, s, PAGES, PAGES // 2)  # each drops a clean block from DRAM
    hops: list[str] = []
    real = asyncio.to_thread

    async def to_thread(fn: Any, /, *args: Any, **kw: Any) -> Any:
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args, **kw)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    assert await st.write_ahead() == PAGES // 2 * PAGE
    assert hops == ["_free_all", "write_copies"]  # one for the room, one for the batch's write
    assert not any(in_tier(st, k, 'disk') for k in keys[: PAGES // 2])  # the disk's coldest went
    assert all(in_tier(st, k, 'disk') and in_tier(st, k, 'dram') for k in keys[PAGES // 2:])
    assert st.lookup(keys[PAGES // 2:] + more)[0] == PAGES


async def test_a_cancelled_write_ahead_ends_once_its_batch_is_written(harness: Harness) -> None:
    """A stopping sidecar cancels the write-ahead before its tiers close: a batch already
    writing in a thread must be waited for (and landed), not left reading DRAM pages and
    writing a closed disk tier."""
    st = await harness.store(disk=True, clean_share=0.5)
    s = st.open_session()
    await fill(st, s, 0, PAGES)
    assert disk(st) is not None
    writing, go, wrote = threading.Event(), threading.Event(), threading.Event()
    real = disk(st).write_copies

    def slow(items: Any) -> Any:
        writing.set()
        go.wait(30)
        try:
            return real(items)
        finally:
            wrote.set()

    disk(st).write_copies = slow  # type: ignore[method-assign]
    task = asyncio.ensure_future(st.write_ahead())
    assert await asyncio.to_thread(writing.wait, 30)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=0.2)
    assert not done  # the cancelled pass waits for its batch ...
    go.set()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    assert wrote.is_set() and task.cancelled()  # ... and then ends, cancelled
    await asyncio.wait_for(st.settle(), 30)


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_a_block_removed_while_a_stopping_sidecar_writes_it_ahead_stays_removed(harness: Harness,
                                                                                     layout: str) -> None:
    """A stopping sidecar cancels the write-ahead while a thread writes its batch: the batch
    still lands, so the copy of a block removed meanwhile leaves the disk, and the next start
    does not serve it (it had: the copy was written, never forgotten, and adopted at open)."""
    st = await harness.store(disk=True, clean_share=0.5, layout=layout)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    tier = disk(st)
    assert tier is not None
    writing, go = threading.Event(), threading.Event()
    real = tier.write_copies

    def held(items: Any) -> Any:
        writing.set()
        go.wait(10)
        return real(items)

    tier.write_copies = held  # type: ignore[method-assign]
    task = asyncio.ensure_future(st.write_ahead())
    assert await asyncio.to_thread(writing.wait, 10)
    gone = keys[0]  # the coldest: in the batch being written
    assert st.remove(s, [gone]) == 1
    task.cancel()  # what Sidecar.stop does to the write-ahead
    go.set()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await st.settle()
    assert not tier.contains(gone)
    kept = [k for k in keys[1:] if tier.contains(k)]
    assert kept  # the batch's other blocks were written and are on disk ...
    assert all(in_tier(st, k, "disk") for k in kept)  # ... and the store knows it
    st.close()
    again = await harness.store(disk=True, layout=layout)
    s2 = again.open_session()
    assert await get(again, s2, gone) is None
    assert await get(again, s2, kept[0]) == payload(keys.index(kept[0]))  # what was written ahead is kept
    again.close()


async def test_a_put_that_finds_no_room_free_or_clean_is_refused_at_once_and_wakes_the_write_ahead(
        harness: Harness) -> None:
    """``dram.put_waits_for_disk: false``: a put never waits for a disk write. Where no room
    is free or copied down (puts came faster than the write-ahead wrote), it is FULL at once
    and the write-ahead is woken; once that pass has written, puts drop clean blocks again."""
    st = await harness.store(disk=True, clean_share=0.5, put_waits_for_disk=False)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)  # DRAM full, nothing written ahead yet
    st.room_wanted.clear()
    written = count_writes(st)
    assert await put(st, s, key("late"), payload("late")) == PutStatus.FULL
    assert written == [] and st.room_wanted.is_set()  # refused without a write; the writer woken
    assert st.lookup(keys)[0] == PAGES  # nothing was lost for it
    assert st.metrics.counts["put_full_no_clean_room"] == 1
    assert await st.write_ahead() > 0
    before = len(written)
    assert await put(st, s, key("later"), payload("later")) == PutStatus.STORED
    assert len(written) == before  # room from a clean block: no write of its own
    assert st.lookup([key("later")])[0] == 1


async def test_a_put_waits_for_its_copy_down_while_the_write_ahead_cannot_write(harness: Harness) -> None:
    """The write-ahead's last pass had blocks to copy down and copied none (a failing disk):
    refusing every put until it writes again would stop the node storing anything, so puts
    wait for their own victim's copy down, as with ``put_waits_for_disk``."""
    st = await harness.store(disk=True, clean_share=0.5, put_waits_for_disk=False)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    tier = disk(st)
    assert tier is not None
    real = tier.write_copies
    tier.write_copies = lambda items: [TierIOError("EIO") for _ in items]  # type: ignore[method-assign]
    assert await st.write_ahead() == 0  # it had blocks to write and wrote none
    tier.write_copies = real  # type: ignore[method-assign]
    written = count_writes(st)
    assert await put(st, s, key("waits"), payload("waits")) == PutStatus.STORED
    assert written == [keys[0]]  # the coldest block, copied down on demand
    assert st.lookup([keys[0], key("waits")])[0] == 2


async def test_puts_are_refused_again_once_the_write_ahead_writes_again(harness: Harness) -> None:
    """A stall lasts while the write-ahead cannot write: once a pass writes again, a put that
    finds no clean room is FULL at once again (it does not wait for good)."""
    st = await harness.store(disk=True, clean_share=0.5, put_waits_for_disk=False)
    s = st.open_session()
    await fill(st, s, 0, PAGES)
    tier = disk(st)
    assert tier is not None
    real = tier.write_copies
    tier.write_copies = lambda items: [TierIOError("EIO") for _ in items]  # type: ignore[method-assign]
    assert await st.write_ahead() == 0
    tier.write_copies = real  # type: ignore[method-assign]
    assert await st.write_ahead() > 0  # the disk writes again
    clean = PAGES // 2  # the clean share, in pages
    await fill(st, s, PAGES, clean)  # each drops a clean block
    assert await put(st, s, key("late"), payload("late")) == PutStatus.FULL


async def test_a_block_larger_than_the_clean_share_waits_for_its_room(harness: Harness) -> None:
    """The write-ahead never makes more clean room than its share: a block that needs more
    would be refused for good, so it waits for the copies down its room takes."""
    st = await harness.store(disk=True, clean_share=0.25, put_waits_for_disk=False, block_max_bytes=PAGES * PAGE)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    big = PAGES // 2 * PAGE  # half the tier: twice the clean share
    assert await put(st, s, key("big"), payload("big", big)) == PutStatus.STORED
    assert st.lookup(keys)[0] == PAGES  # what it evicted went to disk
    assert st.metrics.counts["put_full_no_clean_room"] == 0


async def _alloc_chain(st: TieredStore, s: Any, keys: list[bytes]) -> list[PutStatus]:
    """A chain put in one ALLOC request: every block allocated, then each committed."""
    lineage, out, parent = st.lineage(), [], None
    for depth, k in enumerate(keys):
        out.append(await st.allocate(s, k, PAGE, depth=depth, parent=parent, lineage=lineage))
        parent = k
    for status, lease in out:
        if lease is not None:
            views = st.host.views(lease.place)
            views[0][:] = payload(keys.index(lease.meta.key))
            assert st.commit(s, lease.id, checksum(views)) == PutStatus.STORED
    return [status for status, _ in out]


async def test_a_chain_refused_for_want_of_clean_room_is_stored_whole_when_put_again(harness: Harness) -> None:
    """The rest of a chain behind a block refused FULL is refused too (unreachable); put again
    on the same connection once there is room, the whole chain is stored (its refused keys
    are forgotten as they are allocated: each retry had stored one more block)."""
    st = await harness.store(disk=True, clean_share=0.5, put_waits_for_disk=False)
    s = st.open_session()
    await fill(st, s, 0, PAGES)
    chain = [key(f"chain{i}") for i in range(4)]
    assert await _alloc_chain(st, s, chain) == [PutStatus.FULL] * 4
    assert await st.write_ahead() > 0
    assert await _alloc_chain(st, s, chain) == [PutStatus.ALLOCATED] * 4
    assert st.lookup(chain)[0] == 4


async def test_a_block_fetched_for_a_reader_waits_for_its_room(harness: Harness) -> None:
    """A peer fetch serves a read, as a promotion does: it waits for a copy down where no room
    is clean (a refusal would pause the tenant's peer reads, ``fetchgate``)."""
    st = await harness.store(disk=True, clean_share=0.5, put_waits_for_disk=False)
    s = st.open_session()
    keys = await fill(st, s, 0, PAGES)
    sink = StoreSink(st)
    status, room = await sink.place(key("fetched"), PAGE, "default")
    assert status == PutStatus.ALLOCATED and room is not None
    lease, views = room
    views[0][:] = payload("fetched")
    sink.commit(lease, checksum(views))
    assert st.lookup([key("fetched"), keys[0]])[0] == 2  # stored; its room's block went to disk
