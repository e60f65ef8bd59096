"""The disk tier's segment layout on a real filesystem: records, holes, restarts, torn writes."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import threading
from pathlib import Path

import pytest

from kvpool_bench.disk import drop_cache
from kvpool_client.integrity import checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError
from kvpool_sidecar.tiers import descriptors
from kvpool_sidecar.tiers import segfiles as segfiles_mod
from kvpool_sidecar.tiers import segments as seg_mod
from kvpool_sidecar.tiers import segscan as segscan_mod
from kvpool_sidecar.tiers import segtable as segtable_mod
from kvpool_sidecar.tiers.base import BlockRecord
from kvpool_sidecar.tiers.diskformat import pack_header
from kvpool_sidecar.tiers.segments import ALIGN, MIN_SEGMENT_BYTES, SEAL_BYTES, SegmentDiskTier, aligned, punch_hole

MiB = 1 << 20


def key(i: int) -> bytes:
    return hashlib.blake2b(b"segment key %d" % i, digest_size=48).digest()


def block(i: int, size: int = 60_000, tenant: str = "default") -> tuple[BlockRecord, bytes]:
    data = hashlib.shake_256(b"payload %d" % i).digest(size)
    return BlockRecord(key(i), size, checksum(memoryview(data)), tenant), data


def make(tmp_path: Path, size: int = 64 * MiB, **kw: object) -> SegmentDiskTier:
    tier = SegmentDiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=size, **kw))  # type: ignore[arg-type]
    tier.open()
    return tier


def read(tier: SegmentDiskTier, record: BlockRecord) -> bytes:
    out = memoryview(bytearray(record.size))
    tier.read_into(record.key, out)
    return bytes(out)


def segment_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "disk" / "segments").glob("*.kvs"))


def test_blocks_span_segments_and_read_back(tmp_path: Path) -> None:
    tier = make(tmp_path)
    blocks = [block(i, size=300_000 + i) for i in range(40)]  # 12 MB: several 4 MiB segments
    for record, data in blocks:
        assert tier.write(record, [memoryview(data)]) == aligned(tier.estimate_bytes(record.size, "default"))
    assert tier.segment_bytes == MIN_SEGMENT_BYTES and len(segment_files(tmp_path)) >= 3
    assert tier.used_bytes == sum(aligned(len(pack_header(r, 0, r.size)) + SEAL_BYTES + r.size) for r, _ in blocks)
    for record, data in blocks:
        assert read(tier, record) == data
    tier.close()


def test_a_deleted_record_frees_its_pages_and_an_empty_segment_goes(tmp_path: Path) -> None:
    tier = make(tmp_path)
    blocks = [block(i, size=1 * MiB) for i in range(10)]  # three records a segment
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    first = segment_files(tmp_path)[0]
    allocated = os.stat(first).st_blocks
    tier.delete(blocks[0][0].key)
    assert os.stat(first).st_blocks < allocated - (MiB // 512) // 2  # the record's pages are free
    for record, _ in blocks[1:3]:
        tier.delete(record.key)
    assert not first.exists()  # all its records gone: the segment is deleted
    assert tier.used_bytes == sum(aligned(len(pack_header(r, 0, r.size)) + SEAL_BYTES + r.size) for r, _ in blocks[3:])
    for record, data in blocks[3:]:
        assert read(tier, record) == data
    tier.close()


def test_a_restart_recovers_every_block_and_writes_a_new_segment(tmp_path: Path) -> None:
    tier = make(tmp_path)
    blocks = [block(i, size=200_000) for i in range(30)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    for record, _ in blocks[::3]:
        tier.delete(record.key)
    used = tier.used_bytes
    tier.close()
    before = segment_files(tmp_path)
    again = make(tmp_path)
    kept = [b for i, b in enumerate(blocks) if i % 3]
    assert sorted(again.keys()) == sorted(r.key for r, _ in kept)
    assert again.used_bytes == used and again.discarded_on_open == 0
    for record, data in kept:
        assert again.record(record.key) == record and read(again, record) == data
    extra, data = block(99)
    again.write(extra, [memoryview(data)])
    assert len(segment_files(tmp_path)) == len(before) + 1  # never appends to an old segment
    again.close()


def test_a_torn_record_is_discarded_at_restart(tmp_path: Path) -> None:
    tier = make(tmp_path)
    blocks = [block(i, size=100_000) for i in range(5)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    tier.close()
    [segment] = segment_files(tmp_path)
    os.truncate(segment, os.path.getsize(segment) - ALIGN)  # the last record, cut short
    again = make(tmp_path)
    assert sorted(again.keys()) == sorted(r.key for r, _ in blocks[:4])
    assert again.discarded_on_open == 1
    again.close()


def test_a_header_hidden_in_a_payload_is_never_recovered(tmp_path: Path) -> None:
    """A tenant's payload may hold a well-formed header (for another tenant's key) at a page
    boundary: when the record around it is torn, the scan must not read on into it."""
    tier = make(tmp_path)
    victim = BlockRecord(key(1000), ALIGN, checksum(memoryview(bytes(ALIGN))), "victim")
    fake = pack_header(victim, 0, ALIGN)
    # the attacker's payload follows its record's header: this puts a forged header at the
    # start of the record's page 2, followed by the forged block's bytes
    size = 4 * ALIGN
    lead = 2 * ALIGN - len(pack_header(BlockRecord(key(1), size, 0, "attacker"), 0, size))
    payload = os.urandom(lead) + fake + bytes(size - lead - len(fake))
    attacker = BlockRecord(key(1), size, checksum(memoryview(payload)), "attacker")
    tier.write(attacker, [memoryview(payload)])
    tier.close()
    [segment] = segment_files(tmp_path)
    with open(segment, "r+b") as f:  # the attacker's own record header, torn
        f.seek(0)
        f.write(b"\xff" * 16)
    again = make(tmp_path)
    assert not again.contains(victim.key) and not again.contains(attacker.key)
    assert again.discarded_on_open == 1
    again.close()


def test_a_header_behind_a_lost_page_is_not_taken_for_a_record(tmp_path: Path) -> None:
    """A power loss may leave a record's first page unwritten (a hole: zeros) and later pages
    written. A header in those pages, made by the tenant whose payload they are, lacks the
    tier's seal and is never recovered, even though the scan reads on past zeros."""
    tier = make(tmp_path)
    victim = BlockRecord(key(1000), ALIGN, checksum(memoryview(bytes(ALIGN))), "victim")
    fake = pack_header(victim, 0, ALIGN)
    size = 4 * ALIGN
    lead = 2 * ALIGN - len(pack_header(BlockRecord(key(1), size, 0, "attacker"), 0, size)) - SEAL_BYTES
    payload = os.urandom(lead) + fake + bytes(SEAL_BYTES) + bytes(size - lead - len(fake) - SEAL_BYTES)
    attacker = BlockRecord(key(1), size, checksum(memoryview(payload)), "attacker")
    tier.write(attacker, [memoryview(payload)])
    tier.close()
    [segment] = segment_files(tmp_path)
    fd = os.open(segment, os.O_RDWR)
    try:
        punch_hole(fd, 0, 2 * ALIGN)  # the record's first pages never reached the disk
    finally:
        os.close(fd)
    again = make(tmp_path)
    assert not again.contains(victim.key) and not again.contains(attacker.key)
    again.close()


