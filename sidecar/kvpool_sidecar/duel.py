"""Shadow caches that let a policy pick, online, the eviction order that serves its workload.

No single order wins every workload: frequency (ARC's protected segment) keeps popular
prefixes through floods of one-shot blocks, and recency follows a working set that moves.
A :class:`Duel` replays the block accesses a policy sees through two shadow caches of the
same capacity, one per order, counts each one's prefix hits (a block counts only if its
parent counted too, as a lookup stops at the first miss), and says which order is ahead.
The policy follows the leader, so it does about as well as the better of the two on a
workload that keeps its character (shadow duelling, as in set-dueling caches and
Waldspurger's miniature simulations, but with whole shadows).

A shadow holds metadata only, never a payload: about a kilobyte per block it tracks (its
policy's structures and ghosts included), next to blocks of megabytes.

This module knows nothing about the policies it runs: they come ready made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool_sidecar.policy import BlockMeta, EvictionPolicy

#: The one tier a shadow simulates.
_TIER = "shadow"

#: The window, in block accesses per block of capacity: long enough to hold many turnovers
#: of the cache, so that the duel settles on a workload's better order instead of flapping
#: with every burst (each switch costs: the cache was shaped by the other order).
WINDOW_PER_BLOCK = 64

#: The smallest window, in block accesses.
MIN_WINDOW = 8192

#: How sure the duel must be before the challenger takes over: its windowed lead in prefix
#: hits, in standard deviations of that lead were both orders equally good. The unit of
#: evidence is the request (one request's blocks hit or miss together). Two, not more: a
#: needless switch happens when the orders are about equal, and then costs little; a late
#: one costs the hits the better order would have had meanwhile (on traces of a few
#: thousand requests, 3 left a moving working set up to 0.3% below LRU).
CONFIDENCE = 2.0


class ShadowCache:
    """A cache of keys only, run by its own policy, that counts the prefix hits it would have."""

    __slots__ = ("policy", "capacity", "_resident", "_reached", "_bytes", "hits")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        #: Bytes the shadow may hold; its owner keeps it equal to the real cache's size.
        self.capacity = 0
        self._resident: dict[bytes, BlockMeta] = {}
        #: Resident keys whose last access was a prefix hit here: a child hits only after its
        #: parent did. Kept per block rather than per request, so that requests from many
        #: clients may interleave.
        self._reached: set[bytes] = set()
        self._bytes = 0
        #: Prefix hits since the start.
        self.hits = 0

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: bytes) -> bool:
        return key in self._resident

    def touch(self, meta: BlockMeta, copy: Callable[[BlockMeta], BlockMeta]) -> bool:
        """A request reads ``meta``, or writes it after a miss; True when it is a prefix hit here."""
        key = meta.key
        held = self._resident.get(key)
        if held is not None:
            if meta.parent is not None and meta.parent not in self._reached:
                self._reached.discard(key)
                return False  # held behind a missing block: a lookup never reaches it
            self.policy.accessed(_TIER, held)
            self._reached.add(key)
            self.hits += 1
            return True
        mine = copy(meta)
        if not self.policy.admit(_TIER, mine):
            return False
        self._resident[key] = mine
        self._bytes += mine.size
        self.policy.inserted(_TIER, mine)
        while self._bytes > self.capacity and self._resident:
            victim = next(iter(self.policy.victims(_TIER)), None)
            if victim is None:
                break
            self._drop(victim)
        return False

    def _drop(self, meta: BlockMeta) -> None:
        del self._resident[meta.key]
        self._reached.discard(meta.key)
        self._bytes -= meta.size
        self.policy.removed(_TIER, meta)


class Duel:
    """Two shadow caches, one per eviction order, and which of them is ahead.

    ``first`` leads at the start. For each request the duel takes the difference between the
    prefix hits the two shadows had, and keeps its sum and the sum of its squares, both
    decayed over a sliding window (the squares at the square of the rate, so that the second
    sum is the variance of the first were the orders equally good). The challenger takes
    over once its lead exceeds :data:`CONFIDENCE` times the square root of that variance,
    and the other way round.
    """

    __slots__ = ("shadows", "leader", "lead", "variance", "switches", "_hits", "_touches", "_copy")

    def __init__(self, first: EvictionPolicy, second: EvictionPolicy,
                 copy: Callable[[BlockMeta], BlockMeta]) -> None:
        self.shadows = (ShadowCache(first), ShadowCache(second))
        #: 0 while ``first`` leads, 1 while ``second`` does; how often that changed.
        self.leader = 0
        self.switches = 0
        #: Windowed sum of (second's hits - first's hits) per request, and its variance.
        self.lead = 0.0
        self.variance = 0.0
        #: The current request's hits in each shadow, and its block accesses.
        self._hits = [0, 0]
        self._touches = 0
        self._copy = copy

    def resize(self, capacity: int) -> None:
        """The real cache holds ``capacity`` bytes (or will, once its puts in flight land)."""
        for s in self.shadows:
            s.capacity = capacity

    def touch(self, meta: BlockMeta, *, new_request: bool) -> None:
        """A request reads ``meta``, or writes it after a miss; ``new_request`` when it is
        the first block of a request (the previous one is then complete)."""
        if new_request:
            self._settle()
        self._touches += 1
        for i, s in enumerate(self.shadows):
            self._hits[i] += s.touch(meta, self._copy)

    def _settle(self) -> None:
        """The request so far is over: add its evidence, and let the challenger take over
        if it is surely ahead."""
        if not self._touches:
            return
        first, second = self.shadows
        window = max(MIN_WINDOW, WINDOW_PER_BLOCK * max(len(first), len(second)))
        keep = (1.0 - 1.0 / window) ** self._touches
        diff = self._hits[1] - self._hits[0]
        self.lead = self.lead * keep + diff
        self.variance = self.variance * keep * keep + diff * diff
        self._hits = [0, 0]
        self._touches = 0
        ahead = self.lead if self.leader == 0 else -self.lead
        if ahead > 0 and ahead * ahead > CONFIDENCE * CONFIDENCE * self.variance:
            self.leader = 1 - self.leader
            self.switches += 1
