"""What the disk tier's two layouts share: a block's place is its key, and the store's
:class:`~kvpool_sidecar.tiers.base.Tier` calls map onto a layout's own ``write``,
``write_many``, ``read_into`` and ``delete`` (what a layout supplies:
:class:`~kvpool_sidecar.tiers.disklayout.DiskLayout`), each timed
(:class:`~kvpool_sidecar.tiers.ioseconds.IoSeconds`).

:meth:`KeyedDiskTier.write_many` runs a batch between the layout's two hooks and, if the sync
that ends it fails, deletes the batch's new blocks and answers each with a TierIOError.

The room a layout offers is its capacity less the blocks held and the writes in flight, and
never more than its filesystem has, with a least charge per block
(:class:`~kvpool_sidecar.tiers.diskspace.DiskSpace`).
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from kvpool_sidecar.config import DiskSettings
from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError
from kvpool_sidecar.tiers.base import BlockRecord, TierKind, WriteResult, scatter
from kvpool_sidecar.tiers.diskformat import errname
from kvpool_sidecar.tiers.disklayout import DiskLayout
from kvpool_sidecar.tiers.diskspace import DiskSpace
from kvpool_sidecar.tiers.ioseconds import IoSeconds

WriteOutcome = int | CorruptBlockError | TierFullError | TierIOError


class KeyedDiskTier(DiskLayout):
    """A disk tier whose place for a block is the block's key."""

    kind = TierKind.DISK
    blocking = True
    release_blocks = True
    accounts_only = False
    #: The clock :data:`~kvpool_sidecar.tiers.fsfree.FS_FREE_TTL_S` is counted on.
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, settings: DiskSettings) -> None:
        if settings.path is None:
            raise ValueError("a disk tier needs settings.path")
        self._settings = settings
        self._root = os.path.abspath(settings.path)
        self._fsync = settings.fsync == "always"
        #: Guards the room below and the layout's table; never held during I/O.
        self._lock = threading.Lock()
        #: The blocks held, the writes in flight, the filesystem's free space (under the lock).
        self._space = DiskSpace(self._root, settings.size_bytes, settings.min_block_bytes or 0)
        #: The tier's size (``disk.size``).
        self.capacity_bytes: Final[int] = self._space.capacity
        #: Seconds spent writing, syncing, reading and deleting (see
        #: :class:`~kvpool_sidecar.tiers.ioseconds.IoSeconds`).
        self.io_seconds = IoSeconds()
        #: The least a block is charged of the capacity (0: what its record takes), and so
        #: the most blocks the tier holds (None: as many as their records fit).
        self.min_charge: Final[int] = self._space.min_charge
        self.max_blocks: Final[int | None] = self._space.max_blocks

    # ------------------------------------------------------------------ sizes
    @property
    def used_bytes(self) -> int:
        """Bytes the blocks held take on disk (headers included), not counting writes in flight."""
        return self._space.used

    @property
    def free_bytes(self) -> int:
        """Capacity left after the blocks held and the space reserved by writes in flight,
        and never more than the filesystem has: a filesystem that fills up (other files, a
        smaller volume than configured) shrinks the tier, so the store evicts disk blocks to
        make room instead of failing every demotion; it grows back when space returns."""
        with self._lock:
            room = self._space.room(self.clock())
        return self._space.offered(room, len(self))

    @property
    def discarded_on_open(self) -> int:
        """Invalid or torn blocks the last ``open()`` discarded."""
        return self._space.discarded

    # ------------------------------------------------------------------ shared
    def write_many(self, items: Sequence[tuple[BlockRecord, Sequence[memoryview]]]) -> list[WriteOutcome]:
        """Store several blocks; per item, the bytes it takes or the error that kept it out
        (as :meth:`write` would raise it). Durable when this returns, under ``fsync: always``."""
        began = self.io_seconds.begin()
        self._batch_begin(len(items))
        out: list[WriteOutcome] = []
        new: list[int] = []  # items written by this call (not already held)
        try:
            for i, (record, views) in enumerate(items):
                held = self.record(record.key) == record
                try:
                    out.append(self.write(record, views))
                except (CorruptBlockError, TierFullError, TierIOError) as e:
                    out.append(e)
                except (struct.error, ValueError) as e:  # a record no header can hold: this block fails, not the batch
                    out.append(TierIOError(f"disk tier: cannot write block {record.key.hex()}: {e}"))
                else:
                    if not held:
                        new.append(i)
        finally:
            try:
                sync = self._batch_end()
            finally:
                self.io_seconds.add("write", began)
        if sync is not None and new:
            began = self.io_seconds.begin()
            try:
                sync()
            except OSError as e:
                self.io_seconds.add("sync", began)  # (the deletes below are not the sync's)
                err = TierIOError(f"disk tier: cannot sync a batch of {len(new)} blocks: {errname(e)}")
                for i in new:
                    with contextlib.suppress(TierIOError):  # left on disk: the next open checks it
                        self.delete(items[i][0].key)
                    out[i] = err
            else:
                self.io_seconds.add("sync", began)
        return out

    # ------------------------------------------------------------- Tier (a place is the key)
    def footprint(self, size: int, tenant: str | None = None) -> int:
        return max(self.estimate_bytes(size, tenant), self.min_charge)

    def reserve(self, record: BlockRecord) -> bytes | None:
        """The key, when the block fits now (the write itself reserves the bytes)."""
        return record.key if self.free_bytes >= self.footprint(record.size, record.tenant) else None

    def release(self, place: bytes) -> None:
        began = self.io_seconds.begin()
        try:
            self.delete(place)
        finally:
            self.io_seconds.add("delete", began)

    def detach(self, key: bytes) -> Callable[[], None] | None:
        """See :class:`~kvpool_sidecar.tiers.base.Detaching` (a place is the key); the release
        it returns is timed as a delete."""
        free = self._detach(key)
        if free is None:
            return None
        io = self.io_seconds

        def release() -> None:
            began = io.begin()
            try:
                free()
            finally:
                io.add("delete", began)

        return release

    def write_copy(self, place: bytes, record: BlockRecord, src: Sequence[memoryview]) -> None:
        began = self.io_seconds.begin()
        try:
            self.write(record, src)
        finally:
            self.io_seconds.add("write", began)

    def write_copies(self, items: Sequence[tuple[bytes, BlockRecord, Sequence[memoryview]]]) -> list[WriteResult]:
        done = self.write_many([(record, src) for _, record, src in items])
        return [None if isinstance(r, int) else r for r in done]

    def read_copy(self, place: bytes, record: BlockRecord, dest: Sequence[memoryview]) -> None:
        """:meth:`read_into`, into one or more views, of the block ``record`` names: bytes
        held under the key for another block (a stale copy) are refused as corrupt."""
        _refuse_stale(self.record(place), place, record)
        began = self.io_seconds.begin()
        try:
            if len(dest) == 1:
                self.read_into(place, dest[0])
                return
            buf = memoryview(bytearray(sum(d.nbytes for d in dest)))
            self.read_into(place, buf)
            scatter(buf, dest)
        finally:
            self.io_seconds.add("read", began)

    def read_cached(self, place: bytes, record: BlockRecord, dest: Sequence[memoryview]) -> bool:
        """:meth:`read_copy` from the page cache alone (:meth:`read_nowait`); False when the
        bytes are not all in memory."""
        _refuse_stale(self.record(place), place, record)
        began = self.io_seconds.begin()
        try:
            return self.read_nowait(place, dest)
        finally:
            self.io_seconds.add("read_cached", began)

    def views(self, place: bytes) -> None:
        return None

    def recover(self) -> list[tuple[BlockRecord, bytes]]:
        return [(r, r.key) for r in self.open()]


def _refuse_stale(held: BlockRecord | None, place: bytes, record: BlockRecord) -> None:
    """CorruptBlockError when the key holds another block (``held``) than ``record`` (a stale copy)."""
    if held is not None and held != record:
        raise CorruptBlockError(f"disk tier: the copy of {place.hex()} holds another block")
