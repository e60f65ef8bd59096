"""The DRAM tier: a shared-memory arena that local clients map.

The arena is one ``memfd`` (anonymous shared memory; its descriptor travels to clients
over the Unix socket), cut into pages by :class:`PageAllocator`. A block occupies one or
more extents ``(byte offset, byte length)`` whose lengths add up to the block's size.
Without an arena (``arena=None``) the tier only keeps accounts, which is how the trace
replay drives the very same store without payloads.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os

from kvpool_client.memory import prefault_write
from kvpool_sidecar.errors import TierError
from kvpool_sidecar.tiers.alloc import Extent, PagedSpace
from kvpool_sidecar.tiers.base import TierKind

__all__ = ["DramTier", "Extent", "SharedArena"]

logger = logging.getLogger(__name__)


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
            self._mmap = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            if populate and not prefault_write(self._mmap):
                self._mmap.close()
                self._mmap = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError as e:
            os.close(self.fd)
            raise TierError(f"cannot map a shared arena of {size} bytes: {e.strerror}") from e
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        """Close the descriptor and unmap; a mapping that views still hold (a copy still
        running in a thread, a reference cycle) is unmapped when the last view goes."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        for attempt in range(2):
            try:
                self.view.release()
                self._mmap.close()
                return
            except BufferError:
                if attempt == 0:
                    gc.collect()  # views kept alive only by reference cycles go now
        logger.info("shared arena still viewed at close; it is unmapped when the last view goes")


class DramTier(PagedSpace):
    """Page-granular accounts over the arena, plus views of a block's extents."""

    kind = TierKind.DRAM

    def __init__(self, capacity_bytes: int, page_bytes: int, arena: SharedArena | None = None) -> None:
        super().__init__(capacity_bytes, page_bytes)
        if arena is not None and arena.size < capacity_bytes:
            raise ValueError("the arena is smaller than the DRAM tier")
        self.arena = arena

    def views(self, extents: list[Extent]) -> list[memoryview]:
        """Writable views of a block's bytes in the arena."""
        if self.arena is None:
            raise TierError("this DRAM tier keeps accounts only; it has no arena")
        v = self.arena.view
        return [v[off : off + n] for off, n in extents]
