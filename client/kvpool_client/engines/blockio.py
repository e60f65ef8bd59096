"""Moving whole blocks between an engine's paged KV cache and the pool.

:func:`load_blocks` reads the blocks a step needs before its forward, in batches of about
:data:`STAGE_BYTES` (the device memory a step stages blocks in stays bounded however many
it loads): ``acquire`` in rounds of about 256 MiB (each block verified against its checksum
by the client, in the arena), the bytes copied out of the arena into ``[n, block_bytes]``
rows (on a GPU engine whose client registered the arena with CUDA, by DMA straight from it,
a round's verification overlapping the copies of the round before), one indexed copy per
layout segment into the cache, and the blocks released once the copies are done. A client
with no arena mapped (a node with several key spaces) reads the blocks inline instead. A
request's blocks load up to its first block that is missing, corrupt or of the wrong size;
that block and every later one of the request are returned as failed, so the engine
recomputes them (never serves them).

:func:`save_blocks` gathers the blocks a forward computed off the device, a batch of about
:data:`STAGE_BYTES` at a time, and hands them to a :class:`BackgroundSaver`, which puts them
(allocate, copy with checksum, commit) from a thread of its own, so the forward never waits
on the pool. Its backlog is bounded in bytes: past the bound a save is dropped, never waited
for, and :func:`save_blocks` says how many blocks went, so that the engine's connector can
save the rest again (a drop is a future miss only if the engine no longer holds them).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool_client.blockinfo import EngineBlock, PutHints
from kvpool_client.client import PoolClient
from kvpool_client.engines.paged import PagedLayout
from kvpool_client.engines.prefix import LoadSpec, Reconnecting
from kvpool_client.errors import KVPoolError
from kvpool_client.protocol import PutStatus
from kvpool_client.tensors import HeldRounds, arena_tensor, copy_out, register_arena_pinned, tensor_bytes

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _torch() -> Any:
    import torch

    return torch


def _stage_cpu(tc: Any, layout: PagedLayout, blocks: list[list[memoryview]]) -> torch.Tensor:
    """Rows of verified block bytes in host memory (pinned for a GPU cache)."""
    pin = layout.device.type == "cuda"
    rows = tc.empty((len(blocks), layout.block_bytes), dtype=tc.uint8, pin_memory=pin)
    dst = tensor_bytes(rows)
    pos = 0
    for views in blocks:
        for v in views:
            dst[pos : pos + v.nbytes] = v
            pos += v.nbytes
    out: torch.Tensor = rows if not pin else rows.to(layout.device, non_blocking=True)
    return out


def _read_in_place(tc: Any, client: PoolClient, layout: PagedLayout, flat: list[bytes],
                   rows_on: Any) -> tuple[torch.Tensor, list[bool]]:
    """Every block of ``flat`` into rows on ``rows_on`` (the cache's device, or pinned host
    memory), copied out of the arena where it was verified (by DMA from a pinned-registered
    arena to a GPU) in rounds (:class:`~kvpool_client.tensors.HeldRounds`: a round is verified
    while the copies of the one before run); and whether each one arrived whole."""
    pin = rows_on.type == "cpu" and layout.device.type == "cuda"
    rows: torch.Tensor = tc.empty((len(flat), layout.block_bytes), dtype=tc.uint8, device=rows_on, pin_memory=pin)
    whole = [False] * len(flat)
    arena = arena_tensor(client)
    try:
        with HeldRounds(client, [rows_on]) as rounds:
            for lo, blocks in rounds.acquire(flat, [layout.block_bytes] * len(flat)):
                for j, (views, extents) in enumerate(zip(blocks.views, blocks.extents)):
                    if views is None or extents is None or sum(n for _, n in extents) != layout.block_bytes:
                        continue
                    copy_out(arena, rows[lo + j], extents)
                    whole[lo + j] = True
    finally:
        del arena
    return rows, whole


#: Device memory a step's load or save stages blocks in, at most (a load's rows of one batch,
#: and once more while the rows of blocks that did load are picked out of them).
STAGE_BYTES = 512 << 20


def stage_batches(count: int, block_bytes: int, stage_bytes: int = STAGE_BYTES) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of ``count`` blocks of ``block_bytes`` each, about
    ``stage_bytes`` a range (at least one block)."""
    per = max(1, stage_bytes // max(1, block_bytes))
    return [(lo, min(count, lo + per)) for lo in range(0, count, per)]


class _LoadPlan:
    """Which engine block each position of a load is, and which load: a request's blocks
    load up to its first one that does not arrive whole, which fails with every later one."""

    def __init__(self, specs: Sequence[LoadSpec]) -> None:
        self.owner = [s for s, spec in enumerate(specs) for _ in spec.block_ids]
        self.block = [b for spec in specs for b in spec.block_ids]
        self.broken: set[int] = set()
        self.failed: set[int] = set()

    def take(self, lo: int, whole: Sequence[bool]) -> tuple[list[int], list[int]]:
        """Positions ``lo`` on arrived (``whole``): the engine blocks to write, and their
        offsets in ``whole``; the rest go to :attr:`failed`."""
        ids: list[int] = []
        at: list[int] = []
        for j, ok in enumerate(whole):
            s = self.owner[lo + j]
            if s in self.broken or not ok:
                self.broken.add(s)
                self.failed.add(self.block[lo + j])
                continue
            ids.append(self.block[lo + j])
            at.append(j)
        return ids, at


def load_blocks(conn: Reconnecting[PoolClient], layout: PagedLayout, specs: Sequence[LoadSpec],
                keys: Sequence[Sequence[bytes]], *, stage_bytes: int = STAGE_BYTES) -> set[int]:
    """Load ``specs`` into the cache, in batches of about ``stage_bytes`` (the device
    memory a batch's rows take); the engine block ids that did not load."""
    flat = [k for ks in keys for k in ks]
    if not flat:
        return set()
    tc = _torch()
    plan = _LoadPlan(specs)

    def write(lo: int, rows: torch.Tensor, whole: Sequence[bool]) -> None:
        ok_ids, ok_at = plan.take(lo, whole)
        if not ok_ids:
            return
        if rows.device != layout.device:
            rows = rows.to(layout.device, non_blocking=True)
        if len(ok_at) < len(whole):
            rows = rows[tc.tensor(ok_at, device=rows.device)]
        layout.scatter(ok_ids, rows)

    def run(client: PoolClient, pinned: bool) -> set[int]:
        # straight into the cache's device where it can read the arena (the CPU, or a GPU
        # that page-locked it), else into pinned rows first
        direct = layout.device.type == "cpu" or pinned
        for lo, hi in stage_batches(len(flat), layout.block_bytes, stage_bytes):
            if not client.shm:  # no arena mapped (several key spaces on the node): inline copies
                got = client.get(flat[lo:hi])
                ok_ids, ok_at = plan.take(lo, [g is not None and g.nbytes == layout.block_bytes for g in got])
                if ok_ids:
                    layout.scatter(ok_ids, _stage_cpu(tc, layout, [[got[j]] for j in ok_at]))  # type: ignore[list-item]
                continue
            rows, whole = _read_in_place(tc, client, layout, flat[lo:hi], layout.device if direct else tc.device("cpu"))
            write(lo, rows, whole)
        return plan.failed

    def bounded(client: PoolClient) -> set[int]:
        # page-locking the arena (once per connection; seconds for a large one) is not the load's time
        pinned = client.shm and layout.device.type == "cuda" and register_arena_pinned(client)
        with client.within():  # the whole load ends within the client's timeout, not each batch
            return run(client, pinned)

    try:
        return conn.call(bounded)
    except KVPoolError as e:
        logger.warning("pool load failed, %d blocks will be recomputed: %s", len(flat), e)
        return {b for spec in specs for b in spec.block_ids}
    except RuntimeError:  # torch's (out of device memory for the step's rows): recomputed, not a dead worker
        logger.exception("pool load of %d blocks failed; they will be recomputed", len(flat))
        return {b for spec in specs for b in spec.block_ids}


@dataclass
class _Save:
    rows: Any  # torch.Tensor [n, block_bytes] in host memory
    event: Any  # a CUDA event to wait for before reading rows (None on the CPU)
    keys: list[bytes]
    depth: int
    parent: bytes | None
    engine: list[EngineBlock | None] | None = None
    hints: PutHints | None = None


@dataclass
class SaverStats:
    submitted: int = 0
    stored: int = 0
    existed: int = 0
    refused: int = 0
    dropped: int = 0
    failed: int = 0


class BackgroundSaver:
    """Puts gathered blocks from a thread of its own; a bounded backlog in bytes."""

    def __init__(self, connect: Callable[[], PoolClient], *, max_pending_bytes: int = 1 << 30) -> None:
        self._conn = Reconnecting(connect)
        self.max_pending_bytes = max_pending_bytes
        self.stats = SaverStats()
        self._queue: queue.Queue[_Save | None] = queue.Queue()
        self._pending_bytes = 0
        self._busy = 0
        self._cond = threading.Condition()
        self._last_drop_log = 0.0
        self._last_error_log = float("-inf")
        #: Saves held until their step's outcome is known (:meth:`settle`), by step.
        self._held: dict[int, list[_Save]] = {}
        self._thread = threading.Thread(target=self._run, name="kvpool-saver", daemon=True)
        self._thread.start()

    def submit(self, rows: torch.Tensor, keys: list[bytes], *, depth: int, parent: bytes | None,
               engine: list[EngineBlock | None] | None = None, hints: PutHints | None = None,
               hold: int | None = None) -> bool:
        """Queue ``rows`` (one per key) for a put; False when the backlog is full (dropped).

        ``engine`` (one per key, or None) and ``hints`` go with the put (see
        :mod:`kvpool_client.blockinfo`). ``hold``: the engine step the rows were computed in,
        whose outcome is not known yet: the rows are copied off the device now and put only
        once :meth:`settle` says the step went well (they count in the backlog meanwhile)."""
        if len(keys) != rows.shape[0]:
            raise KVPoolError("a save needs one row per key")
        if engine is not None and len(engine) != len(keys):
            raise KVPoolError("a save needs one engine block (or None) per key")
        n = int(rows.numel())
        with self._cond:
            if self._pending_bytes + n > self.max_pending_bytes:
                self._dropped(len(keys))
                return False
            self._pending_bytes += n
            self._busy += 1
            self.stats.submitted += len(keys)
        event = None
        if rows.device.type == "cuda":
            tc = _torch()
            try:
                host = tc.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                event = tc.cuda.Event()
                event.record()
            except RuntimeError:  # torch's (no page-locked memory left): a save lost, not a dead worker
                logger.exception("pool save of %d blocks: no room to copy them off the device; dropped", len(keys))
                self._done(_Save(rows, None, keys, depth, parent), dropped=True)
                return False
            rows = host
        item = _Save(rows, event, keys, depth, parent, engine, hints)
        if hold is None:
            self._queue.put(item)
        else:
            with self._cond:
                self._held.setdefault(hold, []).append(item)
        return True

    def has_room(self, nbytes: int) -> bool:
        """Whether a save of ``nbytes`` would fit in the backlog now (gather it only then)."""
        with self._cond:
            return self._pending_bytes + nbytes <= self.max_pending_bytes

    def drop(self, blocks: int) -> None:
        """``blocks`` were not submitted for want of room: counted (and logged) as dropped."""
        with self._cond:
            self._dropped(blocks)

    def _dropped(self, blocks: int) -> None:
        self.stats.dropped += blocks
        now = time.monotonic()
        if now - self._last_drop_log > 10.0:
            self._last_drop_log = now
            logger.warning("pool saves behind by %d bytes: dropping saves (future misses)", self._pending_bytes)

    def settle(self, step: int, ok: bool) -> None:
        """The outcome of ``step`` is known: put its held saves (``ok``), or drop them."""
        with self._cond:
            items = self._held.pop(step, [])
        for item in items:
            if ok:
                self._queue.put(item)
            else:
                self._done(item, dropped=True)

    def settle_before(self, step: int) -> int:
        """Drop the saves held for steps before ``step`` (an outcome that never came);
        how many blocks were dropped."""
        with self._cond:
            old = [s for s in self._held if s < step]
            items = [item for s in old for item in self._held.pop(s)]
        for item in items:
            self._done(item, dropped=True)
        return sum(len(item.keys) for item in items)

    def _done(self, item: _Save, *, dropped: bool = False) -> None:
        with self._cond:
            if dropped:
                self.stats.dropped += len(item.keys)
            self._pending_bytes -= int(item.rows.numel())
            self._busy -= 1
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._put(item)
            except Exception:  # a task guard: one save that fails unforeseen must not end every later one
                self.stats.failed += len(item.keys)
                now = time.monotonic()
                if now - self._last_error_log > 10.0:  # (an error that stays would log every save)
                    self._last_error_log = now
                    logger.exception("pool save of %d blocks failed", len(item.keys))
            finally:
                self._done(item)

    def _put(self, item: _Save) -> None:
        if item.event is not None:
            item.event.synchronize()
        payloads = [tensor_bytes(item.rows[i]) for i in range(len(item.keys))]
        try:
            statuses = self._conn.call(
                lambda c: c.put(item.keys, payloads, chain=True, depth=item.depth, parent=item.parent,
                                hints=item.hints, engine=item.engine))
        except KVPoolError as e:
            self.stats.failed += len(item.keys)
            logger.info("pool save of %d blocks failed: %s", len(item.keys), e)
            return
        for s in statuses:
            if s == PutStatus.STORED:
                self.stats.stored += 1
            elif s == PutStatus.EXISTS:
                self.stats.existed += 1
            else:
                self.stats.refused += 1

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted save has been answered, but those held for their
        step's outcome; False at the deadline."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == sum(map(len, self._held.values())), timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.settle_before(1 << 62)  # saves still waiting for their step's outcome: never known now
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        self._conn.close()


def save_blocks(saver: BackgroundSaver, layout: PagedLayout, block_ids: Sequence[int], keys: list[bytes], *,
                depth: int, parent: bytes | None, engine: list[EngineBlock | None] | None = None,
                hints: PutHints | None = None, hold: int | None = None, stage_bytes: int = STAGE_BYTES) -> int:
    """Gather ``block_ids`` (keys ``keys``, the first at chain depth ``depth`` after
    ``parent``) off the device in batches of about ``stage_bytes`` and submit each to
    ``saver``; how many were submitted. A batch the backlog has no room for (checked before
    it is gathered), or that there is no device memory to gather, is not, nor is any after it
    (the pool would hold them behind a gap): the caller saves them again later."""
    # (a batch must fit in the backlog when half of it is taken, or a large save never goes)
    stage_bytes = min(stage_bytes, saver.max_pending_bytes // 2)
    for lo, hi in stage_batches(len(block_ids), layout.block_bytes, stage_bytes):
        if not saver.has_room((hi - lo) * layout.block_bytes):
            saver.drop(len(block_ids) - lo)
            return lo
        try:
            rows = layout.gather(block_ids[lo:hi])
        except RuntimeError:  # torch's (out of device memory for the rows): a save lost, not a dead worker
            logger.exception("kvpool: gathering %d blocks to save failed; not saved", hi - lo)
            saver.drop(len(block_ids) - lo)
            return lo
        if not saver.submit(rows, keys[lo:hi], depth=depth + lo, parent=parent if lo == 0 else keys[lo - 1],
                            engine=engine[lo:hi] if engine is not None else None, hints=hints, hold=hold):
            saver.drop(len(block_ids) - hi)
            return lo
    return len(block_ids)


__all__ = ["STAGE_BYTES", "BackgroundSaver", "SaverStats", "load_blocks", "save_blocks", "stage_batches"]
