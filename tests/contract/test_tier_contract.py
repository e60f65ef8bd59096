"""One contract for every tier of the store (:class:`kvpool_sidecar.tiers.base.Tier`).

DRAM, disk, the GPU tier (on a CPU tensor here; on the device in ``scripts/gpu_check.sh``),
the plain-memory stand-in for the GPU and the replay's accounting tier all answer room,
sizes and bytes the same way, and every tier that holds bytes refuses bytes that do not
match the block's checksum, going in and coming out.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.integrity import checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError
from kvpool_sidecar.tiers.base import BlockRecord, Detaching, Tier, TierKind
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from kvpool_sidecar.tiers.hostmem import HostMemoryTier
from kvpool_sidecar.tiers.keyed import KeyedDiskTier
from kvpool_sidecar.tiers.ledger import LedgerTier
from kvpool_sidecar.tiers.segments import SegmentDiskTier

PAGE = 4096
CAPACITY = 16 * PAGE
KINDS = ["dram", "disk", "segments", "hostmem", "ledger", "gpu-on-cpu"]


def make_tier(kind: str, tmp_path: Path) -> Iterator[Tier]:
    if kind == "dram":
        arena = SharedArena(CAPACITY, populate=False)
        yield DramTier(CAPACITY, PAGE, arena)
        arena.close()
    elif kind == "disk":
        # room for the payloads and their headers (the tier counts whole files)
        disk = DiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=CAPACITY + 16 * 512))
        disk.open()
        yield disk
    elif kind == "segments":
        # room for the payloads and their headers, in whole pages (the tier counts records)
        segments = SegmentDiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=CAPACITY + 16 * PAGE))
        segments.open()
        yield segments
        segments.close()
    elif kind == "hostmem":
        yield HostMemoryTier(CAPACITY, PAGE)
    elif kind == "ledger":
        yield LedgerTier(TierKind.DISK, CAPACITY, PAGE)
    else:
        torch = pytest.importorskip("torch")
        from kvpool_sidecar.tiers.gpu import GpuTier

        yield GpuTier(torch.empty(CAPACITY, dtype=torch.uint8), PAGE)


@pytest.fixture(params=KINDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    yield from make_tier(request.param, tmp_path)


def block(i: int, size: int = PAGE + 100) -> tuple[BlockRecord, bytes]:
    data = os.urandom(size)
    key = hashlib.blake2b(str(i).encode(), digest_size=48).digest()
    return BlockRecord(key, size, checksum(memoryview(data))), data


def test_it_is_a_tier(tier: Tier) -> None:
    assert isinstance(tier, Tier)
    assert tier.capacity_bytes >= CAPACITY - PAGE and tier.used_bytes == 0
    assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes
    assert tier.footprint(PAGE + 100) >= PAGE + 100


def test_bytes_round_trip_in_pieces(tier: Tier) -> None:
    record, data = block(1)
    place = tier.reserve(record)
    assert place is not None
    cut = memoryview(data)
    tier.write_copy(place, record, [cut[:1000], cut[1000:]])  # pieces that match no page
    out = [memoryview(bytearray(3000)), memoryview(bytearray(record.size - 3000))]
    tier.read_copy(place, record, out)
    if not tier.accounts_only:
        assert b"".join(bytes(o) for o in out) == data
    assert tier.used_bytes > 0
    tier.release(place)
    assert tier.used_bytes == 0


def room_for_bytes(tier: Tier, i: int) -> tuple[BlockRecord, bytes, Any]:
    """Block ``i`` and room reserved for it, in a tier that holds bytes (else the test skips)."""
    if tier.accounts_only:
        pytest.skip("an accounting tier holds no bytes")
    record, data = block(i)
    place = tier.reserve(record)
    assert place is not None
    return record, data, place


def test_bytes_that_do_not_match_their_checksum_are_refused(tier: Tier) -> None:
    record, data, place = room_for_bytes(tier, 2)
    bad = bytearray(data)
    bad[7] ^= 0x01
    with pytest.raises(CorruptBlockError):
        tier.write_copy(place, record, [memoryview(bytes(bad))])
    tier.release(place)


def test_bytes_that_rot_in_the_tier_are_refused_on_the_way_out(tier: Tier) -> None:
    record, data, place = room_for_bytes(tier, 3)
    tier.write_copy(place, record, [memoryview(data)])
    other = BlockRecord(record.key, record.size, record.checksum ^ 1, record.tenant)  # what it should hold
    with pytest.raises(CorruptBlockError):
        tier.read_copy(place, other, [memoryview(bytearray(record.size))])


def test_a_read_without_waiting_gives_the_bytes_or_nothing(tier: Tier) -> None:
    record, data, place = room_for_bytes(tier, 4)
    tier.write_copy(place, record, [memoryview(data)])
    out = [memoryview(bytearray(3000)), memoryview(bytearray(record.size - 3000))]
    if tier.read_cached(place, record, out):  # a tier that would wait says so, and a thread reads
        assert b"".join(bytes(o) for o in out) == data
    other = BlockRecord(record.key, record.size, record.checksum ^ 1, record.tenant)
    try:
        served = tier.read_cached(place, other, [memoryview(bytearray(record.size))])
    except CorruptBlockError:
        served = False
    assert not served  # bytes that miss their checksum never come back as read


@pytest.mark.parametrize("layout", [DiskTier, SegmentDiskTier])
@pytest.mark.parametrize("fsync", ["never", "always"])
def test_a_disk_tier_counts_the_seconds_it_spends_on_each_kind_of_work(layout: type[KeyedDiskTier], fsync: str,
                                                                      tmp_path: Path) -> None:
    """What ``kvpool demo`` and ``kvpool_disk_io_seconds`` report of the disk (``io_seconds``
    in the store's stats): a sync inside a write counts as syncing, not writing."""
    tier = layout(DiskSettings(path=str(tmp_path / "disk"), size_bytes=CAPACITY + 16 * PAGE, fsync=fsync))
    tier.open()
    synced = fsync == "always"
    try:
        assert set(tier.io_seconds.snapshot().values()) == {0.0}
        blocks = [block(10 + i) for i in range(4)]
        places = [tier.reserve(record) for record, _ in blocks]
        assert all(p is not None for p in places)
        tier.write_copies([(p, record, [memoryview(data)]) for p, (record, data) in zip(places[:3], blocks)])
        batch = tier.io_seconds.snapshot()
        assert batch["write"] > 0.0 and (batch["sync"] > 0.0) == synced  # the sync that ends the batch
        tier.write_copy(places[3], blocks[3][0], [memoryview(blocks[3][1])])
        one = tier.io_seconds.snapshot()
        assert one["write"] > batch["write"] and (one["sync"] > batch["sync"]) == synced  # its own sync
        assert one["read"] == one["read_cached"] == one["delete"] == 0.0
        record = blocks[1][0]
        tier.read_copy(places[1], record, [memoryview(bytearray(record.size))])
        tier.read_cached(places[1], record, [memoryview(bytearray(record.size))])
        read = tier.io_seconds.snapshot()
        assert read["read"] > 0.0 and read["read_cached"] > 0.0 and read["delete"] == 0.0
        tier.release(places[2])
        after_release = tier.io_seconds.snapshot()["delete"]
        free = tier.detach(places[1])
        assert after_release > 0.0 and free is not None
        free()
        done = tier.io_seconds.snapshot()
        assert done["delete"] > after_release
        assert {k: done[k] for k in ("write", "sync", "read", "read_cached")} == \
            {k: read[k] for k in ("write", "sync", "read", "read_cached")}
    finally:
        if isinstance(tier, SegmentDiskTier):
            tier.close()


def test_a_full_tier_gives_no_room_and_room_comes_back(tier: Tier) -> None:
    places = []
    for i in range(64):
        record, data = block(100 + i, PAGE)
        place = tier.reserve(record)
        if place is None:
            break
        tier.write_copy(place, record, [memoryview(data)])  # the disk tier's room is its files
        places.append(place)
    else:
        pytest.fail("a tier of 16 pages took 64 blocks of a page")
    assert 8 <= len(places) <= 17  # (the disk tier counts headers too)
    tier.release(places.pop())
    record, _ = block(999, PAGE)
    assert tier.reserve(record) is not None


def test_a_detached_block_is_forgotten_at_once_and_its_release_frees_it_alone(tier: Tier) -> None:
    """A tier whose releases block (a hole to punch, a file to unlink) forgets a block when
    the store says, and frees its room later in a thread: what it frees then is that block's,
    never the block written under the same key since (a disk place is the key)."""
    if not tier.release_blocks:
        assert not isinstance(tier, Detaching)  # (its releases are cheap: done at once)
        pytest.skip("this tier's releases do not block")
    assert isinstance(tier, Detaching)
    record, data, place = room_for_bytes(tier, 5)
    tier.write_copy(place, record, [memoryview(data)])
    free = tier.detach(place)
    assert free is not None and tier.detach(place) is None  # forgotten, once
    assert tier.used_bytes == 0
    again, fresh = block(5)  # the same key again, new bytes
    second = tier.reserve(again)
    assert second is not None
    tier.write_copy(second, again, [memoryview(fresh)])
    free()  # the first block's late release
    out = memoryview(bytearray(again.size))
    tier.read_copy(second, again, [out])
    assert bytes(out) == fresh
    free = tier.detach(second)
    assert free is not None
    free()
    assert tier.used_bytes == 0
