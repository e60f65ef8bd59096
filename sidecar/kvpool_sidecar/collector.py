"""Python's cyclic garbage collector, kept from stopping the sidecar for its whole heap.

A sidecar keeps a few Python objects for every block it holds (its entry, the policy's
node, the index's record: about 4.5 per block in ``make demo``). CPython's full
collection walks every tracked object, on the event loop, whenever the objects promoted
to its oldest generation since the last one pass a quarter of those it found alive then:
under churn, every few seconds. Measured here, while a sidecar holding 300,000 blocks of
4 KiB had them replaced, another client's 64-key lookups waited up to 734 ms (p99.9 590 ms;
``kvpool bench churn``). Yet the sidecar makes almost no cyclic garbage: in
``make demo`` its full collections found 39 unreachable objects in all.

So the daemon (:func:`kvpool_sidecar.__main__.serve`, not a sidecar run inside another
program) runs a :class:`Collector`:

- once started, everything alive is frozen (``gc.freeze``): no collection walks it again;
- at the end of each full collection, what survived it is frozen too (from the collector's
  own callback, when the younger generations are empty), so the next one walks only the
  objects made since that are still alive (Python's own rule still says when it runs);
- every ``gc_reclaim_interval_s`` (an hour by default; 0: never) everything is thawed and
  collected once, so that cycles among frozen objects are not kept for ever. That one
  pause is as long as a full collection had been.

Frozen objects that become unreachable without a cycle are freed at once, as always (by
their reference counts); only garbage in cycles waits for the next reclaim. On uvloop (the
sidecar's event loop) a closed connection leaves none; on asyncio's own loop each one
would (its transport refers to itself through a bound method: about 1 KB each, measured
with 300 connections), so the daemon freezes nothing there (:func:`suits`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: How often the collector's task looks whether a reclaim is due.
TICK_S = 1.0


def suits(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether freezing suits a daemon on ``loop``: uvloop's transports make no reference
    cycles, asyncio's own do (one per connection, kept frozen until the next reclaim)."""
    return type(loop).__module__.split(".")[0] == "uvloop"


class Collector:
    """Freezes the survivors of full collections; reclaims frozen cycles every ``reclaim_interval_s``.

    Its counters (``full_collections``, ``reclaims``) count since :meth:`start`."""

    def __init__(self, reclaim_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= reclaim_interval_s < math.inf:  # (NaN too: no reclaim would ever have been due)
            raise ValueError(f"reclaim interval must be 0 or a finite number of seconds, not {reclaim_interval_s}")
        self.reclaim_interval_s = reclaim_interval_s
        self._clock = clock
        self._last_reclaim = clock()
        self._started = False
        # the callback runs in whatever thread collects: its check and freeze, and stop(), under one lock
        # (re-entrant: a collection may start inside stop() itself)
        self._lock = threading.RLock()
        #: Full collections begun, counted from their callbacks (a reclaim checks that its own ran).
        self._begun = 0
        #: Full collections seen, and the reclaims run, since start.
        self.full_collections = 0
        self.reclaims = 0

    def start(self) -> None:
        """Freeze what is alive now (collected first) and follow full collections from now."""
        if self._started:
            return
        self._started = True
        self._collect_and_freeze()
        gc.callbacks.append(self._observe)
        self._last_reclaim = self._clock()

    @staticmethod
    def _collect_and_freeze() -> int:
        found = gc.collect()
        gc.freeze()
        # Python's rule waits for a quarter of the objects the last full collection left
        # alive to be promoted again: a second one, over the nothing left unfrozen, makes that
        # quarter of nothing (else the next automatic one would walk a quarter of the heap)
        gc.collect()
        return found

    def stop(self) -> None:
        """Stop following collections and thaw everything (Python's collector as it was)."""
        with self._lock:
            if not self._started:
                return
            self._started = False
            if self._observe in gc.callbacks:
                gc.callbacks.remove(self._observe)
            gc.unfreeze()

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        # called as a collection begins and once it has ended: after a full one, its survivors
        # are all in the oldest generation and the younger ones are empty, so only they are frozen
        if info.get("generation") != 2:
            return
        with self._lock:
            if not self._started:
                return
            if phase == "start":
                self._begun += 1
            else:
                self.full_collections += 1
                gc.freeze()

    def tick(self) -> None:
        """Reclaim frozen cycles when the interval has passed."""
        if self._started and self.reclaim_interval_s and self._clock() - self._last_reclaim >= self.reclaim_interval_s:
            self._reclaim()

    def _reclaim(self) -> None:
        started = time.perf_counter()
        begun = self._begun
        gc.unfreeze()
        found = self._collect_and_freeze()
        if self._begun == begun:
            # another thread was collecting: Python ran nothing here; the next tick tries again
            gc.freeze()
            return
        self._last_reclaim = self._clock()
        self.reclaims += 1
        logger.info("garbage collection: %d unreachable objects reclaimed in %.0f ms", found,
                    (time.perf_counter() - started) * 1e3)

    async def run(self) -> None:
        """:meth:`tick` every :data:`TICK_S` until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()
