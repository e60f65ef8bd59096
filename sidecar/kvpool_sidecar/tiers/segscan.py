"""The segment tier's scan at open (a warm restart): the records its segments hold.

Open scans each segment from record to record, skipping holes with ``SEEK_DATA`` (new blocks
then go to a new segment). At a page that is neither zeros nor a sealed header
(:func:`~kvpool_sidecar.tiers.segrecord.sealed`: a torn record, a damaged header) the scan
goes on a page at a time to the next sealed header, and frees the pages in between. Where a
key is found twice (a rewrite whose older record's hole was not punched before a crash), the
later record wins, and the older one's hole is punched. Only files named exactly as the tier
names them are read (:func:`~kvpool_sidecar.tiers.segfiles.segment_number`), each file once
(not a second name of it: a hard link), and only those the tier's user owns, so that no
record is ever taken for a stale copy of itself. A page the device cannot read (a bad
sector) costs the records of its segment from there on, not the start: they are logged and
left as they are, unpunched.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

from kvpool_sidecar.tiers.diskformat import MAX_HEADER_BYTES, errname
from kvpool_sidecar.tiers.segfiles import ALIGN, Segment, SegmentFiles, close_segment, punch_hole
from kvpool_sidecar.tiers.segrecord import SEAL_BYTES, Slot, sealed

logger = logging.getLogger(__name__)


def scan_all(files: SegmentFiles, key: bytes, numbers: list[int]) -> tuple[dict[bytes, Slot], int]:
    """The records of segments ``numbers`` (the later of two under one key) sealed under
    ``key``, and how many were discarded; lists the segments read in ``files`` (their live
    records counted, their append descriptors closed) and punches the holes of the stale
    records."""
    table: dict[bytes, Slot] = {}
    stale: list[Slot] = []
    discarded = 0
    seen: set[tuple[int, int]] = set()
    for number in numbers:
        seg = _open_old_segment(files, number, seen)
        if seg is None:
            continue
        try:
            found, bad = scan_segment(seg, key)
        finally:
            close_segment(seg)
        discarded += bad
        for slot in found:
            older = table.get(slot.block.record.key)
            if older is not None:  # a rewrite: the later record wins
                older.segment.live -= 1
                stale.append(older)
            table[slot.block.record.key] = slot
            seg.live += 1
    for slot in stale:
        with contextlib.suppress(OSError), files.opened(slot.segment) as fd:
            punch_hole(fd, slot.offset, slot.length)
    return table, discarded


def _open_old_segment(files: SegmentFiles, number: int, seen: set[tuple[int, int]]) -> Segment | None:
    """Segment ``number``, opened to be scanned, unless it cannot be or its file is one
    already read under another name (a hard link): its records would be taken for stale
    copies of themselves, and their holes punched in the file the table reads."""
    seg = files.open(number, create=False)
    if seg is None:
        return None
    st = os.fstat(seg.fd)
    if (st.st_dev, st.st_ino) in seen:
        logger.warning("disk tier: ignoring segment %s: it is a link to a segment already read", seg.path)
        del files.segments[number]
        close_segment(seg)
        return None
    seen.add((st.st_dev, st.st_ino))
    return seg


def scan_segment(seg: Segment, key: bytes) -> tuple[list[Slot], int]:
    """The records of one segment, and how many runs of pages it holds that are neither
    a record nor a hole (a torn write, a damaged header): their pages are freed, and the
    scan goes on at the next page that begins with a sealed header. Only the seal makes a
    page a record's start, so a header a tenant's payload holds (no seal) is never taken
    for one, and one damaged record costs only itself. Each page is read once, up to a
    header's length (pages in holes not at all): linear in the segment's size. A page that
    cannot be read (an OS error: a bad sector) ends the scan of this segment, counted as one
    discarded run: the records before it are kept, none after it, and no page is freed
    (a run being passed then included)."""
    found: list[Slot] = []
    bad = 0
    torn: int | None = None  # where the run of unreadable pages being passed began
    off, size = 0, seg.end
    while (off := _next_data(seg.fd, off, size)) < size:
        try:
            head = os.pread(seg.fd, MAX_HEADER_BYTES + SEAL_BYTES, off)
        except OSError as e:
            # A page the device cannot read (a bad sector: EIO): what lies behind it is not
            # recovered, but nothing is punched either (the device may read it again at a
            # later start), and the records before it are kept.
            logger.warning("disk tier: cannot read segment %s at offset %d (%s): its records from there on "
                           "are not recovered", seg.path, off, errname(e))
            return found, bad + 1
        block = sealed(key, head)
        if block is not None and off + block.file_bytes + SEAL_BYTES <= size:
            if torn is not None:
                bad += 1
                _punch_quiet(seg.fd, torn, off - torn)
                torn = None
            slot = Slot(block, seg, off)
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
