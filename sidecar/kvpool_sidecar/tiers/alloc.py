"""A page allocator that never collapses under fragmentation.

The DRAM arena is cut into fixed pages. A block takes ``ceil(size / page)`` pages,
contiguous when a free run is large enough (best fit), otherwise gathered from the largest
free runs. A block may therefore live in several extents, and an allocation succeeds
whenever enough pages are free, whatever the churn; internal waste is under one page per
block. Freed runs coalesce with their neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedList

from kvpool_sidecar.tiers.base import BlockRecord

#: ``(first page, page count)``.
Run = tuple[int, int]


class PageAllocator:
    """Free-run bookkeeping over ``total_pages`` pages; O(log n) per run touched."""

    def __init__(self, total_pages: int) -> None:
        if total_pages <= 0:
            raise ValueError("allocator needs at least one page")
        self.total_pages = total_pages
        self.free_pages = total_pages
        self._by_start: dict[int, int] = {0: total_pages}
        self._by_end: dict[int, int] = {total_pages: 0}
        self._by_size: SortedList = SortedList([(total_pages, 0)])
        #: Starts of the free runs in address order (finds overlaps on free).
        self._starts: SortedList = SortedList([0])

    @property
    def free_runs(self) -> int:
        return len(self._by_start)

    def _take(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        self._by_size.remove((length, start))
        self._starts.remove(start)

    def _put(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._by_size.add((length, start))
        self._starts.add(start)

    def allocate(self, pages: int) -> list[Run] | None:
        """Pages for one block, or ``None`` when fewer than ``pages`` are free."""
        if pages <= 0:
            raise ValueError("allocate at least one page")
        if pages > self.free_pages:
            return None
        i = self._by_size.bisect_left((pages, -1))
        if i < len(self._by_size):
            length, start = self._by_size[i]
            self._take(start, length)
            if length > pages:
                self._put(start + pages, length - pages)
            self.free_pages -= pages
            return [(start, pages)]
        runs: list[Run] = []
        need = pages
        while need:
            length, start = self._by_size[-1]
            self._take(start, length)
            use = min(length, need)
            runs.append((start, use))
            if length > use:
                self._put(start + use, length - use)
            need -= use
        self.free_pages -= pages
        runs.sort()
        return runs

    def free(self, runs: list[Run]) -> None:
        """Return runs obtained from :meth:`allocate`."""
        for start, length in runs:
            if length <= 0 or start < 0 or start + length > self.total_pages:
                raise ValueError(f"run {(start, length)} is outside the arena")
            end = start + length
            i = self._starts.bisect_right(start)
            below = self._starts[i - 1] if i else None
            if (below is not None and below + self._by_start[below] > start) or (
                i < len(self._starts) and self._starts[i] < end
            ):
                raise ValueError(f"run {(start, length)} overlaps free space (double free)")
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


class PagedSpace:
    """Byte-addressed extents over a :class:`PageAllocator`: what the DRAM and GPU tiers share."""

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise ValueError("a tier needs at least one page")
        self.page_bytes = page_bytes
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

    def footprint(self, size: int, tenant: str | None = None) -> int:
        """Bytes a block of ``size`` bytes takes (whole pages, whoever owns it)."""
        return -(-size // self.page_bytes) * self.page_bytes

    def prefetch(self, places: Sequence[object]) -> int:
        """Memory needs no read-ahead."""
        return 0

    def recover(self) -> list[tuple[BlockRecord, object]]:
        """Memory does not outlive the sidecar: nothing to adopt."""
        return []

    def allocate(self, size: int) -> list[Extent] | None:
        """Extents covering exactly ``size`` bytes, or ``None`` when there is no room."""
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
        return extents

    def free(self, extents: list[Extent]) -> None:
        self._alloc.free([(off // self.page_bytes, -(-n // self.page_bytes)) for off, n in extents])
