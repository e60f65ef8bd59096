"""The DRAM tier: shared-memory arenas that local clients map, one per key space.

An arena is a sealed ``memfd`` (anonymous shared memory; its descriptor travels to
clients over the Unix socket). One page allocator cuts the tier into pages; a block
occupies one or more extents ``(byte offset, byte length)`` whose lengths add up to its
size. With several key spaces, each space has an arena of the tier's whole size, and the
pages of a block live in its own space's arena at the page's offset. The extents of the
tier are offsets in the arenas laid end to end (arena ``i`` starts at ``i * capacity``),
so an extent names its arena as well as its bytes. A page given to another space is
first punched out of the arena that last held it (``MADV_REMOVE``): a client maps only
its space's arena, so it sees its space's blocks and zeros, never another space's bytes,
and the arenas together hold no more than the tier's size of the sidecar's memory.
Without an arena (``arena=None``) the tier only keeps accounts, which is how the trace
replay drives the very same store without payloads.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import mmap
import os
from collections.abc import Mapping, Sequence

from kvpool_client.integrity import checksum, copy_with_checksum
from kvpool_client.memory import prefault_write
from kvpool_sidecar.errors import CorruptBlockError, TierError, UnknownSpaceError
from kvpool_sidecar.tiers.alloc import Extent, PagedSpace
from kvpool_sidecar.tiers.base import BlockRecord, Place, TierKind, WriteResult, write_each

__all__ = ["DramTier", "Extent", "SharedArena"]

#: Seals that keep a client holding the descriptor from resizing the arena under the
#: sidecar (a shrink would fault every later access of the sidecar: SIGBUS).
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4) | getattr(fcntl, "F_SEAL_SEAL", 0x1)

logger = logging.getLogger(__name__)


class SharedArena:
    """An anonymous shared-memory region with a descriptor that can be sent to clients."""

    def __init__(self, size: int, *, name: str = "kvpool-arena", populate: bool = True) -> None:
        self.size = size
        try:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise TierError(f"cannot create the shared arena: {e.strerror}") from e
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, getattr(fcntl, "F_ADD_SEALS", 1033), _SEALS)
            self._mmap = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
            if populate and not prefault_write(self._mmap):
                self._mmap.close()
                self._mmap = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError as e:
            os.close(self.fd)
            raise TierError(f"cannot map a shared arena of {size} bytes: {e.strerror}") from e
        self.view = memoryview(self._mmap)

    def punch(self, offset: int, length: int) -> None:
        """Give the pages of ``[offset, offset + length)`` back to the kernel (they read as zeros)."""
        try:
            self._mmap.madvise(mmap.MADV_REMOVE, offset, length)
        except OSError as e:  # pages left resident are a cost, never a leak of bytes
            logger.warning("could not release %d arena bytes at %d: %s", length, offset, e.strerror)
            self.view[offset : offset + length] = bytes(length)

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
    """Page-granular accounts over the arenas, plus views of a block's extents.

    The store's host tier (:class:`~kvpool_sidecar.tiers.base.Tier` plus the arenas that
    local clients map and peers read).
    """

    kind = TierKind.DRAM
    blocking = False
    release_blocks = False

    def __init__(self, capacity_bytes: int, page_bytes: int,
                 arena: SharedArena | Sequence[SharedArena] | None = None,
                 spaces: Mapping[str, int] | None = None) -> None:
        """``arena``: one arena, or one per key space; ``spaces``: tenant -> arena index
        (tenants not named use arena 0)."""
        super().__init__(capacity_bytes, page_bytes)
        self.arenas: list[SharedArena] = [] if arena is None else [arena] if isinstance(arena, SharedArena) \
            else list(arena)
        if any(a.size < capacity_bytes for a in self.arenas):
            raise ValueError("the arena is smaller than the DRAM tier")
        self._spaces = dict(spaces or {})
        if any(not 0 <= i < max(1, len(self.arenas)) for i in self._spaces.values()):
            raise ValueError("a tenant's arena index is out of range")
        #: Per page: 1 + the index of the arena that may still hold its bytes.
        self._owner = bytearray(b"\x01" * self._alloc.total_pages) if len(self.arenas) > 1 else None

    @property
    def accounts_only(self) -> bool:
        return not self.arenas

    @property
    def arena(self) -> SharedArena | None:
        """The first arena (the only one with a single key space); None: accounts only."""
        return self.arenas[0] if self.arenas else None

    def arena_of(self, tenant: str) -> int:
        """The index of the arena that holds ``tenant``'s blocks. With an arena per key
        space, a tenant no space names has none (UnknownSpaceError): arena 0 would put its
        bytes where the first space's clients read them."""
        index = self._spaces.get(tenant)
        if index is not None:
            return index
        if self._owner is not None:
            raise UnknownSpaceError(f"tenant {tenant!r} is in no key space of this node: its blocks get no arena here")
        return 0

    def allocate(self, size: int, tenant: str | None = None) -> list[Extent] | None:
        """Extents for ``size`` bytes in ``tenant``'s arena, or ``None`` when there is no room."""
        index = self.arena_of(tenant) if tenant is not None else 0  # (before any page is taken)
        extents = super().allocate(size, tenant)
        if extents is None or self._owner is None:
            return extents
        for off, n in extents:
            self._claim(off // self.page_bytes, -(-n // self.page_bytes), index)
        base = index * self.capacity_bytes
        return [(base + off, n) for off, n in extents]

    def _claim(self, first: int, count: int, index: int) -> None:
        """Make pages ``[first, first + count)`` ``index``'s, punching them out of other arenas."""
        owner, mark = self._owner, index + 1
        if owner is None or owner[first : first + count].count(mark) == count:
            return
        page = self.page_bytes
        run_start, run_owner = first, owner[first]
        for p in range(first + 1, first + count + 1):
            o = owner[p] if p < first + count else -1
            if o == run_owner:
                continue
            if run_owner not in (0, mark):
                self.arenas[run_owner - 1].punch(run_start * page, (p - run_start) * page)
            run_start, run_owner = p, o
        owner[first : first + count] = bytes([mark]) * count

    def free(self, extents: list[Extent]) -> None:
        cap = self.capacity_bytes
        super().free([(off % cap, n) for off, n in extents])

    def file_extents(self, extents: list[Extent]) -> tuple[SharedArena, list[Extent]]:
        """The arena holding a block's extents, and their offsets in it."""
        cap = self.capacity_bytes
        arena = self.arenas[extents[0][0] // cap] if extents and self.arenas else self.arena
        if arena is None:
            raise TierError("this DRAM tier keeps accounts only; it has no arena")
        return arena, [(off % cap, n) for off, n in extents]

    def views(self, extents: list[Extent]) -> list[memoryview]:
        """Writable views of a block's bytes in its arena."""
        if not self.arenas:
            raise TierError("this DRAM tier keeps accounts only; it has no arena")
        cap, arenas = self.capacity_bytes, self.arenas
        return [arenas[off // cap].view[off % cap : off % cap + n] for off, n in extents]

    # ------------------------------------------------------------- Tier
    def reserve(self, record: BlockRecord) -> list[Extent] | None:
        return self.allocate(record.size, record.tenant)

    def release(self, place: list[Extent]) -> None:
        self.free(place)

    def write_copy(self, place: list[Extent], record: BlockRecord, src: Sequence[memoryview]) -> None:
        if not self.arenas:
            return
        dest = self.views(place)
        data = src[0] if len(src) == 1 else memoryview(b"".join(src))
        if data.nbytes != record.size or copy_with_checksum(dest, data) != record.checksum:
            raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch on its way into DRAM")

    def write_copies(self, items: Sequence[tuple[Place, BlockRecord, Sequence[memoryview]]]
                     ) -> list[WriteResult]:
        return write_each(self, items)

    def read_copy(self, place: list[Extent], record: BlockRecord, dest: Sequence[memoryview]) -> None:
        if not self.arenas:
            return
        pos, views = 0, self.views(place)
        flat = [d.cast("B") if d.format != "B" else d for d in dest]
        out = flat[0] if len(flat) == 1 else memoryview(bytearray(record.size))
        for v in views:
            out[pos : pos + v.nbytes] = v
            pos += v.nbytes
        if len(flat) > 1:
            pos = 0
            for d in flat:
                d[:] = out[pos : pos + d.nbytes]
                pos += d.nbytes
        if pos != record.size or checksum(out) != record.checksum:
            raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch on its way out of DRAM")

    def read_cached(self, place: list[Extent], record: BlockRecord, dest: Sequence[memoryview]) -> bool:
        """Memory never waits: :meth:`read_copy`."""
        self.read_copy(place, record, dest)
        return True

    def close(self) -> None:
        for a in self.arenas:
            a.close()
