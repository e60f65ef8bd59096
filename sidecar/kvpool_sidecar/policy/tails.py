"""The prefix-aware policy's tail rule: whether unread partial tails go before other unread
blocks, from what became of the tails evicted lately (:class:`TailWatch`)."""

from __future__ import annotations

from collections import deque

from kvpool_sidecar.keyhash import key_hash


#: How much of the tail rule's record each eviction of its kind keeps (see :class:`TailWatch`).
_TAIL_KEEP = 1.0 - 1.0 / 512

#: Tails evicted (decayed) before the tail rule may be judged by what became of them.
_TAIL_EVIDENCE = 32.0

#: One ordinary eviction in this many (by the key's first byte) is followed by the tail rule.
_TAIL_SAMPLE = 32

#: Keys one eviction stops following at most beyond the one it adds: a horizon that shrank at
#: once (the tier's blocks, which a tenant swapping small blocks for large ones makes fewer)
#: is reached over the next evictions, not by one that drops every key past it.
_TRIM = 16

#: A followed key is kept as 30 bits of its hash (:mod:`kvpool_sidecar.keyhash`): an int of
#: the smallest size CPython makes (28 bytes), and two keys that share them only blur a rate.
_GHOST_BITS = (1 << 30) - 1


class TailWatch:
    """Whether partial tails should go before other unread blocks: once :data:`_TAIL_EVIDENCE`
    tails have gone, while they come back (are written again after they went) less often
    than blocks evicted in the ordinary order, each within the same number of evictions after
    it went. Not before that evidence, and not where neither come back: tool outputs read
    again once, whose tails are the rare blocks that come back at all, lost .002 of LRU's
    hit rate to the rule at 0.50 (``shapes.tool_outputs``).

    Where engines store only full blocks, or a conversation's next turn replaces its tail, a
    tail seldom comes back and the rule gains. Where the same partial block is written again
    (its key unchanged when the prompt grows), evicting tails first throws away what the next
    request reads: there the tails' ghosts come back and the rule steps aside until they stop.
    It follows every evicted tail and one ordinary eviction in :data:`_TAIL_SAMPLE`, by a hash
    of the key, for ``horizon`` evictions each; both rates are decayed by each eviction of
    their kind.
    """

    __slots__ = ("ghosts", "_keys", "_went", "evictions", "out", "back", "tail_out", "tail_back")

    def __init__(self) -> None:
        #: Keys followed (hashed): the eviction count when each went, negative for a tail ...
        self.ghosts: dict[int, int] = {}
        #: ... and the same, in the order they went, oldest first (an entry whose key was
        #: followed again since, or came back, no longer matches the dict's and only waits
        #: its turn to go). Not the dict's own order: its first item is found by a walk past
        #: every item deleted since it last grew (26 us an eviction at 100,000 blocks).
        self._keys: deque[int] = deque()
        self._went: deque[int] = deque()
        self.evictions = 0
        self.out = self.back = self.tail_out = self.tail_back = 0.0

    def evicted(self, key: bytes, tail: bool, horizon: int) -> None:
        """A block left (``tail``: as a tail); what went more than ``horizon`` evictions ago
        is no longer followed (at most :data:`_TRIM` + 1 keys dropped a call)."""
        self.evictions += 1
        ghosts = self.ghosts
        if tail:
            self.tail_out, self.tail_back = self.tail_out * _TAIL_KEEP + 1.0, self.tail_back * _TAIL_KEEP
        elif key[0] % _TAIL_SAMPLE == 0:
            self.out, self.back = self.out * _TAIL_KEEP + 1.0, self.back * _TAIL_KEEP
        keys, went = self._keys, self._went
        if tail or key[0] % _TAIL_SAMPLE == 0:
            h = key_hash(key) & _GHOST_BITS
            ghosts[h] = -self.evictions if tail else self.evictions
            keys.append(h)
            went.append(ghosts[h])
        oldest = self.evictions - horizon
        for _ in range(_TRIM + 1):
            if not went or abs(went[0]) >= oldest:
                break
            h, when = keys.popleft(), went.popleft()
            if ghosts.get(h) == when:
                del ghosts[h]

    def arrived(self, key: bytes) -> None:
        """``key`` came into the cache anew."""
        went = self.ghosts.pop(key_hash(key) & _GHOST_BITS, 0) if self.ghosts else 0
        if went < 0:
            self.tail_back += 1.0
        elif went > 0:
            self.back += 1.0

    @property
    def tails_first(self) -> bool:
        if self.tail_out < _TAIL_EVIDENCE:
            return False
        return self.tail_back * max(self.out, 1.0) < self.back * self.tail_out
