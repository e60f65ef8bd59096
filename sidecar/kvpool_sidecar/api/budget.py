"""What one tenant may make the pool's index and peers do: at once, and per second.

Every lookup past a node's own prefix asks the shared Redis, and every fetch asks peers,
on behalf of the node's clients. Each tenant has a number of those calls that may run at
once (``api.index_concurrency``; more wait their turn; a fetch holds its turn for its index
part only, its transfers are bounded apart: :mod:`kvpool_sidecar.fetchgate`) and a rate, in keys asked per
second (``api.index_keys_per_s``, a token bucket holding one second's worth). A call past
the rate is not made and not waited for: the keys it would have asked about are a miss,
so a flooding tenant gets local hits only while the index and the peers stay fast for
everyone else, and no engine waits on a budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvpool_sidecar.bucket import TokenBucket

__all__ = ["IndexBudget", "TokenBucket"]


class IndexBudget:
    """Per tenant: a turn (a semaphore) and a rate (a token bucket) for index calls."""

    def __init__(self, concurrency: int, keys_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.concurrency = concurrency
        self.keys_per_s = keys_per_s
        self._clock = clock
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._buckets: dict[str, TokenBucket] = {}
        #: Index calls not made because their tenant was past its rate.
        self.throttled = 0

    def turn(self, tenant: str) -> asyncio.Semaphore:
        """The tenant's share of the node's concurrent index lookups (a peer fetch's index part included)."""
        sem = self._turns.get(tenant)
        if sem is None:
            sem = self._turns[tenant] = asyncio.Semaphore(self.concurrency)
        return sem

    def allows(self, tenant: str, keys: int) -> bool:
        """Whether ``tenant`` may ask the index (or peers) about ``keys`` keys now."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(self.keys_per_s, self.keys_per_s, self._clock)
        if bucket.take(keys):
            return True
        self.throttled += 1
        return False
