"""Room in each tier: which blocks may go, and evicting them to make room for another.

- **victims**: the policy names a tier's blocks, coldest first; a search takes the first
  evictable ones (no reader, pin or copy on them: :meth:`Room.evictable`), and holds back
  the pinned and read blocks it walked past until their last pin and read lease go
  (:meth:`Room.hold_back`);
- **room**: :meth:`Room.reserve` asks the tier for room and, while there is none, evicts
  the policy's first evictable victim of that tier (a tenant over its quota evicts its
  own first; with the write-ahead on, the first one already copied down and the run of
  such blocks right after it, :meth:`Room.clean_victims`). A tenant with a quota has the
  same share of each colder tier as of the host tier (:meth:`Room.cold_share`). A put that
  finds nothing free or clean there is refused (NoCleanRoomError) rather than wait for a
  disk write, where the store's settings say so;
- **eviction**: :meth:`Room.evict` first copies the victim one tier down when no colder
  tier holds it and the policy admits it there (demotion instead of loss: a copy of the
  :class:`~kvpool_sidecar.store.mover.Mover`), then drops it.

One maker of room at a time per tier (:attr:`Room.locks`); locks are taken down the tier
list (see :mod:`~kvpool_sidecar.store.mover`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence, Set as AbstractSet
from typing import Any

from kvpool_sidecar.errors import NoCleanRoomError, QuotaError, TierFullError
from kvpool_sidecar.metrics import StoreMetrics
from kvpool_sidecar.policy import BlockMeta
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.ledger import Ledger
from kvpool_sidecar.store.settings import StoreSettings, TenantLimits
from kvpool_sidecar.store.threads import Threads
from kvpool_sidecar.tiers.base import BlockRecord, Place

#: With the write-ahead on, a put that finds the host tier full drops its victim and the run
#: of clean blocks (copied down already: they go without a write) right after it in the
#: policy's order, until they make this many times its own room: the next puts find room free
#: instead of each walking again past the blocks the write-ahead is copying at the cold end
#: (33 of them a walk in ``make demo``, where those walks took 13% of the sidecar's CPU).
CLEAN_ROOM_PER_WALK = 8

#: Evictions one put makes between turns of the event loop (a few milliseconds of it). A
#: block much larger than the blocks a full tier holds, or than the longest free runs of a
#: tier cut into one-page holes (:data:`~kvpool_sidecar.tiers.alloc.MAX_RUNS`: each block
#: evicted merges the holes beside it), evicts a thousand blocks or more: 1,536 for a
#: 256 MiB block among the one-page holes of a 4 GiB tier, about 0.1 s of the loop in one
#: step where no eviction waits for a copy down.
EVICTIONS_PER_TURN = 64

#: Copies a block one tier down, busy meanwhile (``(entry, from tier, to tier, keep)``).
Demote = Callable[[Entry, int, int, AbstractSet[bytes]], Coroutine[Any, Any, None]]


def _note_pinned(m: BlockMeta, pinned: list[Entry]) -> None:
    """Add ``m`` to ``pinned`` when it is a block a client pinned, or is reading (a read lease
    keeps a block as a pin does: a tenant may hold leases on half the host tier, and every
    put on the node had walked past them all once they drifted to the cold end)."""
    if isinstance(m, Entry) and (m.pins or m.readers):
        pinned.append(m)


class Room:
    """Victims and room in the store's tiers (see the module docstring)."""

    def __init__(self, ledger: Ledger, threads: Threads, settings: StoreSettings, metrics: StoreMetrics,
                 demote: Demote) -> None:
        self._ledger = ledger
        self.tiers = ledger.tiers
        self.names = ledger.names
        self.host = ledger.host
        self.policy = ledger.policy
        self.quotas = ledger.quotas
        self.settings = settings
        self.metrics = metrics
        self._threads = threads
        #: An eviction's copy one tier down (:meth:`Mover.copy_busy
        #: <kvpool_sidecar.store.mover.Mover.copy_busy>`).
        self._demote = demote
        #: One maker of room at a time in each tier.
        self.locks = [asyncio.Lock() for _ in ledger.tiers]
        self.on_demand = 0  # evictions waiting for their block's copy down
        #: Set when the host tier's free or clean room falls below ``clean_share``.
        self.room_wanted = asyncio.Event()
        #: Whether the write-ahead's last pass had blocks to copy down and copied none (a
        #: disk that fails or is full of pinned blocks): puts then wait for their own copy
        #: down, as without it, rather than be refused until it writes again.
        self.ahead_stalled = False

    def evictable(self, m: BlockMeta) -> bool:
        return isinstance(m, Entry) and m.readers == 0 and m.pins == 0 and m.busy == 0

    def victim(self, i: int, tenant: str | None) -> Entry | None:
        pinned: list[Entry] = []
        found: Entry | None = None
        for m in self.policy.victims(self.names[i], tenant):
            if self.evictable(m):
                found = m  # type: ignore[assignment]
                break
            _note_pinned(m, pinned)
        self.hold_back(i, pinned)
        return found

    def hold_back(self, i: int, pinned: list[Entry]) -> None:
        """Hold back the pinned blocks a search for victims walked past: they go after every
        block of tier ``i`` that may be evicted, until their last pin goes
        (:meth:`Pins.unpinned <kvpool_sidecar.store.pins.Pins.unpinned>`). After the walk: its
        lists must not change under it. A client that pins its share of the tier at the cold
        end otherwise made every put on the node walk past all of its pins (20,000 of them: 4
        to 5 ms a block allocated); the write-ahead's walk, each pass."""
        for e in pinned:
            if (e.pins or e.readers) and e.place(i) is not None:
                self.policy.skipped(self.names[i], e)
                e.held_back = True

    def victims_for(self, i: int, need: int, keep: set[bytes]) -> list[Entry]:
        """The policy's first evictable blocks of tier ``i``, but those in ``keep``, whose
        room makes at least ``need`` bytes (all there are when fewer): one walk of its order."""
        tier, room = self.tiers[i], 0
        out: list[Entry] = []
        pinned: list[Entry] = []
        for m in self.policy.victims(self.names[i], None):
            if room >= need:
                break
            if isinstance(m, Entry) and self.evictable(m) and m.key not in keep:
                out.append(m)
                room += tier.footprint(m.size, m.tenant)
            else:
                _note_pinned(m, pinned)
        self.hold_back(i, pinned)
        return out

    async def evict_many(self, i: int, victims: Sequence[Entry]) -> None:
        """:meth:`evict` each of ``victims``. Where none is copied down first (the coldest
        tier, or demotion off) they go together, their room given back in one call: one hop
        to a thread for a tier that blocks, not one per block."""
        if i + 1 < len(self.tiers) and self.settings.demote:
            for e in victims:
                await self.evict(i, e)
            return
        freed: list[tuple[int, str, Place]] = []
        detach = self._ledger.detach
        for e in victims:
            if e.readers or e.pins or e.busy:
                continue
            place = detach(i, e)
            if place is not None:
                freed.append((e.size, e.tenant, place))
                self.metrics.evicted(self.names[i])
        if freed:
            await self._ledger.release_later(i, freed)

    @property
    def writes_ahead(self) -> bool:
        """Whether the host tier's blocks are copied down ahead of need
        (:mod:`~kvpool_sidecar.store.writeahead`)."""
        return self.host + 1 < len(self.tiers) and self.settings.demote and self.settings.clean_share > 0

    def clean_victim(self, i: int, tenant: str | None, scan: int = 256) -> Entry | None:
        """In the host tier with the write-ahead on: the first victim already copied down
        (it goes without a write) among the first ``scan`` evictable ones, else the first."""
        found = self.clean_victims(i, tenant, 0, scan)
        return found[0] if found else None

    def clean_victims(self, i: int, tenant: str | None, room: int, scan: int = 256) -> list[Entry]:
        """:meth:`clean_victim`, and the clean victims right after it in the policy's order,
        until their room in tier ``i`` makes ``room`` bytes: one walk, then drops without
        writes, leaves room for the next puts (each walk goes past the blocks the write-ahead
        is copying, at the cold end). The run ends at the first evictable block not yet
        copied down: a clean block past it is a warmer one (read back from disk, or written
        ahead and read since) and stays. Without the write-ahead, the one victim there is."""
        if i != self.host or not self.writes_ahead:
            one = self.victim(i, tenant)
            return [one] if one is not None else []
        first: Entry | None = None
        pinned: list[Entry] = []
        clean: list[Entry] = []
        tier, freed = self.tiers[i], 0
        for m in self.policy.victims(self.names[i], tenant):
            if not self.evictable(m):
                _note_pinned(m, pinned)
                continue
            e: Entry = m  # type: ignore[assignment]
            if e.below(i):
                clean.append(e)
                freed += tier.footprint(e.size, e.tenant)
                if freed >= room:
                    break
                continue
            if clean:
                break
            first = first or e
            scan -= 1
            if scan <= 0:
                break
        self.hold_back(i, pinned)
        if clean:
            return clean
        if first is not None:
            self.room_wanted.set()  # a put is about to wait for a write: write ahead
            return [first]
        return []

    async def reserve(self, i: int, record: BlockRecord, limits: TenantLimits | None = None,
                      keep: AbstractSet[bytes] = frozenset(), *, waits: bool = True) -> Place:
        """Room for ``record`` in tier ``i``, evicting as needed, but never the last copy of
        one of ``keep`` (a put's own ancestors, :meth:`evict`); ``limits``: the tenant's
        quota applies (host tier only). QuotaError, TierFullError when there is none.
        ``waits=False`` (a put, ``dram.put_waits_for_disk: false``): with the write-ahead on,
        NoCleanRoomError rather than wait for a victim's copy down where no room is free or
        clean (the write-ahead is woken; not while its last pass could copy nothing down,
        :attr:`ahead_stalled`, nor for a block larger than the clean share, which the
        write-ahead never makes). A tenant at its quota still waits for its own block's copy:
        the write-ahead copies the node's coldest blocks, which need not be that tenant's.
        While it evicts other blocks for room, that room counts against the tenant's quota
        (:meth:`Quotas.making_room <kvpool_sidecar.store.quotas.Quotas.making_room>`)."""
        tier, tenant = self.tiers[i], record.tenant
        need = tier.footprint(record.size, tenant)
        evicted = 0

        async def evict(victim: Entry) -> None:
            """:meth:`evict`, the loop turning every :data:`EVICTIONS_PER_TURN` of them."""
            nonlocal evicted
            await self.evict(i, victim, keep)
            evicted += 1
            if evicted % EVICTIONS_PER_TURN == 0:
                await asyncio.sleep(0)

        quota = limits if i == self.host and limits is not None and limits.quota_bytes is not None else None
        if quota is not None and need > (quota.quota_bytes or 0):
            raise QuotaError(f"a block of {record.size} bytes exceeds tenant {tenant!r}'s quota")
        share = self.cold_share(i, tenant) if i != self.host else None
        if share is not None and need > share:  # (evicting all its blocks there would not make room)
            raise QuotaError(f"a block of {record.size} bytes exceeds tenant {tenant!r}'s share of the "
                             f"{self.names[i]} tier")
        if share is not None and not self.within_share(i, tenant, need):
            # a demotion within the tenant's share of this tier: its own blocks there make the
            # room (a tenant under its quota above had flushed every other's blocks below)
            async with self.locks[i]:
                while not self.within_share(i, tenant, need):
                    victim = self.victim(i, tenant)
                    if victim is None:
                        raise QuotaError(f"tenant {tenant!r} holds its share of the {self.names[i]} tier")
                    await evict(victim)
        if quota is None or not self.quotas.over_quota(tenant, quota, need):
            place = tier.reserve(record)
            if place is not None:
                self._ledger.charge(i, tenant, need)
                return place
        async with self.locks[i]:
            while quota is not None and self.quotas.over_quota(tenant, quota, need):
                victim = self.clean_victim(i, tenant)
                if victim is None:
                    raise QuotaError(f"tenant {tenant!r} is at its quota and holds only pinned blocks")
                await evict(victim)
            # Within its quota now: the room it evicts for counts against the quota until it
            # is charged, or the tenant's other puts take it (Quotas.making_room).
            with self.quotas.making_room(tenant, need if quota is not None else 0):
                while True:
                    place = tier.reserve(record)
                    if place is not None:
                        self._ledger.charge(i, tenant, need)
                        return place
                    victims = self.clean_victims(i, None, CLEAN_ROOM_PER_WALK * need)
                    if not victims:
                        raise TierFullError(f"the {self.names[i]} tier is full of pinned blocks or blocks being read")
                    if not waits and not self.ahead_stalled and self.writes_ahead and i == self.host \
                            and need <= self.settings.clean_share * tier.capacity_bytes and not victims[0].below(i) \
                            and (getattr(self.policy, "admits_all", False)
                                 or self.policy.admit(self.names[i + 1], victims[0])):  # (else it goes without a write)
                        # (clean_victims woke the write-ahead)
                        raise NoCleanRoomError(f"no room in the {self.names[i]} tier free or copied down: "
                                               "the write-ahead is behind")
                    await evict(victims[0])
                    for victim in victims[1:]:
                        # Room ahead of need, so only what still goes without a write (checked
                        # again: the loop may have turned since the walk).
                        if self.evictable(victim) and victim.below(i):
                            await evict(victim)

    def within_share(self, i: int, tenant: str, more: int) -> bool:
        """Whether ``tenant``'s blocks may take ``more`` bytes in tier ``i`` (not the host tier)."""
        share = self.cold_share(i, tenant)
        return share is None or self._ledger.cold_used[i][tenant] + more <= share

    def cold_share(self, i: int, tenant: str) -> int | None:
        """What ``tenant``'s blocks may take in tier ``i`` (not the host tier): its quota's
        share of the host tier, of this one (None: no quota)."""
        quota = self.quotas.limits_or_default(tenant).quota_bytes
        if quota is None:
            return None
        return quota * self.tiers[i].capacity_bytes // max(1, self.tiers[self.host].capacity_bytes)

    async def evict(self, i: int, e: Entry, keep: AbstractSet[bytes] = frozenset()) -> None:
        """Take ``e`` out of tier ``i``, copying it one tier down first where that is possible
        (its room below made as :meth:`reserve` says for ``keep``). TierFullError where ``e`` is
        one of ``keep`` (a put's own ancestors, :mod:`~kvpool_sidecar.store.lineage`) and no
        other copy of it would be left: the put is refused rather than stored unreachable."""
        lower = i + 1
        if lower < len(self.tiers) and self.settings.demote and not e.below(i) \
                and self.policy.admit(self.names[lower], e):
            # The copy runs in its own task: a requester that goes away must not strand a
            # half-recorded copy (bytes written but never accounted).
            self.on_demand += 1  # the write-ahead steps aside while a put waits for a write
            try:
                await asyncio.shield(self._threads.finishing(self._demote(e, i, lower, keep)))
            finally:
                self.on_demand -= 1
            if e.dead:
                self._ledger.reap(e)
                return
        if e.readers or e.pins or e.busy or e.place(i) is None:
            return  # a reader or mover arrived while it was being copied: it stays, now clean
        if keep and sum(1 for _ in e.held()) <= 1 and e.key in keep:
            raise TierFullError("room for this block would evict an earlier block of its own chain")
        await self._ledger.drop(i, e)
        self.metrics.evicted(self.names[i])
