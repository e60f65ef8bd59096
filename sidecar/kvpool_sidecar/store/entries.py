"""One record per block: its metadata, and where each tier of the store keeps a copy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvpool_sidecar.events import EngineRef
from kvpool_sidecar.policy import BlockMeta
from kvpool_sidecar.tiers.base import BlockRecord, Place


@dataclass(slots=True, eq=False)
class Entry(BlockMeta):
    """A committed block. ``copies[i]`` is the place tier ``i`` of the store's list keeps it
    at (hottest tier first), or None where that tier holds no copy."""

    checksum: int = 0
    copies: list[Place | None] | None = None
    #: Read leases outstanding (clients and peers reading the host tier's copy in place).
    readers: int = 0
    #: Client pins (by any session).
    pins: int = 0
    #: A search for victims walked past it (pinned or read) and told the policy so: it goes
    #: last in the tiers that hold it until its last pin and read lease go (then restored).
    held_back: bool = False
    #: Copies between tiers in flight.
    busy: int = 0
    #: Removed from the store (found corrupt, or deleted); its room comes back when the
    #: last reader and mover let go.
    dead: bool = False
    #: The engine's identity for the block, when its writer gave it (for KV events).
    engine: EngineRef | None = None

    def record(self) -> BlockRecord:
        return BlockRecord(self.key, self.size, self.checksum, self.tenant)

    def place(self, tier: int) -> Place | None:
        return self.copies[tier] if self.copies is not None else None

    def held(self) -> Iterator[int]:
        """The tiers holding a copy, hottest first."""
        copies = self.copies or ()
        return (i for i, p in enumerate(copies) if p is not None)

    @property
    def best(self) -> int:
        """The hottest tier holding a copy (-1: none). (Plain loops here and in :meth:`below`:
        lookups and every eviction ask, and a generator costs more than the list is long.)"""
        for i, p in enumerate(self.copies or ()):
            if p is not None:
                return i
        return -1

    def below(self, tier: int) -> bool:
        """Whether a tier colder than ``tier`` holds a copy."""
        copies = self.copies or ()
        for i in range(tier + 1, len(copies)):
            if copies[i] is not None:
                return True
        return False


def new_entry(meta: BlockMeta, checksum: int, tiers: int, engine: EngineRef | None = None) -> Entry:
    """An entry for ``meta`` with no copy yet in any of ``tiers`` tiers."""
    return Entry(meta.key, meta.size, meta.tenant, meta.priority, meta.depth, meta.parent, hints=meta.hints,
                 checksum=checksum, copies=[None] * tiers, engine=engine)
