"""A tier that keeps accounts only: the trace replay's stand-in for any real tier.

It answers room, sizes and placement exactly as a tier of ``capacity_bytes`` whose blocks
take their payload size rounded up to whole pages of ``page_bytes``, and holds no bytes: copies in and out of it do nothing, so the
replay drives the very same store logic at the speed of its bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool_sidecar.tiers.base import BlockRecord, TierKind, WriteResult


class LedgerTier:
    """Accounts of a tier of ``kind`` (see the module docstring); a place is the key."""

    blocking = False
    release_blocks = False
    accounts_only = True

    def __init__(self, kind: TierKind, capacity_bytes: int, page_bytes: int = 1) -> None:
        if page_bytes <= 0 or capacity_bytes < page_bytes:
            raise ValueError("a tier needs at least one page")
        self.kind = kind
        self.page_bytes = page_bytes
        self._capacity = capacity_bytes // page_bytes * page_bytes
        self._held: dict[bytes, int] = {}
        self._used = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    def __len__(self) -> int:
        return len(self._held)

    def footprint(self, size: int, tenant: str | None = None) -> int:
        return -(-size // self.page_bytes) * self.page_bytes

    def reserve(self, record: BlockRecord) -> bytes | None:
        need = self.footprint(record.size)
        if record.key in self._held or need > self.free_bytes:
            return None
        self._held[record.key] = need
        self._used += need
        return record.key

    def release(self, place: bytes) -> None:
        self._used -= self._held.pop(place, 0)

    def write_copy(self, place: bytes, record: BlockRecord, src: Sequence[memoryview]) -> None:
        """No bytes to write."""

    def write_copies(self, items: Sequence[tuple[bytes, BlockRecord, Sequence[memoryview]]]
                     ) -> list[WriteResult]:
        return [None] * len(items)

    def read_copy(self, place: bytes, record: BlockRecord, dest: Sequence[memoryview]) -> None:
        """No bytes to read."""

    def read_cached(self, place: bytes, record: BlockRecord, dest: Sequence[memoryview]) -> bool:
        """No bytes to read."""
        return True

    def views(self, place: bytes) -> None:
        return None

    def prefetch(self, places: Sequence[bytes]) -> int:
        return 0

    def recover(self) -> list[tuple[BlockRecord, bytes]]:
        return []

    def close(self) -> None:
        """Nothing to close."""
