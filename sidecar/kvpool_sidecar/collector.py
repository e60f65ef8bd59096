"""Python's cyclic garbage collector, kept from stopping the sidecar for its whole heap.

A sidecar keeps a few Python objects for every block it holds (its entry, the policy's
node, the index's record: about 4.5 per block in ``make demo``). CPython's full
collection walks every tracked object, on the event loop, whenever the objects promoted
to its oldest generation since the last one pass a quarter of those it found alive then:
under churn, every few seconds. Measured here, a sidecar holding 300,000 blocks of 4 KiB
answered a 64-key LOOKUP in 101 µs at the median and 509 ms at worst while its blocks were
replaced (``kvpool bench churn``). Yet the sidecar makes almost no cyclic garbage: in
``make demo`` its full collections found 39 unreachable objects in all.

So the daemon (:func:`kvpool_sidecar.__main__.serve`, not a sidecar run inside another
program) runs a :class:`Collector`:

- once started, everything alive is frozen (``gc.freeze``): no collection walks it again;
- after each full collection, what survived it is frozen too, so the next walks only the
  objects made since (Python's own rule still says when);
- every ``gc_reclaim_interval_s`` (an hour by default; 0: never) everything is thawed and
  collected once, so that cycles among frozen objects (a closed connection's, say) are
  not kept for ever. That one pause is as long as a full collection had been.

Frozen objects that become unreachable without a cycle are freed at once, as always (by
their reference counts); only garbage in cycles waits for the next reclaim.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: How often the collector's task looks whether a full collection has run since.
TICK_S = 1.0


class Collector:
    """Freezes the survivors of full collections; reclaims frozen cycles every ``reclaim_interval_s``."""

    def __init__(self, reclaim_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if reclaim_interval_s < 0:
            raise ValueError(f"reclaim interval must not be negative, not {reclaim_interval_s}")
        self.reclaim_interval_s = reclaim_interval_s
        self._clock = clock
        self._last_reclaim = clock()
        self._full_since = False
        self._started = False
        #: Full collections seen, and the reclaims run, since start.
        self.full_collections = 0
        self.reclaims = 0

    def start(self) -> None:
        """Freeze what is alive now (collected first) and follow full collections from now."""
        if self._started:
            return
        self._started = True
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._observe)
        self._last_reclaim = self._clock()

    def stop(self) -> None:
        """Stop following collections and thaw everything (Python's collector as it was)."""
        if not self._started:
            return
        self._started = False
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
        gc.unfreeze()

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        # runs inside the collector: only note it; the freeze waits for the next tick
        if phase == "stop" and info.get("generation") == 2:
            self._full_since = True

    def tick(self) -> None:
        """Freeze the survivors of a full collection that ran since the last tick; reclaim
        frozen cycles when the interval has passed."""
        if not self._started:
            return
        if self.reclaim_interval_s and self._clock() - self._last_reclaim >= self.reclaim_interval_s:
            self._reclaim()
            return
        if self._full_since:
            self._full_since = False
            self.full_collections += 1
            gc.freeze()

    def _reclaim(self) -> None:
        frozen = gc.get_freeze_count()
        started = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self._full_since = False
        self._last_reclaim = self._clock()
        self.reclaims += 1
        logger.info("garbage collection: %d unreachable objects among %d frozen reclaimed in %.0f ms",
                    found, frozen, (time.perf_counter() - started) * 1e3)

    async def run(self) -> None:
        """:meth:`tick` every :data:`TICK_S` until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()
