"""A token bucket: a rate with a burst, for what clients may make the sidecar do."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """``rate`` tokens a second, holding at most ``burst``; starts full."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not (rate > 0 and burst > 0):  # (NaN too: a bucket of NaN tokens had refused every take)
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def give(self, n: float) -> None:
        """Put back ``n`` tokens taken by a request that did not go ahead (up to the burst)."""
        self._tokens = min(self.burst, self._tokens + n)

    def take(self, n: float) -> bool:
        """Take ``n`` tokens if the bucket holds them (a request larger than the burst is
        allowed from a full bucket, which it then empties)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= min(n, self.burst):
            self._tokens = max(0.0, self._tokens - n)
            return True
        return False
