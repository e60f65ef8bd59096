"""The segment tier's files: their names, the directory's lock, and the segments open now.

A segment is the file ``<path>/segments/<number>.kvs``, named by :func:`segment_name` alone:
:func:`segment_number` reads back no other spelling of a number, so that no file is read as
two segments. Records in it start at multiples of :data:`ALIGN` (4 KiB), so that punching a
deleted record's hole (:func:`punch_hole`, ``fallocate(PUNCH_HOLE)``) frees whole pages.

:class:`SegmentFiles` holds the segments open now, by number, and the open tier's ``flock`` on
``segments/.lock`` (:data:`LOCK_FILE`): a second tier on the directory (another sidecar) is
refused. It opens segments (the scan at open), creates them (when the current one is full;
the new directory entry synced with ``fsync: always``) and deletes them. It remembers which
directory it locked: one removed since (or another under its name) is made again by the tier
before a new segment goes there (:meth:`SegmentFiles.create`). It takes no lock of its own:
the tier creates and deletes segments under its lock, as it changes its table; a few reads
of the map of segments (a hole's punch, a batch's sync, the count of open files) look a
segment up without it, each ready for one deleted meanwhile. The descriptor cache below has
its own lock.

The segment being appended to keeps its descriptor. Reads from the page cache alone, hole
punches, read-ahead hints and syncs share the descriptors of at most 64 other segments, the
least recently used closed first (:mod:`~kvpool_sidecar.tiers.descriptors`): opening the file
for each of them had cost as much as a read from the page cache, and blocks spread over many
segments still hold at most that many descriptors. A dropped segment's descriptor goes with
it (closed by its last user). A read that may go to the device opens the file for itself
(see :func:`fresh`: the kernel's read-ahead).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvpool_sidecar.errors import TierIOError
from kvpool_sidecar.tiers.descriptors import DescriptorCache
from kvpool_sidecar.tiers.diskformat import errname, fsync_dir, libc_function, raise_errno

logger = logging.getLogger(__name__)

#: Records start at multiples of this (the page size of the filesystems a node has): a
#: punched record frees whole pages.
ALIGN = 4096
SUFFIX = ".kvs"
#: Held locked (``flock``) by the open tier: one tier, in one process, per directory.
LOCK_FILE = ".lock"
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
class Segment:
    number: int
    path: str
    #: Open only while records are appended to it (the current segment, and one rolled over
    #: while writes into it finish): a node with many segments holds one such descriptor,
    #: not one each. Reads from the page cache, hole punches and syncs take theirs from
    #: :meth:`SegmentFiles.opened` (at most 64 more).
    fd: int
    #: Where the next record goes (only the current segment grows).
    end: int = 0
    #: Records held, and writes under way into it.
    live: int = 0
    pending: int = 0
    #: Bytes of deleted records whose hole could not be punched (still on disk).
    dead: int = 0


def close_segment(seg: Segment) -> None:
    """Close the segment's append descriptor, if open."""
    if seg.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(seg.fd)
        seg.fd = -1


@contextlib.contextmanager
def fresh(seg: Segment) -> Iterator[int]:
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


