"""Shadow caches that let a policy pick, online, the eviction order that serves its workload.

No single order wins every workload: frequency (ARC's protected segment) keeps popular
prefixes through floods of one-shot blocks, recency follows a working set that moves, and a
learned order is only as good as what it learned. A :class:`Duel` replays the block accesses
a policy sees through one shadow cache per order, all of the same capacity, counts each
one's prefix hits (a block counts only if its parent counted too, as a lookup stops at the
first miss), and says which order is ahead. The policy follows the leader, so it does about
as well as the best of them on a workload that keeps its character (shadow duelling, as in
set-dueling caches).

A shadow holds metadata only, never a payload: what its policy keeps (it asks the policy
what it holds rather than keep a table of its own: :class:`~kvpool_sidecar.policy.ShadowPolicy`),
about 600 bytes per block it tracks, ghosts included. A *sampled* duel (Waldspurger et al.'s SHARDS)
tracks only the blocks whose key hashes below a threshold, in shadows of that share of the
capacity: a share of :data:`SAMPLE_SHARE` of the blocks once the cache holds (or, as its
owner says, will hold) more than ``MIN_SAMPLED / SAMPLE_SHARE`` of them, so the shadows cost a
few tens of bytes per block of the cache and follow one access in sixteen. A sampled block is followed on its own (its parent is most likely not sampled),
so a sampled shadow counts plain hits, not prefix hits.

A challenger may be given a *simpler* order (``simpler``): it then takes over only when it is
also surely ahead of that one. The default policy gives the learned order recency: a
learned order that leads ARC only by what recency also gains adds nothing but the risk of
its estimates, and on sessions that send their partial tails again it had led on that and
fallen below LRU.

Beside the shadows, a duel may weigh evidence from the real cache itself (:meth:`Duel.witnessed`,
``fallback``): how many more prefix hits LRU of its size would have had, every access
followed (:mod:`kvpool_sidecar.witness`). Once LRU is surely ahead by it, the fallback order
(plain recency) leads.

This module knows nothing about the policies it runs: they come ready made.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvpool_sidecar.errors import ConfigError

if TYPE_CHECKING:
    from kvpool_sidecar.policy import BlockMeta, ShadowPolicy

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

#: How sure LRU's evidence from the real cache (:meth:`Duel.witnessed`) must be before plain
#: recency takes over: one standard deviation of it, not two. That evidence follows every
#: access (the shadows one in sixteen), it only ever hands the cache to recency, LRU's own
#: order, and a needless switch is undone once the shadows are sure of the order it left.
#: At two, an agent's tool outputs read again once stayed 0.0053 below LRU at a tenth of
#: their distinct blocks (one: 0.0008; the shadows alone: 0.0142).
WITNESS_CONFIDENCE = 1.0

#: Added to that variance (and to the witness's): a challenger that won five requests by one sampled hit each (a
#: lead of 5 and a variance of 5) had taken over on that noise alone, and on traces of
#: agents re-reading documents the learned order it switched to lost .03 of LRU's hit rate.
VARIANCE_FLOOR = 32.0

#: The share of blocks a sampled duel follows once the cache is large enough ...
SAMPLE_SHARE = 1 / 16

#: ... which is when that share is this many blocks; a smaller cache is followed more
#: densely (all of it, below this many blocks). 64 rather than 128: on caches of a few
#: hundred to two thousand blocks it halves the shadows' work (the sidecar's CPU per put
#: fell by about a third in ``kvpool bench local``) and their memory. Replays of the shared
#: trace: 0.02 gains .002 (.0766 to .0785), three tenants at 0.05 lose .0009 (.1592 to
#: .1582), 0.01, 0.05, 0.10 and pools of 4 or 8 instances are unchanged. Sampling at the
#: share for the tiers' capacity from the first block on (the store tells the policy its size)
#: rather than for the blocks held so far: 0.02 .0785 to .0778, 0.05, 0.10, 0.25, 8 private
#: caches and three tenants (priorities 1, 0, 0) at 0.05 unchanged.
MIN_SAMPLED = 64

#: Sampling thresholds are 32-bit hashes.
_HASH_SPACE = 1 << 32

#: While the cache grows, the sample shrinks in steps of at least this factor (or straight
#: to :data:`SAMPLE_SHARE`): each step scans the shadows, so a cache filling up block by block
#: pays for a few dozen scans in all instead of one per block.
SHRINK_STEP = 0.8


class ShadowCache:
    """A cache of keys only, run by its own policy, that counts the prefix hits it would have."""

    __slots__ = ("policy", "capacity", "max_blocks", "_reached", "_bytes", "hits")

    def __init__(self, policy: ShadowPolicy, *, chained: bool = True) -> None:
        self.policy = policy
        #: Bytes the shadow may hold; its owner keeps it equal to the real cache's size.
        self.capacity = 0
        #: Blocks it may hold (None: any number): blocks of a byte each, which the real cache
        #: charges a page, would otherwise fill a shadow of its bytes with millions of keys.
        self.max_blocks: int | None = None
        #: Resident keys whose last access was a prefix hit here: a child hits only after its
        #: parent did. Kept per block rather than per request, so that requests from many
        #: clients may interleave. None when not ``chained``: the blocks come without their
        #: parents (a sampled duel's), every hit is a plain one, and there is nothing to keep
        #: (a set that only grows and shrinks, whose size varied with the process's hash seed).
        self._reached: set[bytes] | None = set() if chained else None
        self._bytes = 0
        #: Prefix hits since the start.
        self.hits = 0

    def __len__(self) -> int:
        return len(self.policy.resident_keys(_TIER))

    def __contains__(self, key: bytes) -> bool:
        return self.policy.resident(_TIER, key) is not None

    def touch(self, meta: BlockMeta, copy: Callable[[BlockMeta], BlockMeta]) -> bool:
        """A request reads ``meta``, or writes it after a miss; True when it is a prefix hit here."""
        key = meta.key
        policy = self.policy
        held = policy.resident(_TIER, key)
        if held is not None:
            reached = self._reached
            if reached is not None:
                if meta.parent is not None and meta.parent not in reached:
                    reached.discard(key)
                    return False  # held behind a missing block: a lookup never reaches it
                reached.add(key)
            self.policy.accessed(_TIER, held)
            self.hits += 1
            return True
        mine = copy(meta)
        if not policy.admit(_TIER, mine):
            return False
        self._bytes += mine.size
        policy.inserted(_TIER, mine)
        while (self._bytes > self.capacity
               or (self.max_blocks is not None and len(policy.resident_keys(_TIER)) > self.max_blocks)):
            victim = next(iter(policy.victims(_TIER)), None)
            if victim is None:
                break
            self._drop(victim)
        return False

    def _drop(self, meta: BlockMeta, *, evicted: bool = True) -> None:
        if self._reached is not None:
            self._reached.discard(meta.key)
        self._bytes -= meta.size
        self.policy.removed(_TIER, meta, evicted=evicted)

    def forget(self, keep: Callable[[bytes], bool]) -> None:
        """Drop the blocks that ``keep`` refuses (not evictions: the sample shrank)."""
        policy = self.policy
        for key in [k for k in policy.resident_keys(_TIER) if not keep(k)]:
            meta = policy.resident(_TIER, key)
            if meta is not None:
                self._drop(meta, evicted=False)


class Duel:
    """Shadow caches, one per eviction order, and which of them is ahead.

    The first leads at the start. For each request the duel takes each shadow's prefix hits
    and keeps, decayed over a sliding window, each shadow's sum and, for each pair, the sum
    of the squares of their difference (decayed at the square of the rate, so that it is the
    variance of the difference of the sums were the two orders equally good). A challenger
    takes over once its lead over the leader exceeds :data:`CONFIDENCE` times the square root
    of that variance (the one furthest ahead, if several are).

    ``sampled``: follow a share of the blocks only (see the module's docstring).
    """

    __slots__ = ("shadows", "leader", "sums", "squares", "switches", "_hits", "_touches", "_copy", "_threshold",
                 "_share", "_simpler", "_fallback", "_witness")

    def __init__(self, policies: Sequence[ShadowPolicy], copy: Callable[[BlockMeta], BlockMeta], *,
                 sampled: bool = False, simpler: Mapping[int, int] | None = None,
                 fallback: int | None = None) -> None:
        self.shadows = tuple(ShadowCache(p, chained=not sampled) for p in policies)
        n = len(self.shadows)
        if simpler is not None and any(not (0 <= i < n and 0 <= j < n) or i == j for i, j in simpler.items()):
            raise ConfigError("a simpler order must be another of the duel's orders")
        if fallback is not None and not 0 <= fallback < n:
            raise ConfigError("the fallback order must be one of the duel's orders")
        #: The order that LRU's evidence from the real cache (:meth:`witnessed`) speaks for:
        #: plain recency. None: that evidence is not weighed.
        self._fallback = fallback
        #: That evidence, decayed as the shadows' is: LRU's lead over the real cache in prefix
        #: hits, and the sum of its squares per request.
        self._witness = [0.0, 0.0]
        #: Orders that take over only when they are also surely ahead of a simpler one:
        #: ``order -> simpler order`` (see :meth:`_surely_ahead`).
        self._simpler = dict(simpler or {})
        #: The index of the order that leads, and how often that changed.
        self.leader = 0
        self.switches = 0
        #: Windowed sum of each shadow's hits per request, and of the squared differences
        #: per pair (``squares[i][j]``, i > j).
        self.sums = [0.0] * n
        self.squares = [[0.0] * n for _ in range(n)]
        #: The current request's hits in each shadow, and its block accesses followed.
        self._hits = [0] * n
        self._touches = 0
        self._copy = copy
        #: Keys whose hash is below this are followed; the share of the cache that is.
        self._threshold = _HASH_SPACE
        self._share = 1.0 if sampled else 0.0

    @property
    def share(self) -> float:
        """The share of the blocks the shadows follow."""
        return self._share or 1.0

    def lead(self, i: int) -> float:
        """How far order ``i`` is ahead of the leader (windowed prefix hits)."""
        return self.sums[i] - self.sums[self.leader]

    def variance(self, i: int) -> float:
        """The windowed variance of the difference between order ``i`` and the leader."""
        return self._variance(i, self.leader)

    def _variance(self, i: int, j: int) -> float:
        return self.squares[max(i, j)][min(i, j)]

    def _surely_ahead(self, i: int, j: int) -> bool:
        """Whether order ``i``'s windowed lead over order ``j`` exceeds :data:`CONFIDENCE`
        standard deviations of that lead were both equally good."""
        ahead = self.sums[i] - self.sums[j]
        return ahead > 0.0 and ahead * ahead > CONFIDENCE * CONFIDENCE * (self._variance(i, j) + VARIANCE_FLOOR)

    def witnessed(self, ahead: int, touches: int, blocks: int) -> None:
        """One request's evidence from the real cache itself, every access followed: LRU of
        its size would have had ``ahead`` more prefix hits than it had (negative: fewer) over
        its ``touches`` accesses (:class:`~kvpool_sidecar.witness.LruWitness`); the cache
        holds ``blocks`` blocks.

        While another order than the fallback leads (the real cache then follows it), LRU's
        windowed lead over the real cache is weighed as the shadows' leads are; once the
        fallback is surely ahead by it, the fallback leads, and the order it replaces must
        prove itself again on the shadows (its windowed hits there are brought down to the
        fallback's). The shadows follow one block in sixteen: on a cache of a thousand blocks
        they had taken most of a trace to see what this sees in a few requests."""
        fallback = self._fallback
        w = self._witness
        if fallback is None or self.leader == fallback:
            w[0] = w[1] = 0.0
            return
        window = max(MIN_WINDOW, WINDOW_PER_BLOCK * blocks)
        keep = (1.0 - 1.0 / window) ** touches
        w[0] = w[0] * keep + ahead
        w[1] = w[1] * keep * keep + ahead * ahead
        if w[0] > 0.0 and w[0] * w[0] > WITNESS_CONFIDENCE * WITNESS_CONFIDENCE * (w[1] + VARIANCE_FLOOR) \
                and not self._surely_ahead(self.leader, fallback):
            self.sums[self.leader] = min(self.sums[self.leader], self.sums[fallback])
            self.leader = fallback
            self.switches += 1
            w[0] = w[1] = 0.0

    def resize(self, capacity: int, blocks: int = 0) -> None:
        """The real cache holds ``capacity`` bytes (or will, once its puts in flight land);
        ``blocks``: how many blocks it holds or will hold, which sets the sample's share."""
        if self._share and blocks > MIN_SAMPLED:
            share = max(SAMPLE_SHARE, MIN_SAMPLED / blocks)
            # the sample only ever shrinks (keys once out stay out), and in steps
            if share < self._share * SHRINK_STEP or (share == SAMPLE_SHARE and share < self._share):
                self._share = share
                self._threshold = int(share * _HASH_SPACE)
                for s in self.shadows:
                    s.forget(self._follows)
        mine = int(capacity * self.share)
        for s in self.shadows:
            s.capacity = mine

    def cap_blocks(self, blocks: int) -> None:
        """The real cache has held as many as ``blocks`` blocks at once: each shadow holds at
        most twice its share of that many."""
        for s in self.shadows:
            s.max_blocks = max(MIN_SAMPLED, int(2 * blocks * self.share))

    def _follows(self, key: bytes) -> bool:
        return self._threshold >= _HASH_SPACE or zlib.crc32(key, 0x2545F491) < self._threshold

    def touch(self, meta: BlockMeta, *, new_request: bool) -> None:
        """A request reads ``meta``, or writes it after a miss; ``new_request`` when it is
        the first block of a request (the previous one is then complete)."""
        if new_request:
            self._settle()
        if not self._follows(meta.key):
            return
        mine = self._copy(meta)  # one copy, shared by the shadows (none of them changes it)
        if self._share:
            mine.parent = None  # followed alone: its parent is most likely not sampled
        self._touches += 1
        for i, s in enumerate(self.shadows):
            self._hits[i] += s.touch(mine, _same)

    def _settle(self) -> None:
        """The request so far is over: add its evidence, and let a challenger take over if
        it is surely ahead."""
        if not self._touches:
            return
        window = max(MIN_WINDOW * self.share, WINDOW_PER_BLOCK * max(len(s) for s in self.shadows))
        keep = (1.0 - 1.0 / window) ** self._touches
        keep2 = keep * keep
        hits = self._hits
        for i, h in enumerate(hits):
            self.sums[i] = self.sums[i] * keep + h
            row = self.squares[i]
            for j in range(i):
                row[j] = row[j] * keep2 + (h - hits[j]) ** 2
        self._hits = [0] * len(hits)
        self._touches = 0
        best, best_ahead = self.leader, 0.0
        for i in range(len(hits)):
            ahead = self.lead(i)
            if i != self.leader and ahead > best_ahead and self._surely_ahead(i, self.leader):
                simpler = self._simpler.get(i)
                if simpler is None or simpler == self.leader or self._surely_ahead(i, simpler):
                    best, best_ahead = i, ahead
        if best != self.leader:
            self.leader = best
            self.switches += 1
            self._witness[0] = self._witness[1] = 0.0  # (it spoke of the real cache under the last leader)


def _same(meta: BlockMeta) -> BlockMeta:
    return meta
