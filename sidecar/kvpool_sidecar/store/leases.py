"""Leases and sessions: what one client connection holds in the store.

A write lease is room in the host tier reserved for a block being written (phase one of
a put); a read lease keeps a block's host-tier copy in place while a client or peer reads
it. Every lease belongs to a :class:`Session` (one connection): closing it, when the
client exits or dies, aborts its writes, releases its reads and drops its pins.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvpool_sidecar.events import EngineRef
from kvpool_sidecar.policy import BlockMeta
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.tiers.alloc import extents_of
from kvpool_sidecar.tiers.base import Place


#: Bytes per second of blocks one connection may report corrupt and have checked (and a
#: burst of as much): a real corruption is rare, while a client crying wolf on every block
#: would have the sidecar hash all of DRAM on its event loop, stalling every client.
CHECK_BYTES_PER_S = 64 << 20

#: How many of a session's refused puts it remembers (:attr:`Session.refused`): a chain
#: written in order needs only the last.
REFUSED_KEYS = 64


@dataclass(slots=True)
class WriteLease:
    id: int
    meta: BlockMeta
    #: Where the host tier reserved the block's room.
    place: Place
    deadline: float
    engine: EngineRef | None = None

    @property
    def extents(self) -> int:
        """The extents its room lies in (each given back one at a time)."""
        return extents_of(self.place)


@dataclass(slots=True)
class ReadLease:
    id: int
    entry: Entry
    #: The copy being read: the host tier's, or for a device lease the GPU tier's.
    place: Place
    #: Whether it is a GPU-tier copy read by a local engine through CUDA IPC.
    device: bool = False

    @property
    def extents(self) -> int:
        """The extents of the copy it reads (given back with its last reader where the block
        was removed meanwhile)."""
        return extents_of(self.place)


@dataclass(slots=True)
class Session:
    """The leases and pins of one client connection."""

    id: int
    tenant: str = "default"
    writes: dict[int, WriteLease] = field(default_factory=dict)
    #: Write leases past their deadline, by id: their keys are free, their room is not, until
    #: the writer says it is done with it (its late commit or abort, both refused) or the
    #: session closes (the writer may still be copying into it).
    lapsed: dict[int, WriteLease] = field(default_factory=dict)
    reads: dict[int, ReadLease] = field(default_factory=dict)
    pins: Counter[bytes] = field(default_factory=Counter)
    #: Whether its write leases expire: not for the sidecar's own sessions (a peer fetch
    #: commits or aborts within its deadline), only for clients'.
    expiring: bool = True
    #: Host-tier bytes this session keeps from eviction or reuse: its write leases, read
    #: leases and pins; capped per session (:class:`~kvpool_sidecar.store.quotas.Quotas`).
    held_bytes: int = 0
    #: Size of each block the session pins (counted once however often it pins it).
    pinned_sizes: dict[bytes, int] = field(default_factory=dict)
    #: The keys of its last puts that were refused (FULL, QUOTA, REJECTED), oldest first: a
    #: block whose parent is one of them could never be reached, and is refused too.
    refused: dict[bytes, None] = field(default_factory=dict)

    def lease_extents(self, lease_id: int) -> int:
        """The extents of the room its lease ``lease_id`` holds (0: it holds none such)."""
        lease = self.writes.get(lease_id) or self.lapsed.get(lease_id) or self.reads.get(lease_id)
        return lease.extents if lease is not None else 0

    def refuse(self, key: bytes) -> None:
        """Remember that a put of ``key`` was refused (the last :data:`REFUSED_KEYS` of them)."""
        self.refused[key] = None
        if len(self.refused) > REFUSED_KEYS:
            del self.refused[next(iter(self.refused))]


class Deadlines:
    """The write leases of clients' sessions in the order their deadlines come (one lease
    timeout for them all: the order they were granted), so that ending those past it looks
    at those alone: a walk of every session's every lease once a second had stalled the
    event loop for 80 to 136 ms each time while one client held 262,144 of them (a review)."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[int, tuple[Session, WriteLease]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, session: Session, lease: WriteLease) -> None:
        """``lease`` was granted to ``session`` (the sidecar's own sessions' never expire)."""
        if session.expiring:
            self._order[lease.id] = (session, lease)

    def discard(self, lease_id: int) -> None:
        """The lease ended (committed, aborted, lapsed or its session closed)."""
        self._order.pop(lease_id, None)

    def due(self, now: float) -> list[tuple[Session, WriteLease]]:
        """The leases whose deadline is past at ``now``, taken out, oldest first."""
        out: list[tuple[Session, WriteLease]] = []
        order = self._order
        while order:
            lease_id = next(iter(order))
            s, w = order[lease_id]
            if w.deadline >= now:
                break
            del order[lease_id]
            out.append((s, w))
        return out


@dataclass(slots=True)
class CheckBudget:
    """Bytes of blocks a tenant's clients reported corrupt that the store may still check now:
    a bucket refilled at :data:`CHECK_BYTES_PER_S`, one per tenant (a client that reconnects
    finds it as it left it), since each check hashes the block on the event loop."""

    check_bytes: float = CHECK_BYTES_PER_S
    checked_at: float = field(default_factory=time.monotonic)

    def may_check(self, size: int) -> bool:
        """Whether a corrupt report of a block of ``size`` bytes is checked (and the budget
        taken): past the budget a report is not believed, the block stays. A block larger
        than a second's budget is checked from a full budget, which then goes into debt: the
        next check waits until the refill has paid it back (a block past the budget had never
        been checked, so a corrupt one of more than 64 MiB was never dropped)."""
        now = time.monotonic()
        refill = max(0.0, now - self.checked_at) * CHECK_BYTES_PER_S
        self.check_bytes, self.checked_at = min(float(CHECK_BYTES_PER_S), self.check_bytes + refill), now
        if size > self.check_bytes and self.check_bytes < CHECK_BYTES_PER_S:
            return False
        self.check_bytes -= size
        return True
