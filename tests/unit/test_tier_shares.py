"""A tenant's quota holds in every tier, in proportion: its share of the disk tier is counted
for every copy that lands there (demoted, written ahead, kept from a previous run) and made
from its own blocks there, never from another tenant's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.policy import LRUPolicy
from kvpool_sidecar.store import StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from kvpool_sidecar.tiers.segments import SegmentDiskTier
from tests.unit.store_support import put, read

PAGE = 4096


def key(n: int) -> bytes:
    return (b"k%03d" % n).ljust(48, b"x")


async def store(tmp_path: Path, *, quota_pages: int, disk_blocks: int, clean_share: float = 0.0) -> TieredStore:
    dram = DramTier(64 * PAGE, PAGE, SharedArena(64 * PAGE, populate=False))
    disk = DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=disk_blocks * (PAGE + 512)))
    disk.open()
    st = TieredStore([dram, disk], LRUPolicy(), StoreSettings(
        tenants={"default": TenantLimits(), "a": TenantLimits(quota_bytes=quota_pages * PAGE)}, clean_share=clean_share))
    await st.open()
    return st


def on_disk(st: TieredStore, tenant: str) -> int:
    """What ``tenant``'s blocks take on disk, counted from the blocks themselves."""
    disk = st.tiers[1]
    return sum(disk.footprint(e.size, e.tenant) for e in st._entries.values()  # noqa: SLF001
               if e.place(1) is not None and e.tenant == tenant)


async def test_copies_written_ahead_count_against_the_tenants_share(tmp_path: Path) -> None:
    """The write-ahead took room on disk without counting it, and its releases were counted:
    the tenant's count drifted below zero while its blocks went past its share (and the
    write-ahead made room for them from any tenant's blocks)."""
    st = await store(tmp_path, quota_pages=60, disk_blocks=128, clean_share=0.3)
    try:
        mover = st._mover  # noqa: SLF001
        for n in range(200):
            await put(st, key(n), bytes([n]) * PAGE, tenant="a")
            await st.write_ahead()
        await st.settle()
        assert mover.ledger.cold_used[1]["a"] == on_disk(st, "a")
        share = mover.room.cold_share(1, "a")
        assert share is not None and 0 < on_disk(st, "a") <= share
    finally:
        st.close()


async def test_a_block_larger_than_the_share_fails_at_once_without_evicting_the_tenants_blocks(
        tmp_path: Path) -> None:
    """Room for a block larger than the tenant's whole share of a tier can never be made: it
    had evicted every block of the tenant there first, then failed all the same."""
    st = await store(tmp_path, quota_pages=16, disk_blocks=16)
    try:
        for n in range(20):
            await put(st, key(n), bytes([n]) * PAGE, tenant="a")
        await st.settle()
        before = on_disk(st, "a")
        assert before > 0
        await put(st, key(100), b"B" * (5 * PAGE), tenant="a")  # within the DRAM quota, past the disk share
        big = st._entries[key(100)]  # noqa: SLF001
        await st._mover.room.evict(0, big)  # noqa: SLF001
        await st.settle()
        assert on_disk(st, "a") == before and key(100) not in st._entries  # noqa: SLF001
    finally:
        st.close()


