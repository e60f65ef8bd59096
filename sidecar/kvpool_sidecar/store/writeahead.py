"""The write-ahead: cold host-tier blocks copied one tier down before anyone needs their
room, so that a put evicts a clean block at once instead of waiting for a disk write."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from kvpool_sidecar.errors import TierFullError
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.mover import Mover
from kvpool_sidecar.tiers.base import Place, WriteResult

#: Most bytes the write-ahead copies down in one batch (one disk sync).
WRITE_AHEAD_BATCH_BYTES = 16 << 20

#: A pass wakes once puts took this share of the clean share since the last pass began
#: (at most :data:`WRITE_AHEAD_BATCH_BYTES`), or at once when a put is about to wait for a
#: copy down (:meth:`~kvpool_sidecar.store.room.Room.clean_victims`): each pass walks the
#: coldest blocks from the start, a tenth of the tier by default, so a pass per put cost a
#: walk of thousands of blocks per put on a large tier, and wrote one block per sync.
WAKE_SHARE = 0.25


class WriteAhead:
    """Keeps ``clean_share`` of the host tier free or already copied down."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover
        self._taken = 0  # bytes puts took while the clean share was short, since the last pass

    def taken(self, nbytes: int) -> bool:
        """A put took ``nbytes`` of the host tier while its clean share is short: whether a
        pass is due (see :data:`WAKE_SHARE`)."""
        self._taken += nbytes
        capacity = self.mover.tiers[self.mover.host].capacity_bytes
        return self._taken >= min(WRITE_AHEAD_BATCH_BYTES, WAKE_SHARE * self.mover.settings.clean_share * capacity)

    async def write_ahead(self) -> int:
        """Copy the coldest host-tier blocks that no colder tier holds yet one tier down,
        keeping them, until ``clean_share`` of the host tier is free or clean: a put that
        needs room then evicts one of them at once. Returns the bytes copied (0: done)."""
        if not self.mover.room.writes_ahead:
            return 0
        self._taken = 0
        host, lower = self.mover.host, self.mover.host + 1
        tier = self.mover.tiers[host]
        target = self.mover.settings.clean_share * tier.capacity_bytes
        room, todo, window = tier.free_bytes, [], set()
        pinned: list[Entry] = []
        for m in self.mover.policy.victims(self.mover.names[host]):  # collected first: copies change the lists
            if room >= target:
                break
            if not isinstance(m, Entry) or m.place(host) is None:
                continue
            if m.pins:
                pinned.append(m)
                continue
            room += tier.footprint(m.size, m.tenant)
            window.add(m.key)
            if not (m.below(host) or m.busy or m.dead) and self.mover.policy.admit(self.mover.names[lower], m):
                todo.append(m)
        # held back as a put's search holds them: each pass would otherwise walk past every
        # pin a client keeps at the cold end
        self.mover.room.hold_back(host, pinned)
        written, had = 0, bool(todo)
        while todo:
            if self.mover.room.on_demand and written:
                # A put is waiting for a copy down: its copy goes next, this round ends. Not
                # before the round's first batch: a round that wrote nothing is woken again
                # by the next put that waits, and would walk the tier again for nothing.
                break
            # batches of at most WRITE_AHEAD_BATCH_BYTES: one disk sync each, and a put that
            # needs a write of its own waits for at most one of them
            batch: list[Entry] = []
            size = 0
            while todo and (not batch or size + todo[0].size <= WRITE_AHEAD_BATCH_BYTES):
                e = todo.pop(0)
                if e.place(host) is not None and not (e.below(host) or e.busy or e.dead):
                    batch.append(e)
                    size += e.size
            done = await self._copy_batch(batch, host, lower, window)
            if done < 0:  # no room below but other blocks' copies: the pass ends here
                break
            written += done
        # (a pass that stepped aside for a put that waits wrote its first batch)
        self.mover.room.ahead_stalled = had and not written
        return written

    async def _copy_batch(self, batch: list[Entry], src: int, dst: int, window: set[bytes]) -> int:
        """Copy ``batch`` from ``src`` one tier down in one :meth:`Tier.write_copies` (the
        blocks keep their source copies); returns the bytes now copied, or -1 when the tier
        below has no room for the batch but what other blocks' copies take (see
        :meth:`_room_for`): nothing was copied, and no copy failed."""
        for e in batch:
            e.busy += 1
        tier, source = self.mover.tiers[dst], self.mover.tiers[src]
        try:
            async with self.mover.writes[dst]:
                live = self._within_shares(dst, [e for e in batch if e.place(src) is not None
                                                 and not (e.below(src) or e.dead)])
                try:
                    await self._room_for(dst, sum(tier.footprint(e.size, e.tenant) for e in live), window)
                except TierFullError:
                    return -1
                places: list[Place | None] = [tier.reserve(e.record()) for e in live]
                took = self.mover.ledger.took
                for e, p in zip(live, places):
                    if p is not None:
                        took(dst, e.tenant, e.size)
                items = [(p, e.record(), source.views(e.place(src)) or []) for e, p in zip(live, places)
                         if p is not None]
                if tier.accounts_only or source.accounts_only:
                    done: list[WriteResult] = [None] * len(items)
                elif not tier.blocking:
                    done = tier.write_copies(items)
                else:
                    write = asyncio.ensure_future(self.mover.threads.in_thread(tier.write_copies, items))
                    try:
                        done = await asyncio.shield(write)
                    except asyncio.CancelledError:
                        # A stopping sidecar: the thread writes on, and what it wrote lands
                        # before the cancellation goes on, the lock and the blocks held till
                        # then. Else the copy of a block removed meanwhile stays on disk, and
                        # the next start serves it. (The stop waits for this a bounded time.)
                        await asyncio.wait([write])
                        if not write.cancelled() and write.exception() is None:
                            await self._land(live, places, write.result(), src, dst)
                        raise
                await self._land(live, places, done, src, dst)
            return sum(e.size for e in live if e.place(dst) is not None)
        finally:
            reap = self.mover.ledger.reap
            for e in batch:
                e.busy -= 1
                reap(e)

    def _within_shares(self, dst: int, entries: list[Entry]) -> list[Entry]:
        """``entries`` whose tenants' shares of tier ``dst`` have room for them: the copy of a
        tenant at its share is made when its block must go, from its own blocks there."""
        tier = self.mover.tiers[dst]
        within_share = self.mover.room.within_share
        taken: Counter[str] = Counter()
        out = []
        for e in entries:
            more = tier.footprint(e.size, e.tenant)
            if within_share(dst, e.tenant, taken[e.tenant] + more):
                taken[e.tenant] += more
                out.append(e)
        return out

    async def _land(self, live: list[Entry], places: list[Place | None], done: list[WriteResult], src: int,
                    dst: int) -> None:
        """What each copy of a batch (or its error) means; under the batch's write lock: the
        copy of a block removed meanwhile is forgotten before another write can put a new
        block under its key."""
        it = iter(done)
        results: list[Any] = [next(it) if p is not None else TierFullError("no room") for p in places]
        for e, place, result in zip(live, places, results):
            await self.mover.landed(e, src, dst, place, result)

    async def _room_for(self, i: int, need: int, window: set[bytes]) -> None:
        """Evict from tier ``i`` until ``need`` bytes are free, never the copy of a block in
        the pass's ``window`` (the host tier's coldest, which the pass keeps copied down:
        trading one of their copies for another only moves a write, and makes the next pass
        write the dropped one again). The victims for what is short come from one walk of
        the policy's order and go together (a batch of 64 KiB blocks makes room for 256 at a
        time, in one hop to a thread). With no other victim, TierFullError."""
        room = self.mover.room
        async with room.locks[i]:
            while (short := need - self.mover.tiers[i].free_bytes) > 0:
                victims = room.victims_for(i, short, window)
                if not victims:
                    raise TierFullError(f"the {self.mover.names[i]} tier has no room but the copies written ahead")
                await room.evict_many(i, victims)
