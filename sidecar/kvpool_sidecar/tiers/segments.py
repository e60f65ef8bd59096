"""The disk tier in segments: blocks appended to a few large files; survives restarts.

A file per block (:mod:`kvpool_sidecar.tiers.disk`) costs a create, a rename and later an
unlink per block: metadata work that the filesystem's journal serialises, so that under a
stream of demotions the disk spends its time on inodes, not bytes (``make demo`` stalled
for seconds on ``unlink``). Here a block is a *record* appended to the current segment
file, ``<path>/segments/<number>.kvs``, at an offset that is a multiple of 4 KiB:

    record = header (the block file's header, :func:`~kvpool_sidecar.tiers.diskformat.pack_header`)
             | seal (16 bytes) | stored payload | zeros up to the next 4 KiB

The seal is a keyed BLAKE2b of the header under the tier's own secret: a header that anyone
else wrote never passes for a record (:mod:`~kvpool_sidecar.tiers.segrecord`).

A segment grows to :attr:`SegmentDiskTier.segment_bytes`, then the next one starts. Deleting
a block punches a hole over its record (``fallocate(PUNCH_HOLE)``): the filesystem frees
those pages at once and reads them as zeros, and a segment whose records are all gone is
unlinked. Offsets are never reused, so a read never meets another block's bytes.

Writes: the room and the offset are taken under the lock, the bytes are written outside it
(``pwritev``, hashed on the way against the record's checksum), and the block is visible
only once written. ``fsync: always`` ends a write with ``fdatasync`` of its segment (a batch,
:meth:`~SegmentDiskTier.write_many`, with one per segment it touched), and a new segment's
directory entry is synced when the segment is created. A crash may leave a torn record at a
segment's end, or a record whose hole was not yet punched: the first fails its header or
payload checksum (at open, or at its first read) and is discarded; the second is a whole
block that was evicted, and comes back as it was (it is still that key's bytes).

Open (a warm restart) scans each segment from record to record and writes new blocks to a new
segment; torn or damaged records are discarded, and where a key is found twice the later
record wins (:mod:`~kvpool_sidecar.tiers.segscan`). The open tier holds an ``flock`` on
``segments/.lock``: a second tier on the directory (another sidecar) is refused.

A directory removed while the tier runs (an operator's ``rm -r``, a tmp cleaner) takes every
record with it. A write that finds its segment's file deleted once its record is in (its
link count 0) fails rather than report bytes that nothing will find, and that segment is
forgotten with its blocks; the next segment is created in the directory made again as open
makes it (private, locked, with a new seal key), and the tier forgets every block it held.

The segment files themselves (their names, the lock, the descriptors kept open for reads,
hole punches and syncs) are :mod:`~kvpool_sidecar.tiers.segfiles`'s; the table of the records
held, the segments they lie in and when a record's pages or a segment go are
:mod:`~kvpool_sidecar.tiers.segtable`'s. This module holds what the tier does with them:
open, writes, reads and deletes.

Thread safety: as the file tier's: methods may run in several threads at once on different
keys; do not read a key while writing or deleting that same key.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import xxhash

from kvpool_client.integrity import checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError
from kvpool_sidecar.tiers.base import BlockRecord
from kvpool_sidecar.tiers.diskformat import (
    advance, errname, flat_bytes, header_length, make_private_dir, payload_problem, prepare,
)
from kvpool_sidecar.tiers.ioseconds import IoSeconds
from kvpool_sidecar.tiers.keyed import KeyedDiskTier
from kvpool_sidecar.tiers.segfiles import (
    ALIGN, LOCK_FILE, SUFFIX, SegmentFiles, aligned, fresh, punch_hole, segment_name, segment_number,
)
from kvpool_sidecar.tiers.segrecord import KEY_FILE, SEAL_BYTES, Slot, record_problem, seal_key, seal_of
from kvpool_sidecar.tiers.segscan import scan_all
from kvpool_sidecar.tiers.segtable import SegmentTable

__all__ = [
    "ALIGN", "KEY_FILE", "LOCK_FILE", "MAX_SEGMENT_BYTES", "MIN_SEGMENT_BYTES", "SEAL_BYTES", "SUBDIR", "SUFFIX",
    "SegmentDiskTier", "aligned", "punch_hole", "segment_name", "segment_number",
]

logger = logging.getLogger(__name__)

SUBDIR = "segments"
#: The largest segment; smaller for a small tier (a sixteenth of it, at least 4 MiB).
MAX_SEGMENT_BYTES = 256 << 20
MIN_SEGMENT_BYTES = 4 << 20
#: Payload bytes hashed and handed to the kernel per piece (stays in L2).
_PIECE = 256 * 1024
_IOV_MAX = 512


class SegmentDiskTier(KeyedDiskTier):
    """Blocks as records in segment files on local NVMe; see the module docstring."""

    def __init__(self, settings: DiskSettings) -> None:
        super().__init__(settings)
        self._dir = os.path.join(self._root, SUBDIR)
        self.segment_bytes = max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, aligned(settings.size_bytes // 16)))
        #: The segment files (guarded by the lock, as the table), the directory's lock, and
        #: the descriptors kept for reads, hole punches and syncs.
        self._files = SegmentFiles(self._dir)
        #: The records held and the segments they lie in (guarded by the lock).
        self._records = SegmentTable(self._files, self._lock, self._space)
        #: Whether reads from the page cache alone work here (:meth:`read_nowait`).
        self._nowait = hasattr(os, "RWF_NOWAIT")
        self._key = b""
        #: Per thread: inside :meth:`write_many`, the segments its writes touched (synced once).
        self._batch = threading.local()

    @property
    def used_bytes(self) -> int:
        """Bytes of the records held (4 KiB pages), and of deleted ones not yet freed."""
        return self._space.used

    def __len__(self) -> int:
        return len(self._records.table)

    @property
    def segments(self) -> int:
        """Segment files open now."""
        return len(self._files.segments)

    def contains(self, key: bytes) -> bool:
        return key in self._records.table

    def record(self, key: bytes) -> BlockRecord | None:
        slot = self._records.table.get(key)
        return None if slot is None else slot.block.record

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._records.table)

    def estimate_bytes(self, size: int, tenant: str | None = None) -> int:
        """The most a record of ``size`` payload bytes takes (any tenant if None)."""
        tlen = 255 if tenant is None else len(tenant.encode("utf-8"))
        return aligned(header_length(tlen) + SEAL_BYTES + size)

    # ------------------------------------------------------------------ open
    def open(self) -> list[BlockRecord]:
        """Create the directory, scan the segments, return the blocks held.

        TierIOError if the directory cannot be used (or read: a page that cannot be read
        only ends its own segment's scan), or another tier (another sidecar) has it open;
        the directory is then left unlocked."""
        self.close()
        files = self._files
        try:
            make_private_dir(self._root)
            make_private_dir(self._dir, follow=False)
            files.lock()
            with os.scandir(self._root) as it:
                if any(len(d.name) == 2 and d.is_dir(follow_symlinks=False) for d in it):
                    logger.warning("disk tier %s: blocks of the one-file-per-block layout are there and are not "
                                   "used (disk.layout: files reads them; delete them to free the space)", self._root)
            numbers = files.numbers()
            self._key = seal_key(self._dir)
        except OSError as e:
            files.unlock()
            raise TierIOError(f"disk tier: cannot open directory {self._dir}: {errname(e)}") from e
        files.next_number = max(numbers, default=0) + 1
        try:
            table, discarded = scan_all(files, self._key, numbers)
        except OSError as e:  # (a page that cannot be read only ends its segment's scan)
            files.close(files.forget_all())  # the segments opened so far, and the directory's lock
            raise TierIOError(f"disk tier: cannot scan the segments in {self._dir}: {errname(e)}") from e
        records = self._records
        with self._lock:
            records.table = table
            self._space.reset(sum(s.length for s in table.values()), discarded)
            used = self._space.used
        for seg in list(files.segments.values()):
            if not seg.live:
                with records.locked():
                    records.drop_locked(seg)
        if discarded:
            logger.warning("disk tier %s: discarded %d invalid records", self._dir, discarded)
        if used > self.capacity_bytes:
            logger.warning("disk tier %s: %d bytes of blocks found exceed the capacity of %d bytes",
                           self._dir, used, self.capacity_bytes)
        return [s.block.record for s in table.values()]

    # ------------------------------------------------------------------ writes
    def write(self, record: BlockRecord, views: Sequence[memoryview]) -> int:
        """Store the block; the bytes its record takes (no-op if already held).

        Raises CorruptBlockError (``views`` do not match ``record``'s size or checksum;
        nothing is stored), TierFullError, TierIOError, ValueError (bad key or tenant).
        """
        block, header, pieces, expect = prepare(record, views, self._settings.compression,
                                                self._settings.compression_level)
        length = aligned(block.file_bytes + SEAL_BYTES)
        records = self._records
        with records.locked():
            held = records.table.get(record.key)
            if held is not None and held.block.record == record:
                return held.length
            if length > self._space.room(self.clock()):
                raise TierFullError(f"disk tier: no room for {length} bytes")
            seg, off = records.take_locked(length, self.segment_bytes, self._fsync, self._remake_locked)
            self._space.reserved += length
            seg.pending += 1
        slot = Slot(block, seg, off)
        written = unlinked = False
        try:
            _write_record(slot, header, self._key, pieces, expect, self._batch, self._fsync, self.io_seconds)
            written = True
        except TierIOError as e:
            unlinked = isinstance(e.__cause__, FileNotFoundError)
            raise
        finally:
            with records.locked():
                self._space.reserved -= length
                # (a segment forgotten meanwhile, its file deleted under the tier, holds nothing)
                kept, old = records.settle_locked(slot, written)
            if unlinked:
                records.lose(seg)  # (and the next write starts a segment, in the directory made again if need be)
            if not kept:
                records.free(slot)
            elif old is not None:
                records.free(old)
        if not kept:
            raise TierIOError(f"disk tier: cannot write to {seg.path}: it was deleted meanwhile")
        return length

    def _batch_begin(self, items: int) -> None:
        """The batch's writes note their segments instead of syncing; each segment is synced
        once at the end (with ``fsync: always``)."""
        self._batch.segments = set()

    def _batch_end(self) -> Callable[[], None] | None:
        touched: set[int] = self._batch.segments or set()
        self._batch.segments = None
        if not self._fsync or not touched:
            return None
        files = self._files

        def sync() -> None:
            for number in sorted(touched):
                seg = files.segments.get(number)
                if seg is not None:
                    with files.opened(seg) as fd:
                        os.fdatasync(fd)

        return sync

    # ------------------------------------------------------------------ reads
    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the kernel to start reading these blocks (``POSIX_FADV_WILLNEED`` on their
        records); only a hint. How many were hinted."""
        n = 0
        opened = self._files.opened
        table = self._records.table
        for key in keys:
            slot = table.get(key)
            if slot is None:
                continue
            with contextlib.suppress(OSError), opened(slot.segment) as fd:
                os.posix_fadvise(fd, slot.offset, slot.span, os.POSIX_FADV_WILLNEED)
                n += 1
        return n

    def read_into(self, key: bytes, dest: memoryview) -> BlockRecord:
        """Read the block into ``dest`` and verify it; its record.

        KeyError if not held; ValueError if ``dest`` is not ``record.size`` writable bytes;
        CorruptBlockError (the record is dropped) if it fails its header or checksums, and
        then ``dest`` holds garbage; TierIOError on an OS error (if the segment's file is
        gone, every block in it is dropped: KeyError for them from then on).
        """
        slot = self._records.table.get(key)
        if slot is None:
            raise KeyError(key.hex())
        block = slot.block
        dest = flat_bytes(dest)
        if dest.readonly or dest.nbytes != block.record.size:
            raise ValueError(f"dest must be writable and hold exactly {block.record.size} bytes "
                             f"(got {dest.nbytes}, readonly={dest.readonly})")
        head = memoryview(bytearray(block.header_len))
        seal = memoryview(bytearray(SEAL_BYTES))
        stored = dest if not block.flags else memoryview(bytearray(block.stored))
        try:
            with fresh(slot.segment) as fd:
                got = _preadv_all(fd, [head, seal, stored], slot.offset)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                self._records.lose(slot.segment)
            raise TierIOError(f"disk tier: cannot read {slot.segment.path}: {errname(e)}") from e
        reason = f"short read ({got} of {slot.span} bytes)" if got != slot.span \
            else record_problem(self._key, slot, head, seal, lambda: payload_problem(block, stored, dest))
        if reason:
            logger.warning("disk tier: discarding corrupt block %s in %s: %s", key.hex(), slot.segment.path, reason)
            self._records.forget(slot)
            raise CorruptBlockError(f"disk tier: block {key.hex()} is corrupt: {reason}")
        return block.record

    def read_nowait(self, key: bytes, dest: Sequence[memoryview]) -> bool:
        """:meth:`read_into` from the page cache alone: one ``preadv2`` with ``RWF_NOWAIT``
        straight into ``dest``'s pieces, which fails (or comes back short) rather than wait
        for the disk. True only when the whole record came and passed every check of
        :meth:`read_into`; False, with nothing of use in ``dest``, for anything else: not all
        in memory, a compressed block, more pieces than one call takes, an OS error, or a
        record that fails a check (the thread's :meth:`read_into` then reads it again, and
        drops it if it is corrupt, off the event loop). Where the kernel or the filesystem
        does not take the flag, it is not asked again.

        This lets the store skip a thread for a read: a block read again soon after it was
        demoted is in memory, and a hop to a thread and back cost the event loop and the
        reader more than the read (several times more where the loop is busy, as the thread
        waits for the GIL)."""
        slot = self._records.table.get(key)
        if slot is None:
            raise KeyError(key.hex())
        block = slot.block
        views = [flat_bytes(d) for d in dest]
        if not self._nowait or block.flags or len(views) + 2 > _IOV_MAX or any(v.readonly for v in views) \
                or sum(v.nbytes for v in views) != block.record.size:
            return False
        head = memoryview(bytearray(block.header_len))
        seal = memoryview(bytearray(SEAL_BYTES))
        try:
            with self._files.opened(slot.segment) as fd:
                got = os.preadv(fd, [head, seal, *views], slot.offset, os.RWF_NOWAIT)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                self._nowait = False  # the kernel or this filesystem always waits: reads go to a thread
            return False  # (EAGAIN: not in memory; any other error: the thread's read reports it)
        if got != slot.span:
            return False  # part of it is not in memory
        return not record_problem(self._key, slot, head, seal, lambda: "" if checksum(views) == block.record.checksum
                                  else "payload checksum mismatch")

    # ------------------------------------------------------------------ deletes
    def delete(self, key: bytes) -> int:
        """Delete the block; the bytes it took (0 if not held)."""
        slot = self._records.unlist(key)
        if slot is None:
            return 0
        self._records.free(slot)
        return slot.length

    def _detach(self, key: bytes) -> Callable[[], None] | None:
        """Take the block out of the table now; what punches its record's hole (that record's
        alone: a later record under the key lies elsewhere)."""
        slot = self._records.unlist(key)
        return None if slot is None else functools.partial(self._records.free, slot)

    def forgotten(self) -> list[bytes]:
        """The keys of the blocks lost with a segment or the directory since the last call
        (:class:`~kvpool_sidecar.tiers.base.Forgetting`)."""
        return self._records.forgotten()

    def _remake_locked(self) -> None:
        """The segments' directory was removed (an operator's ``rm -r``, a tmp cleaner), or
        another took its name, while the tier had it open: its records went with it, and its
        lock and seal key. Forget every block and segment, and make the directory again as
        :meth:`open` does: private, locked, and with a seal key of its own on disk (the one
        held went with the old directory; records sealed with it would not be read back
        after a restart). TierIOError if it cannot be made (the tier then writes nothing
        there: each new segment tries again)."""
        files = self._files
        lost = self._records.forget_all_locked()
        files.forget_descriptors()
        files.unlock()
        try:
            make_private_dir(self._root)
            make_private_dir(self._dir, follow=False)
            files.lock()
            self._key = seal_key(self._dir)
        except OSError as e:
            files.unlock()
            raise TierIOError(f"disk tier: {self._dir} was removed while in use, and cannot be made again: "
                              f"{errname(e)}") from e
        except TierIOError:
            files.unlock()
            raise
        logger.warning("disk tier: %s was removed while in use; made it again, and forgot the %d blocks that "
                       "were in it", self._dir, lost)

    def close(self) -> None:
        """Close the segment files (the blocks stay on disk for the next open)."""
        with self._records.locked():  # (and the files of segments dropped before it go)
            segments = self._records.clear_locked()
        self._files.close(segments)

    @property
    def open_files(self) -> int:
        """Segment files held open now for appends (those being appended to)."""
        return self._files.open_files


def _write_record(slot: Slot, header: bytes, key: bytes, pieces: Sequence[memoryview], expect: int | None,
                  batch: threading.local, fsync: bool, io: IoSeconds) -> None:
    """Write a record (sealed under ``key``) where ``slot`` says, hashing its payload against
    ``expect`` on the way; then sync its segment (timed in ``io``), or note it in ``batch`` (the
    thread's batch of :meth:`~SegmentDiskTier.write_many`, if one is under way) to be synced at its end.
    TierIOError from a FileNotFoundError if the segment's file was deleted by the time the
    record was in it (one ``fstat`` a record: the bytes would be in a file nothing finds)."""
    seg = slot.segment
    hasher = xxhash.xxh3_64()
    bufs: list[memoryview] = [memoryview(header), memoryview(seal_of(key, header))]
    pad = slot.length - slot.span
    try:
        pos = slot.offset
        for v in pieces:
            flat = flat_bytes(v)
            for i in range(0, flat.nbytes, _PIECE):
                piece = flat[i : i + _PIECE]
                if expect is not None:
                    hasher.update(piece)
                bufs.append(piece)
                if len(bufs) >= _IOV_MAX:
                    pos = _pwritev_all(seg.fd, bufs, pos)
                    bufs = []
        if pad:
            bufs.append(memoryview(bytes(pad)))
        _pwritev_all(seg.fd, bufs, pos)
        if expect is not None and hasher.intdigest() != expect:
            raise CorruptBlockError(f"block {slot.block.record.key.hex()}: checksum mismatch at write")
        if os.fstat(seg.fd).st_nlink == 0:
            # the segment's file was deleted (its directory removed) before or while this
            # record went in: the bytes are in a file no read or restart finds
            raise FileNotFoundError(errno.ENOENT, "the segment's file was deleted")
        touched = getattr(batch, "segments", None)
        if touched is not None:
            touched.add(seg.number)
        elif fsync:
            began = time.perf_counter()
            os.fdatasync(seg.fd)
            io.synced(began)
    except OSError as e:
        raise TierIOError(f"disk tier: cannot write to {seg.path}: {errname(e)}") from e


def _pwritev_all(fd: int, bufs: list[memoryview], pos: int) -> int:
    """Write ``bufs`` at ``pos``; the offset after them."""
    while bufs:
        n = os.pwritev(fd, bufs, pos)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        pos += n
        advance(bufs, n)
    return pos


def _preadv_all(fd: int, bufs: list[memoryview], pos: int) -> int:
    """Fill ``bufs`` from ``pos``; the bytes read (short at the end of the file)."""
    total = 0
    while bufs and (n := os.preadv(fd, bufs, pos + total)):
        total += n
        advance(bufs, n)
    return total
