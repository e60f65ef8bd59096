"""Shadow caches that let a policy pick, online, the eviction order that serves its workload.

No single order wins every workload: frequency (ARC's protected segment) keeps popular
prefixes through floods of one-shot blocks, and recency follows a working set that moves.
A :class:`Duel` replays the requests a policy sees through two miniature caches of the same
capacity, one per order, counts each one's prefix hits (only while the prefix is unbroken,
as a lookup does) over a sliding window, and says which order is ahead. The policy follows
the leader, so it does at least about as well as the better of the two on any workload
(shadow duelling, as in set-dueling caches and Waldspurger's miniature simulations, but with
whole shadows: the keys are small next to the blocks they stand for).

A shadow holds metadata only, never a payload: about 700 bytes per block it tracks (its
policy's structures included), next to blocks of megabytes.

This module knows nothing about the policies it runs: they come as factories.
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

#: How sure the duel must be before the challenger takes over, in standard deviations of
#: the hits on which the two shadows disagree (a sign test: were both orders equally good,
#: each disagreement would go either way with even odds).
CONFIDENCE = 4.0


class ShadowCache:
    """A cache of keys only, run by its own policy, that counts the prefix hits it would have."""

    __slots__ = ("policy", "capacity", "_resident", "_bytes", "_broken", "hits")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        #: Bytes the shadow may hold; its owner keeps it equal to the real cache's size.
        self.capacity = 0
        self._resident: dict[bytes, BlockMeta] = {}
        self._bytes = 0
        self._broken = False
        #: Prefix hits since the start.
        self.hits = 0

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: bytes) -> bool:
        return key in self._resident

    def touch(self, meta: BlockMeta, *, new_request: bool, copy: Callable[[BlockMeta], BlockMeta]) -> bool:
        """A request reads or writes ``meta``; True when it is a prefix hit here."""
        if new_request:
            self._broken = False
        held = self._resident.get(meta.key)
        if held is not None:
            if self._broken:
                return False  # cached behind a missing block: a lookup never reaches it
            self.policy.accessed(_TIER, held)
            self.hits += 1
            return True
        self._broken = True
        mine = copy(meta)
        if not self.policy.admit(_TIER, mine):
            return False
        self._resident[mine.key] = mine
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
        self._bytes -= meta.size
        self.policy.removed(_TIER, meta)


class Duel:
    """Two shadow caches, one per eviction order, and which of them is ahead.

    ``first`` leads at the start. The duel counts, over a sliding window, the prefix hits
    only one of the shadows had; the challenger takes over once its lead in those is
    :data:`CONFIDENCE` standard deviations of a fair coin, and the other way round.
    """

    __slots__ = ("shadows", "leader", "only", "_seen", "_copy")

    def __init__(self, first: EvictionPolicy, second: EvictionPolicy,
                 copy: Callable[[BlockMeta], BlockMeta]) -> None:
        self.shadows = (ShadowCache(first), ShadowCache(second))
        #: 0 while ``first`` leads, 1 while ``second`` does.
        self.leader = 0
        #: Windowed hits that only the first, and only the second, shadow had.
        self.only = [0.0, 0.0]
        #: Keys this request already touched: a put retried or a block read twice counts once.
        self._seen: set[bytes] = set()
        self._copy = copy

    def resize(self, capacity: int) -> None:
        """The real cache holds ``capacity`` bytes now; the shadows grow with it, never shrink
        (a cache that just evicted is as large as it gets)."""
        for s in self.shadows:
            s.capacity = max(s.capacity, capacity)

    def touch(self, meta: BlockMeta, *, new_request: bool) -> None:
        if new_request:
            self._seen.clear()
        elif meta.key in self._seen:
            return
        self._seen.add(meta.key)
        first, second = self.shadows
        hit_first = first.touch(meta, new_request=new_request, copy=self._copy)
        hit_second = second.touch(meta, new_request=new_request, copy=self._copy)
        if hit_first == hit_second:
            return
        window = max(MIN_WINDOW, WINDOW_PER_BLOCK * max(len(first), len(second)))
        keep = 1.0 - 1.0 / window
        only = self.only
        only[0] = only[0] * keep + hit_first
        only[1] = only[1] * keep + hit_second
        challenger = 1 - self.leader
        lead = only[challenger] - only[self.leader]
        if lead > 0 and lead * lead > CONFIDENCE * CONFIDENCE * (only[0] + only[1]):
            self.leader = challenger
