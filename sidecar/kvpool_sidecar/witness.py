"""What an LRU cache of the same size would have served, on the real cache's own accesses.

The duel (duel.py) compares orders on shadow caches that follow one block in sixteen. On a
cache of a thousand blocks that is little evidence: where the order it follows (ARC's, at
the start) falls behind plain recency only once the workload comes back for blocks it
pushed out, the shadows took most of a 2,000-request trace to be sure (an agent's tool
outputs, each read once more about a hundred requests later: 0.014 below LRU), and a
document set that changed every 1,500 requests stayed on ARC's order throughout (0.0036
below LRU at a quarter of the distinct blocks).

:class:`LruWitness` follows *every* access, at a cost of a few words per request rather than
per block: LRU keeps a block as long as fewer than its capacity of other blocks' bytes have
been touched since its last touch (its stack distance). The policy knows each block's last
touch (the tick of the request that made it, for resident blocks and for the ones its ghosts
remember), and :class:`TickBytes` keeps, per tick, the bytes of the blocks whose latest touch
was then, so the distance is one range sum. The witness counts the prefix hits that LRU
would have had and the ones the real cache had, per request; the duel weighs the difference
like its own evidence (see :meth:`~kvpool_sidecar.duel.Duel.witnessed`).

The witness's clock counts the requests of tenants no quota bounds, and its size is the
cache's less what those tenants hold (see ``PrefixAccesses._witness_touch`` in ``policy/accesses.py``). Where a
tenant's quota starts or ends, a block's bytes may be taken off a tick they were never added
to, until that tick leaves the window. Otherwise it errs towards LRU missing: a block read
twice in one request counts every byte the request touched before it as touched since; a
put that landed after another request began, and a block whose last touch the policy no
longer knows (evicted without a ghost, or past the ghosts' reach), count as LRU misses, and
the old bytes of the latter stay counted until they age out. So it speaks for recency only
where recency surely does better.
"""

from __future__ import annotations

from array import array

#: The ticks :class:`TickBytes` follows at first, and at most: it doubles rather than forget
#: a tick while fewer bytes than the cache holds came after it (LRU's horizon is longer than
#: its window), up to twice the most blocks the cache held (16 bytes a block at most; past
#: that, a block last touched before the window counts as an LRU miss) and this many (1 MiB;
#: the last doubling rebuilds the tree, a few tens of milliseconds of the event loop). 8 bytes
#: a tick.
INITIAL_SPAN = 16
MAX_SPAN = 1 << 17


class TickBytes:
    """Bytes per tick, over the last ``span`` ticks: a Fenwick tree over a ring of ticks."""

    __slots__ = ("_tree", "_span", "_now", "total")

    def __init__(self, span: int = INITIAL_SPAN) -> None:
        if span <= 0 or span & (span - 1):
            raise ValueError("span must be a power of two")
        self._span = span
        self._tree = array("q", bytes(8 * (span + 1)))
        self._now = 0
        #: The bytes counted, over the ticks followed.
        self.total = 0

    @property
    def span(self) -> int:
        return self._span

    def _add(self, i: int, delta: int) -> None:
        tree, n = self._tree, self._span
        while i <= n:
            tree[i] += delta
            i += i & -i

    def _prefix(self, i: int) -> int:
        tree, s = self._tree, 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def _at(self, tick: int) -> int:
        i = tick % self._span + 1
        return self._prefix(i) - self._prefix(i - 1)

    def follows(self, tick: int) -> bool:
        """Whether ``tick`` is within the window (not older than ``span`` ticks ago; the
        clock starts at 0)."""
        return tick >= 0 and 0 <= self._now - tick < self._span

    def advance(self, tick: int, keep: int = 0, most: int = MAX_SPAN) -> None:
        """The clock reads ``tick``: ticks that fall out of the window are forgotten, unless
        fewer than ``keep`` bytes came after them (then the window doubles, up to ``most``
        ticks, rather than forget what may still be within an LRU cache of ``keep`` bytes)."""
        if tick - self._now >= self._span:  # (the witness's clock moves by one at a time)
            self._tree = array("q", bytes(8 * (self._span + 1)))
            self.total = 0
            self._now = tick
            return
        while self._now < tick:
            t = self._now + 1
            if t >= self._span:  # its slot holds tick t - span, which falls out
                v = self._at(t)
                if v and self.total - v < keep and 2 * self._span <= most:
                    self._grow()
                    continue
                if v:
                    self._add(t % self._span + 1, -v)
                    self.total -= v
            self._now = t

    def add(self, tick: int, delta: int) -> None:
        """``delta`` bytes at ``tick`` (nothing where it is out of the window)."""
        if self.follows(tick):
            self._add(tick % self._span + 1, delta)
            self.total += delta

    def since(self, tick: int) -> int | None:
        """The bytes at the ticks after ``tick``, up to now; None where ``tick`` is out of
        the window."""
        if not self.follows(tick):
            return None
        if tick == self._now:
            return 0
        n = self._span
        a, b = (tick + 1) % n, self._now % n  # slots a..b, in ring order
        if a <= b:
            return self._prefix(b + 1) - self._prefix(a)
        return self._prefix(n) - self._prefix(a) + self._prefix(b + 1)

    def _grow(self) -> None:
        """Twice the window, keeping what it counts: the tree's slots back to the bytes per
        tick, then a tree of twice the slots built from them, each in one pass."""
        tree, n = self._tree, self._span
        for i in range(n, 0, -1):  # (the inverse of the linear build below)
            j = i + (i & -i)
            if j <= n:
                tree[j] -= tree[i]
        span = 2 * n
        grown = array("q", bytes(8 * (span + 1)))
        for t in range(max(0, self._now - n + 1), self._now + 1):
            grown[t % span + 1] = tree[t % n + 1]
        for i in range(1, span + 1):
            j = i + (i & -i)
            if j <= span:
                grown[j] += grown[i]
        self._tree, self._span = grown, span


