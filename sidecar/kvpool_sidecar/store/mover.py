"""Copies between tiers: demotion and promotion, and the parts of the store that move blocks.

The store's tiers form one list, hottest first (GPU, DRAM, disk); one of them, the host
tier (DRAM), is where puts land and local clients read. Whatever the pair of tiers, a
block moves the same way:

- **room**: made in the tier a block goes to, by evicting victims there
  (:class:`~kvpool_sidecar.store.room.Room`; an eviction first copies its victim one tier
  down when no colder tier holds it: demotion instead of loss);
- **copies**: a copy in flight keeps its block ``busy`` (no eviction takes its source),
  runs in a thread when either tier blocks (:class:`~kvpool_sidecar.store.threads.Threads`),
  and is checked on the way (a corrupt block is dropped from every tier:
  :meth:`~kvpool_sidecar.store.ledger.Ledger.kill`; a copy its device cannot read back,
  EIO and the like, from its own tier: :class:`SourceLostError`);
- **record**: where each block's copies are and what room they take, and the release of
  that room (:class:`~kvpool_sidecar.store.ledger.Ledger`);
- **promotion**: a read of a block the host tier lacks brings it from the nearest tier
  holding it (concurrent readers share one copy); a block read ``promote_hits`` times is
  copied up to the tier above the host tier in the background
  (:mod:`~kvpool_sidecar.store.promotion`).

:class:`Mover` makes the copies and holds the other parts. Locks are always taken down the
list (a tier's writers, then its room, then the next tier's), so movers never wait on each
other in a cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence, Set as AbstractSet

from kvpool_client.integrity import checksum
from kvpool_sidecar.errors import CorruptBlockError, QuotaError, TierError, TierFullError, TierIOError
from kvpool_sidecar.metrics import StoreMetrics
from kvpool_sidecar.policy import EvictionPolicy
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store.entries import Entry
from kvpool_sidecar.store.ledger import Ledger
from kvpool_sidecar.store.quotas import Quotas
from kvpool_sidecar.store.room import Room
from kvpool_sidecar.store.settings import StoreSettings
from kvpool_sidecar.store.threads import Threads
from kvpool_sidecar.tiers.base import BlockRecord, Forgetting, Place, Tier, WriteResult, device_failed

logger = logging.getLogger(__name__)

#: What a copy between tiers may fail with (a tier's own errors, TierIOError, TierFullError,
#: among them): the copy's result, never an error of the task that asked for it.
_COPY_ERRORS = (CorruptBlockError, TierError, KeyError, ValueError)

#: The largest block a promotion reads on the event loop when the page cache holds it, and
#: the most bytes one batch reads there: larger ones wait for a thread, as all reads did.
INLINE_BLOCK_BYTES = 4 << 20
INLINE_BATCH_BYTES = 16 << 20

class SourceLostError(TierIOError):
    """A copy's source tier could not read its copy back, the device's fault (EIO and the
    like: :func:`~kvpool_sidecar.tiers.base.device_failed`): that copy is lost, whatever
    the copy's destination."""


def _read_source(src: Tier, src_place: Place, record: BlockRecord, dest: Sequence[memoryview]) -> None:
    """``src.read_copy``; a device's failure to read it back as :class:`SourceLostError`
    (a write's failure into the destination is never taken for the source's)."""
    try:
        src.read_copy(src_place, record, dest)
    except TierIOError as err:
        if device_failed(err):
            raise SourceLostError(str(err)) from err
        raise


def _copy_between(src: Tier, src_place: Place, dst: Tier, dst_place: Place, record: BlockRecord) -> None:
    """One block's bytes from ``src`` to ``dst``, checked by whichever tier sees them."""
    views = src.views(src_place)
    if views is not None:
        dst.write_copy(dst_place, record, views)
        return
    into = dst.views(dst_place)
    if into is not None:
        _read_source(src, src_place, record, into)
        return
    buf = memoryview(bytearray(record.size))
    _read_source(src, src_place, record, [buf])
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


