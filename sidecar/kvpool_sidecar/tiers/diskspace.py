"""The room of a disk tier: its capacity, the bytes its blocks take, the bytes writes in flight
have reserved, and the least a block is charged.

A disk tier (:class:`~kvpool_sidecar.tiers.keyed.KeyedDiskTier`, either layout) offers its
capacity less the blocks held and the writes in flight, and never more than its filesystem
has (:mod:`~kvpool_sidecar.tiers.fsfree`); with a least charge per block
(``disk.min_block_bytes``), a block takes at least that much of it, and the tier holds at
most its capacity over it in blocks.

:class:`DiskSpace` takes no lock of its own: the layout changes and reads its counts under
the tier's lock (never held during I/O), as it changes its table.
"""

from __future__ import annotations

from kvpool_sidecar.tiers.fsfree import FsFree


class DiskSpace:
    """The counts of one disk tier's room; see the module docstring."""

    __slots__ = ("capacity", "min_charge", "max_blocks", "used", "reserved", "discarded", "_fs")

    def __init__(self, root: str, capacity: int, min_charge: int) -> None:
        #: The tier's size (``disk.size``).
        self.capacity = capacity
        #: The least a block is charged of the capacity (0: what its bytes on disk take), and
        #: so the most blocks the tier holds (None: as many as their bytes fit).
        self.min_charge = min_charge
        self.max_blocks = capacity // min_charge if min_charge else None
        #: Bytes the blocks held take on disk (headers included; a layout may count more, as
        #: its ``used_bytes`` says), not counting writes in flight.
        self.used = 0
        #: Bytes that writes in flight have taken, so that concurrent writes cannot overrun.
        self.reserved = 0
        #: Invalid or torn blocks the last open discarded.
        self.discarded = 0
        #: The filesystem's free space, asked once a while.
        self._fs = FsFree(root, capacity)

    def reset(self, used: int, discarded: int) -> None:
        """What an open found: blocks of ``used`` bytes, and ``discarded`` invalid ones; no
        write is in flight."""
        self.used = used
        self.reserved = 0
        self.discarded = discarded

    def room(self, now: float) -> int:
        """The bytes a write may take now (less than 0 when none): the capacity less the blocks
        held and the writes in flight, and never more than the filesystem has (``now`` on the
        clock of :data:`~kvpool_sidecar.tiers.fsfree.FS_FREE_TTL_S`)."""
        return min(self.capacity - self.used, self._fs.free(self.used, now)) - self.reserved

    def offered(self, room: int, blocks: int) -> int:
        """What a tier holding ``blocks`` blocks offers of ``room`` (:meth:`room`): never less
        than 0, nor more than the blocks it may still hold at the least charge each."""
        if self.max_blocks is not None:  # (blocks of the least charge each)
            room = min(room, (self.max_blocks - blocks) * self.min_charge)
        return max(0, room)