def test_a_rewrite_left_unpunched_by_a_crash_loses_to_the_newer_record(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)
    old, old_data = block(1)
    tier.write(old, [memoryview(old_data)])
    newer_data = b"newer bytes" * 1000
    newer = BlockRecord(old.key, len(newer_data), checksum(memoryview(newer_data)), "default")

    def fail(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, "simulated: the machine died before the hole was punched")

    monkeypatch.setattr(segtable_mod, "punch_hole", fail)
    tier.write(newer, [memoryview(newer_data)])
    monkeypatch.undo()
    assert tier.record(old.key) == newer
    tier.close()
    again = make(tmp_path)
    assert again.record(old.key) == newer and read(again, newer) == newer_data and len(again) == 1
    again.close()


def test_a_corrupt_payload_is_refused_and_forgotten(tmp_path: Path) -> None:
    tier = make(tmp_path)
    record, data = block(7)
    tier.write(record, [memoryview(data)])
    [segment] = segment_files(tmp_path)
    with open(segment, "r+b") as f:
        f.seek(ALIGN + 123)
        b = f.read(1)
        f.seek(ALIGN + 123)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CorruptBlockError):
        read(tier, record)
    assert not tier.contains(record.key) and tier.used_bytes == 0
    tier.close()


def nowait_reads(path: Path) -> bool:
    """Whether the filesystem under ``path`` takes reads that must not wait (RWF_NOWAIT)."""
    probe = path / "probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_block_in_the_page_cache_is_read_without_waiting_and_one_on_disk_is_left_to_a_thread(
        tmp_path: Path) -> None:
    if not nowait_reads(tmp_path):
        pytest.skip("this filesystem does not take RWF_NOWAIT reads")
    tier = make(tmp_path)
    record, data = block(11, size=200_000)
    tier.write(record, [memoryview(data)])
    out = [memoryview(bytearray(70_000)), memoryview(bytearray(record.size - 70_000))]  # DRAM extents
    assert tier.read_nowait(record.key, out)  # just written: in memory
    assert b"".join(bytes(o) for o in out) == data
    [segment] = segment_files(tmp_path)
    drop_cache(segment)
    gone = [memoryview(bytearray(record.size))]
    if tier.read_nowait(record.key, gone):  # the kernel may keep pages it was asked to drop
        pytest.skip("the kernel kept the segment's pages in memory")
    assert read(tier, record) == data  # what a thread does then
    tier.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_block_read_without_waiting_is_checked_as_any_read(tmp_path: Path, where: str) -> None:
    if not nowait_reads(tmp_path):
        pytest.skip("this filesystem does not take RWF_NOWAIT reads")
    tier = make(tmp_path)
    record, data = block(12)
    tier.write(record, [memoryview(data)])
    out = memoryview(bytearray(record.size))
    assert tier.read_nowait(record.key, [out])  # in memory and whole
    [segment] = segment_files(tmp_path)
    at = ALIGN + 500 if where == "payload" else 20  # into the bytes, or into the record's header
    with open(segment, "r+b") as f:  # through the page cache: still in memory, and wrong
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    assert not tier.read_nowait(record.key, [out])  # never served; left to a thread's read ...
    assert tier.contains(record.key)
    with pytest.raises(CorruptBlockError):
        read(tier, record)  # ... which drops it, off the event loop
    assert not tier.contains(record.key) and tier.used_bytes == 0
    with pytest.raises(KeyError):
        tier.read_nowait(record.key, [out])
    tier.close()


