"""What a disk tier's layout supplies: blocks written, read and deleted by their key.

A layout (:mod:`~kvpool_sidecar.tiers.segments`, the default; :mod:`~kvpool_sidecar.tiers.disk`,
a file per block) keeps blocks on local disk under their keys. :class:`DiskLayout` is what it
supplies to :class:`~kvpool_sidecar.tiers.keyed.KeyedDiskTier`, which maps the store's
:class:`~kvpool_sidecar.tiers.base.Tier` calls onto it (a block's place is its key) and times
them: the blocks held and their sizes, ``open``, ``write``, ``read_into``, ``delete``, a
delete split in two (``_detach``), and two hooks around a batch of writes: ``_batch_begin``
(writes until the end may skip their own sync) and ``_batch_end`` (what makes the batch
durable, or None).

The contract suites of the layouts are ``tests/unit/test_disk_tier.py`` (files),
``tests/unit/test_segment_tier.py`` (segments) and the disk kinds of
``tests/contract/test_tier_contract.py`` (both).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from kvpool_sidecar.tiers.base import BlockRecord


class DiskLayout(abc.ABC):
    """Blocks on disk by key; see the module docstring."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Blocks held."""

    @abc.abstractmethod
    def estimate_bytes(self, size: int, tenant: str | None = None) -> int:
        """The most a block of ``size`` payload bytes takes on disk (any tenant if None)."""

    @abc.abstractmethod
    def record(self, key: bytes) -> BlockRecord | None:
        """The record of the block held under ``key``, if any."""

    @abc.abstractmethod
    def open(self) -> list[BlockRecord]:
        """Make the directory ready, drop what is invalid; the blocks held (a warm restart)."""

    @abc.abstractmethod
    def write(self, record: BlockRecord, views: Sequence[memoryview]) -> int:
        """Store the block; the bytes it takes (no-op if already held)."""

    @abc.abstractmethod
    def read_into(self, key: bytes, dest: memoryview) -> BlockRecord:
        """Read the block into ``dest`` and verify it; its record."""

    @abc.abstractmethod
    def delete(self, key: bytes) -> int:
        """Delete the block; the bytes it took (0 if not held)."""

    @abc.abstractmethod
    def _detach(self, key: bytes) -> Callable[[], None] | None:
        """:meth:`~kvpool_sidecar.tiers.keyed.KeyedDiskTier.detach`, untimed."""

    @abc.abstractmethod
    def _batch_begin(self, items: int) -> None:
        """A batch of ``items`` writes starts in this thread."""

    @abc.abstractmethod
    def _batch_end(self) -> Callable[[], None] | None:
        """The batch's writes are done: what makes them durable (raising OSError), or None."""

    def read_nowait(self, key: bytes, dest: Sequence[memoryview]) -> bool:
        """Read the block into ``dest`` (laid end to end) and verify it as :meth:`read_into`
        does, but only from memory: False, with nothing of use in ``dest``, when that would
        wait for the device. This layout always waits (the reads go to a thread)."""
        return False
