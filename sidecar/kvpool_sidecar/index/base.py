"""The block index interface: which node holds which block in which tier.

Three operations, as in llm-d's kv-cache index: apply a batch of publish/unpublish events
of one node, look up the holders of a chain of keys (longest prefix held anywhere), and
drop a node. The same contract suite runs against every implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool_sidecar.events import IndexEvent


class BlockIndex(Protocol):
    async def apply(self, node: str, events: Sequence[IndexEvent]) -> None:
        """Publish (after a write completed) and unpublish (after eviction) in one batch."""

    async def lookup(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Holders (``node@tier``) of each key of the longest prefix held anywhere."""

    async def drop_node(self, node: str) -> None:
        """Forget everything ``node`` published (it drained or died)."""

    async def close(self) -> None:
        """Release connections."""