@pytest.mark.parametrize("outcome", ["short", errno.EINVAL, errno.EIO, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_read_without_waiting_that_comes_short_or_fails_is_left_to_a_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: object) -> None:
    tier = make(tmp_path)
    record, data = block(15)
    tier.write(record, [memoryview(data)])
    real = os.preadv
    calls: list[int] = []

    def preadv(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        calls.append(flags)
        if outcome == "short":
            return real(fd, buffers, offset) - 1  # the last page was not in memory
        raise OSError(outcome, os.strerror(outcome))  # type: ignore[arg-type]

    monkeypatch.setattr(seg_mod.os, "preadv", preadv)
    out = memoryview(bytearray(record.size))
    assert not tier.read_nowait(record.key, [out])
    assert tier.contains(record.key)
    tier.read_nowait(record.key, [out])
    # a kernel or filesystem without the flag is not asked again; anything else may pass next time
    assert len(calls) == (1 if outcome in (errno.ENOSYS, errno.EOPNOTSUPP) else 2)
    monkeypatch.setattr(seg_mod.os, "preadv", real)
    assert read(tier, record) == data
    tier.close()


def test_a_block_in_more_pieces_than_one_call_takes_is_left_to_a_thread(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path)
    record, data = block(16, size=600 * 64)
    tier.write(record, [memoryview(data)])
    calls: list[int] = []
    monkeypatch.setattr(seg_mod.os, "preadv", lambda *a: calls.append(1))
    pieces = [memoryview(bytearray(64)) for _ in range(600)]  # past the kernel's limit on one call
    assert not tier.read_nowait(record.key, pieces) and calls == []
    assert tier._nowait  # noqa: SLF001 - still on for the next read: nothing was refused
    tier.close()


def test_reads_without_waiting_leave_compressed_blocks_and_odd_buffers_to_a_thread(tmp_path: Path) -> None:
    tier = make(tmp_path, compression="zstd")
    data = bytes(200_000)
    record = BlockRecord(key(13), len(data), checksum(memoryview(data)), "default")
    tier.write(record, [memoryview(data)])
    assert not tier.read_nowait(record.key, [memoryview(bytearray(record.size))])  # decoded in a thread
    plain = make(tmp_path / "plain")
    other, payload = block(14)
    plain.write(other, [memoryview(payload)])
    assert not plain.read_nowait(other.key, [memoryview(bytearray(other.size - 1))])  # not the block's size
    assert not plain.read_nowait(other.key, [memoryview(bytes(other.size))])  # read-only
    assert read(plain, other) == payload
    tier.close()
    plain.close()


def test_bytes_that_miss_their_checksum_are_not_stored(tmp_path: Path) -> None:
    tier = make(tmp_path)
    record, data = block(3)
    with pytest.raises(CorruptBlockError):
        tier.write(record, [memoryview(data[:-1] + b"?")])
    assert not tier.contains(record.key) and tier.used_bytes == 0 and tier.free_bytes > 0
    tier.close()


def test_zstd_records_read_back(tmp_path: Path) -> None:
    tier = make(tmp_path, compression="zstd")
    data = bytes(500_000) + os.urandom(1000)
    record = BlockRecord(key(5), len(data), checksum(memoryview(data)), "default")
    assert tier.write(record, [memoryview(data)]) < len(data) // 2
    assert read(tier, record) == data
    tier.close()
    again = make(tmp_path, compression="zstd")
    assert read(again, record) == data
    again.close()


def test_a_full_tier_refuses_and_recovers_room_on_delete(tmp_path: Path) -> None:
    tier = make(tmp_path, size=8 * MiB)
    stored = []
    with pytest.raises(TierFullError):
        for i in range(20):
            record, data = block(i, size=1 * MiB)
            tier.write(record, [memoryview(data)])
            stored.append(record)
    assert tier.used_bytes <= tier.capacity_bytes and len(stored) >= 6
    tier.delete(stored[0].key)
    record, data = block(50, size=1 * MiB)
    tier.write(record, [memoryview(data)])
    assert read(tier, record) == data
    tier.close()


def test_a_segments_unlink_holds_no_one_else_waiting_on_the_tiers_lock(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier's lock is the event loop's too (room, reservations, every eviction): a
    segment's unlink (63-71 ms for a full 256 MiB one where holes cannot be punched) had run
    under it, and a slow one held every caller of the tier for as long. The file now goes
    once the lock is released."""
    tier = make(tmp_path)
    blocks = [block(i, size=1 * MiB) for i in range(6)]  # three records a segment: two segments
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    first = segment_files(tmp_path)[0]
    for record, _ in blocks[1:3]:
        tier.delete(record.key)
    unlinking, go = threading.Event(), threading.Event()
    real_unlink = os.unlink

    def slow_unlink(path: str | os.PathLike[str]) -> None:
        unlinking.set()
        go.wait(30)
        real_unlink(path)

    monkeypatch.setattr(segfiles_mod.os, "unlink", slow_unlink)
    deleter = threading.Thread(target=tier.delete, args=(blocks[0][0].key,))  # the segment's last record
    deleter.start()
    try:
        assert unlinking.wait(10)
        listed = threading.Event()
        reader = threading.Thread(target=lambda: (tier.keys(), listed.set()))
        reader.start()
        assert listed.wait(10)  # (had waited for the unlink)
        reader.join()
    finally:
        go.set()
        deleter.join()
    assert not first.exists() and tier.keys() and all(read(tier, r) == d for r, d in blocks[3:])
    tier.close()


def test_without_hole_punching_space_returns_with_the_whole_segment(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(segtable_mod, "punch_hole", unsupported)
    tier = make(tmp_path)
    blocks = [block(i, size=1 * MiB) for i in range(6)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    used = tier.used_bytes
    tier.delete(blocks[0][0].key)
    assert tier.used_bytes == used  # still on disk: still counted
    for record, _ in blocks[1:3]:
        tier.delete(record.key)
    assert tier.used_bytes == used - 3 * aligned(len(pack_header(blocks[0][0], 0, MiB)) + SEAL_BYTES + MiB)
    tier.close()


def test_a_hole_that_cannot_be_punched_in_a_segment_dropped_meanwhile_is_not_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads delete a segment's last two records: the second drops the segment (and
    unlinks it) while the first is still punching its hole, which then fails. The first's
    record went with the file: the tier's use must not keep it forever."""
    tier = make(tmp_path)
    blocks = [block(i, size=1 * MiB) for i in range(6)]  # three records a segment
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    first = segment_files(tmp_path)[0]
    tier.delete(blocks[0][0].key)
    real = segtable_mod.punch_hole

    def racing(fd: int, offset: int, length: int) -> None:
        monkeypatch.setattr(segtable_mod, "punch_hole", real)
        tier.delete(blocks[2][0].key)  # the other thread: the segment's last record, it goes
        raise OSError(errno.ENOENT, "gone")

    monkeypatch.setattr(segtable_mod, "punch_hole", racing)
    tier.delete(blocks[1][0].key)
    assert not first.exists()
    assert tier.used_bytes == sum(aligned(len(pack_header(r, 0, r.size)) + SEAL_BYTES + r.size) for r, _ in blocks[3:])
    tier.close()


def test_a_batch_syncs_each_segment_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path, fsync="always")
    synced: list[str] = []
    real = os.fdatasync
    monkeypatch.setattr(seg_mod.os, "fdatasync",
                        lambda fd: (synced.append(os.readlink("/proc/self/fd/%d" % fd)), real(fd))[1])
    items = [(r, [memoryview(d)]) for r, d in (block(i, size=500_000) for i in range(12))]
    out = tier.write_many(items)
    assert all(isinstance(n, int) for n in out)
    assert sorted(synced) == sorted(str(p) for p in segment_files(tmp_path)) and len(synced) > 1
    for record, views in items:
        assert read(tier, record) == bytes(views[0])
    tier.close()


def deleted_files_held(under: Path) -> list[str]:
    """What this process's descriptors point at under ``under`` that was deleted."""
    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{n}")
        except FileNotFoundError:  # (the listing's own descriptor, closed since)
            continue
        if target.startswith(str(under)) and target.endswith("(deleted)"):
            out.append(target)
    return out


def test_only_the_segment_being_written_and_a_bounded_few_are_held_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long-lived blocks spread one per segment hold no file descriptors of their own: a
    tenant that keeps one block alive in every segment, and reads them all, cannot run the
    sidecar out of them (reads share at most ``descriptors.DEFAULT_LIMIT``)."""
    monkeypatch.setattr(descriptors, "DEFAULT_LIMIT", 4)
    tier = make(tmp_path)
    fds_before = len(os.listdir("/proc/self/fd"))
    kept = []
    for i in range(40):  # 1 MiB blocks, three a segment: keep the first of each segment
        record, data = block(i, size=1 * MiB)
        tier.write(record, [memoryview(data)])
        if i % 3:
            tier.delete(record.key)
        else:
            kept.append((record, data))
    assert tier.segments >= 13 and tier.open_files == 1
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1 + 4  # (deletes punched holes)
    for record, data in kept:
        assert read(tier, record) == data
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 1 + 4
    for record, _ in kept:  # every segment but the last empties and goes, its descriptor with it
        tier.delete(record.key)
    assert tier.segments <= 1 and deleted_files_held(tmp_path) == []
    tier.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before - 1  # (the directory's lock too)


def test_writers_in_threads_never_overlap(tmp_path: Path) -> None:
    tier = make(tmp_path)
    errors: list[BaseException] = []

    def writer(base: int) -> None:
        try:
            for i in range(base, base + 40):
                record, data = block(i, size=30_000 + i)
                tier.write(record, [memoryview(data)])
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n * 100,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(tier) == 160
    for n in range(4):
        for i in range(n * 100, n * 100 + 40):
            record, data = block(i, size=30_000 + i)
            assert read(tier, record) == data
    tier.close()


@pytest.mark.parametrize("bad", [-1, 1 << 64])
def test_a_record_no_header_can_hold_fails_alone_in_its_batch(tmp_path: Path, bad: int) -> None:
    """A checksum outside 64 bits (the API refuses one; this is the tier's own guard) fails
    its block in a batch, never the batch: the blocks around it are stored."""
    tier = make(tmp_path)
    (r0, d0), (r1, d1), (r2, d2) = (block(i) for i in range(3))
    broken = BlockRecord(r1.key, r1.size, bad, r1.tenant)
    out = tier.write_many([(r0, [memoryview(d0)]), (broken, [memoryview(d1)]), (r2, [memoryview(d2)])])
    assert isinstance(out[0], int) and isinstance(out[2], int)
    assert isinstance(out[1], Exception) and not tier.contains(r1.key)
    assert read(tier, r0) == d0 and read(tier, r2) == d2
    tier.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")
def test_a_directory_another_user_owns_is_refused_with_what_it_planted(tmp_path: Path) -> None:
    """Another user who made the disk directory first (its parent is writable by all, like
    /tmp) could plant a seal key it knows and records sealed with it: the tier refuses the
    directory instead of serving them."""
    first = make(tmp_path)
    rec, data = block(1)
    first.write(rec, [memoryview(data)])
    first.close()
    for p in [tmp_path / "disk", *(tmp_path / "disk").rglob("*")]:
        os.chown(p, 2000, 2000)  # as if the other user had made all of it
    tier = SegmentDiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=64 * MiB))
    with pytest.raises(TierIOError, match="belongs to uid 2000"):
        tier.open()
    assert tier.used_bytes == 0


def test_a_directory_of_its_own_that_others_may_write_is_made_private(tmp_path: Path) -> None:
    (tmp_path / "disk" / "segments").mkdir(parents=True)
    for p in (tmp_path / "disk", tmp_path / "disk" / "segments"):
        p.chmod(0o777)
    make(tmp_path)
    assert [stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "disk", tmp_path / "disk" / "segments")] == [0o700] * 2


def test_a_disk_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "disk").write_bytes(b"not a directory")
    with pytest.raises(TierIOError):
        make(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("planted", ["seal key", "segment"])
def test_what_another_user_wrote_into_the_tier_is_never_taken_for_its_own(tmp_path: Path, planted: str) -> None:
    """The directory is the tier's, but a file in it is another user's (written while the
    directory was still open to a group, as a host directory is before the sidecar makes it
    0700): a seal key of theirs refuses the directory, a segment of theirs is not read."""
    first = make(tmp_path)
    rec, data = block(1)
    first.write(rec, [memoryview(data)])
    first.close()
    segments = tmp_path / "disk" / "segments"
    os.chown(segments / ".seal-key" if planted == "seal key" else segment_files(tmp_path)[0], 2000, 2000)
    tier = SegmentDiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=64 * MiB))
    if planted == "seal key":
        with pytest.raises(TierIOError, match="belongs to uid 2000"):
            tier.open()
    else:
        assert tier.open() == [] and tier.used_bytes == 0


def test_a_segments_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """Planted as a link to another pool's segments, it would have this tier write there."""
    (tmp_path / "other").mkdir(mode=0o700)
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "disk" / "segments").symlink_to(tmp_path / "other")
    with pytest.raises(TierIOError, match="symlink"):
        make(tmp_path)
    assert list((tmp_path / "other").iterdir()) == []


def test_a_seal_key_that_is_no_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO in the key's place had hung the tier's open (the sidecar's start) for good."""
    (tmp_path / "disk" / "segments").mkdir(mode=0o700, parents=True)
    os.chmod(tmp_path / "disk", 0o700)
    os.mkfifo(tmp_path / "disk" / "segments" / ".seal-key", 0o600)
    with pytest.raises(TierIOError, match="not a regular file"):
        make(tmp_path)


def flip(path: Path, at: int) -> None:
    """Flip one bit of the file's byte at ``at``."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize("alias", ["1.kvs", "\u0661.kvs", "0000000002.kvs"])
def test_a_segment_under_a_second_name_is_read_once(tmp_path: Path, alias: str) -> None:
    """A second name for segment 1 (another spelling of its number, one in Arabic-Indic
    digits, or a hard link under another number) must not have its records read twice: the
    first reading's records would be taken for stale copies and their holes punched in the
    one file the table reads from."""
    tier = make(tmp_path)
    blocks = [block(i) for i in range(10)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    tier.close()
    [segment] = segment_files(tmp_path)
    os.link(segment, segment.parent / alias)
    again = make(tmp_path)
    assert len(again) == len(blocks) and again.discarded_on_open == 0
    for record, data in blocks:
        assert read(again, record) == data
    again.close()


def test_a_file_whose_name_only_looks_like_a_number_is_ignored(tmp_path: Path) -> None:
    """'\u00b2' is a digit to str.isdigit() and not to int(): such a name stopped the tier's
    open (and so the sidecar, at every start)."""
    tier = make(tmp_path)
    record, data = block(1)
    tier.write(record, [memoryview(data)])
    tier.close()
    (tmp_path / "disk" / "segments" / "\u00b2.kvs").write_bytes(b"")
    again = make(tmp_path)
    assert read(again, record) == data
    again.close()


def test_a_damaged_header_costs_only_its_own_record(tmp_path: Path) -> None:
    tier = make(tmp_path)
    blocks = [block(i) for i in range(50)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    offsets = [tier._records.table[r.key].offset for r, _ in blocks]  # noqa: SLF001 - where each record lies
    tier.close()
    [segment] = segment_files(tmp_path)
    flip(segment, offsets[1] + 20)
    again = make(tmp_path)
    assert sorted(again.keys()) == sorted(r.key for i, (r, _) in enumerate(blocks) if i != 1)
    assert again.discarded_on_open == 1
    for record, data in blocks[2:]:
        assert read(again, record) == data
    with open(segment, "rb") as f:  # the damaged record's pages were freed, no others
        f.seek(offsets[1])
        assert f.read(offsets[2] - offsets[1]) == bytes(offsets[2] - offsets[1])
    again.close()


def test_a_long_damaged_run_is_passed_page_by_page_reading_each_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A megabyte of garbage over the first records: the scan steps over it a page at a time,
    reading no more than a header's length of each, and recovers the records behind it."""
    tier = make(tmp_path)
    blocks = [block(i, size=300_000) for i in range(8)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    offsets = {r.key: tier._records.table[r.key].offset for r, _ in blocks}  # noqa: SLF001 - where each record lies
    tier.close()
    [segment] = segment_files(tmp_path)
    with open(segment, "r+b") as f:
        f.write(os.urandom(MiB))
    reads: list[int] = []
    real = os.pread
    monkeypatch.setattr(seg_mod.os, "pread", lambda fd, n, at: (reads.append(n), real(fd, n, at))[1])
    again = make(tmp_path)
    monkeypatch.undo()
    kept = [(r, d) for r, d in blocks if offsets[r.key] >= MiB]
    assert sorted(again.keys()) == sorted(r.key for r, _ in kept) and len(kept) >= 4
    assert again.discarded_on_open == 1
    # one read of each page up to the first record left whole, then one a record
    assert len(reads) <= min(offsets[r.key] for r, _ in kept) // ALIGN + len(kept) and max(reads) <= ALIGN
    for record, data in kept:
        assert read(again, record) == data
    again.close()


def test_a_segment_whose_directory_entry_cannot_be_synced_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing disk refuses every write: each must not leave a segment behind (its file,
    its descriptor, its place among the tier's segments)."""
    tier = make(tmp_path, fsync="always")
    fds = len(os.listdir("/proc/self/fd"))

    def failing(path: str) -> None:
        raise OSError(errno.EIO, "simulated: the directory cannot be synced")

    monkeypatch.setattr(segfiles_mod, "fsync_dir", failing)
    for i in range(5):
        record, data = block(i)
        with pytest.raises(TierIOError, match="EIO"):
            tier.write(record, [memoryview(data)])
    assert tier.segments == 0 and tier.open_files == 0 and segment_files(tmp_path) == []
    assert len(os.listdir("/proc/self/fd")) == fds
    monkeypatch.undo()
    record, data = block(9)
    tier.write(record, [memoryview(data)])
    assert read(tier, record) == data
    tier.close()


@pytest.mark.parametrize("found_by", ["read", "delete"])
def test_a_segment_deleted_under_the_tier_is_forgotten_with_its_blocks(tmp_path: Path, found_by: str) -> None:
    tier = make(tmp_path)
    blocks = [block(i, size=1 * MiB) for i in range(6)]  # three records a segment
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    segments = tier.segments
    segment_files(tmp_path)[0].unlink()
    if found_by == "read":
        with pytest.raises(TierIOError):
            read(tier, blocks[0][0])
    else:
        tier.delete(blocks[0][0].key)
    assert [tier.contains(r.key) for r, _ in blocks] == [False] * 3 + [True] * 3
    assert tier.used_bytes == sum(aligned(len(pack_header(r, 0, r.size)) + SEAL_BYTES + r.size) for r, _ in blocks[3:])
    assert tier.segments == segments - 1
    for record, _ in blocks[:3]:
        with pytest.raises(KeyError):  # a plain miss from now on
            read(tier, record)
    for record, data in blocks[3:]:
        assert read(tier, record) == data
    tier.close()


def test_a_directory_another_tier_has_open_is_refused(tmp_path: Path) -> None:
    """Two sidecars on one disk.path would scan, punch and unlink each other's records."""
    first = make(tmp_path)
    record, data = block(1)
    first.write(record, [memoryview(data)])
    second = SegmentDiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=64 * MiB))
    with pytest.raises(TierIOError, match=re.escape(f"{tmp_path / 'disk' / 'segments'} is in use")):
        second.open()
    assert read(first, record) == data and len(second) == 0
    first.close()
    assert second.open() == [record]  # released with the tier that held it
    second.close()


def test_a_page_the_device_cannot_read_at_open_costs_only_the_rest_of_its_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """One bad sector (EIO) in a segment had stopped the open, and with it the sidecar's
    start, at every start. The records before it are recovered, those from it on are not,
    the sidecar starts, and nothing is punched: the device may read them again next time."""
    tier = make(tmp_path)
    blocks = [block(i) for i in range(6)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    offsets = [tier._records.table[r.key].offset for r, _ in blocks]  # noqa: SLF001 - where each record lies
    tier.close()
    [segment] = segment_files(tmp_path)
    before = segment.read_bytes()
    real = os.pread

    def pread(fd: int, n: int, at: int) -> bytes:
        if at == offsets[3]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, n, at)

    monkeypatch.setattr(segscan_mod.os, "pread", pread)
    with caplog.at_level(logging.WARNING, logger=segscan_mod.__name__):
        again = make(tmp_path)
    monkeypatch.undo()
    assert sorted(again.keys()) == sorted(r.key for r, _ in blocks[:3]) and again.discarded_on_open == 1
    assert str(segment) in caplog.text and "EIO" in caplog.text
    for record, data in blocks[:3]:
        assert read(again, record) == data
    again.close()
    assert segment.read_bytes() == before  # no hole punched over what could not be read
    healed = make(tmp_path)  # the sector reads again: every record is back
    assert sorted(healed.keys()) == sorted(r.key for r, _ in blocks) and healed.discarded_on_open == 0
    healed.close()


def test_an_os_error_while_scanning_fails_the_open_cleanly_and_unlocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A raw OSError out of the scan had reached the sidecar's start as a traceback naming no
    file, and left the directory locked. It is a TierIOError naming the directory (a
    SidecarError: the sidecar says why it stops), and the directory is free again."""
    tier = make(tmp_path)
    record, data = block(1)
    tier.write(record, [memoryview(data)])
    tier.close()
    fds = len(os.listdir("/proc/self/fd"))
    real = seg_mod.scan_all

    def failing(files: segfiles_mod.SegmentFiles, key: bytes, numbers: list[int]) -> object:
        files.open(numbers[0], create=False)  # a segment opened before the error
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(seg_mod, "scan_all", failing)
    broken = SegmentDiskTier(DiskSettings(path=str(tmp_path / "disk"), size_bytes=64 * MiB))
    with pytest.raises(TierIOError, match=re.escape(str(tmp_path / "disk" / "segments")) + ".*EIO"):
        broken.open()
    assert len(os.listdir("/proc/self/fd")) == fds  # nor a segment's descriptor, nor the lock's
    monkeypatch.setattr(seg_mod, "scan_all", real)
    again = make(tmp_path)  # not locked by the failed open
    assert read(again, record) == data
    again.close()


def test_a_directory_removed_at_run_time_is_made_again(tmp_path: Path) -> None:
    """Writes had gone on into the deleted current segment, reporting success for bytes no
    read would find, then every segment's creation failed (ENOENT) until a restart, while the
    tier offered all its room. The write that finds its segment deleted fails; the next one
    makes the directory again as open does (0700, locked, a seal key on disk) and forgets
    what went with the old one."""
    root = tmp_path / "disk"
    tier = make(tmp_path)
    first, first_data = block(0)
    tier.write(first, [memoryview(first_data)])
    shutil.rmtree(root)
    lost, lost_data = block(1)
    with pytest.raises(TierIOError, match="deleted"):
        tier.write(lost, [memoryview(lost_data)])
    assert not tier.contains(lost.key) and not tier.contains(first.key) and tier.used_bytes == 0
    blocks = [block(i) for i in range(2, 5)]
    for record, data in blocks:
        tier.write(record, [memoryview(data)])
    assert [read(tier, r) == d for r, d in blocks] == [True] * 3 and len(tier) == 3
    assert [stat.S_IMODE(p.stat().st_mode) for p in (root, root / "segments")] == [0o700] * 2
    assert (root / "segments" / ".seal-key").is_file()
    other = SegmentDiskTier(DiskSettings(path=str(root), size_bytes=64 * MiB))
    with pytest.raises(TierIOError, match="in use"):  # the new directory is locked
        other.open()
    assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes
    tier.close()
    again = make(tmp_path)  # sealed under the key now on disk: read back after a restart
    assert sorted(again.keys()) == sorted(r.key for r, _ in blocks) and again.discarded_on_open == 0
    again.close()


def test_a_directory_removed_at_run_time_that_cannot_be_made_again_fails_writes_cleanly(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    tier = make(tmp_path)
    record, data = block(0)
    tier.write(record, [memoryview(data)])
    shutil.rmtree(root)
    root.write_text("now a file")
    for i in range(1, 4):
        record, data = block(i)
        with pytest.raises(TierIOError):
            tier.write(record, [memoryview(data)])
        assert not tier.contains(record.key)
    assert tier.free_bytes == tier.capacity_bytes - tier.used_bytes and tier.segments == 0
    root.unlink()
    record, data = block(9)
    tier.write(record, [memoryview(data)])  # it comes back once the directory can be made
    assert read(tier, record) == data
    tier.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another user needs root")
@pytest.mark.parametrize("where", ["the disk path", "a directory above it"])
def test_a_disk_path_through_another_users_symlink_is_refused(tmp_path: Path, where: str) -> None:
    """As the socket's directory: a link another user owns (planted in a directory others
    may write, as /tmp) points at a directory of ours today and of theirs tomorrow, where
    the tier would write tenants' blocks and serve what it finds. One of ours, or root's, is
    followed."""
    (tmp_path / "real").mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    path = link if where == "the disk path" else link / "disk"
    ours = SegmentDiskTier(DiskSettings(path=str(path), size_bytes=64 * MiB))
    ours.open()
    ours.close()
    os.lchown(link, 2000, 2000)
    theirs = SegmentDiskTier(DiskSettings(path=str(path), size_bytes=64 * MiB))
    with pytest.raises(TierIOError, match=re.escape(f"goes through {link}, a symbolic link that uid 2000 owns")):
        theirs.open()