class Mover:
    """Copies between the store's tiers, and the parts that make room for them and keep their
    record (see the module docstring)."""

    def __init__(self, tiers: Sequence[Tier], host: int, policy: EvictionPolicy, settings: StoreSettings,
                 quotas: Quotas, metrics: StoreMetrics, entries: dict[bytes, Entry],
                 announce: Callable[[bool, str, Entry], None], unpin_all: Callable[[Entry], None]) -> None:
        #: Calls in threads on the tiers' bytes (copies, releases), which the store waits for.
        self.threads = Threads()
        #: Where each block's copies are, and the room they take.
        self.ledger = Ledger(tiers, host, policy, quotas, entries, announce, unpin_all, self.threads)
        #: Victims and room in each tier; its evictions demote with :meth:`copy_busy`.
        self.room = Room(self.ledger, self.threads, settings, metrics, self.copy_busy)
        self.tiers = self.ledger.tiers
        self.names = self.ledger.names
        self.host = host
        self.policy = policy
        self.settings = settings
        self.quotas = quotas
        self.metrics = metrics
        #: One writer at a time into a tier whose copies block (the eviction's and the
        #: write-ahead's disk writes take turns).
        self.writes = [asyncio.Lock() for _ in tiers]
        #: The tiers that can lose blocks by themselves (asked once: a protocol's isinstance
        #: costs microseconds, and every copy would ask).
        self._forgetting = [(i, t) for i, t in enumerate(self.tiers) if isinstance(t, Forgetting)]

    async def copy_busy(self, e: Entry, src: int, dst: int, keep: AbstractSet[bytes] = frozenset()) -> None:
        """:meth:`copy_many` of ``e`` alone, busy meanwhile (an eviction's copy down,
        :meth:`Room.evict <kvpool_sidecar.store.room.Room.evict>`)."""
        e.busy += 1
        try:
            await self.copy_many([(e, src)], dst, keep)
        finally:
            e.busy -= 1
            self.ledger.reap(e)

    async def copy(self, e: Entry, src: int, dst: int) -> None:
        """Copy ``e`` from tier ``src`` to tier ``dst`` (``e`` is busy: its source stays)."""
        await self.copy_many([(e, src)], dst)

    async def copy_many(self, todo: Sequence[tuple[Entry, int]], dst: int,
                        keep: AbstractSet[bytes] = frozenset()) -> None:
        """Copy each ``(entry, source tier)`` into tier ``dst`` (each entry is busy: its source
        stays): room for each in turn (made from none of ``keep``,
        :meth:`Room.reserve <kvpool_sidecar.store.room.Room.reserve>`), then every
        copy in one call to a thread when a tier blocks (a copy into a colder tier that blocks
        waits for that tier's other writers)."""
        colder = self.tiers[dst].blocking and any(src < dst for _, src in todo)
        async with self.writes[dst] if colder else contextlib.nullcontext():
            planned: list[tuple[Entry, int, Place]] = []
            reserve = self.room.reserve
            try:
                for e, src in todo:
                    if e.place(src) is None or e.place(dst) is not None or e.dead:
                        continue  # another mover did it (or found it corrupt)
                    limits = self.quotas.limits_or_default(e.tenant) if dst == self.host else None
                    try:
                        place = await reserve(dst, e.record(), limits, keep)
                    except (TierFullError, QuotaError) as full:
                        self.failed(e, src, dst, full)
                        continue
                    planned.append((e, src, place))
            except BaseException:  # the room taken so far goes back before the error does
                for e, _, place in planned:
                    self.ledger.release(dst, e.size, e.tenant, place)
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
                    self.ledger.release(dst, e.size, e.tenant, place)
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
            for k, outcome in zip(rest, await self.threads.in_thread(_run_copies, todo, _hints(planned, rest, self.tiers))):
                results[k] = outcome
        return results

    async def landed(self, e: Entry, src: int, dst: int, place: Place | None, err: WriteResult | Exception) -> None:
        """What a copy of ``e`` from ``src`` into ``place`` of ``dst`` (or its error) means;
        and then the copies either tier lost by itself meanwhile go from the record (after:
        a block read out of a segment deleted just after is placed where it went first)."""
        try:
            await self._landed(e, src, dst, place, err)
        finally:
            for i, tier in self._forgetting:
                if i == src or i == dst:
                    await self._forget_lost(i, tier)

    async def _landed(self, e: Entry, src: int, dst: int, place: Place | None, err: WriteResult | Exception) -> None:
        if err is None and not e.dead and place is not None:
            self.ledger.placed(dst, e, place)
            if dst > src:
                self.metrics.demoted(e.size)
            else:
                self.metrics.promoted(e.size)
            return
        if place is not None:  # (forgotten by the tier now, freed in a thread: see Ledger.release_soon)
            self.ledger.release_soon(dst, e.size, e.tenant, place)
        if e.dead or err is None:
            return  # found corrupt, or removed, while it was copied: nothing to keep
        if isinstance(err, CorruptBlockError):
            logger.warning("block %s failed its checksum between the %s and %s tiers; dropping it",
                           e.key.hex(), self.names[src], self.names[dst])
            self.metrics.corrupt(self.names[src])
            self.ledger.kill(e)
            return
        self.failed(e, src, dst, err)
        if isinstance(err, SourceLostError):
            # the device cannot read it back: every read of it would cost a device read and
            # then miss, and the index would keep offering it
            warn_once(logger, f"lost-{src}", "block %s cannot be read back from the %s tier; dropping that copy",
                      e.key.hex(), self.names[src])
        if isinstance(err, (KeyError, ValueError, SourceLostError)):  # the source no longer holds this block
            await self.ledger.drop(src, e, evicted=False)

    async def _forget_lost(self, i: int, tier: Forgetting) -> None:
        """Drop the store's record of the copies tier ``i`` lost by itself (a segment file
        deleted under it, its directory removed): they had stayed listed and counted, and
        offered by LOOKUP and the index, until a read of each missed."""
        for key in tier.forgotten():
            e = self.ledger.entry(key)
            if e is not None and e.place(i) is not None and not tier.contains(key):  # (not one written since)
                await self.ledger.drop(i, e, evicted=False)

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
