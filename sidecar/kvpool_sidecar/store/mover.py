"""Room in each tier, and copies between tiers: eviction, demotion and promotion.

The store's tiers form one list, hottest first (GPU, DRAM, disk); one of them, the host
tier (DRAM), is where puts land and local clients read. Whatever the pair of tiers, a
block moves the same way:

- **room**: :meth:`Mover.reserve` asks the tier for room and, while there is none, evicts
  the policy's first evictable victim of that tier (a tenant over its quota evicts its
  own first; with the write-ahead on, the first one already copied down and the run of
  such blocks right after it, :meth:`Mover.clean_victims`);
- **eviction**: :meth:`Mover.evict` first copies the victim one tier down when no colder
  tier holds it and the policy admits it there (demotion instead of loss), then drops it;
- **copies**: a copy in flight keeps its block ``busy`` (no eviction takes its source),
  runs in a thread when either tier blocks, and is checked on the way (a corrupt block is
  dropped from every tier: :class:`~kvpool_sidecar.store.facade.TieredStore` kills it);
- **promotion**: a read of a block the host tier lacks brings it from the nearest tier
  holding it (concurrent readers share one copy); a block read ``promote_hits`` times is
  copied up to the tier above the host tier in the background.

Locks are always taken down the list (a tier's writers, then its room, then the next
tier's), so movers never wait on each other in a cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence, Set as AbstractSet
from typing import Any, TypeVar, cast

from kvpool_client.integrity import checksum
from kvpool_sidecar.errors import CorruptBlockError, QuotaError, TierError, TierFullError, TierIOError
from kvpool_sidecar.metrics import StoreMetrics
from kvpool_sidecar.policy import BlockMeta, EvictionPolicy
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.quotas import Quotas
from kvpool_sidecar.store.settings import StoreSettings, TenantLimits
from kvpool_sidecar.tiers.base import BlockRecord, Detaching, Place, Tier, WriteResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: What a copy between tiers may fail with (a tier's own errors, TierIOError, TierFullError,
#: among them): the copy's result, never an error of the task that asked for it.
_COPY_ERRORS = (CorruptBlockError, TierError, KeyError, ValueError)

#: The largest block a promotion reads on the event loop when the page cache holds it, and
#: the most bytes one batch reads there: larger ones wait for a thread, as all reads did.
INLINE_BLOCK_BYTES = 4 << 20
INLINE_BATCH_BYTES = 16 << 20

#: With the write-ahead on, a put that finds the host tier full drops its victim and the run
#: of clean blocks (copied down already: they go without a write) right after it in the
#: policy's order, until they make this many times its own room: the next puts find room free
#: instead of each walking again past the blocks the write-ahead is copying at the cold end
#: (33 of them a walk in ``make demo``, where those walks took 13% of the sidecar's CPU).
CLEAN_ROOM_PER_WALK = 8


def _copy_between(src: Tier, src_place: Place, dst: Tier, dst_place: Place, record: BlockRecord) -> None:
    """One block's bytes from ``src`` to ``dst``, checked by whichever tier sees them."""
    views = src.views(src_place)
    if views is not None:
        dst.write_copy(dst_place, record, views)
        return
    into = dst.views(dst_place)
    if into is not None:
        src.read_copy(src_place, record, into)
        return
    buf = memoryview(bytearray(record.size))
    src.read_copy(src_place, record, [buf])
    dst.write_copy(dst_place, record, [buf])


def _hints(planned: Sequence[tuple[Entry, int, Place]], which: Sequence[int], tiers: Sequence[Tier]
           ) -> list[Callable[[], object]]:
    """Read-ahead hints for the copies ``which`` of ``planned``: to each blocking tier that
    several of them come from, their places there."""
    by_tier: dict[int, list[Place]] = {}
    for k in which:
        e, src, _ = planned[k]
        where = e.place(src)
        if tiers[src].blocking and where is not None:
            by_tier.setdefault(src, []).append(where)
    return [functools.partial(tiers[i].prefetch, places) for i, places in by_tier.items() if len(places) > 1]


