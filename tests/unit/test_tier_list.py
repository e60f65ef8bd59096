"""The store as a list of tiers: two and three tiers, the GPU tier played by plain memory
(:class:`~kvpool_sidecar.tiers.hostmem.HostMemoryTier`, which like device memory only
copies). The CUDA tier itself runs the same logic in ``scripts/gpu_check.sh``."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from typing import Any, cast
from pathlib import Path

import pytest

from kvpool_client.integrity import checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.events import IndexEvent
from kvpool_sidecar.policy import LRUPolicy, PrefixAwarePolicy, make_policy
from kvpool_sidecar.store import StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.tiers.base import Tier, TierKind
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from kvpool_sidecar.tiers.hostmem import HostMemoryTier
from tests.unit.store_support import close_store, entry, in_tier, put, read
from tests.unit.test_gpu_tier import needs_cuda

PAGE = 4096
DRAM_PAGES = 8
GPU_PAGES = 4


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=48).digest()


def data(i: int) -> bytes:
    return hashlib.shake_256(str(i).encode()).digest(PAGE)


@pytest.fixture(params=["lru", "prefix"])
def three(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TieredStore]:
    """GPU (plain memory), DRAM, disk; under LRU and under the default policy."""
    yield from build(tmp_path, gpu=True, disk=True, policy=request.param)


def build(tmp_path: Path, *, gpu: bool, disk: bool, promote_hits: int = 2,
          policy: str = "lru") -> Iterator[TieredStore]:
    tiers: list[Tier] = []
    if gpu:
        tiers.append(HostMemoryTier(GPU_PAGES * PAGE, PAGE))
    tiers.append(DramTier(DRAM_PAGES * PAGE, PAGE, SharedArena(DRAM_PAGES * PAGE, populate=False)))
    if disk:
        d = DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=64 * PAGE))
        tiers.append(d)
    st = TieredStore(tiers, make_policy(policy), StoreSettings(block_max_bytes=PAGE, promote_hits=promote_hits))
    yield st
    close_store(st)


async def read_twice(st: TieredStore, k: bytes) -> bytes | None:
    first = await read(st, k)
    second = await read(st, k)
    await st.settle()
    return first if first == second else None


async def test_a_block_read_often_is_copied_up_to_the_gpu_tier(three: TieredStore) -> None:
    st = three
    await put(st, key(0), data(0))
    assert await read(st, key(0)) == data(0)
    await st.settle()
    assert not in_tier(st, key(0), "gpu")  # one read is not enough
    assert await read(st, key(0)) == data(0)
    await st.settle()
    assert in_tier(st, key(0), "gpu") and in_tier(st, key(0), "dram")  # a copy up, the DRAM copy stays
    assert st.index_events is not None and IndexEvent(True, "gpu", key(0)) in st.index_events.items
    assert st.lookup([key(0)]) == (1, [["gpu", 1]])
    assert (await st.report.inventory_soon())[key(0)] == ["gpu", "dram"]
    assert st.report.tier_usage()["gpu"] == (GPU_PAGES * PAGE, PAGE, 1)


async def test_a_block_only_in_the_gpu_tier_comes_back_from_it_not_from_disk(three: TieredStore,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    st = three
    await put(st, key(0), data(0))
    assert await read_twice(st, key(0)) == data(0)
    for i in range(1, DRAM_PAGES + 2):  # push block 0 out of DRAM: it is copied to disk first
        await put(st, key(i), data(i))
    assert not in_tier(st, key(0), "dram") and in_tier(st, key(0), "gpu") and in_tier(st, key(0), "disk")
    disk = st.tiers[2]
    assert isinstance(disk, DiskTier)

    def no_disk_read(*args: object) -> None:
        raise AssertionError("read from disk while the GPU tier holds the block")

    monkeypatch.setattr(disk, "read_into", no_disk_read)
    assert await read(st, key(0)) == data(0)  # brought from the nearest, hotter copy
    assert in_tier(st, key(0), "dram")


async def test_gpu_victims_go_down_to_dram_when_no_colder_tier_holds_them(tmp_path: Path) -> None:
    for st in build(tmp_path, gpu=True, disk=False):
        for i in range(GPU_PAGES):
            await put(st, key(i), data(i))
            assert await read_twice(st, key(i)) == data(i)
        assert all(in_tier(st, key(i), "gpu") for i in range(GPU_PAGES))
        for i in range(GPU_PAGES, GPU_PAGES + DRAM_PAGES):  # DRAM loses the old blocks: only the GPU has them
            await put(st, key(i), data(i))
        only_gpu = [i for i in range(GPU_PAGES) if not in_tier(st, key(i), "dram")]
        assert only_gpu
        # new hot blocks take the GPU tier: its victims are copied down to DRAM, not lost
        for i in range(100, 100 + GPU_PAGES):
            await put(st, key(i), data(i))
            assert await read_twice(st, key(i)) == data(i)
        for i in only_gpu:
            assert st.contains(key(i))
            assert await read(st, key(i)) == data(i)


async def test_a_copy_that_rots_in_the_gpu_tier_is_a_miss_never_wrong_bytes(three: TieredStore) -> None:
    st = three
    await put(st, key(0), data(0))
    assert await read_twice(st, key(0)) == data(0)
    gpu = st.tiers[0]
    assert isinstance(gpu, HostMemoryTier)
    gpu.corrupt(entry(st, key(0)).place(0))
    for i in range(1, DRAM_PAGES + 2):
        await put(st, key(i), data(i))
    assert not in_tier(st, key(0), "dram")
    assert await read(st, key(0)) is None  # the GPU copy fails its checksum: the block goes
    assert not st.contains(key(0)) and st.metrics.snapshot().get("corrupt_gpu", 1) >= 1
    disk = st.tiers[2]
    assert isinstance(disk, DiskTier)
    assert st.tiers[0].used_bytes == 0 and not disk.contains(key(0))  # every copy of it went


async def test_two_tiers_gpu_and_dram_keep_their_accounts(tmp_path: Path) -> None:
    for st in build(tmp_path, gpu=True, disk=False, promote_hits=1):
        for i in range(40):
            k = key(i % 12)
            if not st.contains(k):
                await put(st, k, data(i % 12))
            got = await read(st, k)
            assert got is None or got == data(i % 12)
        await st.settle()
        usage = st.report.tier_usage()
        for name, tier in zip(("gpu", "dram"), st.tiers):
            held = [k for k in (key(i) for i in range(12)) if in_tier(st, k, name)]
            assert usage[name][2] == len(held)
            assert tier.used_bytes == len(held) * PAGE


def test_a_store_needs_a_dram_tier_and_tiers_in_order(tmp_path: Path) -> None:
    dram = DramTier(DRAM_PAGES * PAGE, PAGE)
    gpu = HostMemoryTier(GPU_PAGES * PAGE, PAGE)
    with pytest.raises(ValueError):
        TieredStore([gpu], LRUPolicy(), StoreSettings())
    with pytest.raises(ValueError):
        TieredStore([dram, gpu], LRUPolicy(), StoreSettings())  # the GPU tier is hotter: it comes first
    with pytest.raises(ValueError):
        TieredStore([dram, HostMemoryTier(PAGE, PAGE, TierKind.DRAM)], LRUPolicy(), StoreSettings())


async def test_checksums_of_what_came_back(three: TieredStore) -> None:
    """Every byte read back through any path matches what was put."""
    st = three
    blobs = {i: os.urandom(PAGE - i) for i in range(20)}
    for i, b in blobs.items():
        await put(st, key(i), b)
    for _ in range(3):
        for i, b in blobs.items():
            got = await read(st, key(i))
            if got is not None:
                assert checksum(memoryview(got)) == checksum(memoryview(b))
        await st.settle()


@pytest.mark.gpu
@needs_cuda
async def test_the_cuda_tier_in_the_list(tmp_path: Path) -> None:
    """The same moves with the real GPU tier: up after two reads, back from it when DRAM lost
    the block, and rot on the device is a miss."""
    from kvpool_sidecar.config import GpuSettings
    from kvpool_sidecar.tiers.gpu import GpuTier

    gpu = GpuTier.create(GpuSettings(enabled=True, size_bytes=GPU_PAGES * PAGE), PAGE)
    assert gpu is not None
    dram = DramTier(DRAM_PAGES * PAGE, PAGE, SharedArena(DRAM_PAGES * PAGE, populate=False))
    st = TieredStore([gpu, dram], LRUPolicy(), StoreSettings(block_max_bytes=PAGE))
    try:
        await put(st, key(0), data(0))
        assert await read_twice(st, key(0)) == data(0)
        assert in_tier(st, key(0), "gpu")
        for i in range(1, DRAM_PAGES + 2):
            await put(st, key(i), data(i))
        assert not in_tier(st, key(0), "dram") and in_tier(st, key(0), "gpu")
        assert await read(st, key(0)) == data(0)  # device to host, checked
        place = entry(st, key(0)).place(0)
        assert place is not None
        for i in range(1, DRAM_PAGES + 2):
            await put(st, key(100 + i), data(100 + i))
        gpu.buffer[place[0][0]] ^= 0xFF  # rot on the device
        if not in_tier(st, key(0), "dram"):
            assert await read(st, key(0)) is None and not st.contains(key(0))
    finally:
        close_store(st)


async def test_prefetch_brings_a_batch_of_cold_blocks_together(tmp_path: Path) -> None:
    for st in build(tmp_path, gpu=False, disk=True):
        for i in range(3 * DRAM_PAGES):
            await put(st, key(i), data(i))
        cold = [key(i) for i in range(2)]  # long gone from DRAM, on disk
        assert not any(in_tier(st, k, "dram") for k in cold) and all(in_tier(st, k, "disk") for k in cold)
        await st.prefetch(cold)
        assert all(in_tier(st, k, "dram") for k in cold)  # already there for the acquires
        big = [key(i) for i in range(2, 2 + DRAM_PAGES // 4 + 1)]  # more than a quarter of DRAM
        await st.prefetch(big)
        assert not any(in_tier(st, k, "dram") for k in big)  # left to the acquires, one by one
        for i in range(2 + DRAM_PAGES // 4 + 1):
            assert await read(st, key(i)) == data(i)


async def test_blocks_the_page_cache_holds_come_back_without_a_thread(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from kvpool_sidecar.tiers.segments import SegmentDiskTier

    segments = SegmentDiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=64 * PAGE))
    segments.open()
    reads: list[str] = []  # the thread each read from disk ran in
    hints: list[int] = []
    read_copy, prefetch = segments.read_copy, segments.prefetch

    def counted_read(*args: object) -> None:
        reads.append(threading.current_thread().name)
        read_copy(*args)  # type: ignore[arg-type]

    def counted_hint(places: list[bytes]) -> int:
        hints.append(len(places))
        return prefetch(places)

    monkeypatch.setattr(segments, "read_copy", counted_read)
    monkeypatch.setattr(segments, "prefetch", counted_hint)
    st = TieredStore([DramTier(DRAM_PAGES * PAGE, PAGE, SharedArena(DRAM_PAGES * PAGE, populate=False)), segments],
                     LRUPolicy(), StoreSettings(block_max_bytes=PAGE))
    try:
        for i in range(3 * DRAM_PAGES):
            await put(st, key(i), data(i))
        on_disk = [key(i) for i in range(4)]
        assert all(in_tier(st, k, "disk") and not in_tier(st, k, "dram") for k in on_disk)
        with monkeypatch.context() as m:
            m.setattr(segments, "read_nowait", lambda key, dest: False)  # as if on the device alone
            await st.prefetch(on_disk[:2])  # a quarter of DRAM: brought together
        assert all(in_tier(st, k, "dram") for k in on_disk[:2])
        assert len(reads) == 2 and threading.main_thread().name not in reads  # in a thread ...
        assert hints == [2]  # ... that hinted the batch's reads first
        reads.clear()
        cached = segments.read_nowait(on_disk[2], [memoryview(bytearray(PAGE))])
        await st.prefetch(on_disk[2:])
        assert all(in_tier(st, k, "dram") for k in on_disk[2:])
        for i in range(4):
            assert await read(st, key(i)) == data(i)
        if not cached:
            pytest.skip("this filesystem does not take RWF_NOWAIT reads: every read went to a thread")
        assert reads == [] and hints == [2]  # just written, in the page cache: no thread, no hint
        from kvpool_sidecar.store import mover

        monkeypatch.setattr(mover, "INLINE_BATCH_BYTES", PAGE)  # the event loop reads one block a batch
        more = [key(i) for i in range(4, 6)]
        assert all(in_tier(st, k, "disk") and not in_tier(st, k, "dram") for k in more)
        await st.prefetch(more)
        assert len(reads) == 1 and all(in_tier(st, k, "dram") for k in more)
        assert [await read(st, k) for k in more] == [data(4), data(5)]
    finally:
        close_store(st)


class BlockingMemoryTier(HostMemoryTier):
    """Plain memory whose copies the store runs in a thread, as it does the GPU tier's."""

    blocking = True


