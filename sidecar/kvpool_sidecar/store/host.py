"""The host tier as local clients and peers reach it: shared arenas and leases' bytes.

A local client maps its key space's arena (its descriptor travels over the Unix socket)
and reads and writes a leased block in place at offsets in it; a peer's transport sends a
leased block from its arena. This view is all they get of the tier.
"""

from __future__ import annotations

from typing import Any

from kvpool_sidecar.errors import TierError
from kvpool_sidecar.tiers.base import HostTier, Place, Tier


class HostView:
    """What the API and the peer path may know of the host tier (see the module docstring)."""

    def __init__(self, tier: Tier) -> None:
        self._tier: HostTier | None = tier if isinstance(tier, HostTier) and tier.arenas else None

    @property
    def keeps_payloads(self) -> bool:
        """False when the tier keeps accounts only (no bytes: nothing to map or read)."""
        return self._tier is not None

    @property
    def arena_count(self) -> int:
        return len(self._tier.arenas) if self._tier is not None else 0

    def arena_index(self, tenant: str) -> int:
        """The arena of ``tenant``'s key space (-1: no arena)."""
        return self._tier.arena_of(tenant) if self._tier is not None else -1

    def arena(self, index: int) -> Any:
        """Arena ``index`` (``SharedArena``: ``fd``, ``size``)."""
        if self._tier is None:
            raise TierError("the host tier keeps accounts only; it has no arena")
        return self._tier.arenas[index]

    def arena_views(self) -> list[memoryview]:
        """Every arena whole (a transport registers them with its engine)."""
        return [a.view for a in self._tier.arenas] if self._tier is not None else []

    def views(self, place: Place) -> list[memoryview]:
        """Writable views of a leased block's bytes, in order."""
        if self._tier is None:
            raise TierError("the host tier keeps accounts only; it has no arena")
        views = self._tier.views(place)
        if views is None:
            raise TierError("the host tier lends no views")
        return views

    def offsets(self, place: Place, index: int) -> list[tuple[int, int]] | None:
        """A leased block's extents as offsets in arena ``index`` (None: it lies in another)."""
        if self._tier is None:
            return None
        arena, offsets = self._tier.file_extents(place)
        return offsets if arena is self._tier.arenas[index] else None

    def file_extents(self, place: Place) -> tuple[int, list[tuple[int, int]]]:
        """The descriptor of the arena holding a leased block, and its offsets there."""
        if self._tier is None:
            raise TierError("the host tier keeps accounts only; it has no arena")
        arena, offsets = self._tier.file_extents(place)
        return arena.fd, offsets

    @property
    def fragments(self) -> int:
        return self._tier.fragments if self._tier is not None else 0
