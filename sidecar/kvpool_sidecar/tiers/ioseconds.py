"""The seconds a disk tier's calls took, per kind (:class:`IoSeconds`): what ``kvpool demo``,
the store's report (:meth:`~kvpool_sidecar.store.report.StoreReport.io_seconds`) and
``kvpool_disk_io_seconds`` show of the disk. Each disk tier, of either layout, times its calls
with one (:class:`~kvpool_sidecar.tiers.keyed.KeyedDiskTier`), and the segment layout the
syncs inside one block's write.
"""

from __future__ import annotations

import threading
import time

__all__ = ["IO_KINDS", "IoSeconds"]

#: What :class:`IoSeconds` times: writes (a batch's or one block's, checksummed on the way),
#: syncs (``fsync: always``: those that end a batch, and those inside one block's write), reads
#: that wait for the device (in a thread), reads tried from the page cache alone (on the event
#: loop; those that find the block not all in memory count too), and deletes (a file unlinked
#: or a record's hole punched: for a store's REMOVE or an eviction, in a thread).
IO_KINDS = ("write", "sync", "read", "read_cached", "delete")


class IoSeconds:
    """Seconds a disk tier's calls took, per kind (:data:`IO_KINDS`), summed over the threads
    that ran them: where several run at once the sum passes the wall time, and the event loop
    runs beside them (what ``kvpool demo`` and ``kvpool_disk_io_seconds`` report of the disk).

    A call is timed from :meth:`begin` to :meth:`add`; a sync inside it (:meth:`synced`) counts
    as syncing and not as the call's own kind."""

    __slots__ = ("_lock", "_seconds", "_inner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(IO_KINDS, 0.0)
        #: Per thread: the seconds of syncs inside the call under way.
        self._inner = threading.local()

    def begin(self) -> float:
        """A call starts in this thread: its start, for :meth:`add`."""
        self._inner.seconds = 0.0
        return time.perf_counter()

    def add(self, kind: str, since: float) -> None:
        """The call of ``kind`` that began at ``since`` (:meth:`begin`) is over."""
        spent = time.perf_counter() - since - getattr(self._inner, "seconds", 0.0)
        self._inner.seconds = 0.0
        with self._lock:
            self._seconds[kind] += max(0.0, spent)

    def synced(self, since: float) -> None:
        """A sync that began at ``since`` (``time.perf_counter``) inside a timed call is over."""
        spent = time.perf_counter() - since
        self._inner.seconds = getattr(self._inner, "seconds", 0.0) + spent
        with self._lock:
            self._seconds["sync"] += spent

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)
