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
holder queue for it without taking the turns the tenant's reads of other holders need; and
the wait is not counted in the holder's time (a holder is backed off when a fetch costs it
half the deadline: :class:`~kvpool_sidecar.peers.PeerReader`), where a fetch queued on a
connection busy with another had been. A transfer that ends hands its turns to the waiters
its end lets go, those of the tenant running fewest transfers first, and first come among
equals (not a wake-up of all of them: thousands of one tenant's waiters had cost the loop
22 ms each time any transfer ended; nor first come alone: one tenant's queue for a holder
had taken every turn of the holder ahead of another tenant's read), and at most
:data:`WAITING_PER_TENANT` of one tenant wait (more are a miss at once).

A tenant whose fetched blocks all found no room here (its quota smaller than a block, its
quota full of blocks in use, the node full of them, a writer no key space here names) had
them sent again on every read, and ``LOOKUP`` kept counting them as held by peers so engines
kept asking: such a tenant fetches nothing, and its lookups count no peer's blocks, for
:data:`NO_ROOM_PAUSE_S` (2 s, doubled while it goes on, up to 60 s, and back to 2 s once a
pause has been over for as long as it lasted), then tries again. Only the reader's own
blocks count, and blocks of a writer no key space here names: another tenant's, in a key
space they share, refused for that tenant's quota (or behind one so refused, which the
store answers as it answers a full node), say nothing of the reader's room (a tenant
keeping its quota full had turned off the peer reads of every tenant reading its
prefixes). So a reader of another tenant's prefixes on a full node is not paused: each of
its reads takes an answer up to its first block without room, and no further.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, deque
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
#: Transfers of one tenant that wait for a turn at once (past it a read's fetch is a miss).
WAITING_PER_TENANT = 4 * TRANSFERS_PER_TENANT
#: Why a fetched block of the reader's own was not kept that says its blocks find no room
#: here (not EXISTS or PENDING: the block came meanwhile by another way). Another tenant's
#: blocks count for nothing: refused for that tenant's quota, or behind one so refused, they
#: say nothing of the reader's room.
NO_ROOM = frozenset({PutStatus.QUOTA, PutStatus.FULL, PutStatus.TOO_LARGE, PutStatus.REJECTED})


class Placing(Protocol):
    """The store's side of a fetch (:class:`~kvpool_sidecar.peers.StoreSink`)."""

    async def place(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                    parent: bytes | None = None) -> tuple[PutStatus, tuple[object, list[memoryview]] | None]: ...

    def commit(self, lease: object, checksum: int) -> None: ...

    def abort(self, lease: object) -> None: ...

    def arena_views(self) -> list[memoryview]: ...


class Landing:
    """The sink of one fetch (a :class:`~kvpool_sidecar.transfer.base.BlockSink`) of
    ``reader``'s: the store's, counting the blocks the holders offered and those that found
    no room for the reader (see the module docstring)."""

    def __init__(self, sink: Placing, reader: str) -> None:
        self._sink = sink
        self._reader = reader
        self.offered = 0
        self.no_room = 0

    async def reserve(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                      parent: bytes | None = None) -> tuple[object, list[memoryview]] | None:
        status, room = await self._sink.place(key, size, tenant, depth=depth, parent=parent)
        if tenant != self._reader and status is not PutStatus.REJECTED:
            return room  # (another tenant's block: its room says nothing of the reader's)
        self.offered += 1
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


class _Waiter:
    """A transfer waiting for its turns: woken with them taken for it."""

    __slots__ = ("seq", "tenant", "holder", "woken")

    def __init__(self, seq: int, tenant: str, holder: str, woken: asyncio.Future[None]) -> None:
        self.seq = seq
        self.tenant = tenant
        self.holder = holder
        self.woken = woken