def with_blocking_gpu(gpu_pages: int = 32, dram_pages: int = 32) -> TieredStore:
    return TieredStore([BlockingMemoryTier(gpu_pages * PAGE, PAGE),
                        DramTier(dram_pages * PAGE, PAGE, SharedArena(dram_pages * PAGE, populate=False))],
                       LRUPolicy(), StoreSettings(block_max_bytes=PAGE))


async def heat(st: TieredStore, stored: int, hot: int) -> None:
    """Put blocks ``0..stored-1``, then acquire and release ``0..hot-1`` in turn, twice
    (``promote_hits``), without waiting in between (the hits of one client's batches), and
    wait for the copies up that made."""
    for i in range(stored):
        await put(st, key(i), data(i))
    s = st.open_session()
    for _ in range(2):
        leases = [await st.acquire(s, key(i)) for i in range(hot)]
        for lease in leases:
            assert lease is not None
            st.release(s, lease.id)
    await st.settle()


async def all_read_back(st: TieredStore, n: int) -> bool:
    return [await read(st, key(i)) for i in range(n)] == [data(i) for i in range(n)]


async def test_the_copies_up_of_a_batch_of_reads_take_one_thread_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's batch of reads that makes 16 blocks hot copies them up together: one call
    to a thread (one pass of the device tier's lock), not one each."""
    from kvpool_sidecar.store import mover

    hops: list[int] = []
    run_copies = mover._run_copies

    def counted(copies: Any, hints: Any = ()) -> list[Exception | None]:
        hops.append(len(copies))
        return run_copies(copies, hints)

    monkeypatch.setattr(mover, "_run_copies", counted)
    st = with_blocking_gpu()
    try:
        await heat(st, 16, 16)
        assert all(in_tier(st, key(i), "gpu") for i in range(16))
        assert hops == [16]  # one copy up each, in its own thread call: [1] * 16
        assert await all_read_back(st, 16)
    finally:
        close_store(st)


async def test_copies_up_wait_for_no_more_than_their_cap_and_a_failed_one_is_only_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Hits faster than the tier above takes them schedule at most MAX_QUEUED_UP copies; a copy
    whose tier fails (any TierError) leaves the block where it was, logged once, never as an
    error of the loop."""
    from kvpool_sidecar.errors import TierError
    from kvpool_sidecar.store import promotion

    monkeypatch.setattr(promotion, "MAX_QUEUED_UP", 4)
    st = with_blocking_gpu()
    gpu = st.tiers[0]
    failures: list[bytes] = []

    def broken(place: Any, record: Any, src: Any) -> None:
        failures.append(record.key)
        raise TierError("the device is gone")

    monkeypatch.setattr(gpu, "write_copy", broken)
    try:
        await heat(st, 12, 12)
        assert len(failures) == 4  # the first four hot blocks were scheduled, the rest not
        assert not any(in_tier(st, key(i), "gpu") for i in range(12))
        assert await all_read_back(st, 12)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        await st.settle()
        assert not st._promoter._promoting  # noqa: SLF001 - nothing left scheduled
    finally:
        close_store(st)


async def test_one_tenants_reads_take_no_more_than_its_share_of_the_copies_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant whose reads make more blocks hot than the tier above takes holds at most its
    share of the copy-up queue, and batches take the tenants' blocks in turn: another
    tenant's hot blocks are scheduled (not turned away by a full queue) and go up in the
    first batch, not after the first tenant's whole backlog."""
    from kvpool_sidecar.store import promotion

    monkeypatch.setattr(promotion, "MAX_QUEUED_UP", 6)
    monkeypatch.setattr(promotion, "MAX_QUEUED_UP_PER_TENANT", 4)
    monkeypatch.setattr(promotion, "UP_BATCH", 4)
    st = TieredStore([BlockingMemoryTier(32 * PAGE, PAGE),
                      DramTier(32 * PAGE, PAGE, SharedArena(32 * PAGE, populate=False))],
                     LRUPolicy(), StoreSettings(tenants={"greedy": TenantLimits(), "other": TenantLimits()},
                                                block_max_bytes=PAGE))
    gpu = st.tiers[0]
    copied: list[bytes] = []
    write_copy = gpu.write_copy

    def recorded(place: Any, record: Any, src: Any) -> Any:
        copied.append(record.key)
        return write_copy(place, record, src)

    monkeypatch.setattr(gpu, "write_copy", recorded)
    greedy, other = range(0, 6), range(6, 8)
    try:
        for i in greedy:
            await put(st, key(i), data(i), tenant="greedy")
        for i in other:
            await put(st, key(i), data(i), tenant="other")
        s = st.open_session()
        for _ in range(2):  # greedy's reads first, all in one go: its backlog is there first
            for i in [*greedy, *other]:
                lease = await st.acquire(s, key(i))
                assert lease is not None
                st.release(s, lease.id)
        await st.settle()
        assert all(in_tier(st, key(i), "gpu") for i in other)  # before: turned away, the queue full
        assert {key(i) for i in other} <= set(copied[:4])  # before: behind greedy's four
        assert [i for i in greedy if in_tier(st, key(i), "gpu")] == [0, 1, 2, 3]  # its share
        assert await all_read_back(st, 8)
    finally:
        close_store(st)


def test_copy_up_batches_take_the_tenants_in_turn_and_the_next_starts_after_the_last_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 4 from tenants a (5 blocks), b (1) and c (3), queued in that order: each
    batch takes the tenants' oldest in turn, and the next begins with the tenant after the
    last one served, not with the first tenant again."""
    from kvpool_sidecar.store import promotion

    monkeypatch.setattr(promotion, "UP_BATCH", 4)
    promoter = promotion.Promoter(cast(Any, None))  # batching touches no tier
    queued = {"a": 5, "b": 1, "c": 3}
    promoter._up = {t: {f"{t}{i}".encode(): f"{t}{i}" for i in range(n)}  # noqa: SLF001
                    for t, n in queued.items()}
    promoter._queued = sum(queued.values())  # noqa: SLF001
    batches = []
    while promoter._up:  # noqa: SLF001
        batches.append(promoter._next_batch())  # noqa: SLF001
    assert batches == [["a0", "b0", "c0", "a1"], ["c1", "a2", "c2", "a3"], ["a4"]]
    assert promoter._queued == 0  # noqa: SLF001


async def test_a_copy_up_that_fails_unexpectedly_gives_its_room_back_and_the_next_one_runs(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An error no tier should raise (a bug, a device library's own) ends that batch's copies
    up: their room in the tier above goes back, the blocks stay readable where they were, it
    is logged as a warning, and the next hot blocks still go up."""
    st = with_blocking_gpu()
    gpu = st.tiers[0]
    write_copy = gpu.write_copy

    def broken(place: Any, record: Any, src: Any) -> None:
        raise RuntimeError("not a tier's error")

    monkeypatch.setattr(gpu, "write_copy", broken)
    try:
        await heat(st, 8, 4)
        assert gpu.used_bytes == 0  # was 4 pages, taken for good
        assert await all_read_back(st, 4)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        monkeypatch.setattr(gpu, "write_copy", write_copy)
        for i in range(4, 8):
            assert await read_twice(st, key(i)) == data(i)
        assert all(in_tier(st, key(i), "gpu") for i in range(4, 8))
    finally:
        close_store(st)


async def test_a_read_of_a_block_the_gpu_tier_also_holds_counts_once(tmp_path: Path) -> None:
    """A read of a block in DRAM and the GPU tier tells the policy of both copies (each
    copy's place in its tier's order); the default policy counted the read twice (its
    estimates, shadows and witness: a block the GPU tier held seemed read by two requests
    each time)."""
    for st in build(tmp_path, gpu=True, disk=False, policy="prefix"):
        await put(st, key(0), data(0))
        assert await read_twice(st, key(0)) == data(0)
        assert in_tier(st, key(0), "gpu") and in_tier(st, key(0), "dram")
        inner = st.policy.inner
        assert isinstance(inner, PrefixAwarePolicy) and inner._learning is not None
        sketch = inner._learning.sketch
        counted = sketch.count(key(0))
        for n in range(1, 4):
            assert await read(st, key(0)) == data(0)
            st.policy.settle()  # (the policy hears of a read after its answer)
            assert sketch.count(key(0)) == counted + n
