"""The disk tier in segments: blocks appended to a few large files; survives restarts.

A file per block (:mod:`kvpool_sidecar.tiers.disk`) costs a create, a rename and later an
unlink per block: metadata work that the filesystem's journal serialises, so that under a
stream of demotions the disk spends its time on inodes, not bytes (``make demo`` stalled
for seconds on ``unlink``). Here a block is a *record* appended to the current segment
file, ``<path>/segments/<number>.kvs``, at an offset that is a multiple of 4 KiB:

    record = header (the block file's header, :func:`~kvpool_sidecar.tiers.diskformat.pack_header`)
             | seal (16 bytes) | stored payload | zeros up to the next 4 KiB

The seal is a keyed BLAKE2b of the header under the tier's own secret (``segments/.seal-key``,
32 random bytes, 0600, made at the first open): a header that anyone else wrote (a tenant's
payload can hold any bytes) never passes for a record, wherever it lies.

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

Open (a warm restart) scans each segment from record to record, skipping holes with
``SEEK_DATA``, and writes new blocks to a new segment. At a page that is neither zeros nor
a sealed header (a torn record, a damaged header) the scan goes on a page at a time to the
next sealed header, and frees the pages in between. Where a key is found twice (a rewrite
whose older record's hole was not punched before a crash), the later record wins. Only files
named exactly as the tier names them are read, each file once (not a second name of it: a
hard link), so that no record is ever taken for a stale copy of itself. The open tier holds
an ``flock`` on ``segments/.lock``: a second tier on the directory (another sidecar) is refused.

The segment being appended to keeps its descriptor. Reads from the page cache alone, hole
punches, read-ahead hints and syncs share the descriptors of at most 64 other segments, the
least recently used closed first (:mod:`~kvpool_sidecar.tiers.descriptors`): opening the file
for each of them had cost as much as a read from the page cache, and blocks spread over many
segments still hold at most that many descriptors. A dropped segment's descriptor goes with
it (closed by its last user). A read that may go to the device opens the file for itself
(see ``_fresh``: the kernel's read-ahead).

Thread safety: as the file tier's: methods may run in several threads at once on different
keys; do not read a key while writing or deleting that same key.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from kvpool_client.integrity import checksum
from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError
from kvpool_sidecar.tiers.base import BlockRecord
from kvpool_sidecar.tiers.descriptors import DescriptorCache
from kvpool_sidecar.tiers.diskformat import (
    MAX_HEADER_BYTES, StoredBlock, advance, errname, flat_bytes, fsync_dir, header_length, libc_function,
    make_private_dir, owned_by_us, parse_header, payload_problem, prepare, raise_errno,
)
from kvpool_sidecar.tiers.keyed import KeyedDiskTier

logger = logging.getLogger(__name__)

#: Records start at multiples of this (the page size of the filesystems a node has): a
#: punched record frees whole pages.
ALIGN = 4096
SUFFIX = ".kvs"
SUBDIR = "segments"
KEY_FILE = ".seal-key"
#: Held locked (``flock``) by the open tier: one tier, in one process, per directory.
LOCK_FILE = ".lock"
SEAL_BYTES = 16
#: The largest segment; smaller for a small tier (a sixteenth of it, at least 4 MiB).
MAX_SEGMENT_BYTES = 256 << 20
MIN_SEGMENT_BYTES = 4 << 20
#: Payload bytes hashed and handed to the kernel per piece (stays in L2).
_PIECE = 256 * 1024
_IOV_MAX = 512
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def segment_name(number: int) -> str:
    """The file name of segment ``number``: the only spelling of it that is read back."""
    return f"{number:010d}{SUFFIX}"


def segment_number(name: str) -> int | None:
    """The number of a segment's file name, or None if the tier never writes this name.
    Only the exact spelling :func:`segment_name` makes: ``1.kvs`` or ``\u0661.kvs`` (an
    Arabic-Indic one) would name segment 1 a second time, and the same file read twice
    has its records taken for stale copies of themselves and their holes punched."""
    stem = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or not stem.isascii() or not stem.isdigit():
        return None
    number = int(stem)
    return number if segment_name(number) == name else None


_FALLOCATE = libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``length`` bytes of ``fd`` at ``offset`` (they read as zeros); OSError if the
    filesystem cannot."""
    if _FALLOCATE is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available")
    if _FALLOCATE(fd, _PUNCH_HOLE, offset, length) != 0:
        raise_errno()


