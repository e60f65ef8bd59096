"""What one tenant's reads may make this node fetch from peers: transfers at once, and none
while its blocks find no room here.

A read that misses asks the index (within the tenant's index turns, ``api.index_concurrency``:
:mod:`kvpool_sidecar.api.budget`), then moves blocks from the holders. The transfers have
bounds of their own: :data:`TRANSFERS_PER_TENANT` of one tenant at once, and as many to one
holder at once as the transport keeps connections to it (``peer.connections_per_peer``).
They had held an index turn for as long as they ran, so a holder that was slow but complete
(never backed off) took every turn of the tenant, and its lookups, which need a turn within
``peer.lookup_timeout_s``, stopped finding any block held by a peer. One tenant still cannot
take every receive thread of the transport (it moves blocks in at most a quarter of them).
A transfer waits until both bounds let it go, holding neither meanwhile: the reads of a slow
holder queue for it without taking the turns the tenant's reads of other holders need, nor
the holder's from other tenants; and the wait is not counted in the holder's time (a holder
is backed off when a fetch costs it half the deadline: :class:`~kvpool_sidecar.peers.PeerReader`),
where a fetch queued on a connection busy with another had been.

A tenant whose fetched blocks all found no room here (its quota smaller than a block, its
quota full of blocks in use, the node full of them, a writer no key space here names) had
them sent again on every read, and ``LOOKUP`` kept counting them as held by peers so engines
kept asking: such a tenant fetches nothing, and its lookups count no peer's blocks, for
:data:`NO_ROOM_PAUSE_S` (2 s, doubled while it goes on, up to 60 s), then tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Protocol

from kvpool_client.protocol import PutStatus

logger = logging.getLogger(__name__)

#: Transfers from peers one tenant runs at once on this node: a quarter of the TCP
#: transport's receive threads (``transfer.tcp.BULK_WORKERS``).
TRANSFERS_PER_TENANT = 8
#: Transfers from one holder at once, where the transport does not say how many connections
#: it keeps to a peer.
TRANSFERS_PER_HOLDER = 4
#: A tenant whose fetched blocks found no room fetches nothing for this long, doubled at
#: each such fetch in a row.
NO_ROOM_PAUSE_S = (2.0, 60.0)
#: Why a fetched block was not kept that says this tenant's blocks find no room here (not
#: EXISTS or PENDING: the block came meanwhile by another way).
NO_ROOM = frozenset({PutStatus.QUOTA, PutStatus.FULL, PutStatus.TOO_LARGE, PutStatus.REJECTED})


class Placing(Protocol):
    """The store's side of a fetch (:class:`~kvpool_sidecar.peers.StoreSink`)."""

    async def place(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                    parent: bytes | None = None) -> tuple[PutStatus, tuple[object, list[memoryview]] | None]: ...

    def commit(self, lease: object, checksum: int) -> None: ...

    def abort(self, lease: object) -> None: ...

    def arena_views(self) -> list[memoryview]: ...


class Landing:
    """The sink of one fetch (a :class:`~kvpool_sidecar.transfer.base.BlockSink`): the
    store's, counting the blocks the holders offered and those that found no room."""

    def __init__(self, sink: Placing) -> None:
        self._sink = sink
        self.offered = 0
        self.no_room = 0

    async def reserve(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                      parent: bytes | None = None) -> tuple[object, list[memoryview]] | None:
        self.offered += 1
        status, room = await self._sink.place(key, size, tenant, depth=depth, parent=parent)
        if room is None and status in NO_ROOM:
            self.no_room += 1
        return room

    def commit(self, lease: object, checksum: int) -> None:
        self._sink.commit(lease, checksum)

    def abort(self, lease: object) -> None:
        self._sink.abort(lease)

    def arena_views(self) -> list[memoryview]:
        return self._sink.arena_views()

    @property
    def found_no_room(self) -> bool:
        """Whether holders offered blocks and not one of them found room."""
        return self.offered > 0 and self.no_room == self.offered


class FetchGate:
    """Per tenant: its turns to move blocks, and whether its fetches are paused for want of
    room; per holder: the turns to move blocks from it (see the module docstring)."""

    def __init__(self, transfers: int = TRANSFERS_PER_TENANT, per_holder: int = TRANSFERS_PER_HOLDER) -> None:
        self.transfers = transfers
        self.per_holder = per_holder
        #: Transfers running, by tenant and by holder (none kept at zero).
        self._tenants: Counter[str] = Counter()
        self._holders: Counter[str] = Counter()
        #: Transfers waiting for the bounds to let them go: each woken when one ends.
        self._waiting: list[asyncio.Future[None]] = []
        #: Tenants whose blocks found no room: paused until, and the next pause.
        self._paused: dict[str, tuple[float, float]] = {}

    def takes(self, tenant: str) -> bool:
        """Whether ``tenant``'s reads may fetch from peers now (not paused for want of room)."""
        until = self._paused.get(tenant, (0.0, 0.0))[0]
        return until <= time.monotonic()

    def landed(self, tenant: str, landing: Landing, kept: int) -> None:
        """After a fetch of ``tenant``'s: pause it if its blocks found no room, else resume it
        once a block was kept."""
        if kept:
            self._paused.pop(tenant, None)
        elif landing.found_no_room:
            pause = self._paused.get(tenant, (0.0, NO_ROOM_PAUSE_S[0] / 2))[1] * 2
            pause = min(NO_ROOM_PAUSE_S[1], max(NO_ROOM_PAUSE_S[0], pause))
            self._paused[tenant] = (time.monotonic() + pause, pause)
            logger.info("none of the %d blocks peers offered tenant %s found room here; its reads fetch "
                        "nothing for %.0f s", landing.offered, tenant, pause)

    @contextlib.asynccontextmanager
    async def transfer(self, tenant: str, holder: str, deadline: float) -> AsyncIterator[bool]:
        """A transfer of ``tenant``'s from ``holder`` (an address), once fewer than the bounds
        of each run, if that comes before ``deadline`` (loop time): yields whether it came
        (counted until the block ends)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                while self._tenants[tenant] >= self.transfers or self._holders[holder] >= self.per_holder:
                    woken: asyncio.Future[None] = loop.create_future()
                    self._waiting.append(woken)
                    try:
                        await woken
                    finally:
                        if not woken.done():  # (the deadline, or the reader went away)
                            self._waiting.remove(woken)
        except TimeoutError:
            yield False
            return
        self._tenants[tenant] += 1
        self._holders[holder] += 1
        try:
            yield True
        finally:
            for running, name in ((self._tenants, tenant), (self._holders, holder)):
                running[name] -= 1
                if running[name] <= 0:
                    del running[name]
            waiting, self._waiting = self._waiting, []
            for w in waiting:  # each looks again (the woken that still cannot go wait again)
                if not w.done():
                    w.set_result(None)
