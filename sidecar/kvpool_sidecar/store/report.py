"""What the store holds, as the index, KV events, metrics and status ask for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Sequence

from kvpool_sidecar.events import EngineEvent
from kvpool_sidecar.metrics import StoreMetrics
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.host import HostView
from kvpool_sidecar.store.leases import Session
from kvpool_sidecar.store.mover import Mover
from kvpool_sidecar.tiers.alloc import PagedSpace, extents_of
from kvpool_sidecar.tiers.base import Tier


#: Blocks read per turn of the event loop by the reports that read the whole store.
SLICE = 2048


class StoreReport:
    """Read-only reports over the store's blocks and tiers."""

    def __init__(self, tiers: Sequence[Tier], mover: Mover, entries: dict[bytes, Entry],
                 sessions: dict[int, Session], pending: Collection[bytes], metrics: StoreMetrics, host: HostView) -> None:
        self._tiers = list(tiers)
        self._mover = mover
        self._entries = entries
        self._sessions = sessions
        self._pending = pending
        self._metrics = metrics
        self._host = host

    @property
    def tier_names(self) -> list[str]:
        return list(self._mover.names)

    async def inventory_soon(self, every: int = SLICE) -> dict[bytes, list[str]]:
        """Every block held and its tiers (what the index should say about this node), ``every``
        blocks per turn of the event loop (see :meth:`_held_soon`)."""
        names = self._mover.names
        return {k: [names[i] for i in e.held()] async for k, e in self._held_soon(every)}

    async def engine_inventory_soon(self, every: int = SLICE) -> list[EngineEvent]:
        """A stored event for every tier of every block with an engine identity (the whole
        state, for a KV-event consumer that has to start over), ``every`` blocks per turn of
        the event loop."""
        names = self._mover.names
        return [EngineEvent(True, names[i], e.tenant, e.engine)
                async for _, e in self._held_soon(every) if e.engine is not None for i in e.held()]

    async def _held_soon(self, every: int) -> AsyncIterator[tuple[bytes, Entry]]:
        """The blocks held when it is called (a copy of the list), each as it is when reached
        (one removed meanwhile is left out; its tiers may be newer than the call), with a
        turn of the event loop after every ``every``: a whole store read in one go had held
        every other request (0.9 s at 300,000 blocks, with the commands made of it)."""
        for n, (k, e) in enumerate(list(self._entries.items()), 1):
            if e.best >= 0 and self._entries.get(k) is e:
                yield k, e
            if n % every == 0:
                await asyncio.sleep(0)

    def scattered(self, tenant: str) -> int:
        """Extents of ``tenant``'s blocks that lie in more than one, in the tiers cut into
        pages (:meth:`~kvpool_sidecar.tiers.alloc.PagedSpace.scattered`)."""
        return sum(t.scattered(tenant) for t in self._tiers if isinstance(t, PagedSpace))

    def extents(self, key: bytes) -> int:
        """The pieces of room (extents; one for a tier that keeps a block whole) of the
        block stored under ``key`` in every tier: what removing it gives back one at a time."""
        e = self._entries.get(key)
        if e is None:
            return 0
        return sum(extents_of(p) for p in e.copies or () if p is not None)

    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        """``{tier: (capacity bytes, used bytes, resident blocks)}``."""
        return {name: (t.capacity_bytes, t.used_bytes, n)
                for name, t, n in zip(self._mover.names, self._tiers, self._mover.ledger.blocks)}

    def io_seconds(self) -> dict[str, dict[str, float]]:
        """``{tier: {kind: seconds}}``: what each disk tier spent writing, syncing and reading
        (:class:`~kvpool_sidecar.tiers.ioseconds.IoSeconds`)."""
        out: dict[str, dict[str, float]] = {}
        for name, tier in zip(self._mover.names, self._tiers):
            io = getattr(tier, "io_seconds", None)  # (a disk tier's)
            if io is not None:
                out[name] = io.snapshot()
        return out

    def stats(self) -> dict[str, object]:
        tiers: dict[str, dict[str, object]] = {
            name: {"capacity_bytes": cap, "used_bytes": used, "blocks": n}
            for name, (cap, used, n) in self.tier_usage().items()
        }
        if "dram" in tiers:
            tiers["dram"]["free_runs"] = self._host.fragments
        for name, seconds in self.io_seconds().items():
            tiers[name]["io_seconds"] = seconds
        return {
            "blocks": len(self._entries),
            "tiers": tiers,
            "sessions": len(self._sessions),
            "pending_writes": len(self._pending),
            # expired write leases whose room stays held until their writers are done with it
            "lapsed_writes": sum(len(s.lapsed) for s in self._sessions.values()),
            "policy": self._mover.policy.name,
            "counters": self._metrics.snapshot(),
        }