def _run_copies(copies: Sequence[Callable[[], None] | Exception | None],
                hints: Sequence[Callable[[], object]] = ()) -> list[Exception | None]:
    """Run each copy (an error or None stands for its own result); each one's error or None.
    ``hints`` run first (read-ahead; a failed one is only a lost hint)."""
    for hint in hints:
        with contextlib.suppress(OSError):
            hint()
    out: list[Exception | None] = []
    for copy in copies:
        if copy is None or isinstance(copy, Exception):
            out.append(copy)
            continue
        try:
            copy()
        except _COPY_ERRORS as err:
            out.append(err)
        else:
            out.append(None)
    return out


def _thread_done(fut: asyncio.Future[Any]) -> None:
    """Take the outcome of a call in a thread whose caller was cancelled, so that its error
    is not reported as never retrieved (the caller, when there is one, gets it too)."""
    if not fut.cancelled():
        fut.exception()


def _finished(task: asyncio.Future[Any]) -> None:
    """Log the error of a copy that runs to its end whoever waits for it (:meth:`Mover.finishing`)."""
    if not task.cancelled() and task.exception() is not None:
        warn_once(logger, "copy-task", "a copy between tiers failed: %r", task.exception())


def _free_all(frees: Sequence[tuple[str, Callable[[], None]]]) -> None:
    """Run each ``(tier name, release)`` (in a thread); one that fails leaves its bytes
    behind, not the others."""
    for tier, free in frees:
        try:
            free()
        except (TierIOError, OSError) as err:  # forgotten by the tier; only its bytes linger
            logger.warning("could not free a block's room in the %s tier: %s", tier, err)
        except Exception:  # noqa: BLE001 - task guard: the other releases of the batch still run
            logger.exception("freeing a block's room in the %s tier failed", tier)


def _note_pinned(m: BlockMeta, pinned: list[Entry]) -> None:
    """Add ``m`` to ``pinned`` when it is a block a client pinned."""
    if isinstance(m, Entry) and m.pins:
        pinned.append(m)


