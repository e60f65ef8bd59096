"""The tiered block store: the one place that moves blocks between tiers.

Blocks enter the DRAM arena through a two-phase put (``allocate`` reserves extents and
hands them to the writer, ``commit`` makes the block visible with the writer's checksum)
and leave it by eviction. Eviction asks the policy for victims, skips blocks that are
pinned or being read, and demotes a victim to disk (verifying its checksum on the way)
instead of dropping it when a disk tier exists. A read (``acquire``) of a block that is
only on disk promotes it back into DRAM first; concurrent reads of the same block share
one promotion. Read leases pin a block's extents until they are released, so a block being
read is never evicted or overwritten.

Every lease belongs to a :class:`Session` (one client connection). Closing a session —
a client that exits or dies — aborts its writes, releases its reads and drops its pins.

Index updates (publish after a write completes, unpublish after a block leaves a tier) are
queued as :class:`IndexEvent` s for the sidecar's publisher to send in batches. With KV
events on, the same moves of blocks that carry an engine identity go to an
:class:`EngineEventQueue`, which never blocks the store (see :mod:`kvpool_sidecar.kvevents`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool_client.integrity import checksum
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.errors import (
    CorruptBlockError,
    QuotaError,
    TierFullError,
    TierIOError,
    UnknownLeaseError,
)
from kvpool_sidecar.events import EngineEvent, EngineEventQueue, EngineRef, IndexEvent
from kvpool_sidecar.metrics import StoreMetrics
from kvpool_sidecar.policy import BlockMeta, EvictionPolicy, Hints
from kvpool_sidecar.tiers.base import BlockRecord, TierKind
from kvpool_sidecar.tiers.disk import DiskTier
from kvpool_sidecar.tiers.dram import DramTier, Extent

logger = logging.getLogger(__name__)

#: Most bytes the write-ahead writes to disk in one batch (one disk sync).
WRITE_AHEAD_BATCH_BYTES = 16 << 20

DRAM = TierKind.DRAM.value
DISK = TierKind.DISK.value


@dataclass(slots=True, eq=False)
class Entry(BlockMeta):
    """A committed block and where it lives."""

    checksum: int = 0
    dram: list[Extent] | None = None
    on_disk: bool = False
    #: Read leases outstanding on the DRAM copy.
    readers: int = 0
    #: Client pins (by any session).
    pins: int = 0
    #: Moves in flight (demotion or promotion).
    busy: int = 0
    #: Removed from the store (found corrupt); extents are freed by the last reader.
    dead: bool = False
    #: The engine's identity for the block, when its writer gave it (for KV events).
    engine: EngineRef | None = None

    def record(self) -> BlockRecord:
        return BlockRecord(self.key, self.size, self.checksum, self.tenant)

    @property
    def best_tier(self) -> str:
        return DRAM if self.dram is not None else DISK


@dataclass(slots=True)
class WriteLease:
    id: int
    meta: BlockMeta
    extents: list[Extent]
    deadline: float
    engine: EngineRef | None = None


@dataclass(slots=True)
class ReadLease:
    id: int
    entry: Entry
    extents: list[Extent]


@dataclass(slots=True)
class Session:
    """The leases and pins of one client connection."""

    id: int
    tenant: str = "default"
    writes: dict[int, WriteLease] = field(default_factory=dict)
    reads: dict[int, ReadLease] = field(default_factory=dict)
    pins: Counter[bytes] = field(default_factory=Counter)
    #: Whether its write leases expire: not for the sidecar's own sessions (a peer fetch
    #: commits or aborts within its deadline), only for clients'.
    expiring: bool = True
    #: DRAM bytes this session keeps from eviction or reuse: its write leases, read leases
    #: and pins; capped per session.
    held_bytes: int = 0
    #: Size of each block the session pins (counted once however often it pins it).
    pinned_sizes: dict[bytes, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TenantLimits:
    priority: int = 0
    quota_bytes: int | None = None


@dataclass(frozen=True)
class StoreSettings:
    """What the store needs beyond its tiers and policy."""

    tenants: dict[str, TenantLimits] = field(default_factory=lambda: {"default": TenantLimits()})
    block_max_bytes: int = 256 << 20
    #: The most DRAM one client session, and all the client sessions of one tenant together,
    #: may hold at once (write leases, read leases, pins), as a share of the DRAM tier: past
    #: it a put answers QUOTA, a get misses and a pin does not take, so one client or tenant
    #: cannot hold the node (the sidecar's own sessions: no cap).
    #: The sidecar's setting is ``api.max_session_share`` (0.5).
    session_share: float = 1.0
    demote: bool = True
    lease_timeout_s: float = 30.0
    #: The share of DRAM kept free or already written to disk ahead of need (a background
    #: writer, :meth:`TieredStore.write_ahead`), so a put that needs room evicts a clean
    #: block at once instead of waiting for a disk write. 0 (the default here, and the
    #: trace replay's: victims in the policy's exact order): demote only on demand. The
    #: sidecar's setting is ``dram.clean_share`` (0.1).
    clean_share: float = 0.0


class TieredStore:
    """DRAM arena over an optional disk tier, driven by an eviction policy."""

    def __init__(
        self,
        dram: DramTier,
        policy: EvictionPolicy,
        settings: StoreSettings,
        *,
        disk: DiskTier | None = None,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        index_events: bool = True,
        engine_events: EngineEventQueue | None = None,
    ) -> None:
        self.dram = dram
        self.disk = disk
        self.policy = policy
        self.settings = settings
        self.metrics = metrics or StoreMetrics(None)
        self._clock = clock
        self._entries: dict[bytes, Entry] = {}
        self._pending: set[bytes] = set()
        self._promoting: dict[bytes, asyncio.Future[None]] = {}
        self._room = asyncio.Lock()
        self._ids = itertools.count(1)
        self._sessions: dict[int, Session] = {}
        #: What all the client sessions of each tenant hold (see ``_over_cap``).
        self._tenant_held: Counter[str] = Counter()
        self._tenant_dram: Counter[str] = Counter()
        self._index_on = index_events
        self.index_queue: list[IndexEvent] = []
        #: KV events (blocks with an engine identity entering or leaving a tier), when on.
        self.engine_events = engine_events
        #: Set when DRAM that is free or clean falls below ``clean_share``: wakes the writer.
        self.room_wanted = asyncio.Event()
        self._disk_writes = asyncio.Lock()
        self._on_demand = 0  # evictions waiting for their block's disk write

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> int:
        """Adopt the blocks the disk tier still holds (a warm restart); returns how many."""
        if self.disk is None:
            return 0
        records = await asyncio.to_thread(self.disk.open)
        for r in records:
            limits = self.settings.tenants.get(r.tenant, TenantLimits())
            e = Entry(r.key, r.size, r.tenant, limits.priority, checksum=r.checksum, on_disk=True)
            self._entries[r.key] = e
            self.policy.inserted(DISK, e)
            self._event(True, DISK, e)
        return len(records)

    def _over_cap(self, session: Session, size: int) -> bool:
        """Whether holding ``size`` more bytes takes ``session`` past its share of DRAM."""
        if not session.expiring or self.settings.session_share >= 1:  # the sidecar's own: no cap
            return False
        cap = self.settings.session_share * self.dram.capacity_bytes
        # per connection, and for all of a tenant's connections together (a tenant that
        # opens many connections still leaves the rest of the tier to the others)
        return session.held_bytes + size > cap or self._tenant_held[session.tenant] + size > cap

    def _hold(self, session: Session, delta: int) -> None:
        session.held_bytes += delta
        if session.expiring:  # clients' sessions; the sidecar's own (peer fetches) are not capped
            self._tenant_held[session.tenant] += delta

    def open_session(self, tenant: str = "default", *, expiring: bool = True) -> Session:
        s = Session(next(self._ids), tenant, expiring=expiring)
        self._sessions[s.id] = s
        return s

    def close_session(self, session: Session) -> None:
        """Abort writes, release reads and drop pins of a closed or dead client."""
        for lease_id in list(session.writes):
            self.abort(session, lease_id)
        for lease_id in list(session.reads):
            self.release(session, lease_id)
        for key, count in session.pins.items():
            e = self._entries.get(key)
            if e is not None:
                e.pins = max(0, e.pins - count)
        session.pins.clear()
        session.pinned_sizes.clear()
        self._hold(session, -session.held_bytes)
        self._sessions.pop(session.id, None)

    def expire_leases(self) -> int:
        """End write leases past their deadline (a stuck writer); returns how many.

        The key is free for another writer, a late commit is refused, and the pages come
        back at once. A writer that is slow, not dead, may still copy into them after they
        went to another block: that block then fails its checksum when it is read and is
        dropped (a miss, never wrong bytes), and the pages lie in the writer's own key
        space's arena, so only blocks of its own space are exposed to it, as they are
        anyway (see ``tiers.dram``). Read leases never expire while their client is
        connected: it may still be reading the bytes in place, and reusing them would hand
        it another block's bytes.
        """
        now = self._clock()
        expired = 0
        for s in list(self._sessions.values()):
            if not s.expiring:
                continue
            for lid, w in list(s.writes.items()):
                if w.deadline < now:
                    del s.writes[lid]
                    self._pending.discard(w.meta.key)
                    self._hold(s, -(w.meta.size))
                    self._free_dram(w.meta.tenant, w.extents)
                    expired += 1
        return expired

    async def write_ahead(self) -> int:
        """Write the coldest DRAM blocks that are not on disk yet to disk, keeping them in
        DRAM, until ``clean_share`` of DRAM is free or clean: a put that needs room then
        evicts one of them at once. Returns the bytes written (0: nothing to do)."""
        disk = self.disk
        if disk is None or not self._writes_ahead:
            return 0
        target = self.settings.clean_share * self.dram.capacity_bytes
        room, todo = self.dram.free_bytes, []
        for m in self.policy.victims(DRAM):  # collected first: demoting changes the policy's lists
            if room >= target:
                break
            if not isinstance(m, Entry) or m.dram is None or m.pins:
                continue
            room += self.dram.footprint(m.size)
            if not (m.on_disk or m.busy or m.dead) and self.policy.admit(DISK, m):
                todo.append(m)
        written = 0
        while todo:
            if self._on_demand:
                break  # a put is waiting for a disk write: its write goes first, this round ends
            # batches of at most WRITE_AHEAD_BATCH_BYTES: one disk sync each, and a put that
            # needs a write of its own waits for at most one of them
            batch: list[Entry] = []
            size = 0
            while todo and (not batch or size + todo[0].size <= WRITE_AHEAD_BATCH_BYTES):
                e = todo.pop(0)
                if e.dram is not None and not (e.on_disk or e.busy or e.dead):
                    batch.append(e)
                    size += e.size
            written += await self._demote_batch(batch, disk)
        return written

    # ----------------------------------------------------------------- queries
    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[list[Any]]]:
        """The longest prefix of ``keys`` held here, and where: ``[[tier, run length], ...]``."""
        found = list(map(self._entries.get, keys))  # the hot loop runs in C
        try:
            n = found.index(None)
        except ValueError:
            n = len(found)
        in_dram = [e.dram is not None for e in found[:n]]  # type: ignore[union-attr]
        runs = [[DRAM if d else DISK, len(list(g))] for d, g in itertools.groupby(in_dram)]
        self.metrics.lookup(n, len(keys) - n)
        return n, runs

    def limits(self, tenant: str) -> TenantLimits:
        limits = self.settings.tenants.get(tenant)
        if limits is None:
            raise QuotaError(f"unknown tenant {tenant!r}")
        return limits

    # ----------------------------------------------------------------- put
    async def allocate(
        self,
        session: Session,
        key: bytes,
        size: int,
        *,
        tenant: str | None = None,
        depth: int = -1,
        parent: bytes | None = None,
        hints: Hints | None = None,
        engine: EngineRef | None = None,
    ) -> tuple[PutStatus, WriteLease | None]:
        """Phase one of a put: reserve DRAM extents for ``key``."""
        tenant = tenant or session.tenant
        limits = self.limits(tenant)
        if size <= 0 or size > self.settings.block_max_bytes or self.dram.footprint(size) > self.dram.capacity_bytes:
            return PutStatus.TOO_LARGE, None
        held = self._entries.get(key)
        if held is not None:
            # As this put places it (a block adopted from disk or fetched from a peer was
            # stored without its place in this chain).
            self.policy.bypassed(held.best_tier,
                                 BlockMeta(key, held.size, held.tenant, held.priority, depth, parent, hints=hints))
            if held.engine is None and engine is not None and held.tenant == tenant:
                held.engine = engine
                if self.engine_events is not None:  # named only now: announce where it is
                    for tier in ([DRAM] if held.dram is not None else []) + ([DISK] if held.on_disk else []):
                        self.engine_events.put(True, tier, held.tenant, engine)
            return PutStatus.EXISTS, None
        if key in self._pending:
            return PutStatus.PENDING, None
        if self._over_cap(session, size):
            self.metrics.put(PutStatus.QUOTA)
            return PutStatus.QUOTA, None
        meta = BlockMeta(key, size, tenant, limits.priority, depth, parent, hints=hints)
        if not self.policy.admit(DRAM, meta):
            self.metrics.put(PutStatus.REJECTED)
            return PutStatus.REJECTED, None
        self._pending.add(key)
        try:
            extents = await self._reserve_dram(size, tenant, limits)
        except QuotaError:
            self._pending.discard(key)
            self.metrics.put(PutStatus.QUOTA)
            return PutStatus.QUOTA, None
        except TierFullError:
            self._pending.discard(key)
            self.metrics.put(PutStatus.FULL)
            return PutStatus.FULL, None
        except BaseException:
            # Cancelled (the writer's connection died while evicting) or failed: free the key.
            self._pending.discard(key)
            raise
        lease = WriteLease(next(self._ids), meta, extents, self._clock() + self.settings.lease_timeout_s, engine)
        session.writes[lease.id] = lease
        self._hold(session, size)
        if self._writes_ahead and self.dram.free_bytes < self.settings.clean_share * self.dram.capacity_bytes:
            self.room_wanted.set()
        return PutStatus.ALLOCATED, lease

    def commit(self, session: Session, lease_id: int, checksum: int) -> PutStatus:
        """Phase two of a put: the bytes are written; make the block visible."""
        lease = session.writes.pop(lease_id, None)
        if lease is None:
            raise UnknownLeaseError(f"no write lease {lease_id} in this session")
        m = lease.meta
        self._hold(session, -(m.size))
        self._pending.discard(m.key)
        e = Entry(m.key, m.size, m.tenant, m.priority, m.depth, m.parent, hints=m.hints, checksum=checksum,
                  dram=lease.extents, engine=lease.engine)
        self._entries[m.key] = e
        self.policy.inserted(DRAM, e)
        self._event(True, DRAM, e)
        self.metrics.put(PutStatus.STORED, m.size)
        return PutStatus.STORED

    def abort(self, session: Session, lease_id: int) -> None:
        lease = session.writes.pop(lease_id, None)
        if lease is None:
            raise UnknownLeaseError(f"no write lease {lease_id} in this session")
        self._hold(session, -(lease.meta.size))
        self._pending.discard(lease.meta.key)
        self._free_dram(lease.meta.tenant, lease.extents)

    # ----------------------------------------------------------------- get
    async def prefetch(self, keys: Sequence[bytes]) -> None:
        """Start the disk reads of the disk-only blocks among ``keys`` (a batch about to be
        acquired one by one), so that their promotions overlap on the device."""
        disk = self.disk
        if disk is None or self.dram.arena is None:
            return
        cold = [k for k in keys if (e := self._entries.get(k)) is not None and e.dram is None and e.on_disk]
        if len(cold) > 1:
            await asyncio.to_thread(disk.prefetch, cold)

    async def acquire(self, session: Session, key: bytes) -> ReadLease | None:
        """Pin ``key``'s DRAM copy for reading (promoting it from disk); None on a miss."""
        e = self._entries.get(key)
        if e is not None and e.dram is None and e.on_disk:
            await self._promote(e)
        if e is None or e.dram is None or e.dead or self._over_cap(session, e.size):
            self.metrics.get(hit=False)
            return None
        self._hold(session, e.size)
        e.readers += 1
        e.hits += 1
        self.policy.accessed(DRAM, e)
        lease = ReadLease(next(self._ids), e, e.dram)
        session.reads[lease.id] = lease
        self.metrics.get(hit=True, size=e.size)
        return lease

    def release(self, session: Session, lease_id: int, *, corrupt: bool = False) -> None:
        """End a read; ``corrupt`` reports that the reader's checksum did not match."""
        lease = session.reads.pop(lease_id, None)
        if lease is None:
            raise UnknownLeaseError(f"no read lease {lease_id} in this session")
        e = lease.entry
        self._hold(session, -(e.size))
        if corrupt and not e.dead and checksum(self.dram.views(lease.extents)) == e.checksum:
            # a client's word is not proof: the bytes check out, so the block stays
            logger.info("a client reported block %s corrupt, but it matches its checksum; kept", e.key.hex())
            corrupt = False
        e.readers -= 1
        if corrupt and not e.dead:
            logger.warning("block %s failed its checksum in DRAM; dropping it", e.key.hex())
            self.metrics.corrupt(DRAM)
            self._kill(e)
        self._reap(e)

    # ----------------------------------------------------------------- pins
    def pin(self, session: Session, keys: Sequence[bytes]) -> int:
        """Keep these blocks from eviction while the session lives; returns how many."""
        n = 0
        for k in keys:
            e = self._entries.get(k)
            if e is None:
                continue
            if k not in session.pinned_sizes:
                if self._over_cap(session, e.size):
                    continue
                session.pinned_sizes[k] = e.size
                self._hold(session, e.size)
            e.pins += 1
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
                    self._hold(session, -(session.pinned_sizes.pop(k, 0)))
                e = self._entries.get(k)
                if e is not None:
                    e.pins = max(0, e.pins - 1)
                n += 1
        return n

    # ----------------------------------------------------------------- remove
    def remove(self, session: Session, keys: Sequence[bytes]) -> int:
        """Delete blocks from every tier of this node (a client's explicit delete); returns
        how many went. ``keys`` are store keys: the API scoped them to the asker's key space.

        A removed block is gone at once for new readers, the index and the policy (as lost,
        not evicted: a removal says nothing of its worth). A reader that holds it keeps its
        pages until it releases them, so freed bytes are never served; pins on it, by any
        session, go with it. A block being promoted from disk right now stays and is not
        counted (ask again). Copies other nodes hold are theirs: they stay. Only blocks the
        session's tenant wrote go: tenants that share a key space cannot delete each other's.
        """
        n = 0
        for k in keys:
            e = self._entries.get(k)
            if e is None or k in self._promoting or e.tenant != session.tenant:
                continue
            try:
                self._kill(e)  # a demotion in flight finds the block dead and drops its copy
            except TierIOError as err:  # forgotten by the disk tier; only its file stays behind
                logger.warning("could not delete removed block %s from disk: %s", k.hex(), err)
            n += 1
        return n

    def inventory(self) -> dict[bytes, list[str]]:
        """Every block held and its tiers: what the index should say about this node."""
        out: dict[bytes, list[str]] = {}
        for k, e in self._entries.items():
            tiers = ([DRAM] if e.dram is not None else []) + ([DISK] if e.on_disk else [])
            if tiers:
                out[k] = tiers
        return out

    def engine_inventory(self) -> list[EngineEvent]:
        """A stored event for every tier of every block with an engine identity: the whole
        state, for a KV-event consumer that has to start over."""
        out: list[EngineEvent] = []
        for e in self._entries.values():
            if e.engine is not None:
                out += [EngineEvent(True, t, e.tenant, e.engine)
                        for t in ([DRAM] if e.dram is not None else []) + ([DISK] if e.on_disk else [])]
        return out

    # ----------------------------------------------------------------- stats
    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        """``{tier: (capacity bytes, used bytes, resident blocks)}``."""
        dram_blocks = sum(1 for e in self._entries.values() if e.dram is not None)
        usage = {DRAM: (self.dram.capacity_bytes, self.dram.used_bytes, dram_blocks)}
        if self.disk is not None:
            disk_blocks = sum(1 for e in self._entries.values() if e.on_disk)
            usage[DISK] = (self.disk.capacity_bytes, self.disk.used_bytes, disk_blocks)
        return usage

    def stats(self) -> dict[str, object]:
        tiers: dict[str, dict[str, int]] = {
            name: {"capacity_bytes": cap, "used_bytes": used, "blocks": n}
            for name, (cap, used, n) in self.tier_usage().items()
        }
        tiers[DRAM]["free_runs"] = self.dram.fragments
        return {
            "blocks": len(self._entries),
            "tiers": tiers,
            "sessions": len(self._sessions),
            "pending_writes": len(self._pending),
            "policy": self.policy.name,
            "counters": self.metrics.snapshot(),
        }

    # ----------------------------------------------------------------- internals
    def _event(self, publish: bool, tier: str, e: Entry) -> None:
        if self._index_on:
            self.index_queue.append(IndexEvent(publish, tier, e.key))
        if e.engine is not None and self.engine_events is not None:
            self.engine_events.put(publish, tier, e.tenant, e.engine)

    def _free_dram(self, tenant: str, extents: list[Extent]) -> None:
        self.dram.free(extents)
        self._tenant_dram[tenant] -= self.dram.footprint(sum(n for _, n in extents))

    def _evictable(self, e: BlockMeta) -> bool:
        return isinstance(e, Entry) and e.readers == 0 and e.pins == 0 and e.busy == 0

    def _over_quota(self, tenant: str, limits: TenantLimits, need: int) -> bool:
        return limits.quota_bytes is not None and self._tenant_dram[tenant] + need > limits.quota_bytes

    async def _reserve_dram(self, size: int, tenant: str, limits: TenantLimits) -> list[Extent]:
        need = self.dram.footprint(size)
        if limits.quota_bytes is not None and need > limits.quota_bytes:
            raise QuotaError(f"a block of {size} bytes exceeds tenant {tenant!r}'s quota")
        if not self._over_quota(tenant, limits, need):
            extents = self.dram.allocate(size, tenant)
            if extents is not None:
                self._tenant_dram[tenant] += need
                return extents
        async with self._room:
            while self._over_quota(tenant, limits, need):
                victim = self._clean_victim(tenant)
                if victim is None:
                    raise QuotaError(f"tenant {tenant!r} is at its quota and holds only pinned blocks")
                await self._evict_dram(victim)
            while True:
                extents = self.dram.allocate(size, tenant)
                if extents is not None:
                    self._tenant_dram[tenant] += need
                    return extents
                victim = self._clean_victim(None)
                if victim is None:
                    raise TierFullError("DRAM is full of pinned blocks or blocks being read")
                await self._evict_dram(victim)

    @property
    def _writes_ahead(self) -> bool:
        """Whether blocks are written to disk ahead of need (see :meth:`write_ahead`)."""
        return self.disk is not None and self.settings.demote and self.settings.clean_share > 0

    def _clean_victim(self, tenant: str | None, scan: int = 64) -> Entry | None:
        """With the write-ahead on: the first DRAM victim already on disk (it goes without a
        disk write) among the first ``scan`` evictable ones, else the first evictable one."""
        if not self._writes_ahead:
            return self._first_victim(DRAM, tenant)
        first: Entry | None = None
        for m in self.policy.victims(DRAM, tenant):
            if not self._evictable(m):
                continue
            e: Entry = m  # type: ignore[assignment]
            if e.on_disk:
                return e
            first = first or e
            scan -= 1
            if scan <= 0:
                break
        if first is not None:
            self.room_wanted.set()  # a put is about to wait for a disk write: write ahead
        return first

    def _first_victim(self, tier: str, tenant: str | None) -> Entry | None:
        for m in self.policy.victims(tier, tenant):
            if self._evictable(m):
                return m  # type: ignore[return-value]
        return None

    async def _evict_dram(self, e: Entry) -> None:
        """Take ``e`` out of DRAM, demoting it to disk first when that is possible."""
        if self.disk is not None and self.settings.demote and not e.on_disk and self.policy.admit(DISK, e):
            # The write runs in its own task: a requester that goes away must not strand a
            # half-recorded disk copy (the file would be written but never accounted).
            self._on_demand += 1  # the write-ahead steps aside while a put waits for a write
            try:
                await asyncio.shield(asyncio.ensure_future(self._demote_busy(e, self.disk)))
            finally:
                self._on_demand -= 1
            if e.dead:
                self._reap(e)
                return
        if e.readers or e.pins or e.dram is None:
            return  # a reader arrived while it was being written out; it stays, now clean
        self._free_dram(e.tenant, e.dram)
        e.dram = None
        self.policy.removed(DRAM, e)
        self._event(False, DRAM, e)
        self.metrics.evicted(DRAM)
        if not e.on_disk:
            del self._entries[e.key]

    async def _demote_busy(self, e: Entry, disk: DiskTier) -> None:
        e.busy += 1
        try:
            await self._demote(e, disk)
        finally:
            e.busy -= 1
            self._reap(e)

    async def _demote_batch(self, batch: list[Entry], disk: DiskTier) -> int:
        """Write ``batch`` to disk in one :meth:`DiskTier.write_many` (its blocks stay in
        DRAM); returns the bytes now on disk."""
        for e in batch:
            e.busy += 1
        try:
            results: list[Any] = []
            async with self._disk_writes:
                live = [e for e in batch if e.dram is not None and not (e.on_disk or e.dead)]
                try:
                    await self._reserve_disk(disk, sum(disk.estimate_bytes(e.size, e.tenant) for e in live))
                except TierFullError as err:
                    results = [err] * len(live)
                else:
                    items = [(e.record(), self.dram.views(e.dram) if self.dram.arena is not None else [])
                             for e in live if e.dram is not None]
                    results = disk.write_many(items) if self.dram.arena is None \
                        else await asyncio.to_thread(disk.write_many, items)
            for e, result in zip(live, results):
                await self._demoted(e, disk, result)
            return sum(e.size for e in live if e.on_disk)
        finally:
            for e in batch:
                e.busy -= 1
                self._reap(e)

    async def _demote(self, e: Entry, disk: DiskTier) -> None:
        if e.dram is None:
            return
        result: int | Exception
        try:
            async with self._disk_writes:  # one writer at a time: eviction's and the write-ahead's
                if e.dram is None or e.on_disk or e.dead:
                    return  # the other writer did it (or found it corrupt) while this one waited
                await self._reserve_disk(disk, disk.estimate_bytes(e.size, e.tenant))
                if self.dram.arena is None:  # accounts only (the trace replay): no bytes, no I/O
                    result = disk.write(e.record(), [])
                else:
                    result = await asyncio.to_thread(disk.write, e.record(), self.dram.views(e.dram))
        except (CorruptBlockError, TierFullError, TierIOError) as err:
            result = err
        await self._demoted(e, disk, result)

    async def _demoted(self, e: Entry, disk: DiskTier, result: int | Exception) -> None:
        """What a write of ``e`` to disk (its file's bytes, or the error) means for it."""
        if isinstance(result, CorruptBlockError):
            logger.warning("block %s failed its checksum on demotion; dropping it", e.key.hex())
            self.metrics.corrupt(DRAM)
            self._kill(e)
            return
        if isinstance(result, Exception):
            logger.warning("demotion of %s to disk failed: %s", e.key.hex(), result)
            self.metrics.demote_failed()
            return
        if e.dead:  # a reader found it corrupt while it was being written: no disk copy
            now = self._entries.get(e.key)
            if (now is None or not now.on_disk) and disk.record(e.key) == e.record():
                await self._delete_disk_file(disk, e.key)  # (not a newer block's copy)
            return
        e.on_disk = True
        self.policy.inserted(DISK, e)
        self._event(True, DISK, e)
        self.metrics.demoted(e.size)

    async def _reserve_disk(self, disk: DiskTier, need: int) -> None:
        while disk.free_bytes < need:
            victim = self._first_victim(DISK, None)
            if victim is None:
                raise TierFullError("disk tier is full of blocks being read")
            await self._evict_disk(disk, victim)

    async def _evict_disk(self, disk: DiskTier, e: Entry) -> None:
        e.on_disk = False
        self.policy.removed(DISK, e)
        self._event(False, DISK, e)
        self.metrics.evicted(DISK)
        if e.dram is None and self._entries.get(e.key) is e:
            del self._entries[e.key]
        await self._delete_disk_file(disk, e.key)

    async def _delete_disk_file(self, disk: DiskTier, key: bytes) -> None:
        try:
            if self.dram.arena is None:  # accounts only (the trace replay)
                disk.delete(key)
            else:
                await asyncio.to_thread(disk.delete, key)
        except TierIOError as err:
            logger.warning("could not delete %s from disk: %s", key.hex(), err)

    async def _promote(self, e: Entry) -> None:
        """Copy a disk-only block into DRAM; concurrent callers share one copy."""
        running = self._promoting.get(e.key)
        if running is None:
            # A task of its own: a reader cancelled mid-copy must not abandon the extents.
            # Busy from now on, not from when the task first runs: no eviction may take the
            # disk copy in between.
            e.busy += 1
            running = asyncio.ensure_future(self._promote_shared(e))
            self._promoting[e.key] = running
        await asyncio.shield(running)

    async def _promote_shared(self, e: Entry) -> None:
        try:
            await self._promote_once(e)
        finally:
            e.busy -= 1
            del self._promoting[e.key]

    async def _promote_once(self, e: Entry) -> None:
        disk = self.disk
        if disk is None:
            return
        if self.dram.footprint(e.size) > self.dram.capacity_bytes:
            # adopted from a disk written under a larger DRAM tier: it can never be served,
            # and trying would evict all of DRAM on every read
            logger.warning("block %s (%d bytes) is larger than the DRAM tier; dropping it", e.key.hex(), e.size)
            self._forget_disk(e)
            await self._delete_disk_file(disk, e.key)
            return
        try:
            extents = await self._reserve_dram(e.size, e.tenant, self.settings.tenants.get(e.tenant, TenantLimits()))
        except (TierFullError, QuotaError):
            self.metrics.promote_failed()
            return
        views = self.dram.views(extents) if self.dram.arena is not None else None
        try:
            if views is not None:
                await asyncio.to_thread(_read_scattered, disk, e.key, views)
        except CorruptBlockError:
            logger.warning("block %s failed its checksum on disk; dropping it", e.key.hex())
            self.metrics.corrupt(DISK)
            self._free_dram(e.tenant, extents)
            self._forget_disk(e)
            return
        except (TierIOError, KeyError, ValueError) as err:
            logger.warning("promotion of %s from disk failed: %s", e.key.hex(), err)
            self._free_dram(e.tenant, extents)
            self.metrics.promote_failed()
            if isinstance(err, TierIOError) and disk.contains(e.key):
                return  # a passing I/O error (EMFILE, EIO): the copy stays for a later read
            self._forget_disk(e)
            if isinstance(err, ValueError):  # the file does not hold this block
                await self._delete_disk_file(disk, e.key)
            return
        if e.dead:  # removed or found corrupt while it was read: nothing to hold in DRAM
            self._free_dram(e.tenant, extents)
            return
        e.dram = extents
        self.policy.inserted(DRAM, e)
        self._event(True, DRAM, e)
        self.metrics.promoted(e.size)

    def _forget_disk(self, e: Entry) -> None:
        """The disk copy is gone or bad: stop counting on it."""
        e.on_disk = False
        self.policy.removed(DISK, e, evicted=False)
        self._event(False, DISK, e)
        if e.dram is None:
            self._entries.pop(e.key, None)

    def _reap(self, e: Entry) -> None:
        """Free a dead block's DRAM once nobody reads or moves it any more."""
        if e.dead and e.readers == 0 and e.busy == 0 and e.dram is not None:
            self._free_dram(e.tenant, e.dram)
            e.dram = None

    def _kill(self, e: Entry) -> None:
        """Remove a corrupt block from every tier; its extents go with the last reader."""
        e.dead = True
        self._entries.pop(e.key, None)
        for s in self._sessions.values():  # pins go with the block, and so does what they held
            count = s.pins.pop(e.key, 0)
            if count:
                e.pins -= count
                self._hold(s, -s.pinned_sizes.pop(e.key, 0))
        if e.dram is not None:
            self.policy.removed(DRAM, e, evicted=False)
            self._event(False, DRAM, e)
            self._reap(e)
        if e.on_disk and self.disk is not None:
            self._forget_disk(e)
            self.disk.delete(e.key)


def _read_scattered(disk: DiskTier, key: bytes, views: list[memoryview]) -> None:
    """Read a disk block into one or more arena extents."""
    if len(views) == 1:
        disk.read_into(key, views[0])
        return
    buf = bytearray(sum(v.nbytes for v in views))
    disk.read_into(key, memoryview(buf))
    pos = 0
    for v in views:
        v[:] = buf[pos : pos + v.nbytes]
        pos += v.nbytes
