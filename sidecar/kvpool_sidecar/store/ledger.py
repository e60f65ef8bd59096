"""Where each block's copies are, and the room they take: copies placed, forgotten and
released, and blocks that leave the store.

The :class:`Ledger` keeps the store's record of its tiers: each block's copy in each tier
(``Entry.copies``), the blocks each tier holds, and what each tenant's blocks take there (in
the host tier through the tenants' quotas, in the others in :attr:`Ledger.cold_used`). A copy
that enters a tier is :meth:`Ledger.placed` (the policy and the index hear of it); one that
leaves is forgotten, and its room released: at once where the tier's releases do not block,
else forgotten by the tier at once and freed in a thread
(:class:`~kvpool_sidecar.store.threads.Threads`). A block goes when its last copy does; a
dead one (removed, or found corrupt: :meth:`Ledger.kill`) leaves every tier as its readers
and movers let go of it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import cast

from kvpool_sidecar.errors import TierIOError
from kvpool_sidecar.policy import EvictionPolicy
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.quotas import Quotas
from kvpool_sidecar.store.threads import Threads
from kvpool_sidecar.tiers.base import Detaching, Place, Tier

logger = logging.getLogger(__name__)


class Ledger:
    """The store's record of its blocks' copies and their room (see the module docstring)."""

    def __init__(self, tiers: Sequence[Tier], host: int, policy: EvictionPolicy, quotas: Quotas,
                 entries: dict[bytes, Entry], announce: Callable[[bool, str, Entry], None],
                 unpin_all: Callable[[Entry], None], threads: Threads) -> None:
        self.tiers = list(tiers)
        self.names = [t.kind.value for t in tiers]
        self.host = host
        self.policy = policy
        self.quotas = quotas
        self._entries = entries
        self._announce = announce
        #: Takes the sessions' pins off a block that left the store with pins on it.
        self._unpin_all = unpin_all
        self._threads = threads
        #: Blocks each tier holds.
        self.blocks = [0] * len(tiers)
        #: Per tier other than the host tier, what each tenant's blocks take there: a tenant
        #: with a quota has the same share of each of them as of the host tier
        #: (:meth:`~kvpool_sidecar.store.room.Room.reserve`).
        self.cold_used: list[Counter[str]] = [Counter() for _ in tiers]

    def entry(self, key: bytes) -> Entry | None:
        """The block stored under ``key``, if any."""
        return self._entries.get(key)

    def placed(self, i: int, e: Entry, place: Place) -> None:
        """``e`` now has a readable copy at ``place`` in tier ``i``."""
        e.copies[i] = place  # type: ignore[index]
        self.blocks[i] += 1
        self.policy.inserted(self.names[i], e)
        self._announce(True, self.names[i], e)

    def forget(self, i: int, e: Entry, *, evicted: bool = True) -> None:
        """Tier ``i``'s copy of ``e`` is no longer offered (its room may still be taken)."""
        self.blocks[i] -= 1
        self.policy.removed(self.names[i], e, evicted=evicted)
        self._announce(False, self.names[i], e)

    def release(self, i: int, size: int, tenant: str, place: Place) -> None:
        """Give the room of a block of ``size`` bytes back to tier ``i``."""
        tier = self.tiers[i]
        try:
            tier.release(place)
        except TierIOError as err:  # forgotten by the tier; only its bytes linger
            logger.warning("could not free a block's room in the %s tier: %s", self.names[i], err)
        self.charge(i, tenant, -tier.footprint(size, tenant))

    async def release_later(self, i: int, freed: Sequence[tuple[int, str, Place]]) -> None:
        """:meth:`release` of each ``(size, tenant, place)``; where the tier's releases block,
        each copy is forgotten by the tier at once and its room freed in one hop to a thread
        (the place of a disk copy is its key: a release that looked the key up later, in the
        thread, had freed whatever block was written under the key meanwhile)."""
        frees = [(self.names[i], f) for f in (self._detach_place(i, size, tenant, place)
                                               for size, tenant, place in freed) if f]
        if frees:
            await self._threads.free(frees)

    def release_soon(self, i: int, size: int, tenant: str, place: Place) -> None:
        """:meth:`release` from code that cannot wait: what blocks runs in a thread that the
        releases of one turn of the event loop share (a client's REMOVE of 4,096 blocks on disk
        had punched their holes on the event loop, every other client waiting 0.3 s)."""
        free = self._detach_place(i, size, tenant, place)
        if free is None:
            return
        self._threads.free_soon(self.names[i], free)

    def _detach_place(self, i: int, size: int, tenant: str, place: Place) -> Callable[[], None] | None:
        """Tier ``i`` forgets the block at ``place``: what frees its room, where that blocks
        (else it is free already, and None)."""
        tier = self.tiers[i]
        if not tier.release_blocks or tier.accounts_only:
            self.release(i, size, tenant, place)
            return None
        free = cast(Detaching, tier).detach(place)  # (a tier whose releases block is one: the contract's)
        self.charge(i, tenant, -tier.footprint(size, tenant))
        return free

    def detach(self, i: int, e: Entry, *, evicted: bool = True) -> Place | None:
        """Tier ``i``'s copy of ``e`` is no longer the block's (the block goes when it was its
        last copy); where it was, for its room to be released (None: there was none)."""
        place = e.place(i)
        if place is None:
            return None
        self.forget(i, e, evicted=evicted)
        e.copies[i] = None  # type: ignore[index]
        if e.best < 0 and self._entries.get(e.key) is e:
            del self._entries[e.key]
            if e.pins:
                # its last copy was lost (a pinned block is never evicted): the pins go with
                # it, or a session's count would stay, holding its share, and unpin the next
                # block put under the key though another client pinned that one
                self._unpin_all(e)
        return place

    async def drop(self, i: int, e: Entry, *, evicted: bool = True) -> None:
        """Take tier ``i``'s copy of ``e`` away; the block goes when it was the last copy."""
        place = self.detach(i, e, evicted=evicted)
        if place is not None:
            await self.release_later(i, [(e.size, e.tenant, place)])

    def kill(self, e: Entry) -> None:
        """Remove a block from every tier (corrupt, or deleted); the host tier's room goes
        with the last reader."""
        e.dead = True
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        self._unpin_all(e)
        self.retire(e)

    def retire(self, e: Entry) -> None:
        """A dead block (:meth:`kill`) leaves every tier: its room in the host tier, and in a
        device tier above it, when its last reader and mover let go (a read lease there reads
        the copy in place: a device lease's engine copies it with no check of its own, so its
        pages must not hold another block until the lease goes), in the colder tiers at once
        (a copy still reading it fails its checksum; a disk file must go before another block
        takes its name)."""
        for i in list(e.held()):
            self.forget(i, e, evicted=False)
            if i > self.host:
                place = e.copies[i]  # type: ignore[index]
                e.copies[i] = None  # type: ignore[index]
                self.release_soon(i, e.size, e.tenant, place)
        self.reap(e)

    def reap(self, e: Entry) -> None:
        """Free a dead block's room once nobody reads or moves it any more."""
        if e.dead and e.readers == 0 and e.busy == 0:
            for i in list(e.held()):
                place = e.copies[i]  # type: ignore[index]
                e.copies[i] = None  # type: ignore[index]
                self.release_soon(i, e.size, e.tenant, place)

    def charge(self, i: int, tenant: str, need: int) -> None:
        """``need`` bytes (negative: given back) more of tier ``i`` are ``tenant``'s."""
        if i == self.host:
            self.quotas.charge(tenant, need)
        else:
            self.cold_used[i][tenant] += need

    def took(self, i: int, tenant: str, size: int) -> None:
        """Room for a block of ``size`` bytes of ``tenant`` was taken in tier ``i`` other than
        through :meth:`~kvpool_sidecar.store.room.Room.reserve` (a copy written ahead, a block
        kept from a previous run): it counts, as its :meth:`release` will."""
        self.charge(i, tenant, self.tiers[i].footprint(size, tenant))

    def adopted(self, i: int, e: Entry, place: Place) -> None:
        """A block kept by tier ``i`` from a previous run is the store's again (and its room
        the tenant's)."""
        self.took(i, e.tenant, e.size)
        self.placed(i, e, place)
