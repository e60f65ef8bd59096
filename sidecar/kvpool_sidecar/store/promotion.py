"""Promotion: blocks brought into the host tier for a read, and copied up to the tier above
it (the GPU tier) after enough reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TypeVar

from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.mover import Mover

logger = logging.getLogger(__name__)

#: The fewest blocks a batch of :meth:`Promoter.bring_many` copies in one thread call.
MIN_BATCH = 8

#: The most blocks one copy up to the tier above the host tier takes, in one thread hop. On
#: an H200 node, a copy up per block, each in a thread of its own, cost the sidecar 166 to
#: 324 µs of CPU per block read in a loop of acquires of 64 KiB blocks, against 33 with the
#: GPU tier off.
UP_BATCH = 64

#: Blocks waiting for their copy up at most. A copy up only makes later reads faster: hits
#: that come faster than the tier above takes them promote nothing more (a backlog would
#: hold blocks busy and lag behind what is hot, and it had grown without bound).
MAX_QUEUED_UP = 1024

#: Of which one tenant's blocks at most: a client that reads its own blocks twice, over and
#: over, must not keep the queue full for the node's other tenants. Batches take the
#: tenants' blocks in turn.
MAX_QUEUED_UP_PER_TENANT = MAX_QUEUED_UP // 4

T = TypeVar("T")


def split_batches(items: Sequence[T], parallel: int) -> list[Sequence[T]]:
    """``items`` in at most ``parallel`` batches (in order) of at least :data:`MIN_BATCH`."""
    size = max(MIN_BATCH, -(-len(items) // max(1, parallel)))
    return [items[start : start + size] for start in range(0, len(items), size)]


class Promoter:
    """Copies toward the hot end of the store's tier list (see :mod:`kvpool_sidecar.store.mover`)."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover
        self._bringing: dict[bytes, asyncio.Future[None]] = {}  # each key's batch under way
        self._background: set[asyncio.Future[None]] = set()
        self._promoting: set[bytes] = set()  # keys with a copy up scheduled or under way
        self._up: dict[str, dict[bytes, Entry]] = {}  # copies up scheduled, by tenant, oldest first
        self._queued = 0  # of them, in all
        self._up_task: asyncio.Future[None] | None = None  # the one task that runs them

    def moving(self, key: bytes) -> bool:
        """Whether ``key`` is being brought into the host tier right now."""
        return key in self._bringing

    async def bring(self, e: Entry, i: int) -> None:
        """Give ``e`` a copy in tier ``i`` from the nearest tier holding one; concurrent
        callers share one copy."""
        await self.bring_many([e], i, 1)

    async def bring_many(self, entries: list[Entry], i: int, parallel: int) -> None:
        """:meth:`bring` of every entry: in up to ``parallel`` batches of at least
        :data:`MIN_BATCH` blocks, each batch's bytes copied in one call to a thread (a hop
        costs the event loop about as much as reading a small block); entries another
        caller is bringing already are waited for."""
        mine: list[Entry] = []
        waits: list[asyncio.Future[None]] = []
        seen: set[bytes] = set()
        for e in entries:
            running = self._bringing.get(e.key)
            if running is not None:
                if running not in waits:
                    waits.append(running)
            elif e.place(i) is None and not e.dead and e.key not in seen:  # (a key asked twice: once)
                seen.add(e.key)
                # Busy from now on, not from when the task first runs: no eviction may take
                # the source in between.
                e.busy += 1
                mine.append(e)
        for batch in split_batches(mine, parallel):
            # A task of its own: a reader cancelled mid-copy must not abandon the room.
            task = asyncio.ensure_future(self._bring_batch(batch, i))
            for e in batch:
                self._bringing[e.key] = task
            waits.append(task)
        for running in waits:
            await asyncio.shield(running)

    async def _bring_batch(self, batch: Sequence[Entry], i: int) -> None:
        try:
            todo: list[tuple[Entry, int]] = []
            for e in batch:
                held = [j for j in e.held() if j != i]
                if not held or e.dead:
                    continue
                src = min(held, key=lambda j: (abs(j - i), j))  # the nearest, hotter on a tie
                if self.mover.tiers[i].footprint(e.size, e.tenant) > self.mover.tiers[i].capacity_bytes:
                    # adopted from a disk written under a larger tier: it can never be served
                    # here, and trying would evict the whole tier on every read
                    logger.warning("block %s (%d bytes) is larger than the %s tier; dropping it",
                                   e.key.hex(), e.size, self.mover.names[i])
                    await self.mover.ledger.drop(src, e, evicted=False)
                else:
                    todo.append((e, src))
            await self.mover.copy_many(todo, i)
        finally:
            reap = self.mover.ledger.reap
            for e in batch:
                e.busy -= 1
                del self._bringing[e.key]
                reap(e)

    def hit(self, e: Entry) -> None:
        """``e`` was read from the host tier: tell the policy, and copy it up after enough reads."""
        self.mover.policy.accessed(self.mover.names[self.mover.host], e)
        up = self.mover.host - 1
        if up < 0:
            return
        if e.place(up) is not None:
            self.mover.policy.accessed(self.mover.names[up], e, again=True)  # (the same read: its copy's place)
            return
        if e.hits < self.mover.settings.promote_hits or e.key in self._promoting or e.dead \
                or self._queued >= MAX_QUEUED_UP or len(self._up.get(e.tenant, ())) >= MAX_QUEUED_UP_PER_TENANT \
                or not self.mover.policy.admit(self.mover.names[up], e):
            return
        # Not busy until the copy starts: until then the block may still be evicted (the
        # copy then finds no source and does nothing), so a burst of hits never pins DRAM.
        self._promoting.add(e.key)
        self._up.setdefault(e.tenant, {})[e.key] = e
        self._queued += 1
        if self._up_task is None or self._up_task.done():  # done: cancelled before it ran
            task = asyncio.ensure_future(self._copy_up(up))
            self._up_task = task
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _copy_up(self, up: int) -> None:
        """Copy the blocks scheduled for tier ``up`` into it, :data:`UP_BATCH` at a time,
        until none is left (the hits of a client's whole batch join the first)."""
        try:
            await asyncio.sleep(0)  # the loop's other ready callbacks (this batch's hits) first
            while self._up:
                batch = self._next_batch()
                for e in batch:
                    e.busy += 1
                try:
                    await self.mover.copy_many([(e, self.mover.host) for e in batch], up)
                except Exception as err:  # noqa: BLE001 - task guard: the blocks stay where they are
                    warn_once(logger, "copy-up", "copying %d blocks up to the %s tier failed: %r",
                              len(batch), self.mover.names[up], err)
                finally:
                    reap = self.mover.ledger.reap
                    for e in batch:
                        e.busy -= 1
                        self._promoting.discard(e.key)
                        reap(e)
        finally:
            self._up_task = None
            for queue in self._up.values():  # cancelled (shutdown): what was scheduled is not
                for key in queue:
                    self._promoting.discard(key)
            self._up.clear()
            self._queued = 0

    def _next_batch(self) -> list[Entry]:
        """Up to :data:`UP_BATCH` of the blocks scheduled, the tenants' oldest in turn; the
        next batch starts with the tenant after the last one served."""
        batch: list[Entry] = []
        order = list(self._up)
        pos = 0
        while order and len(batch) < UP_BATCH:
            pos %= len(order)
            queue = self._up[order[pos]]
            batch.append(queue.pop(next(iter(queue))))
            if queue:
                pos += 1
            else:
                del self._up[order.pop(pos)]
        self._queued -= len(batch)
        if order:
            pos %= len(order)
            self._up = {tenant: self._up[tenant] for tenant in order[pos:] + order[:pos]}
        return batch

    async def settle(self) -> None:
        """Wait for the background promotions under way (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

