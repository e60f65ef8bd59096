"""The DRAM tier: a shared-memory arena that local clients map.

The arena is one ``memfd`` (anonymous shared memory; its descriptor travels to clients
over the Unix socket), cut into pages by :class:`PageAllocator`. A block occupies one or
more extents ``(byte offset, byte length)`` whose lengths add up to the block's size.
Without an arena (``arena=None``) the tier only keeps accounts, which is how the trace
replay drives the very same store without payloads.
"""

from __future__ import annotations

import mmap
import os

from kvpool_sidecar.errors import TierError
from kvpool_sidecar.tiers.alloc import PageAllocator, Run
from kvpool_sidecar.tiers.base import TierKind

#: ``(byte offset in the arena, byte length)``.
Extent = tuple[int, int]


class SharedArena:
    """An anonymous shared-memory region with a descriptor that can be sent to clients."""

    def __init__(self, size: int, *, name: str = "kvpool-arena", populate: bool = True) -> None:
        self.size = size
        try:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError as e:
            raise TierError(f"cannot create the shared arena: {e.strerror}") from e
        try:
            os.ftruncate(self.fd, size)
            flags = mmap.MAP_SHARED
            if populate:
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(self.fd, size, flags=flags)
        except OSError as e:
            os.close(self.fd)
            raise TierError(f"cannot map a shared arena of {size} bytes: {e.strerror}") from e
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        self._mmap.close()
        os.close(self.fd)


class DramTier:
    """Page-granular accounts over the arena, plus views of a block's extents."""

    kind = TierKind.DRAM

    def __init__(self, capacity_bytes: int, page_bytes: int, arena: SharedArena | None = None) -> None:
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise ValueError("the DRAM tier needs at least one page")
        if arena is not None and arena.size < capacity_bytes:
            raise ValueError("the arena is smaller than the DRAM tier")
        self.page_bytes = page_bytes
        self.arena = arena
        self._alloc = PageAllocator(capacity_bytes // page_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.total_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self._alloc.total_pages - self._alloc.free_pages) * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_pages * self.page_bytes

    @property
    def fragments(self) -> int:
        """Free runs: a measure of fragmentation, exported as a metric."""
        return self._alloc.free_runs

    def footprint(self, size: int) -> int:
        """Bytes a block of ``size`` bytes takes (whole pages)."""
        return -(-size // self.page_bytes) * self.page_bytes

    def allocate(self, size: int) -> list[Extent] | None:
        """Extents covering exactly ``size`` bytes, or ``None`` when there is no room."""
        if size <= 0:
            raise ValueError("block size must be positive")
        pages = -(-size // self.page_bytes)
        runs = self._alloc.allocate(pages)
        if runs is None:
            return None
        extents: list[Extent] = []
        left = size
        for start, count in runs:
            n = min(left, count * self.page_bytes)
            extents.append((start * self.page_bytes, n))
            left -= n
        return extents

    def free(self, extents: list[Extent]) -> None:
        runs: list[Run] = [
            (off // self.page_bytes, -(-n // self.page_bytes)) for off, n in extents
        ]
        self._alloc.free(runs)

    def views(self, extents: list[Extent]) -> list[memoryview]:
        """Writable views of a block's bytes in the arena."""
        if self.arena is None:
            raise TierError("this DRAM tier keeps accounts only; it has no arena")
        v = self.arena.view
        return [v[off : off + n] for off, n in extents]
