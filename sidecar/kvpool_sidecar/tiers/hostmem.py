"""A tier of plain process memory that only copies, never lends its bytes in place.

It behaves as device memory does for the store (no views: every read and write is a
copy, checked against the block's checksum), which makes it the GPU tier's stand-in where
there is no GPU: the store's tier-list tests run with it on the CPU, and ``tiers.gpu``
never has to be faked.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool_client.integrity import checksum
from kvpool_sidecar.errors import CorruptBlockError
from kvpool_sidecar.tiers.alloc import Extent, PagedSpace
from kvpool_sidecar.tiers.base import BlockRecord, TierKind, WriteResult, scatter, write_each


class HostMemoryTier(PagedSpace):
    """Pages of one ``bytearray``; ``kind`` says which tier it stands in for."""

    blocking = False
    release_blocks = False
    accounts_only = False

    def __init__(self, capacity_bytes: int, page_bytes: int, kind: TierKind = TierKind.GPU) -> None:
        super().__init__(capacity_bytes, page_bytes)
        self.kind = kind
        self._mem = memoryview(bytearray(self.capacity_bytes))

    def reserve(self, record: BlockRecord) -> list[Extent] | None:
        return self.allocate(record.size)

    def release(self, place: list[Extent]) -> None:
        self.free(place)

    def write_copy(self, place: list[Extent], record: BlockRecord, src: Sequence[memoryview]) -> None:
        if checksum(src) != record.checksum:
            raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch on its way in")
        data = src[0].cast("B") if len(src) == 1 else memoryview(b"".join(src))
        pos = 0
        for off, n in place:
            self._mem[off : off + n] = data[pos : pos + n]
            pos += n

    def write_copies(self, items: Sequence[tuple[list[Extent], BlockRecord, Sequence[memoryview]]]
                     ) -> list[WriteResult]:
        return write_each(self, items)

    def read_copy(self, place: list[Extent], record: BlockRecord, dest: Sequence[memoryview]) -> None:
        data = b"".join(self._mem[off : off + n] for off, n in place)
        if len(data) != record.size or checksum(memoryview(data)) != record.checksum:
            raise CorruptBlockError(f"block {record.key.hex()}: checksum mismatch on its way out")
        scatter(memoryview(data), dest)

    def read_cached(self, place: list[Extent], record: BlockRecord, dest: Sequence[memoryview]) -> bool:
        """Memory never waits: :meth:`read_copy`."""
        self.read_copy(place, record, dest)
        return True

    def views(self, place: list[Extent]) -> None:
        return None

    def corrupt(self, place: list[Extent]) -> None:
        """Flip the first byte of a block (for tests of what the store does with bad bytes)."""
        off = place[0][0]
        self._mem[off] ^= 0xFF

    def close(self) -> None:
        self._mem.release()
