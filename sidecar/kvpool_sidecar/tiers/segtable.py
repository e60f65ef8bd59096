"""The segment tier's table: the records it holds, the segments they lie in, and when a
record's pages and a segment's file go.

A key's record is a :class:`~kvpool_sidecar.tiers.segrecord.Slot` in :attr:`SegmentTable.table`.
Each segment (:class:`~kvpool_sidecar.tiers.segfiles.Segment`) counts the records it holds
(``live``), the writes under way into it (``pending``) and the bytes of deleted records whose
hole could not be punched (``dead``, still on disk and so still counted as used). New records
go to the current segment, at its end, until the next would pass the segment's size; then a
new one is created (:meth:`SegmentTable.take_locked`). Offsets are never reused, so a read
never meets another block's bytes.

A record taken out of the table is freed by punching its hole (:meth:`SegmentTable.free`;
where the filesystem cannot, its bytes stay counted until the segment goes), and a segment
with no record and no write under way, other than the current one, is dropped: its file is
unlinked once the tier's lock is released (:meth:`SegmentTable.locked`), as an unlink of a
whole segment had held the lock, which the event loop takes too, for tens of milliseconds.

A segment whose file something else deleted is forgotten with every block in it
(:meth:`SegmentTable.lose`), and the tier forgets every block where the whole directory went
(:meth:`SegmentTable.forget_all_locked`); the store asks for the keys of those blocks
(:meth:`SegmentTable.forgotten`).

The table, the segments' counts and the bytes used (:class:`~kvpool_sidecar.tiers.diskspace.DiskSpace`)
are guarded by the tier's lock, which is never held during I/O: the methods whose names end
in ``_locked`` run under it (:meth:`SegmentTable.locked`), the others take it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator

from kvpool_sidecar.tiers.diskformat import errname
from kvpool_sidecar.tiers.diskspace import DiskSpace
from kvpool_sidecar.tiers.segfiles import Segment, SegmentFiles, close_segment, punch_hole
from kvpool_sidecar.tiers.segrecord import Slot

logger = logging.getLogger(__name__)


class SegmentTable:
    """The records of one segment tier and the segments they lie in; see the module docstring."""

    def __init__(self, files: SegmentFiles, lock: threading.Lock, space: DiskSpace) -> None:
        self._files = files
        self._lock = lock
        self._space = space
        #: The records held, by key.
        self.table: dict[bytes, Slot] = {}
        #: The segment new records are appended to (None: the next write creates one).
        self.current: Segment | None = None
        #: Keys of blocks lost with their segment or directory, until the store asks
        #: (:meth:`forgotten`).
        self._forgotten: list[bytes] = []
        #: Whether the filesystem punches holes (else a record's pages come back with its segment).
        self._punching = True
        #: Files of segments dropped under the lock, unlinked after it (:meth:`locked`): an
        #: unlink (63-71 ms for a full 256 MiB segment where holes cannot be punched) had
        #: held the lock, which the event loop takes too.
        self._dropped: deque[str] = deque()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The tier's lock, for a part that may drop segments: their files are unlinked
        once it is released (by this thread, or by another that drains the list first)."""
        with self._lock:
            yield
        while True:
            try:
                path = self._dropped.popleft()
            except IndexError:
                return
            self._files.unlink(path)

    def take_locked(self, length: int, limit: int, fsync: bool, remake: Callable[[], None]) -> tuple[Segment, int]:
        """Where the next record of ``length`` bytes goes: the current segment, or a new one
        when it would pass ``limit`` bytes (created as :meth:`SegmentFiles.create` does, with
        ``fsync`` and ``remake``)."""
        seg = self.current
        if seg is None or (seg.end and seg.end + length > limit):
            seg = self._files.create(fsync, remake)
            old, self.current = self.current, seg
            if old is not None and not old.pending:
                close_segment(old)
                if not old.live:
                    self.drop_locked(old)
        off = seg.end
        seg.end += length
        return seg, off

    def settle_locked(self, slot: Slot, written: bool) -> tuple[bool, Slot | None]:
        """The write of ``slot`` (counted in its segment's ``pending``) is over, ``written``
        or not: whether its record is kept (written into a segment still listed: one forgotten
        meanwhile, its file deleted under the tier, holds nothing), and the record it replaced
        under the key, if any (out of the table: to be freed)."""
        seg = slot.segment
        seg.pending -= 1
        if not seg.pending and seg is not self.current:
            close_segment(seg)
        kept = written and self._files.segments.get(seg.number) is seg
        old = None
        if kept:
            key = slot.block.record.key
            old = self.table.get(key)
            if old is not None:  # another record under the key: replaced
                self._space.used -= old.length
                old.segment.live -= 1
            self.table[key] = slot
            self._space.used += slot.length
            seg.live += 1
        return kept, old

    def unlist(self, key: bytes) -> Slot | None:
        """Take the key's record out of the table (its pages still to be freed: :meth:`free`)."""
        with self._lock:
            slot = self.table.pop(key, None)
            if slot is not None:
                self._space.used -= slot.length
                slot.segment.live -= 1
        return slot

    def forget(self, slot: Slot) -> None:
        """Drop ``slot`` if it is still the one held for its key."""
        with self._lock:
            key = slot.block.record.key
            if self.table.get(key) is not slot:
                return
            del self.table[key]
            self._space.used -= slot.length
            slot.segment.live -= 1
        self.free(slot)

    def free(self, slot: Slot) -> None:
        """Give a record's pages back (it is no longer in the table); a segment left with
        no record and no write under way is deleted."""
        seg = slot.segment
        files = self._files
        freed = False
        if self._punching and files.segments.get(seg.number) is seg:  # (a dropped segment took its pages)
            try:
                with files.opened(seg) as fd:
                    punch_hole(fd, slot.offset, slot.length)
                freed = True
            except OSError as e:
                if isinstance(e, FileNotFoundError):
                    self.lose(seg)
                elif e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    self._punching = False
                    logger.warning("disk tier %s: the filesystem cannot punch holes; space comes back only when "
                                   "a whole segment is free", files.dir)
                else:
                    logger.warning("disk tier: cannot free a record in %s: %s", seg.path, errname(e))
        with self.locked():
            if not freed and files.segments.get(seg.number) is seg:
                # still on disk: counted until its segment goes (a segment another thread
                # dropped meanwhile took its pages with it, and its dead bytes are no longer
                # subtracted from the use)
                seg.dead += slot.length
                self._space.used += slot.length
            if not seg.live and not seg.pending and seg is not self.current:
                self.drop_locked(seg)

    def lose(self, seg: Segment) -> None:
        """Forget a segment whose file something else deleted, and every block in it (their
        bytes went with it): they would otherwise stay listed and counted for good, each
        read of them a failure."""
        with self.locked():
            if self._files.segments.get(seg.number) is not seg:
                return  # (dropped already: by this tier, or by another thread that found it gone)
            lost = [key for key, slot in self.table.items() if slot.segment is seg]
            for key in lost:
                self._space.used -= self.table.pop(key).length
            self._forgotten.extend(lost)
            seg.live -= len(lost)
            if seg is self.current:
                self.current = None  # (new records go to a new segment)
            if not seg.pending:  # (else the last write into it closes it; a read then drops it)
                self.drop_locked(seg)
        logger.warning("disk tier: segment %s was deleted by something else; forgetting its %d blocks",
                       seg.path, len(lost))

    def forget_all_locked(self) -> int:
        """The directory went with every segment in it: forget every block (for
        :meth:`forgotten`) and every segment (their files stay); how many blocks."""
        lost = len(self.table)
        self._forgotten.extend(self.table)
        self.table.clear()
        self._space.used = 0
        self.current = None
        for seg in self._files.forget_all():
            if not seg.pending:  # (a write under way closes its own, and fails: its segment is no longer listed)
                close_segment(seg)
        return lost

    def forgotten(self) -> list[bytes]:
        """The keys of the blocks lost with a segment or the directory since the last call
        (:class:`~kvpool_sidecar.tiers.base.Forgetting`)."""
        with self._lock:
            lost, self._forgotten = self._forgotten, []
        return lost

    def drop_locked(self, seg: Segment) -> None:
        """Take a segment out of the listed ones and retire it; its file is unlinked once the
        lock is released (:meth:`locked`). One dropped already is left alone."""
        if self._files.segments.pop(seg.number, None) is None:
            return
        self._space.used -= seg.dead
        seg.dead = 0
        if seg is self.current:
            self.current = None
        self._files.retire(seg)
        self._dropped.append(seg.path)  # (unlinked once the lock is released: locked)

    def clear_locked(self) -> list[Segment]:
        """Forget every record and segment as the tier closes (their files stay, for the
        next open); the segments, to close."""
        segments = self._files.forget_all()
        self.table.clear()
        self.current = None
        self._space.used = 0
        return segments
