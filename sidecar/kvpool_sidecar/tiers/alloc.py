"""A page allocator that never collapses under fragmentation.

The DRAM arena is cut into fixed pages. A block takes ``ceil(size / page)`` pages,
contiguous when a free run is large enough (best fit), otherwise gathered from the largest
free runs, at most :data:`MAX_RUNS` of them. A block may therefore live in several
extents; internal waste is under one page per block. Freed runs coalesce with their
neighbours.

An allocation succeeds whenever enough pages are free in at most :data:`MAX_RUNS` runs.
Past that it fails as a full tier does, and the store evicts (each block evicted merges
the holes on either side of it, so evicting makes the runs longer as well as more room)
until the block fits in that many runs; evicting every block that may go leaves one run.
Gathering, claiming, mapping and freeing a block each cost a step per extent on the event
loop: a block gathered from one-page holes of a 4 GiB tier of 64 KiB pages took 4,096
extents, and each ALLOC and ABORT of eight of them held the loop for 150 to 230 ms.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sortedcontainers import SortedList

from kvpool_sidecar.tiers.base import BlockRecord

#: ``(first page, page count)``.
Run = tuple[int, int]

#: The most runs (extents) one block is gathered from (see the module docstring): about
#: 2 ms of the event loop to gather, as much to free.
MAX_RUNS = 1024


class PageAllocator:
    """Free-run bookkeeping over ``total_pages`` pages; O(log n) per run touched, and a byte
    per page that says whether it is free (what finds a double free)."""

    def __init__(self, total_pages: int) -> None:
        if total_pages <= 0:
            raise ValueError("allocator needs at least one page")
        self.total_pages = total_pages
        self.free_pages = total_pages
        self._by_start: dict[int, int] = {0: total_pages}
        self._by_end: dict[int, int] = {total_pages: 0}
        self._by_size: SortedList = SortedList([(total_pages, 0)])
        #: 1 for each free page (finds overlaps on free). It replaced a sorted list of the
        #: free runs' starts, whose positional look-ups made each extent of a block freed
        #: among one-page holes cost 2.3 us, not 0.9; a byte a page is less than the store
        #: keeps for any block.
        self._free_map = bytearray(b"\x01") * total_pages

    @property
    def free_runs(self) -> int:
        return len(self._by_start)

    def _take(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        self._by_size.remove((length, start))

    def _put(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._by_size.add((length, start))

    def allocate(self, pages: int, max_runs: int | None = None) -> list[Run] | None:
        """Pages for one block in at most ``max_runs`` runs (:data:`MAX_RUNS` unless told),
        or ``None`` when fewer than ``pages`` are free in the ``max_runs`` largest free runs."""
        if pages <= 0:
            raise ValueError("allocate at least one page")
        max_runs = MAX_RUNS if max_runs is None else max_runs
        if max_runs <= 0:
            raise ValueError("a block needs at least one run")
        if pages > self.free_pages:
            return None
        i = self._by_size.bisect_left((pages, -1))
        if i < len(self._by_size):
            length, start = self._by_size[i]
            self._take(start, length)
            if length > pages:
                self._put(start + pages, length - pages)
            self.free_pages -= pages
            self._free_map[start : start + pages] = bytes(pages)
            return [(start, pages)]
        if len(self._by_size) > max_runs and not self._gathers(pages, max_runs):
            return None
        runs: list[Run] = []
        need = pages
        while need:
            length, start = self._by_size[-1]
            self._take(start, length)
            use = min(length, need)
            runs.append((start, use))
            self._free_map[start : start + use] = bytes(use)
            if length > use:
                self._put(start + use, length - use)
            need -= use
        self.free_pages -= pages
        runs.sort()
        return runs

    def _gathers(self, pages: int, max_runs: int) -> bool:
        """Whether the ``max_runs`` largest free runs hold ``pages`` pages (read only: a
        refusal takes and puts back nothing). It stops at the first run too short for the
        runs left to make up the rest, no longer than it: a put that evicts until its block
        fits asks after each eviction, and reading all ``max_runs`` runs each time had been
        half of its work."""
        got, left = 0, max_runs
        for length, _ in reversed(self._by_size):
            got += length
            left -= 1
            if got >= pages:
                return True
            if not left or got + left * length < pages:
                return False
        return False

    def free(self, runs: list[Run]) -> None:
        """Return runs obtained from :meth:`allocate`."""
        for start, length in runs:
            if length <= 0 or start < 0 or start + length > self.total_pages:
                raise ValueError(f"run {(start, length)} is outside the arena")
            end = start + length
            if self._free_map.find(1, start, end) >= 0:
                raise ValueError(f"run {(start, length)} overlaps free space (double free)")
            self._free_map[start:end] = b"\x01" * length
            self.free_pages += length
            prev_start = self._by_end.get(start)
            if prev_start is not None:
                prev_len = self._by_start[prev_start]
                self._take(prev_start, prev_len)
                start, length = prev_start, prev_len + length
            next_len = self._by_start.get(end)
            if next_len is not None:
                self._take(end, next_len)
                length += next_len
            self._put(start, length)


#: ``(byte offset, byte length)`` of one piece of a block.
Extent = tuple[int, int]


def extents_of(place: object) -> int:
    """The extents of a block's room in a tier: a paged tier's list of them, or one where the
    tier keeps a block whole (a disk tier's key)."""
    return len(place) if isinstance(place, list) else 1


class PagedSpace:
    """Byte-addressed extents over a :class:`PageAllocator`: what the DRAM and GPU tiers share."""

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise ValueError("a tier needs at least one page")
        self.page_bytes = page_bytes
        self._alloc = PageAllocator(capacity_bytes // page_bytes)
        #: Per tenant (None: not told), extents of its blocks that lie in more than one;
        #: the tenant and extents of each such block by its first page (see :meth:`scattered`).
        self._scattered: Counter[str | None] = Counter()
        self._scattered_blocks: dict[int, tuple[str | None, int]] = {}

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

    def scattered(self, tenant: str | None = None) -> int:
        """Extents of ``tenant``'s blocks here that lie in more than one (and of blocks
        allocated with no tenant named): while it is small, removing a few of its blocks
        gives back a few extents (the local API weighs a request's blocks only past it)."""
        return self._scattered[tenant] + (self._scattered[None] if tenant is not None else 0)

    def footprint(self, size: int, tenant: str | None = None) -> int:
        """Bytes a block of ``size`` bytes takes (whole pages, whoever owns it)."""
        return -(-size // self.page_bytes) * self.page_bytes

    def prefetch(self, places: Sequence[object]) -> int:
        """Memory needs no read-ahead."""
        return 0

    def recover(self) -> list[tuple[BlockRecord, object]]:
        """Memory does not outlive the sidecar: nothing to adopt."""
        return []

    def allocate(self, size: int, tenant: str | None = None) -> list[Extent] | None:
        """Extents covering exactly ``size`` bytes, or ``None`` when there is no room (in
        at most :data:`MAX_RUNS` extents); ``tenant``: whose block (:meth:`scattered`)."""
        if size <= 0:
            raise ValueError("block size must be positive")
        runs = self._alloc.allocate(-(-size // self.page_bytes))
        if runs is None:
            return None
        extents: list[Extent] = []
        left = size
        for start, count in runs:
            n = min(left, count * self.page_bytes)
            extents.append((start * self.page_bytes, n))
            left -= n
        if len(extents) > 1:
            self._scattered[tenant] += len(extents)
            self._scattered_blocks[runs[0][0]] = (tenant, len(extents))
        return extents

    def free(self, extents: list[Extent]) -> None:
        """Give back a block's extents (all of them, as :meth:`allocate` gave them)."""
        self._alloc.free([(off // self.page_bytes, -(-n // self.page_bytes)) for off, n in extents])
        held = self._scattered_blocks.pop(extents[0][0] // self.page_bytes, None) if len(extents) > 1 else None
        if held is not None:
            self._scattered[held[0]] -= held[1]
            if not self._scattered[held[0]]:
                del self._scattered[held[0]]
