"""Promotion: blocks brought into the host tier for a read, and copied up to the tier above
it (the GPU tier) after enough reads."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TypeVar

from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.mover import Mover

logger = logging.getLogger(__name__)

#: The fewest blocks a batch of :meth:`Promoter.bring_many` copies in one thread call.
MIN_BATCH = 8

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
                    await self.mover.drop(src, e, evicted=False)
                else:
                    todo.append((e, src))
            await self.mover.copy_many(todo, i)
        finally:
            for e in batch:
                e.busy -= 1
                del self._bringing[e.key]
                self.mover.reap(e)

    def hit(self, e: Entry) -> None:
        """``e`` was read from the host tier: tell the policy, and copy it up after enough reads."""
        self.mover.policy.accessed(self.mover.names[self.mover.host], e)
        up = self.mover.host - 1
        if up < 0:
            return
        if e.place(up) is not None:
            self.mover.policy.accessed(self.mover.names[up], e)
            return
        if e.hits < self.mover.settings.promote_hits or e.key in self._promoting or e.dead \
                or not self.mover.policy.admit(self.mover.names[up], e):
            return
        # Not busy until the copy starts: until then the block may still be evicted (the
        # copy then finds no source and does nothing), so a burst of hits never pins DRAM.
        self._promoting.add(e.key)
        task = asyncio.ensure_future(self._promote(e, up))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _promote(self, e: Entry, up: int) -> None:
        e.busy += 1
        try:
            await self.mover.copy(e, self.mover.host, up)
        finally:
            e.busy -= 1
            self._promoting.discard(e.key)
            self.mover.reap(e)

    async def settle(self) -> None:
        """Wait for the background promotions under way (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