@dataclass(slots=True)
class _Segment:
    number: int
    path: str
    #: Open only while records are appended to it (the current segment, and one rolled over
    #: while writes into it finish): a node with many segments holds one such descriptor,
    #: not one each. Reads from the page cache, hole punches and syncs take theirs from the
    #: tier's :class:`~kvpool_sidecar.tiers.descriptors.DescriptorCache` (at most 64 more).
    fd: int
    #: Where the next record goes (only the current segment grows).
    end: int = 0
    #: Records held, and writes under way into it.
    live: int = 0
    pending: int = 0
    #: Bytes of deleted records whose hole could not be punched (still on disk).
    dead: int = 0


@dataclass(frozen=True, slots=True)
class _Slot:
    block: StoredBlock
    segment: _Segment
    offset: int

    @property
    def span(self) -> int:
        """Header, seal and stored payload."""
        return self.block.file_bytes + SEAL_BYTES

    @property
    def length(self) -> int:
        return aligned(self.span)


class SegmentDiskTier(KeyedDiskTier):
    """Blocks as records in segment files on local NVMe; see the module docstring."""

    def __init__(self, settings: DiskSettings) -> None:
        super().__init__(settings)
        self._dir = os.path.join(self._root, SUBDIR)
        self.segment_bytes = max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, aligned(settings.size_bytes // 16)))
        self._table: dict[bytes, _Slot] = {}
        self._segments: dict[int, _Segment] = {}
        self._current: _Segment | None = None
        self._punching = True
        #: Whether reads from the page cache alone work here (:meth:`read_nowait`).
        self._nowait = hasattr(os, "RWF_NOWAIT")
        self._key = b""
        self._next_number = 1
        #: The open lock file's descriptor (:data:`LOCK_FILE`), -1 when not open.
        self._lock_fd = -1
        #: Descriptors for reads, hole punches and syncs, kept open between them.
        self._files = DescriptorCache()
        #: Per thread: inside :meth:`write_many`, the segments its writes touched (synced once).
        self._batch = threading.local()

    @property
    def used_bytes(self) -> int:
        """Bytes of the records held (4 KiB pages), and of deleted ones not yet freed."""
        return self._used

    def __len__(self) -> int:
        return len(self._table)

    @property
    def segments(self) -> int:
        """Segment files open now."""
        return len(self._segments)

    def contains(self, key: bytes) -> bool:
        return key in self._table

    def record(self, key: bytes) -> BlockRecord | None:
        slot = self._table.get(key)
        return None if slot is None else slot.block.record

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._table)

    def estimate_bytes(self, size: int, tenant: str | None = None) -> int:
        """The most a record of ``size`` payload bytes takes (any tenant if None)."""
        tlen = 255 if tenant is None else len(tenant.encode("utf-8"))
        return aligned(header_length(tlen) + SEAL_BYTES + size)

    def footprint(self, size: int, tenant: str | None = None) -> int:
        return self.estimate_bytes(size, tenant)

    # ------------------------------------------------------------------ open
    def open(self) -> list[BlockRecord]:
        """Create the directory, scan the segments, return the blocks held.

        TierIOError if the directory cannot be used, or another tier (another sidecar) has
        it open."""
        self.close()
        try:
            make_private_dir(self._root)
            make_private_dir(self._dir, follow=False)
            self._lock_dir()
            with os.scandir(self._root) as it:
                if any(len(d.name) == 2 and d.is_dir(follow_symlinks=False) for d in it):
                    logger.warning("disk tier %s: blocks of the one-file-per-block layout are there and are not "
                                   "used (disk.layout: files reads them; delete them to free the space)", self._root)
            numbers = self._segment_numbers()
            self._key = self._seal_key()
        except OSError as e:
            self._unlock_dir()
            raise TierIOError(f"disk tier: cannot open directory {self._dir}: {errname(e)}") from e
        self._next_number = max(numbers, default=0) + 1
        table, discarded = self._scan_all(numbers)
        with self._lock:
            self._table = table
            self._used = sum(s.length for s in table.values())
            self._reserved = 0
            self._discarded = discarded
            used = self._used
        for seg in list(self._segments.values()):
            if not seg.live:
                self._drop_segment(seg)
        if discarded:
            logger.warning("disk tier %s: discarded %d invalid records", self._dir, discarded)
        if used > self.capacity_bytes:
            logger.warning("disk tier %s: %d bytes of blocks found exceed the capacity of %d bytes",
                           self._dir, used, self.capacity_bytes)
        return [s.block.record for s in table.values()]

    def _lock_dir(self) -> None:
        """Lock the directory for this tier's life (released by :meth:`close`): two sidecars
        on one ``disk.path`` would each scan, punch and unlink the other's records. TierIOError
        if another holds it (any other open of the lock file, in this process too)."""
        path = os.path.join(self._dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TierIOError(f"disk tier: {self._dir} is in use by another disk tier ({path} is locked): "
                              "each sidecar needs a disk.path of its own") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # a filesystem without locks: the tier works, unguarded, as it did before locks
            logger.warning("disk tier %s: cannot lock %s (%s); make sure no other sidecar uses this disk.path",
                           self._dir, path, errname(e))
            return
        self._lock_fd = fd

    def _unlock_dir(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # (releases the flock)
            self._lock_fd = -1

    def _segment_numbers(self) -> list[int]:
        """The numbers of the segment files here, in order; other names are left alone."""
        numbers: list[int] = []
        odd: list[str] = []
        for name in os.listdir(self._dir):
            if name.endswith(SUFFIX):
                number = segment_number(name)
                if number is None:
                    odd.append(name)
                else:
                    numbers.append(number)
        if odd:
            logger.warning("disk tier %s: ignoring %d files not named as its segments are, such as %r",
                           self._dir, len(odd), sorted(odd)[0])
        return sorted(numbers)

    def _scan_all(self, numbers: list[int]) -> tuple[dict[bytes, _Slot], int]:
        """The records of the segments (the later of two under one key) and how many were
        discarded; registers the segments read and punches the holes of the stale records."""
        table: dict[bytes, _Slot] = {}
        stale: list[_Slot] = []
        discarded = 0
        seen: set[tuple[int, int]] = set()
        for number in numbers:
            seg = self._open_old_segment(number, seen)
            if seg is None:
                continue
            try:
                found, bad = self._scan(seg)
            finally:
                _close(seg)
            discarded += bad
            for slot in found:
                older = table.get(slot.block.record.key)
                if older is not None:  # a rewrite: the later record wins
                    older.segment.live -= 1
                    stale.append(older)
                table[slot.block.record.key] = slot
                seg.live += 1
        for slot in stale:
            with contextlib.suppress(OSError), self._opened(slot.segment) as fd:
                punch_hole(fd, slot.offset, slot.length)
        return table, discarded

    def _open_old_segment(self, number: int, seen: set[tuple[int, int]]) -> _Segment | None:
        """Segment ``number``, opened to be scanned, unless it cannot be or its file is one
        already read under another name (a hard link): its records would be taken for stale
        copies of themselves, and their holes punched in the file the table reads."""
        seg = self._open_segment(number, create=False)
        if seg is None:
            return None
        st = os.fstat(seg.fd)
        if (st.st_dev, st.st_ino) in seen:
            logger.warning("disk tier: ignoring segment %s: it is a link to a segment already read", seg.path)
            del self._segments[number]
            _close(seg)
            return None
        seen.add((st.st_dev, st.st_ino))
        return seg

    def _seal_key(self) -> bytes:
        """The tier's secret for sealing headers: read, or made once (OSError if neither)."""
        path = os.path.join(self._dir, KEY_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                owned_by_us(os.fstat(f.fileno()), path)  # a key another user planted seals its records
                key = f.read()
            if len(key) == 32:
                return key
            logger.warning("disk tier: %s is damaged; a new key makes every record here unreadable", path)
            os.unlink(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            key = os.urandom(32)
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self._dir)
        return key

    def _seal(self, header: bytes | memoryview) -> bytes:
        return hashlib.blake2b(header, key=self._key, digest_size=SEAL_BYTES).digest()

    def _open_segment(self, number: int, *, create: bool) -> _Segment | None:
        path = os.path.join(self._dir, segment_name(number))
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if create:
                raise
            logger.warning("disk tier: cannot open segment %s: %s", path, errname(e))
            return None
        if not create and os.fstat(fd).st_uid != os.geteuid():  # another user's file is never read as ours
            logger.warning("disk tier: ignoring segment %s: it belongs to another user", path)
            os.close(fd)
            return None
        seg = _Segment(number, path, fd)
        if not create:
            seg.end = os.fstat(fd).st_size
        self._segments[number] = seg
        return seg

    def _scan(self, seg: _Segment) -> tuple[list[_Slot], int]:
        """The records of one segment, and how many runs of pages it holds that are neither
        a record nor a hole (a torn write, a damaged header): their pages are freed, and the
        scan goes on at the next page that begins with a sealed header. Only the seal makes a
        page a record's start, so a header a tenant's payload holds (no seal) is never taken
        for one, and one damaged record costs only itself. Each page is read once, up to a
        header's length (pages in holes not at all): linear in the segment's size."""
        found: list[_Slot] = []
        bad = 0
        torn: int | None = None  # where the run of unreadable pages being passed began
        off, size = 0, seg.end
        while (off := _next_data(seg.fd, off, size)) < size:
            head = os.pread(seg.fd, MAX_HEADER_BYTES + SEAL_BYTES, off)
            block = self._sealed(head)
            if block is not None and off + block.file_bytes + SEAL_BYTES <= size:
                if torn is not None:
                    bad += 1
                    _punch_quiet(seg.fd, torn, off - torn)
                    torn = None
                slot = _Slot(block, seg, off)
                found.append(slot)
                off += slot.length
                continue
            if torn is None and any(head):
                torn = off
            off += ALIGN
        if torn is not None:
            bad += 1
            _punch_quiet(seg.fd, torn, size - torn)
        return found, bad

    def _sealed(self, head: bytes) -> StoredBlock | None:
        """The block whose header ``head`` begins with, if this tier wrote it (sealed)."""
        block, _ = parse_header(head, None)
        if block is None or not hmac.compare_digest(
                head[block.header_len : block.header_len + SEAL_BYTES], self._seal(head[: block.header_len])):
            return None
        return block

    # ------------------------------------------------------------------ writes
    def write(self, record: BlockRecord, views: Sequence[memoryview]) -> int:
        """Store the block; the bytes its record takes (no-op if already held).

        Raises CorruptBlockError (``views`` do not match ``record``'s size or checksum;
        nothing is stored), TierFullError, TierIOError, ValueError (bad key or tenant).
        """
        block, header, pieces, expect = prepare(record, views, self._settings.compression,
                                                self._settings.compression_level)
        length = aligned(block.file_bytes + SEAL_BYTES)
        with self._lock:
            held = self._table.get(record.key)
            if held is not None and held.block.record == record:
                return held.length
            if length > self._room_locked():
                raise TierFullError(f"disk tier: no room for {length} bytes")
            seg, off = self._take_locked(length)
            self._reserved += length
            seg.pending += 1
        slot = _Slot(block, seg, off)
        written = False
        try:
            self._write_record(slot, header, pieces, expect)
            written = True
        finally:
            with self._lock:
                self._reserved -= length
                seg.pending -= 1
                if not seg.pending and seg is not self._current:
                    _close(seg)
                old = None
                if written:
                    old = self._table.get(record.key)
                    if old is not None:  # another record under the key: replaced
                        self._used -= old.length
                        old.segment.live -= 1
                    self._table[record.key] = slot
                    self._used += length
                    seg.live += 1
            if not written:
                self._free(slot)
            elif old is not None:
                self._free(old)
        return length

    def _take_locked(self, length: int) -> tuple[_Segment, int]:
        """Where the next record of ``length`` bytes goes (a new segment when it is full)."""
        seg = self._current
        if seg is None or (seg.end and seg.end + length > self.segment_bytes):
            seg = self._new_segment_locked()
            old, self._current = self._current, seg
            if old is not None and not old.pending:
                _close(old)
                if not old.live:
                    self._drop_segment_locked(old)
        off = seg.end
        seg.end += length
        return seg, off

    def _new_segment_locked(self) -> _Segment:
        """Create the next segment (its directory entry synced with ``fsync: always``).
        TierIOError if that fails, and then nothing of it is left: not its file, its
        descriptor, nor its place in ``_segments`` (a failing disk would otherwise gain
        one of each per write)."""
        number = self._next_number
        self._next_number += 1
        try:
            seg = self._open_segment(number, create=True)
        except OSError as e:
            raise TierIOError(f"disk tier: cannot create a segment in {self._dir}: {errname(e)}") from e
        if seg is None:
            raise TierIOError(f"disk tier: cannot create a segment in {self._dir}")
        if self._fsync:
            try:
                fsync_dir(self._dir)
            except OSError as e:
                del self._segments[number]
                _close(seg)
                with contextlib.suppress(OSError):  # (an empty file a restart would drop anyway)
                    os.unlink(seg.path)
                raise TierIOError(f"disk tier: cannot create a segment in {self._dir}: {errname(e)}") from e
        return seg

    def _write_record(self, slot: _Slot, header: bytes, pieces: Sequence[memoryview], expect: int | None) -> None:
        seg = slot.segment
        hasher = xxhash.xxh3_64()
        bufs: list[memoryview] = [memoryview(header), memoryview(self._seal(header))]
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
            touched = getattr(self._batch, "segments", None)
            if touched is not None:
                touched.add(seg.number)
            elif self._fsync:
                os.fdatasync(seg.fd)
        except OSError as e:
            raise TierIOError(f"disk tier: cannot write to {seg.path}: {errname(e)}") from e

    def _batch_begin(self, items: int) -> None:
        """The batch's writes note their segments instead of syncing; each segment is synced
        once at the end (with ``fsync: always``)."""
        self._batch.segments = set()

    def _batch_end(self) -> Callable[[], None] | None:
        touched: set[int] = self._batch.segments or set()
        self._batch.segments = None
        if not self._fsync or not touched:
            return None

        def sync() -> None:
            for number in sorted(touched):
                seg = self._segments.get(number)
                if seg is not None:
                    with self._opened(seg) as fd:
                        os.fdatasync(fd)

        return sync

    # ------------------------------------------------------------------ reads
    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the kernel to start reading these blocks (``POSIX_FADV_WILLNEED`` on their
        records); only a hint. How many were hinted."""
        n = 0
        for key in keys:
            slot = self._table.get(key)
            if slot is None:
                continue
            with contextlib.suppress(OSError), self._opened(slot.segment) as fd:
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
        slot = self._table.get(key)
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
            with _fresh(slot.segment) as fd:
                got = _preadv_all(fd, [head, seal, stored], slot.offset)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                self._lose(slot.segment)
            raise TierIOError(f"disk tier: cannot read {slot.segment.path}: {errname(e)}") from e
        reason = f"short read ({got} of {slot.span} bytes)" if got != slot.span \
            else self._problem(slot, head, seal, lambda: payload_problem(block, stored, dest))
        if reason:
            logger.warning("disk tier: discarding corrupt block %s in %s: %s", key.hex(), slot.segment.path, reason)
            self._forget(slot)
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
        slot = self._table.get(key)
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
            with self._opened(slot.segment) as fd:
                got = os.preadv(fd, [head, seal, *views], slot.offset, os.RWF_NOWAIT)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                self._nowait = False  # the kernel or this filesystem always waits: reads go to a thread
            return False  # (EAGAIN: not in memory; any other error: the thread's read reports it)
        if got != slot.span:
            return False  # part of it is not in memory
        return not self._problem(slot, head, seal, lambda: "" if checksum(views) == block.record.checksum
                                 else "payload checksum mismatch")

    def _problem(self, slot: _Slot, head: memoryview, seal: memoryview, payload: Callable[[], str]) -> str:
        """What is wrong with a whole record read (or ""): its header and seal, then what
        ``payload()`` finds of its bytes."""
        parsed, reason = parse_header(head, None)
        if parsed is None or parsed != slot.block or not hmac.compare_digest(seal, self._seal(head)):
            return reason or "header does not match the block"
        return payload()

    # ------------------------------------------------------------------ deletes
    def delete(self, key: bytes) -> int:
        """Delete the block; the bytes it took (0 if not held)."""
        slot = self._unlist(key)
        if slot is None:
            return 0
        self._free(slot)
        return slot.length

    def detach(self, key: bytes) -> Callable[[], None] | None:
        """Take the block out of the table now; what punches its record's hole (that record's
        alone: a later record under the key lies elsewhere)."""
        slot = self._unlist(key)
        return None if slot is None else functools.partial(self._free, slot)

    def _unlist(self, key: bytes) -> _Slot | None:
        with self._lock:
            slot = self._table.pop(key, None)
            if slot is not None:
                self._used -= slot.length
                slot.segment.live -= 1
        return slot

    def _forget(self, slot: _Slot) -> None:
        """Drop ``slot`` if it is still the one held for its key."""
        with self._lock:
            key = slot.block.record.key
            if self._table.get(key) is not slot:
                return
            del self._table[key]
            self._used -= slot.length
            slot.segment.live -= 1
        self._free(slot)

    def _free(self, slot: _Slot) -> None:
        """Give a record's pages back (it is no longer in the table); a segment left with
        no record and no write under way is deleted."""
        seg = slot.segment
        freed = False
        if self._punching and self._segments.get(seg.number) is seg:  # (a dropped segment took its pages)
            try:
                with self._opened(seg) as fd:
                    punch_hole(fd, slot.offset, slot.length)
                freed = True
            except OSError as e:
                if isinstance(e, FileNotFoundError):
                    self._lose(seg)
                elif e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self._punching = False
                    logger.warning("disk tier %s: the filesystem cannot punch holes; space comes back only when "
                                   "a whole segment is free", self._dir)
                else:
                    logger.warning("disk tier: cannot free a record in %s: %s", seg.path, errname(e))
        with self._lock:
            if not freed and self._segments.get(seg.number) is seg:
                # still on disk: counted until its segment goes (a segment another thread
                # dropped meanwhile took its pages with it, and its dead bytes are no longer
                # subtracted from the use)
                seg.dead += slot.length
                self._used += slot.length
            if not seg.live and not seg.pending and seg is not self._current:
                self._drop_segment_locked(seg)

    def _lose(self, seg: _Segment) -> None:
        """Forget a segment whose file something else deleted, and every block in it (their
        bytes went with it): they would otherwise stay listed and counted for good, each
        read of them a failure."""
        with self._lock:
            if self._segments.get(seg.number) is not seg:
                return  # (dropped already: by this tier, or by another thread that found it gone)
            lost = [key for key, slot in self._table.items() if slot.segment is seg]
            for key in lost:
                self._used -= self._table.pop(key).length
            seg.live -= len(lost)
            if seg is self._current:
                self._current = None  # (new records go to a new segment)
            if not seg.pending:  # (else the last write into it closes it; a read then drops it)
                self._drop_segment_locked(seg)
        logger.warning("disk tier: segment %s was deleted by something else; forgetting its %d blocks",
                       seg.path, len(lost))

    def _drop_segment(self, seg: _Segment) -> None:
        with self._lock:
            self._drop_segment_locked(seg)

    def _drop_segment_locked(self, seg: _Segment) -> None:
        if self._segments.pop(seg.number, None) is None:
            return
        self._used -= seg.dead
        seg.dead = 0
        if seg is self._current:
            self._current = None
        _close(seg)
        self._files.discard(seg.number)
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("disk tier: cannot remove segment %s: %s", seg.path, errname(e))

    def close(self) -> None:
        """Close the segment files (the blocks stay on disk for the next open)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
            self._table.clear()
            self._current = None
            self._used = 0
        for seg in segments:
            _close(seg)
        self._files.close()
        self._unlock_dir()

    @property
    def open_files(self) -> int:
        """Segment files held open now for appends (those being appended to)."""
        return sum(seg.fd >= 0 for seg in list(self._segments.values()))

    def _opened(self, seg: _Segment) -> contextlib.AbstractContextManager[int]:
        """A descriptor of the segment's file for one read, hole punch or sync (kept open
        after it, up to :data:`~kvpool_sidecar.tiers.descriptors.DEFAULT_LIMIT` files);
        OSError if it cannot be opened."""
        return self._files.opened(seg.number, seg.path)


def _close(seg: _Segment) -> None:
    """Close the segment's append descriptor, if open."""
    if seg.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(seg.fd)
        seg.fd = -1


@contextlib.contextmanager
def _fresh(seg: _Segment) -> Iterator[int]:
    """A descriptor of its own for one read that may go to the device (OSError if it cannot
    open). Not a shared one: the kernel reads ahead for each descriptor from the pattern of
    its reads, and blocks written one after another (a chain demoted together) are read back
    one after another; on a descriptor all readers share, their interleaved offsets look
    random, and it stops reading ahead (``kvpool bench disk``'s promotion of 64 KiB blocks
    one at a time fell from 2.2-2.5 times the raw read to 1.2-1.3)."""
    fd = os.open(seg.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _next_data(fd: int, off: int, size: int) -> int:
    """The start of the page of the first byte at or after ``off`` that is not in a hole
    (``size`` if none is)."""
    try:
        data = os.lseek(fd, off, os.SEEK_DATA)
    except OSError as e:
        if e.errno == errno.ENXIO:  # nothing but holes to the end
            return size
        data = off  # (no SEEK_DATA here: every page is read)
    return data - data % ALIGN


def _punch_quiet(fd: int, offset: int, length: int) -> None:
    """Free pages nothing reads, if the filesystem can (they are not counted either way)."""
    with contextlib.suppress(OSError):
        punch_hole(fd, offset, length)


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