class SegmentFiles:
    """The segment files of one directory; see the module docstring. Changed under the tier's
    lock (the scan at open runs before the tier is shared)."""

    def __init__(self, path: str) -> None:
        #: The directory of the segments (``<disk.path>/segments``).
        self.dir = path
        #: The segments, by number.
        self.segments: dict[int, Segment] = {}
        #: The number the next segment created takes.
        self.next_number = 1
        #: The open lock file's descriptor (:data:`LOCK_FILE`), -1 when not open.
        self._lock_fd = -1
        #: The directory the tier locked, as ``(st_dev, st_ino)`` (None: not locked): another
        #: one under its name, or none, means it was removed while the tier had it open.
        self._locked_dir: tuple[int, int] | None = None
        #: Descriptors for reads, hole punches and syncs, kept open between them.
        self._descriptors = DescriptorCache()

    def lock(self) -> None:
        """Lock the directory for the tier's life (released by :meth:`close`): two sidecars
        on one ``disk.path`` would each scan, punch and unlink the other's records. TierIOError
        if another holds it (any other open of the lock file, in this process too)."""
        path = os.path.join(self.dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TierIOError(f"disk tier: {self.dir} is in use by another disk tier ({path} is locked): "
                              "each sidecar needs a disk.path of its own") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # a filesystem without locks: the tier works, unguarded, as it did before locks
            logger.warning("disk tier %s: cannot lock %s (%s); make sure no other sidecar uses this disk.path",
                           self.dir, path, errname(e))
        else:
            self._lock_fd = fd
        try:
            st = os.stat(self.dir, follow_symlinks=False)
        except OSError:
            self.unlock()
            raise
        self._locked_dir = (st.st_dev, st.st_ino)

    def unlock(self) -> None:
        self._locked_dir = None
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # (releases the flock)
            self._lock_fd = -1

    def removed(self) -> bool:
        """Whether the directory the tier locked is gone, or another took its name (an
        operator's ``rm -r``, a tmp cleaner), or none is locked: new segments must not go
        there unless it is made again and locked (a write into the old one's last segment,
        unlinked with it, is lost when written; one into a new directory of someone else's
        making would be beside another sidecar's, or without a seal key on disk)."""
        try:
            st = os.stat(self.dir, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # (the segment's creation says what is wrong)
        return (st.st_dev, st.st_ino) != self._locked_dir

    def numbers(self) -> list[int]:
        """The numbers of the segment files here, in order; other names are left alone."""
        numbers: list[int] = []
        odd: list[str] = []
        for name in os.listdir(self.dir):
            if name.endswith(SUFFIX):
                number = segment_number(name)
                if number is None:
                    odd.append(name)
                else:
                    numbers.append(number)
        if odd:
            logger.warning("disk tier %s: ignoring %d files not named as its segments are, such as %r",
                           self.dir, len(odd), sorted(odd)[0])
        return sorted(numbers)

    def open(self, number: int, *, create: bool) -> Segment | None:
        """Segment ``number``, opened (to be scanned) or created, and listed; None if an
        existing one cannot be opened or is another user's file (OSError if one cannot be
        created)."""
        path = os.path.join(self.dir, segment_name(number))
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
        seg = Segment(number, path, fd)
        if not create:
            seg.end = os.fstat(fd).st_size
        self.segments[number] = seg
        return seg

    def create(self, fsync: bool, remake: Callable[[], None]) -> Segment:
        """Create the next segment (its directory entry synced if ``fsync``). Where the
        directory was removed since the tier locked it (:meth:`removed`), ``remake()`` first
        makes it again (the tier's: it forgets what went with it; TierIOError if it cannot).
        TierIOError if that fails, and then nothing of it is left: not its file, its
        descriptor, nor its place in :attr:`segments` (a failing disk would otherwise gain
        one of each per write)."""
        if self.removed():
            remake()
        number = self.next_number
        self.next_number += 1
        try:
            seg = self.open(number, create=True)
        except OSError as e:
            raise TierIOError(f"disk tier: cannot create a segment in {self.dir}: {errname(e)}") from e
        if seg is None:
            raise TierIOError(f"disk tier: cannot create a segment in {self.dir}")
        if fsync:
            try:
                fsync_dir(self.dir)
            except OSError as e:
                del self.segments[number]
                close_segment(seg)
                with contextlib.suppress(OSError):  # (an empty file a restart would drop anyway)
                    os.unlink(seg.path)
                raise TierIOError(f"disk tier: cannot create a segment in {self.dir}: {errname(e)}") from e
        return seg

    def opened(self, seg: Segment) -> contextlib.AbstractContextManager[int]:
        """A descriptor of the segment's file for one read, hole punch or sync (kept open
        after it, up to :data:`~kvpool_sidecar.tiers.descriptors.DEFAULT_LIMIT` files);
        OSError if it cannot be opened."""
        return self._descriptors.opened(seg.number, seg.path)

    def retire(self, seg: Segment) -> None:
        """Close a segment taken out of :attr:`segments` (its shared descriptor is closed by
        its last user); its file is left for :meth:`unlink`."""
        close_segment(seg)
        self._descriptors.discard(seg.number)

    @staticmethod
    def unlink(path: str) -> None:
        """Delete a retired segment's file (a number is never used twice, so the name never
        stands for a newer segment); one already gone is no error."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("disk tier: cannot remove segment %s: %s", path, errname(e))

    def forget_all(self) -> list[Segment]:
        """Take every segment out of :attr:`segments` (their files stay); the segments."""
        segments, self.segments = list(self.segments.values()), {}
        return segments

    def forget_descriptors(self) -> None:
        """Drop every shared descriptor (each closed now, or by its last user)."""
        self._descriptors.close()

    def close(self, segments: list[Segment]) -> None:
        """Close ``segments`` (taken out by :meth:`forget_all`) and every shared descriptor,
        and release the directory's lock."""
        for seg in segments:
            close_segment(seg)
        self._descriptors.close()
        self.unlock()

    @property
    def open_files(self) -> int:
        """Segment files held open now for appends (those being appended to)."""
        return sum(seg.fd >= 0 for seg in list(self.segments.values()))