class Mover:
    """Room and copies for the store's tiers (see the module docstring)."""

    def __init__(self, tiers: Sequence[Tier], host: int, policy: EvictionPolicy, settings: StoreSettings,
                 quotas: Quotas, metrics: StoreMetrics, entries: dict[bytes, Entry],
                 announce: Callable[[bool, str, Entry], None], corrupt: Callable[[Entry], None],
                 unpin_all: Callable[[Entry], None] | None = None) -> None:
        self.tiers = list(tiers)
        self.names = [t.kind.value for t in tiers]
        self.host = host
        self.policy = policy
        self.settings = settings
        self.quotas = quotas
        self.metrics = metrics
        self._entries = entries
        self._announce = announce
        self._corrupt = corrupt
        #: Takes the sessions' pins off a block that left the store with pins on it.
        self._unpin_all = unpin_all
        #: Blocks each tier holds.
        self.blocks = [0] * len(tiers)
        #: Per tier other than the host tier, what each tenant's blocks take there: a tenant
        #: with a quota has the same share of each of them as of the host tier (:meth:`reserve`).
        self.cold_used: list[Counter[str]] = [Counter() for _ in tiers]
        self.room = [asyncio.Lock() for _ in tiers]
        #: One writer at a time into a tier whose copies block (the eviction's and the
        #: write-ahead's disk writes take turns).
        self.writes = [asyncio.Lock() for _ in tiers]
        self.on_demand = 0  # evictions waiting for their block's copy down
        #: Set when the host tier's free or clean room falls below ``clean_share``.
        self.room_wanted = asyncio.Event()
        #: Calls running in threads on the tiers' bytes (:meth:`in_thread`).
        self._threads: set[asyncio.Future[Any]] = set()
        #: Releases of blocks that left every tier, still to run in a thread (:meth:`retire`).
        self._frees: list[tuple[str, Callable[[], None]]] = []
        #: Copies that run to their end whoever waited for them (:meth:`finishing`).
        self._finishing: set[asyncio.Future[Any]] = set()

    def _start_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._threads.add(fut)
        fut.add_done_callback(_thread_done)
        fut.add_done_callback(self._threads.discard)
        return fut

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread, which :meth:`settle_threads` waits for even when its
        caller is cancelled (a stopping sidecar cancels the write-ahead): the tiers must not
        close under a copy that still reads or writes them."""
        return await asyncio.shield(self._start_thread(fn, *args))

    def finishing(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """``coro`` in a task of its own, which :meth:`settle_threads` waits for: a copy whose
        bytes were written must also land (be placed, or forgotten by the tier where its block
        was removed meanwhile) when the put that waited for it is cancelled (its client went
        away, the sidecar stops). Await it shielded; its error is logged here too (its caller
        may be gone)."""
        task = asyncio.ensure_future(coro)
        self._finishing.add(task)
        task.add_done_callback(_finished)
        task.add_done_callback(self._finishing.discard)
        return task

    async def settle_threads(self) -> None:
        """Wait for every call :meth:`in_thread` started, the copies :meth:`finishing` runs,
        and the releases still to run."""
        while self._threads or self._frees or self._finishing:
            self._flush_frees()
            await asyncio.wait(self._threads | self._finishing)

    # ------------------------------------------------------------- bookkeeping
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
        self._charge(i, tenant, -tier.footprint(size, tenant))

    async def release_later(self, i: int, freed: Sequence[tuple[int, str, Place]]) -> None:
        """:meth:`release` of each ``(size, tenant, place)``; where the tier's releases block,
        each copy is forgotten by the tier at once and its room freed in one hop to a thread
        (the place of a disk copy is its key: a release that looked the key up later, in the
        thread, had freed whatever block was written under the key meanwhile)."""
        frees = [(self.names[i], f) for f in (self._detach_place(i, size, tenant, place)
                                               for size, tenant, place in freed) if f]
        if frees:
            await self.in_thread(_free_all, frees)

    def release_soon(self, i: int, size: int, tenant: str, place: Place) -> None:
        """:meth:`release` from code that cannot wait: what blocks runs in a thread that the
        releases of one turn of the event loop share (a client's REMOVE of 4,096 blocks on disk
        had punched their holes on the event loop, every other client waiting 0.3 s)."""
        free = self._detach_place(i, size, tenant, place)
        if free is None:
            return
        self._frees.append((self.names[i], free))
        if len(self._frees) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._flush_frees)
            except RuntimeError:  # no event loop (a store driven without one): here
                self._flush_frees()

    def _flush_frees(self) -> None:
        frees, self._frees = self._frees, []
        if not frees:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            _free_all(frees)
            return
        self._start_thread(_free_all, frees)

    def _detach_place(self, i: int, size: int, tenant: str, place: Place) -> Callable[[], None] | None:
        """Tier ``i`` forgets the block at ``place``: what frees its room, where that blocks
        (else it is free already, and None)."""
        tier = self.tiers[i]
        if not tier.release_blocks or tier.accounts_only:
            self.release(i, size, tenant, place)
            return None
        free = cast(Detaching, tier).detach(place)  # (a tier whose releases block is one: the contract's)
        self._charge(i, tenant, -tier.footprint(size, tenant))
        return free

    def _detach(self, i: int, e: Entry, *, evicted: bool = True) -> Place | None:
        """Tier ``i``'s copy of ``e`` is no longer the block's (the block goes when it was its
        last copy); where it was, for its room to be released (None: there was none)."""
        place = e.place(i)
        if place is None:
            return None
        self.forget(i, e, evicted=evicted)
        e.copies[i] = None  # type: ignore[index]
        if e.best < 0 and self._entries.get(e.key) is e:
            del self._entries[e.key]
            if e.pins and self._unpin_all is not None:
                # its last copy was lost (a pinned block is never evicted): the pins go with
                # it, or a session's count would stay, holding its share, and unpin the next
                # block put under the key though another client pinned that one
                self._unpin_all(e)
        return place

    async def drop(self, i: int, e: Entry, *, evicted: bool = True) -> None:
        """Take tier ``i``'s copy of ``e`` away; the block goes when it was the last copy."""
        place = self._detach(i, e, evicted=evicted)
        if place is not None:
            await self.release_later(i, [(e.size, e.tenant, place)])

    def retire(self, e: Entry) -> None:
        """A dead block (:meth:`TieredStore._kill`) leaves every tier: its room in the host
        tier, and in a device tier above it, when its last reader and mover let go (a read
        lease there reads the copy in place: a device lease's engine copies it with no check
        of its own, so its pages must not hold another block until the lease goes), in the
        colder tiers at once (a copy still reading it fails its checksum; a disk file must go
        before another block takes its name)."""
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

    # ------------------------------------------------------------- room
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

    def unpinned(self, e: Entry) -> None:
        """``e``'s last pin went: in each tier whose order it was held back in (see
        :meth:`hold_back`), it takes back its place."""
        for i in e.held():
            self.policy.restored(self.names[i], e)

    def hold_back(self, i: int, pinned: list[Entry]) -> None:
        """Hold back the pinned blocks a search for victims walked past: they go after every
        block of tier ``i`` that may be evicted, until their last pin goes (:meth:`unpinned`).
        After the walk: its lists must not change under it. A client that pins its share of
        the tier at the cold end otherwise made every put on the node walk past all of its
        pins (20,000 of them: 4 to 5 ms a block allocated); the write-ahead's walk, each pass."""
        for e in pinned:
            if e.pins and e.place(i) is not None:
                self.policy.skipped(self.names[i], e)

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
        for e in victims:
            if e.readers or e.pins or e.busy:
                continue
            place = self._detach(i, e)
            if place is not None:
                freed.append((e.size, e.tenant, place))
                self.metrics.evicted(self.names[i])
        if freed:
            await self.release_later(i, freed)

    @property
    def writes_ahead(self) -> bool:
        """Whether the host tier's blocks are copied down ahead of need (:meth:`write_ahead`)."""
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
                      keep: AbstractSet[bytes] = frozenset()) -> Place:
        """Room for ``record`` in tier ``i``, evicting as needed, but never the last copy of
        one of ``keep`` (a put's own ancestors, :meth:`evict`); ``limits``: the tenant's
        quota applies (host tier only). QuotaError, TierFullError when there is none."""
        tier, tenant = self.tiers[i], record.tenant
        need = tier.footprint(record.size, tenant)
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
            async with self.room[i]:
                while not self.within_share(i, tenant, need):
                    victim = self.victim(i, tenant)
                    if victim is None:
                        raise QuotaError(f"tenant {tenant!r} holds its share of the {self.names[i]} tier")
                    await self.evict(i, victim, keep)
        if quota is None or not self.quotas.over_quota(tenant, quota, need):
            place = tier.reserve(record)
            if place is not None:
                self._charge(i, tenant, need)
                return place
        async with self.room[i]:
            while quota is not None and self.quotas.over_quota(tenant, quota, need):
                victim = self.clean_victim(i, tenant)
                if victim is None:
                    raise QuotaError(f"tenant {tenant!r} is at its quota and holds only pinned blocks")
                await self.evict(i, victim, keep)
            while True:
                place = tier.reserve(record)
                if place is not None:
                    self._charge(i, tenant, need)
                    return place
                victims = self.clean_victims(i, None, CLEAN_ROOM_PER_WALK * need)
                if not victims:
                    raise TierFullError(f"the {self.names[i]} tier is full of pinned blocks or blocks being read")
                await self.evict(i, victims[0], keep)
                for victim in victims[1:]:
                    # Room ahead of need, so only what still goes without a write (as long
                    # as drops do not wait, nothing changed since the walk).
                    if self.evictable(victim) and victim.below(i):
                        await self.evict(i, victim, keep)

    def _charge(self, i: int, tenant: str, need: int) -> None:
        if i == self.host:
            self.quotas.charge(tenant, need)
        else:
            self.cold_used[i][tenant] += need

    def took(self, i: int, tenant: str, size: int) -> None:
        """Room for a block of ``size`` bytes of ``tenant`` was taken in tier ``i`` other than
        through :meth:`reserve` (a copy written ahead, a block kept from a previous run): it
        counts, as its :meth:`release` will."""
        self._charge(i, tenant, self.tiers[i].footprint(size, tenant))

    def adopted(self, i: int, e: Entry, place: Place) -> None:
        """A block kept by tier ``i`` from a previous run is the store's again (and its room
        the tenant's)."""
        self.took(i, e.tenant, e.size)
        self.placed(i, e, place)

    def within_share(self, i: int, tenant: str, more: int) -> bool:
        """Whether ``tenant``'s blocks may take ``more`` bytes in tier ``i`` (not the host tier)."""
        share = self.cold_share(i, tenant)
        return share is None or self.cold_used[i][tenant] + more <= share

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
                await asyncio.shield(self.finishing(self._copy_busy(e, i, lower, keep)))
            finally:
                self.on_demand -= 1
            if e.dead:
                self.reap(e)
                return
        if e.readers or e.pins or e.busy or e.place(i) is None:
            return  # a reader or mover arrived while it was being copied: it stays, now clean
        if keep and sum(1 for _ in e.held()) <= 1 and e.key in keep:
            raise TierFullError("room for this block would evict an earlier block of its own chain")
        await self.drop(i, e)
        self.metrics.evicted(self.names[i])

    # ------------------------------------------------------------- copies
    async def _copy_busy(self, e: Entry, src: int, dst: int, keep: AbstractSet[bytes] = frozenset()) -> None:
        e.busy += 1
        try:
            await self.copy_many([(e, src)], dst, keep)
        finally:
            e.busy -= 1
            self.reap(e)

    async def copy(self, e: Entry, src: int, dst: int) -> None:
        """Copy ``e`` from tier ``src`` to tier ``dst`` (``e`` is busy: its source stays)."""
        await self.copy_many([(e, src)], dst)

    async def copy_many(self, todo: Sequence[tuple[Entry, int]], dst: int,
                        keep: AbstractSet[bytes] = frozenset()) -> None:
        """Copy each ``(entry, source tier)`` into tier ``dst`` (each entry is busy: its source
        stays): room for each in turn (made from none of ``keep``, :meth:`reserve`), then every
        copy in one call to a thread when a tier blocks (a copy into a colder tier that blocks
        waits for that tier's other writers)."""
        colder = self.tiers[dst].blocking and any(src < dst for _, src in todo)
        async with self.writes[dst] if colder else contextlib.nullcontext():
            planned: list[tuple[Entry, int, Place]] = []
            try:
                for e, src in todo:
                    if e.place(src) is None or e.place(dst) is not None or e.dead:
                        continue  # another mover did it (or found it corrupt)
                    limits = self.quotas.limits_or_default(e.tenant) if dst == self.host else None
                    try:
                        place = await self.reserve(dst, e.record(), limits, keep)
                    except (TierFullError, QuotaError) as full:
                        self.failed(e, src, dst, full)
                        continue
                    planned.append((e, src, place))
            except BaseException:  # the room taken so far goes back before the error does
                for e, _, place in planned:
                    self.release(dst, e.size, e.tenant, place)
                raise
            if not planned:
                return
            d = self.tiers[dst]
            copies: list[Callable[[], None] | Exception | None] = []
            for e, src, place in planned:
                s, where = self.tiers[src], e.place(src)
                if s.accounts_only or d.accounts_only:
                    copies.append(None)
                elif where is None or e.dead:  # found corrupt while room was made
                    copies.append(KeyError(e.key.hex()))
                else:
                    copies.append(functools.partial(_copy_between, s, where, d, place, e.record()))
            blocking = d.blocking or any(self.tiers[src].blocking for _, src, _ in planned)
            try:
                results = await self._run_blocking(planned, copies, d) if blocking else _run_copies(copies)
            except asyncio.CancelledError:
                raise  # a thread may still be copying into the room: it stays taken
            except BaseException:  # the copies ended with an error of their own: the room goes back
                for e, _, place in planned:
                    self.release(dst, e.size, e.tenant, place)
                raise
            for (e, src, place), err in zip(planned, results):
                await self.landed(e, src, dst, place, err)

    async def _run_blocking(self, planned: Sequence[tuple[Entry, int, Place]],
                            copies: list[Callable[[], None] | Exception | None], d: Tier) -> list[Exception | None]:
        """The copies of :meth:`copy_many` where a tier blocks. A read into host memory from
        a tier that has the bytes at hand (the page cache; :meth:`Tier.read_cached`) is done
        here, on the event loop: blocks of up to :data:`INLINE_BLOCK_BYTES`, and at most
        :data:`INLINE_BATCH_BYTES` per call, so that other clients wait for no more than a
        few milliseconds of copying. The rest go to one thread together, which first hints
        its reads to their tiers (read-ahead)."""
        results: list[Exception | None] = [c if isinstance(c, Exception) else None for c in copies]
        rest: list[int] = []
        budget = INLINE_BATCH_BYTES
        for k, ((e, src, place), copy) in enumerate(zip(planned, copies)):
            if not callable(copy):
                continue
            s = self.tiers[src]
            small = e.size <= min(budget, INLINE_BLOCK_BYTES)
            into = d.views(place) if small and s.blocking and not d.blocking else None
            where = e.place(src)
            if into is not None and where is not None:
                budget -= e.size
                try:
                    if s.read_cached(where, e.record(), into):
                        continue
                except _COPY_ERRORS as failed:
                    results[k] = failed
                    continue
            rest.append(k)
        if rest:
            todo = [copies[k] for k in rest]
            for k, outcome in zip(rest, await self.in_thread(_run_copies, todo, _hints(planned, rest, self.tiers))):
                results[k] = outcome
        return results

    async def landed(self, e: Entry, src: int, dst: int, place: Place | None, err: WriteResult | Exception) -> None:
        """What a copy of ``e`` from ``src`` into ``place`` of ``dst`` (or its error) means."""
        if err is None and not e.dead and place is not None:
            self.placed(dst, e, place)
            if dst > src:
                self.metrics.demoted(e.size)
            else:
                self.metrics.promoted(e.size)
            return
        if place is not None:  # (forgotten by the tier now, freed in a thread: see release_soon)
            self.release_soon(dst, e.size, e.tenant, place)
        if e.dead or err is None:
            return  # found corrupt, or removed, while it was copied: nothing to keep
        if isinstance(err, CorruptBlockError):
            logger.warning("block %s failed its checksum between the %s and %s tiers; dropping it",
                           e.key.hex(), self.names[src], self.names[dst])
            self.metrics.corrupt(self.names[src])
            self._corrupt(e)
            return
        self.failed(e, src, dst, err)
        if isinstance(err, (KeyError, ValueError)):  # the source no longer holds this block
            await self.drop(src, e, evicted=False)

    def failed(self, e: Entry, src: int, dst: int, err: Exception) -> None:
        warn_once(logger, f"copy-{src}-{dst}", "copy of %s from the %s to the %s tier failed: %s",
                  e.key.hex(), self.names[src], self.names[dst], err)
        if dst > src:
            self.metrics.demote_failed()
        else:
            self.metrics.promote_failed()

    def intact(self, e: Entry, i: int, place: Place) -> bool:
        """Whether tier ``i``'s copy of ``e`` at ``place`` matches the block's checksum."""
        tier = self.tiers[i]
        if tier.accounts_only:
            return False
        views = tier.views(place)
        if views is not None:
            return checksum(views) == e.checksum
        try:
            tier.read_copy(place, e.record(), [memoryview(bytearray(e.size))])
        except (CorruptBlockError, TierIOError):
            return False
        return True