@pytest.mark.parametrize("layout", ["segments", "files"])
async def test_blocks_of_a_few_bytes_take_no_more_of_the_disk_than_the_least_charge(tmp_path: Path, layout: str) -> None:
    """Each block the node holds costs the sidecar about 2 KB of memory, and a block of a few
    bytes took a record of a few hundred bytes (one file) or 4 KiB (segments): a tenant putting
    them could make the sidecar keep 40-50% of the disk tier's size in memory. A block now
    takes at least ``disk.min_block_bytes`` of the tier (its tenant's share too), so the tier
    holds at most its size over that in blocks."""
    least = 4 * PAGE
    settings = DiskSettings(path=str(tmp_path / "disk"), size_bytes=64 * least, layout=layout, min_block_bytes=least)
    disk = DiskTier(settings) if layout == "files" else SegmentDiskTier(settings)
    disk.open()
    st = TieredStore([DramTier(16 * PAGE, PAGE, SharedArena(16 * PAGE, populate=False)), disk], LRUPolicy(),
                     StoreSettings(tenants={"default": TenantLimits(), "a": TenantLimits(quota_bytes=8 * PAGE)},
                                   clean_share=0.25))
    await st.open()
    try:
        assert disk.max_blocks == 64 and disk.footprint(1) == least
        for n in range(300):
            await put(st, key(n), bytes([n % 256]), tenant="a" if n % 2 else "default")
            await st.write_ahead()
        await st.settle()
        assert 0 < len(disk) <= 64
        share = st._mover.room.cold_share(1, "a")  # noqa: SLF001
        assert share == 32 * least and 0 < on_disk(st, "a") <= share  # (the quota's half of DRAM: half the disk)
        assert st._mover.ledger.cold_used[1]["a"] == on_disk(st, "a")  # noqa: SLF001
        newest = [n for n in range(300) if key(n) in st._entries]  # noqa: SLF001
        assert len(newest) >= 64
        for n in newest[-8:]:  # (what the store still lists reads back whole)
            assert await read(st, key(n)) == bytes([n % 256])
    finally:
        st.close()


def test_a_sidecar_charges_a_block_on_disk_at_least_a_dram_page(tmp_path: Path) -> None:
    """The sidecar's default: the DRAM tier's page, as the DRAM tier charges a block."""
    from kvpool_sidecar.__main__ import build_tiers
    from kvpool_sidecar.config import settings_from_mapping

    made = build_tiers(settings_from_mapping({
        "node_name": "n", "dram": {"size_bytes": 1 << 20, "page_bytes": 16384},
        "disk": {"path": str(tmp_path / "disk"), "size_bytes": 1 << 20}}), arena=False)
    disk = made[-1]
    assert isinstance(disk, SegmentDiskTier) and disk.min_charge == 16384 and disk.max_blocks == 64
    assert disk.footprint(100) == 16384 and disk.footprint(1 << 20) > 1 << 20
    made = build_tiers(settings_from_mapping({
        "node_name": "n", "dram": {"size_bytes": 1 << 20, "page_bytes": 16384},
        "disk": {"path": str(tmp_path / "disk2"), "size_bytes": 1 << 20, "min_block_bytes": 0}}), arena=False)
    disk = made[-1]
    assert isinstance(disk, SegmentDiskTier) and disk.max_blocks is None and disk.footprint(100) < 16384


async def test_a_disk_that_keeps_more_blocks_than_it_now_holds_gives_up_the_rest_at_open(tmp_path: Path) -> None:
    """Blocks kept from a run without the least charge (or a smaller one, or a larger tier)
    may be more than the tier now holds. They had stayed until the first put that needed room
    below, which then evicted them one by one, every put behind it waiting (a review: 2,937
    evictions in one put). They go at open now, in the policy's order, in one batch."""
    path = str(tmp_path / "disk")
    first = SegmentDiskTier(DiskSettings(path=path, size_bytes=64 * 4 * PAGE, min_block_bytes=0))
    first.open()
    st = TieredStore([DramTier(16 * PAGE, PAGE, SharedArena(16 * PAGE, populate=False)), first], LRUPolicy(),
                     StoreSettings(clean_share=0.25))
    await st.open()
    try:
        for n in range(300):
            await put(st, key(n), bytes([n % 256]))
            await st.write_ahead()
        await st.settle()
        kept = len(first)
        assert kept > 64
    finally:
        st.close()
    disk = SegmentDiskTier(DiskSettings(path=path, size_bytes=64 * 4 * PAGE, min_block_bytes=4 * PAGE))
    disk.open()
    st = TieredStore([DramTier(16 * PAGE, PAGE, SharedArena(16 * PAGE, populate=False)), disk], LRUPolicy(),
                     StoreSettings(clean_share=0.25))
    try:
        assert await st.open() == kept
        await st.settle()
        assert len(disk) <= 64 and st._mover.ledger.cold_used[1]["default"] <= disk.capacity_bytes  # noqa: SLF001
        assert sum(1 for e in st._entries.values() if e.place(1) is not None) == len(disk)  # noqa: SLF001
        await put(st, key(1000), b"new")  # room as ever
        assert await read(st, key(1000)) == b"new"
    finally:
        st.close()