class FetchGate:
    """Per tenant: its turns to move blocks, and whether its fetches are paused for want of
    room; per holder: the turns to move blocks from it (see the module docstring)."""

    def __init__(self, transfers: int = TRANSFERS_PER_TENANT, per_holder: int = TRANSFERS_PER_HOLDER,
                 waiting: int = WAITING_PER_TENANT) -> None:
        self.transfers = transfers
        self.per_holder = per_holder
        self.most_waiting = waiting
        #: Transfers running, by tenant and by holder (none kept at zero).
        self._tenants: Counter[str] = Counter()
        self._holders: Counter[str] = Counter()
        #: Transfers waiting for their turns, by tenant and holder, first come first (none
        #: kept empty); the holders each tenant's wait for, the tenants waiting for each
        #: holder; and how many of each tenant's wait.
        self._waiting: dict[tuple[str, str], deque[_Waiter]] = {}
        self._holders_of: dict[str, dict[str, None]] = {}
        self._tenants_of: dict[str, dict[str, None]] = {}
        self._queued: Counter[str] = Counter()
        self._arrivals = itertools.count()
        #: Tenants whose blocks found no room: paused until, and that pause's length.
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
            now = time.monotonic()
            until, last = self._paused.get(tenant, (0.0, 0.0))
            # doubled while it goes on; back to the first once a pause is long over
            pause = last * 2 if now < until + last else 0.0
            pause = min(NO_ROOM_PAUSE_S[1], max(NO_ROOM_PAUSE_S[0], pause))
            self._paused[tenant] = (now + pause, pause)
            logger.info("none of the %d blocks peers offered tenant %s found room here; its reads fetch "
                        "nothing for %.0f s", landing.offered, tenant, pause)

    def _may_go(self, tenant: str, holder: str) -> bool:
        return self._tenants[tenant] < self.transfers and self._holders[holder] < self.per_holder

    def _start(self, tenant: str, holder: str) -> None:
        self._tenants[tenant] += 1
        self._holders[holder] += 1

    def _end(self, tenant: str, holder: str) -> None:
        """A transfer's turns come back, and go to the first waiters they let go."""
        for running, name in ((self._tenants, tenant), (self._holders, holder)):
            running[name] -= 1
            if running[name] <= 0:
                del running[name]
        while True:
            # of the waiters now let go, the one whose tenant runs fewest transfers, first come
            # among equals: a holder's turns had gone first come, first served, so a tenant with
            # its many waiters queued for a holder (it may run as many transfers as the holder
            # has turns, and queue four times more) took each of them, and another tenant's
            # read of that holder waited for every one queued before it (33 transfers' time).
            # Only waiters of the ended transfer's tenant or holder can have been let go (a
            # waiter waits only while a bound holds it, and an end frees only those two), and of
            # one tenant and holder the first come goes first: their queues' heads are looked
            # at, not every waiter (a scan of every waiter had cost 15 ms an end with 32,000)
            best: _Waiter | None = None
            pairs = itertools.chain(((tenant, h) for h in self._holders_of.get(tenant, ())),
                                    ((t, holder) for t in self._tenants_of.get(holder, ())))
            for t, h in pairs:
                if self._may_go(t, h):
                    head = self._waiting[(t, h)][0]
                    if best is None or (self._tenants[t], head.seq) < (self._tenants[best.tenant], best.seq):
                        best = head
            if best is None:
                return
            self._leave(best)
            self._start(best.tenant, best.holder)  # (taken for it: nobody else takes them before it runs)
            best.woken.set_result(None)

    def _queue(self, tenant: str, holder: str) -> _Waiter:
        waiter = _Waiter(next(self._arrivals), tenant, holder, asyncio.get_running_loop().create_future())
        queue = self._waiting.get((tenant, holder))
        if queue is None:
            queue = self._waiting[(tenant, holder)] = deque()
            self._holders_of.setdefault(tenant, {})[holder] = None
            self._tenants_of.setdefault(holder, {})[tenant] = None
        queue.append(waiter)
        self._queued[tenant] += 1
        return waiter

    def _leave(self, waiter: _Waiter) -> None:
        """``waiter`` no longer waits (served, or gone): out of its queue (of one tenant and
        holder: at most :data:`WAITING_PER_TENANT` long)."""
        tenant, holder = waiter.tenant, waiter.holder
        queue = self._waiting[(tenant, holder)]
        queue.remove(waiter)
        if not queue:
            del self._waiting[(tenant, holder)]
            for index, key, other in ((self._holders_of, tenant, holder), (self._tenants_of, holder, tenant)):
                del index[key][other]
                if not index[key]:
                    del index[key]
        self._unqueue(tenant)

    def _unqueue(self, tenant: str) -> None:
        self._queued[tenant] -= 1
        if self._queued[tenant] <= 0:
            del self._queued[tenant]

    @contextlib.asynccontextmanager
    async def transfer(self, tenant: str, holder: str, deadline: float) -> AsyncIterator[bool]:
        """A transfer of ``tenant``'s from ``holder`` (an address), once fewer than the bounds
        of each run, if that comes before ``deadline`` (loop time) and fewer than
        :data:`WAITING_PER_TENANT` of the tenant wait: yields whether it came (counted until
        the block ends)."""
        if self._may_go(tenant, holder):  # (no waiter of the same bounds could go: see _end)
            self._start(tenant, holder)
        elif self._queued[tenant] >= self.most_waiting:
            yield False
            return
        else:
            waiter = self._queue(tenant, holder)
            woken = waiter.woken
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(woken)
            except TimeoutError:
                pass
            except BaseException:  # the reader went away (cancelled)
                if woken.done() and not woken.cancelled():
                    self._end(tenant, holder)  # served just as it went: the turns go on
                raise
            finally:
                if not woken.done():  # (the deadline, or the reader went away): not served
                    woken.cancel()
                    self._leave(waiter)
            if woken.cancelled():
                yield False
                return
        try:
            yield True
        finally:
            self._end(tenant, holder)
