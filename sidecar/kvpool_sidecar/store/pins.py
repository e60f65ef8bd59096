"""Pins: the blocks each session keeps from eviction, and the sessions that pin each key.

A session counts its pins on each key (``Session.pins``) and holds a block's weight of its
share while it pins it (``Session.pinned_sizes``); a block counts the pins of every session
(``Entry.pins``). A pinned block is never evicted: a search for victims holds it back in
the policy's order (:meth:`~kvpool_sidecar.store.room.Room.hold_back`), and it takes back
its place there with its last pin (:meth:`Pins.unpinned`). The sessions that pin each key
are kept as well (:attr:`Pins.pinners`), so that a block that goes (removed, found corrupt,
its last copy lost) takes their pins off, and gives back what they held, without a walk of
every session.

A session pins only its own tenant's blocks. Tenants that share a key space read each
other's blocks, but a pin keeps a block from eviction, and a tenant with a quota makes room
for its puts by evicting its own blocks alone: another tenant that pinned them all (its
share of the tier allows it) left it answering QUOTA to every put until that tenant's
connection closed. As a REMOVE of another tenant's block, a PIN of one does nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvpool_sidecar.policy import EvictionPolicy
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.leases import Session
from kvpool_sidecar.store.quotas import Quotas
from kvpool_sidecar.tiers.base import Tier


class Pins:
    """The sessions' pins on the store's blocks (see the module docstring)."""

    def __init__(self, tiers: Sequence[Tier], policy: EvictionPolicy, quotas: Quotas, entries: dict[bytes, Entry],
                 sessions: dict[int, Session]) -> None:
        self._names = [t.kind.value for t in tiers]
        self._policy = policy
        self._quotas = quotas
        self._entries = entries
        self._sessions = sessions
        #: The sessions (by id) that pin each pinned key: a block that goes takes their pins
        #: off without a walk of every session (which a client that pins its own blocks, then
        #: removes them in thousands with a thousand idle connections open, made millions of
        #: steps of the event loop a request).
        self.pinners: dict[bytes, set[int]] = {}

    def pin(self, session: Session, keys: Sequence[bytes]) -> int:
        """Keep these blocks from eviction while the session lives; returns how many. Those
        of another tenant (a key space shared) are not pinned (see the module docstring)."""
        n = 0
        for k in keys:
            e = self._entries.get(k)
            if e is None or e.tenant != session.tenant:
                continue
            if k not in session.pinned_sizes:
                weight = self._quotas.weight(e.size, e.tenant)
                if self._quotas.over_cap(session, weight):
                    continue
                session.pinned_sizes[k] = weight
                self._quotas.hold(session, weight)
            e.pins += 1
            if not session.pins[k]:
                self.pinners.setdefault(k, set()).add(session.id)
            session.pins[k] += 1
            n += 1
        return n

    def unpin(self, session: Session, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if session.pins[k] > 0:
                session.pins[k] -= 1
                if session.pins[k] == 0:
                    del session.pins[k]
                    self._unpinned_by(session, k)
                    self._quotas.hold(session, -(session.pinned_sizes.pop(k, 0)))
                e = self._entries.get(k)
                if e is not None:
                    e.pins = max(0, e.pins - 1)
                    if not e.pins:
                        self.unpinned(e)
                n += 1
        return n

    def drop(self, session: Session, most: int | None = None) -> bool:
        """Take the pins of ``session`` (closing) off its blocks, every one or at most those
        of ``most`` keys; whether none is left. What they held is still held (given back with
        the rest of the session's)."""
        for key in list(itertools.islice(session.pins, most)):
            count = session.pins.pop(key)
            session.pinned_sizes.pop(key, None)
            self._unpinned_by(session, key)
            e = self._entries.get(key)
            if e is not None:
                e.pins = max(0, e.pins - count)
                if not e.pins:
                    self.unpinned(e)
        if session.pins:
            return False
        session.pinned_sizes.clear()
        return True

    def unpinned(self, e: Entry) -> None:
        """``e``'s last pin or read lease went: where it was held back (see
        :meth:`~kvpool_sidecar.store.room.Room.hold_back`) and nothing else keeps it, it takes
        back its place in each tier's order."""
        if not e.held_back or e.pins or e.readers or e.dead:  # (a dead one's key may name another block now)
            return
        e.held_back = False
        for i in e.held():
            self._policy.restored(self._names[i], e)

    def unpin_all(self, e: Entry) -> None:
        """Take every session's pins off ``e`` (a block that goes), and what they held."""
        if not e.pins:  # (nobody pins it: the key's pinners, if any, pin a newer block under it)
            return
        for sid in self.pinners.pop(e.key, ()):
            s = self._sessions.get(sid)
            count = s.pins.pop(e.key, 0) if s is not None else 0
            if s is not None and count:
                e.pins -= count
                self._quotas.hold(s, -s.pinned_sizes.pop(e.key, 0))

    def _unpinned_by(self, session: Session, key: bytes) -> None:
        """``session`` no longer pins ``key``."""
        pinners = self.pinners.get(key)
        if pinners is not None:
            pinners.discard(session.id)
            if not pinners:
                del self.pinners[key]
