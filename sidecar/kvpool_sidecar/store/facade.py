"""The tiered block store: the only door to block bytes for the API, peers and membership.

Blocks enter the host tier (DRAM) through a two-phase put (:meth:`TieredStore.allocate`
reserves room and hands it to the writer, :meth:`TieredStore.commit` makes the block
visible with the writer's checksum) and move between the tiers of the store's list by
the :class:`~kvpool_sidecar.store.mover.Mover`: eviction demotes, reads promote. A read
(:meth:`TieredStore.acquire`) of a block the host tier lacks brings it there first;
concurrent reads of the same block share one copy. Read leases keep a block's host copy in
place until they are released, so a block being read is never evicted or overwritten.

Every lease belongs to a :class:`~kvpool_sidecar.store.leases.Session` (one client
connection). Closing a session aborts its writes, releases its reads and drops its pins.

Index updates (a block entered or left a tier) go to an
:class:`~kvpool_sidecar.events.IndexQueue` that the sidecar's publisher awaits. With KV
events on, the same moves of blocks that carry an engine identity go to an
:class:`~kvpool_sidecar.events.EngineEventQueue`, which never blocks the store.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool_client.protocol import PutStatus
from kvpool_sidecar.errors import NoCleanRoomError, QuotaError, TierFullError, TierIOError, UnknownLeaseError
from kvpool_sidecar.events import EngineEventQueue, EngineRef, IndexEvent, IndexQueue
from kvpool_sidecar.metrics import StoreMetrics
from kvpool_sidecar.policy import BlockMeta, EvictionPolicy, Hints
from kvpool_sidecar.store.accounting import DeferredPolicy
from kvpool_sidecar.store.entries import Entry, new_entry
from kvpool_sidecar.store.host import HostView
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store.leases import CHECK_BYTES_PER_S, CheckBudget, Deadlines, ReadLease, Session, WriteLease
from kvpool_sidecar.store.lineage import Lineage
from kvpool_sidecar.store.mover import Mover
from kvpool_sidecar.store.pins import Pins
from kvpool_sidecar.store.promotion import Promoter
from kvpool_sidecar.store.quotas import Quotas
from kvpool_sidecar.store.report import StoreReport
from kvpool_sidecar.store.settings import StoreSettings, TenantLimits
from kvpool_sidecar.store.writeahead import WriteAhead
from kvpool_sidecar.tiers.base import BlockRecord, DeviceTier, Tier, TierKind

logger = logging.getLogger(__name__)

#: Batches of copies into the host tier that one batch's prefetch runs at once.
PREFETCH_PARALLEL = 8

#: A session closed ``most`` leases at a time (:meth:`TieredStore.close_session`) gives back
#: the room of at most this many extents a lease on average in one call (a lease's room may
#: lie in up to :data:`~kvpool_sidecar.tiers.alloc.MAX_RUNS` of them, each freed one at a time).
CLOSE_EXTENTS_PER_LEASE = 16


def _refused(metrics: StoreMetrics, session: Session, key: bytes, status: PutStatus) -> tuple[PutStatus, None]:
    """A put refused: counted, and remembered by its session (:attr:`Session.refused`)."""
    session.refuse(key)
    metrics.put(status)
    return status, None


class TieredStore:
    """An ordered list of tiers (hottest first, DRAM among them), driven by a policy."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: EvictionPolicy,
        settings: StoreSettings,
        *,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        index_events: bool = True,
        engine_events: EngineEventQueue | None = None,
    ) -> None:
        kinds = [t.kind for t in tiers]
        if TierKind.DRAM not in kinds or len(set(kinds)) != len(kinds) \
                or kinds != sorted(kinds, key=lambda k: k.rank):
            raise ValueError("a store needs a DRAM tier, at most one tier of each kind, hottest first")
        self.tiers = list(tiers)
        #: The policy, its reordering after each answer (:mod:`kvpool_sidecar.store.accounting`).
        self.policy = policy = DeferredPolicy(policy)
        policy.sized(sum(t.capacity_bytes for t in self.tiers))
        policy.bounded(frozenset(name for name, limits in settings.tenants.items() if limits.quota_bytes is not None))
        self.metrics = metrics or StoreMetrics(None)
        self.block_max_bytes = settings.block_max_bytes
        self._settings = settings
        self._host = kinds.index(TierKind.DRAM)
        self._clock = clock
        self._entries: dict[bytes, Entry] = {}
        #: Keys allocated and not committed yet, with their parents (a put's lineage walks
        #: them: the pieces of one chain put in several requests).
        self._pending: dict[bytes, bytes | None] = {}
        #: Clients' write leases in the order they lapse.
        self._deadlines = Deadlines()
        self._ids = itertools.count(1)
        self._sessions: dict[int, Session] = {}
        #: Per tenant, the corrupt reports the store may still check (see :class:`CheckBudget`).
        self._checks: dict[str, CheckBudget] = {}
        self._quotas = Quotas(settings, self.tiers[self._host].capacity_bytes, self.tiers[self._host].footprint)
        #: Index updates for the publisher (None: not kept, as in the trace replay).
        self.index_events: IndexQueue | None = IndexQueue() if index_events else None
        #: KV events (blocks with an engine identity entering or leaving a tier), when on.
        self.engine_events = engine_events
        #: The sessions' pins, and the sessions that pin each key.
        self._pins = Pins(self.tiers, policy, self._quotas, self._entries, self._sessions)
        self._mover = Mover(self.tiers, self._host, policy, settings, self._quotas, self.metrics,
                            self._entries, self._event, self._pins.unpin_all)
        #: Each block's copies and their room (:class:`~kvpool_sidecar.store.ledger.Ledger`).
        self._ledger = self._mover.ledger
        self._promoter = Promoter(self._mover)
        self._writer = WriteAhead(self._mover)
        #: Set when the host tier's free or clean room falls short: wakes the write-ahead.
        self.room_wanted = self._mover.room.room_wanted
        #: Whether a background writer copies blocks down ahead of need (:meth:`write_ahead`).
        self.writes_ahead = self._mover.room.writes_ahead
        #: Whether local engines may read GPU-tier copies in place (:meth:`acquire_device`).
        self.device_reads = self._host > 0 and isinstance(self.tiers[self._host - 1], DeviceTier)
        #: The host tier's arenas as local clients and peers reach them.
        self.host = HostView(self.tiers[self._host])
        #: What the store holds, for the index, KV events, metrics and status.
        self.report = StoreReport(self.tiers, self._mover, self._entries, self._sessions, self._pending,
                                  self.metrics, self.host)
        #: A fresh :class:`~kvpool_sidecar.store.lineage.Lineage` for the puts of one request.
        self.lineage: Callable[[], Lineage] = functools.partial(Lineage, self._entries, self._pending)

    # ----------------------------------------------------------------- lifecycle
    async def open(self) -> int:
        """Adopt the blocks the tiers kept from a previous run (a warm restart); how many."""
        adopted = 0
        for i, tier in enumerate(self.tiers):
            if tier.blocking and not tier.accounts_only:
                found = await asyncio.to_thread(tier.recover)
            else:
                found = tier.recover()
            for record, place in found:
                if record.size > self.block_max_bytes and i != self._mover.host:
                    # written under a larger max_block_bytes: no put could store it now, and a
                    # client sizes what it accepts by the limit (an ACQUIRE answer of such
                    # blocks in many extents can exceed it); its room goes back
                    warn_once(logger, "oversized-on-open", "dropping block %s of %d bytes kept by the %s tier: "
                              "larger than max_block_bytes (%d)", record.key.hex(), record.size, tier.kind.value,
                              self.block_max_bytes)
                    self._ledger.took(i, record.tenant, record.size)  # (as its release will count)
                    self._ledger.release_soon(i, record.size, record.tenant, place)
                    continue
                e = self._entries.get(record.key)
                if e is None:
                    limits = self._quotas.limits_or_default(record.tenant)
                    e = new_entry(BlockMeta(record.key, record.size, record.tenant, limits.priority),
                                  record.checksum, len(self.tiers))
                    self._entries[record.key] = e
                    adopted += 1
                elif e.record() != record or e.place(i) is not None:
                    continue
                self._ledger.adopted(i, e, place)
        for i, tier in enumerate(self.tiers):
            # more kept than the tier holds now (a smaller size, or a larger least charge a
            # block, than the run that wrote them): the policy's first victims go now, in one
            # batch, not one by one in the first put that needs room below, which would wait
            # for every one of them (65,536 blocks of a few bytes on a tier that now holds 4,096)
            over = sum(self._ledger.cold_used[i].values()) - tier.capacity_bytes if i != self._host else 0
            if over > 0:
                warn_once(logger, f"over-on-open-{i}", "the %s tier keeps %d bytes more than it holds now; "
                          "evicting the policy's first victims", tier.kind.value, over)
                await self._mover.room.evict_many(i, self._mover.room.victims_for(i, over, set()))
        return adopted

    async def settle(self) -> None:
        """Wait for the background copies under way (promotions to a hotter tier), and for
        every call in a thread on the tiers' bytes, also one whose caller was cancelled (a
        write-ahead's batch at shutdown)."""
        await self._promoter.settle()
        await self._mover.threads.settle()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    # ----------------------------------------------------------------- sessions
    def open_session(self, tenant: str = "default", *, expiring: bool = True) -> Session:
        s = Session(next(self._ids), tenant, expiring=expiring)
        self._sessions[s.id] = s
        return s

    def close_session(self, session: Session, most: int | None = None) -> bool:
        """Abort writes, release reads and drop pins of a closed or dead client: all of them,
        or at most ``most`` of each kind; whether the session is closed (none left). A
        client's connection closes its session ``most`` at a time, each slice a step of the
        tenant's turns (``api/connection.py``): one that held 262,144 write leases had stalled the
        event loop for 1.5 s as it closed (a review). With ``most``, the leases of one call
        give back at most :data:`CLOSE_EXTENTS_PER_LEASE` times ``most`` extents together
        (and at least one lease)."""
        budget = None if most is None else most * CLOSE_EXTENTS_PER_LEASE

        def spend(lease: WriteLease | ReadLease) -> bool:
            """Whether the call may give back one more lease's room (then it is spent)."""
            nonlocal budget
            if budget is None:
                return True
            if budget <= 0:
                return False
            budget -= lease.extents
            return True

        for lease_id, w in list(itertools.islice(session.writes.items(), most)):
            if not spend(w):
                return False
            self.abort(session, lease_id)
        for lease_id, w in list(itertools.islice(session.lapsed.items(), most)):
            if not spend(w):
                return False
            self._settle_lapsed(session, lease_id)
        for lease_id, r in list(itertools.islice(session.reads.items(), most)):
            if not spend(r):
                return False
            self.release(session, lease_id)
        if not self._pins.drop(session, most) or session.writes or session.lapsed or session.reads:
            return False
        self._quotas.hold(session, -session.held_bytes)
        self._sessions.pop(session.id, None)
        return True

    def expire_leases(self) -> int:
        """End write leases past their deadline (a stuck writer); returns how many.

        The key is free for another writer and a late commit is refused; the room stays
        held (``Session.lapsed``, in the session's share) until that late commit or an abort
        says the writer is done with it, or the session closes: a writer that is slow, not
        dead, may still copy into it, and another block placed there would get those bytes
        (a reader in place that checked it first, or a block stored in place and checksummed
        over its room, would serve them: docs/security.md). Read leases
        never expire while their client is connected either: it may still be reading the
        bytes in place, and reusing them would hand it another block's bytes.
        """
        expired = 0
        for s, w in self._deadlines.due(self._clock()):  # (those past it alone: see Deadlines)
            if s.writes.get(w.id) is w:
                del s.writes[w.id]
                self._pending.pop(w.meta.key, None)
                s.lapsed[w.id] = w  # its room stays held, counted in the session's share
                expired += 1
        return expired

    async def write_ahead(self) -> int:
        """Copy cold host-tier blocks down ahead of need (see :mod:`~kvpool_sidecar.store.writeahead`)."""
        return await self._writer.write_ahead()

    # ----------------------------------------------------------------- queries
    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[list[Any]]]:
        """The longest prefix of ``keys`` held here, and where: ``[[tier, run length], ...]``
        (each block's hottest tier)."""
        found = list(map(self._entries.get, keys))  # the hot loop runs in C
        try:
            n = found.index(None)
        except ValueError:
            n = len(found)
        names = self._mover.names
        best = [names[e.best] for e in found[:n]]  # type: ignore[union-attr]
        runs = [[name, len(list(g))] for name, g in itertools.groupby(best)]
        self.metrics.lookup(n, len(keys) - n)
        return n, runs

    def limits(self, tenant: str) -> TenantLimits:
        return self._quotas.limits(tenant)

    def knows_tenant(self, tenant: str) -> bool:
        return self._quotas.knows(tenant)

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
        lineage: Lineage | None = None,
        waits: bool | None = None,
    ) -> tuple[PutStatus, WriteLease | None]:
        """Phase one of a put: reserve room in the host tier for ``key``, made from any
        block but ``key``'s own ancestors (:mod:`~kvpool_sidecar.store.lineage`; ``lineage``
        follows the chains of one request, :attr:`lineage`). ``waits``: whether room that
        only a disk write would make is waited for (None: ``put_waits_for_disk``; a block
        fetched for a reader waits, as a promotion does)."""
        tenant = tenant or session.tenant
        limits = self.limits(tenant)
        host = self.tiers[self._host]
        if self.engine_events is None:
            engine = None  # an engine's identity is kept for KV events alone: no memory for nothing
        if size <= 0 or size > self.block_max_bytes or host.footprint(size, tenant) > host.capacity_bytes:
            return PutStatus.TOO_LARGE, None
        held = self._entries.get(key)
        if held is not None:
            # As this put places it (a block adopted from disk or fetched from a peer was
            # stored without its place in this chain). Another tenant's put (a key space
            # shared) says where the block is in its chain, not what its owner's requests
            # are: its hints are not the owner's; and a tenant a quota bounds moves nothing
            # of the policy's through another's block (see EvictionPolicy.bounded).
            if held.tenant == tenant or limits.quota_bytes is None:
                self.policy.bypassed(self._mover.names[held.best],
                                     BlockMeta(key, held.size, held.tenant, held.priority, depth, parent,
                                               hints=hints if held.tenant == tenant else None))
            if held.engine is None and engine is not None and held.tenant == tenant \
                    and 4 * len(engine.token_ids) <= held.size:  # (bounded by the block held, not the one claimed)
                held.engine = engine
                if self.engine_events is not None:  # named only now: announce where it is
                    for i in held.held():
                        self.engine_events.put(True, self._mover.names[i], held.tenant, engine)
            if session.refused:
                session.refused.pop(key, None)  # (held now: its chain goes on)
            return PutStatus.EXISTS, None
        if key in self._pending:
            return PutStatus.PENDING, None
        if parent is not None and parent in session.refused and parent not in self._entries:
            return _refused(self.metrics, session, key, PutStatus.FULL)  # behind a block refused: unreachable
        weight = self._quotas.weight(size, tenant)
        if self._quotas.over_cap(session, weight):
            return _refused(self.metrics, session, key, PutStatus.QUOTA)
        meta = BlockMeta(key, size, tenant, limits.priority, depth, parent, hints=hints)
        if not self.policy.admit(self._mover.names[self._host], meta):
            return _refused(self.metrics, session, key, PutStatus.REJECTED)
        self._pending[key] = parent
        keep = (lineage or self.lineage()).ancestors(key, parent)
        try:
            place = await self._mover.room.reserve(self._host, meta_record(meta), limits, keep,
                                                   waits=self._settings.put_waits_for_disk if waits is None else waits)
        except QuotaError:
            self._pending.pop(key, None)
            return _refused(self.metrics, session, key, PutStatus.QUOTA)
        except TierFullError as e:
            self._pending.pop(key, None)
            if isinstance(e, NoCleanRoomError):
                self.metrics.no_clean_room()
            return _refused(self.metrics, session, key, PutStatus.FULL)
        except BaseException:
            # Cancelled (the writer's connection died while evicting) or failed: free the key.
            self._pending.pop(key, None)
            raise
        if session.refused:
            # refused before (a chain put again once there is room): the blocks after it are
            # reachable again, though it is only pending while they are allocated
            session.refused.pop(key, None)
        lease = WriteLease(next(self._ids), meta, place, self._clock() + self._settings.lease_timeout_s, engine)
        session.writes[lease.id] = lease
        self._deadlines.add(session, lease)
        self._quotas.hold(session, weight)
        if self.writes_ahead and host.free_bytes < self._settings.clean_share * host.capacity_bytes \
                and self._writer.taken(host.footprint(size, tenant)):
            self.room_wanted.set()
        return PutStatus.ALLOCATED, lease

    def commit(self, session: Session, lease_id: int, checksum: int) -> PutStatus:
        """Phase two of a put: the bytes are written; make the block visible."""
        lease = session.writes.pop(lease_id, None)
        if lease is None:
            self._settle_lapsed(session, lease_id)
            raise UnknownLeaseError(f"no write lease {lease_id} in this session")
        self._deadlines.discard(lease_id)
        m = lease.meta
        self._quotas.hold(session, -self._quotas.weight(m.size, m.tenant))
        self._pending.pop(m.key, None)
        e = new_entry(m, checksum, len(self.tiers), lease.engine)
        self._entries[m.key] = e
        self._ledger.placed(self._host, e, lease.place)
        self.metrics.put(PutStatus.STORED, m.size)
        return PutStatus.STORED

    def abort(self, session: Session, lease_id: int) -> None:
        lease = session.writes.pop(lease_id, None)
        if lease is None:
            self._settle_lapsed(session, lease_id)
            raise UnknownLeaseError(f"no write lease {lease_id} in this session")
        self._deadlines.discard(lease_id)
        self._quotas.hold(session, -self._quotas.weight(lease.meta.size, lease.meta.tenant))
        self._pending.pop(lease.meta.key, None)
        self._ledger.release(self._host, lease.meta.size, lease.meta.tenant, lease.place)

    def _settle_lapsed(self, session: Session, lease_id: int) -> None:
        """A late commit or abort of a lease that expired: the writer is done with its room,
        which comes back (the late commit is refused all the same: the key went to others)."""
        lapsed = session.lapsed.pop(lease_id, None)
        if lapsed is not None:
            self._quotas.hold(session, -self._quotas.weight(lapsed.meta.size, lapsed.meta.tenant))
            self._ledger.release(self._host, lapsed.meta.size, lapsed.meta.tenant, lapsed.place)

    # ----------------------------------------------------------------- get
    async def prefetch(self, keys: Sequence[bytes]) -> None:
        """Bring the blocks among ``keys`` that the host tier lacks (a batch about to be
        acquired one by one) into it together, in up to :data:`PREFETCH_PARALLEL` batches at
        once: what the page cache holds is copied at once, the rest in one call to a thread
        per batch that hints its reads first, so that they overlap on the device instead of
        waiting one after another. A batch larger than a quarter of the host tier is only
        hinted, and left to the acquires (bringing it all first could evict its own head)."""
        host = self._host
        cold = [e for k in keys if (e := self._entries.get(k)) is not None and e.place(host) is None
                and e.best >= 0 and not e.dead]
        if len(cold) < 2:
            return
        room = self.tiers[host]
        if sum(room.footprint(e.size, e.tenant) for e in cold) <= room.capacity_bytes // 4:
            await self._promoter.bring_many(cold, host, PREFETCH_PARALLEL)
            return
        for i, tier in enumerate(self.tiers):
            places = [e.place(i) for e in cold if e.best == i]
            if i != host and tier.blocking and not tier.accounts_only and len(places) > 1:
                await asyncio.to_thread(tier.prefetch, places)

    async def acquire(self, session: Session, key: bytes) -> ReadLease | None:
        """Keep ``key``'s host-tier copy in place for reading (bringing it there first);
        None on a miss."""
        host = self._host
        e = self._entries.get(key)
        if e is not None and e.place(host) is None and not e.dead:
            await self._promoter.bring(e, host)
        place = None if e is None else e.place(host)
        weight = 0 if e is None else self._quotas.weight(e.size, e.tenant)
        if e is None or place is None or e.dead or self._quotas.over_cap(session, weight):
            self.metrics.get(hit=False)
            return None
        self._quotas.hold(session, weight)
        e.readers += 1
        e.hits += 1
        self._promoter.hit(e)
        lease = ReadLease(next(self._ids), e, place)
        session.reads[lease.id] = lease
        self.metrics.get(hit=True, size=e.size)
        return lease

    async def acquire_device(self, session: Session, key: bytes) -> tuple[ReadLease, dict[str, Any]] | None:
        """Keep ``key``'s GPU-tier copy in place for a local engine on the same device, and
        the CUDA IPC descriptor it opens it with; None where the GPU tier holds no copy."""
        up = self._host - 1
        tier = self.tiers[up] if up >= 0 else None
        e = self._entries.get(key)
        place = None if e is None else e.place(up)
        weight = 0 if e is None else self._quotas.weight(e.size, e.tenant)
        if not isinstance(tier, DeviceTier) or e is None or place is None or e.dead \
                or self._quotas.over_cap(session, weight):
            self.metrics.get(hit=False)
            return None
        descriptor = tier.ipc_descriptor(place)
        self._quotas.hold(session, weight)
        e.readers += 1
        e.hits += 1
        self.policy.accessed(self._mover.names[up], e)
        lease = ReadLease(next(self._ids), e, place, device=True)
        session.reads[lease.id] = lease
        self.metrics.get(hit=True, size=e.size)
        return lease, descriptor

    def check_budget(self, tenant: str) -> CheckBudget:
        """``tenant``'s budget of corrupt reports checked (shared by its connections)."""
        budget = self._checks.get(tenant)
        if budget is None:
            budget = self._checks[tenant] = CheckBudget()
        return budget

    def release(self, session: Session, lease_id: int, *, corrupt: bool = False) -> None:
        """End a read; ``corrupt`` reports that the reader's checksum did not match."""
        lease = session.reads.pop(lease_id, None)
        if lease is None:
            raise UnknownLeaseError(f"no read lease {lease_id} in this session")
        e = lease.entry
        self._quotas.hold(session, -self._quotas.weight(e.size, e.tenant))
        if corrupt and not e.dead and not self.check_budget(session.tenant).may_check(e.size):
            warn_once(logger, "corrupt-reports", "a tenant's clients report more blocks corrupt than the sidecar "
                      "checks (%d MiB/s a tenant); the rest are kept unchecked", CHECK_BYTES_PER_S >> 20)
            corrupt = False
        if corrupt and not e.dead and self._mover.intact(e, self._host - 1 if lease.device else self._host, lease.place):
            # a client's word is not proof: the bytes check out, so the block stays
            warn_once(logger, "false-corrupt-report", "a client reported block %s corrupt, but it matches its "
                      "checksum; kept (one line a minute)", e.key.hex())
            corrupt = False
        e.readers -= 1
        if e.held_back and not e.readers:
            self._pins.unpinned(e)  # (its place back in the policy's order, unless pinned)
        if corrupt and not e.dead:
            tier = self._mover.names[self._host - 1 if lease.device else self._host]
            logger.warning("block %s failed its checksum in the %s tier; dropping it", e.key.hex(), tier)
            self.metrics.corrupt(tier)
            self._ledger.kill(e)
        self._ledger.reap(e)

    # ----------------------------------------------------------------- pins
    def pin(self, session: Session, keys: Sequence[bytes]) -> int:
        """Keep these blocks from eviction while the session lives; returns how many. Only
        blocks the session's tenant wrote are pinned (as only those are removed: tenants that
        share a key space cannot keep each other's blocks from eviction)."""
        return self._pins.pin(session, keys)

    def unpin(self, session: Session, keys: Sequence[bytes]) -> int:
        return self._pins.unpin(session, keys)

    # ----------------------------------------------------------------- remove
    def remove(self, session: Session, keys: Sequence[bytes]) -> int:
        """Delete blocks from every tier of this node (a client's explicit delete); returns
        how many went. ``keys`` are store keys: the API scoped them to the asker's key space.

        A removed block is gone at once for new readers, the index and the policy (as lost,
        not evicted: a removal says nothing of its worth). A reader that holds it keeps its
        pages until it releases them, so freed bytes are never served; pins on it, by any
        session, go with it. A block being brought to the host tier right now stays and is
        not counted (ask again). Copies other nodes hold are theirs: they stay. Only blocks
        the session's tenant wrote go: tenants that share a key space cannot delete each
        other's.
        """
        n = 0
        for k in keys:
            e = self._entries.get(k)
            if e is None or self._promoter.moving(k) or e.tenant != session.tenant:
                continue
            try:
                self._ledger.kill(e)  # a copy in flight finds the block dead and drops what it wrote
            except TierIOError as err:  # forgotten by the tier; only its bytes stay behind
                logger.warning("could not delete removed block %s everywhere: %s", k.hex(), err)
            n += 1
        return n

    # ----------------------------------------------------------------- internals
    def _event(self, publish: bool, tier: str, e: Entry) -> None:
        if self.index_events is not None:
            self.index_events.put(IndexEvent(publish, tier, e.key))
        if e.engine is not None and self.engine_events is not None:
            self.engine_events.put(publish, tier, e.tenant, e.engine)


def meta_record(meta: BlockMeta) -> BlockRecord:
    """The record a tier reserves room for (the checksum is not known yet)."""
    return BlockRecord(meta.key, meta.size, 0, meta.tenant)