class LruWitness:
    """Prefix hits an LRU cache of ``capacity`` bytes would have had, against the real cache's,
    request by request (see the module's docstring).

    The owner calls :meth:`touch` for each access it sees, with the tick of the block's last
    touch where it knows it, and :meth:`settle` when a request ends.
    """

    __slots__ = ("ticks", "capacity", "blocks", "clock", "bounded_bytes", "_tick", "_pending", "_last_key",
                 "_last_lru", "_lru", "_real", "_touches")

    def __init__(self) -> None:
        self.ticks = TickBytes()
        #: What the owner keeps for it: its clock (the owner ticks it once per request of a
        #: tenant no quota bounds: a bounded tenant's requests, many of them between two
        #: others, had emptied the window), and the resident bytes of the tenants a quota bounds,
        #: together (the room they hold is not the others').
        self.clock = 0
        self.bounded_bytes = 0
        #: The LRU cache's size in bytes, and the most blocks the real cache held: its owner
        #: keeps them.
        self.capacity = 0
        self.blocks = 0
        #: The current tick, and the bytes touched at it so far (added to :attr:`ticks` when
        #: the clock moves on: one update of the tree per request rather than per block).
        self._tick = 0
        self._pending = 0
        #: The block touched last and whether LRU would have served it: a block that comes
        #: right after its parent counts only if its parent did. (Requests of several clients
        #: that interleave are not told apart: a block whose parent was not the last one
        #: touched counts on its own, as a sampled shadow counts every block.)
        self._last_key: bytes | None = None
        self._last_lru = False
        self._lru = self._real = self._touches = 0

    def touch(self, tick: int, key: bytes, parent: bytes | None, size: int, *, last: int | None,
              hit: bool) -> None:
        """At ``tick`` (never less than the last call's), a request reads ``key`` (``hit``) or
        writes it after a miss; ``last``: the tick of its last touch, if known."""
        ticks = self.ticks
        if tick != self._tick:
            if self._pending:
                ticks.add(self._tick, self._pending)
                self._pending = 0
            self._tick = tick
            ticks.advance(tick, self.capacity, min(MAX_SPAN, max(INITIAL_SPAN, 2 * self.blocks)))
        lru = False
        if last == tick:  # touched before in this request: counted once, now
            lru = self._pending <= self.capacity  # (every byte of the request so far since: at most)
            self._pending = max(0, self._pending - size)
        elif last is not None and last < tick:
            since = ticks.since(last)
            if since is not None:
                lru = since + self._pending + size <= self.capacity
                ticks.add(last, -size)  # its bytes move to now (an unknown last touch leaves them)
        if parent is not None and parent == self._last_key and not self._last_lru:
            lru = False  # its parent was an LRU miss: a lookup stops there
        self._last_key, self._last_lru = key, lru
        self._pending += size
        self._lru += lru
        self._real += hit
        self._touches += 1

    def settle(self) -> tuple[int, int]:
        """The request so far is over: (LRU's prefix hits minus the real cache's, accesses
        followed) since the last settle."""
        out = (self._lru - self._real, self._touches)
        self._lru = self._real = self._touches = 0
        return out
