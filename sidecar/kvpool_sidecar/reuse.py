"""How much a block is worth keeping, learned online from what became of blocks like it.

Every block a request touches (reads, writes, or finds held behind a miss) falls in a
*class*: how many requests touched it lately (1, 2, 3 or more, from a :class:`FrequencySketch`
that remembers keys the cache no longer holds), whether it is a partial tail, its depth in
its chain (log-bucketed), and what its writer said in its hints: the prompt's length in
blocks (log-bucketed), its label (hashed into a few buckets) and whether its session had been
seen before (:class:`SessionTable`); and its tenant: one tenant's blocks never score
another's class (the first :data:`TENANT_CLASSES` tenants seen have classes of their own).
Classes are small integers from a fixed, bounded set, whatever the clients send.

A :class:`ReuseEstimator` follows a sample of blocks (by their key's hash, whether or not the
cache holds them: eviction does not censor what it learns) for a horizon of block touches,
several times the cache's size. When a followed block is touched again within the horizon,
its class at the last touch scores a reuse after that many touches; when the horizon passes
first, it scores none. Per class it keeps, decayed (halved every horizon) so that it follows
a changing workload, the outcomes, the reuses, and the *exposure*: the byte-touches the blocks
were followed for (until their reuse, else the horizon).

``reuses / exposure`` is the class's *hit density*: expected hits per byte per touch kept
(the measure of Beckmann et al.'s LHD, here over a fixed horizon). A class with little
evidence borrows from coarser ones (the same class without depth, then without the hints,
both of its tenant, then all blocks), each worth :data:`PRIOR_WEIGHT` outcomes of the next.
:meth:`ReuseEstimator.relative` answers a class's *worth* against all blocks, or None while
all blocks together have too little evidence (the policy keeps its own order then, see
:mod:`kvpool_sidecar.policy.prefix`): its chance of reuse over all blocks' (``reuses /
outcomes``), or, where lower, its density over all blocks' below 1. Density alone had ranked
what is reused soon above what is reused at all: a partial tail sent again by the next turn
(reused within a few touches, never after) was placed up to 16 times as long as an average
block, and the learned order fell .004-.006 below LRU on such sessions (``shapes.resent_tails``
at 0.20-0.50; now .0000-.0001 above).

Bounded cost: the blocks followed are about :data:`MIN_FOLLOWED` in a small cache and one in
:data:`SAMPLE_RATE` of a horizon's touches in a large one; the sketch is a byte per two
touches of a horizon; the per-class state is three floats for each of at most 3 x
:data:`TENANT_CLASSES` x :data:`CLASSES` + 1 classes (labels and sessions are hashed; at most
:data:`MAX_SESSIONS` sessions are remembered). Labels are hashed with CRC-32, not a keyed
hash: a client that chooses its labels can share a bucket with another of its own tenant's
labels, never another tenant's (a tenant that did had cut another's hit rate from 0.99 to
0.81 by making its class look worthless); what tenants share is the estimate of all blocks
together, which every class's worth is relative to, and, past the first
:data:`TENANT_CLASSES` tenants a node has seen, the classes of the last.
"""

from __future__ import annotations

import zlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

from kvpool_sidecar.keyhash import key_hash

if TYPE_CHECKING:
    from kvpool_sidecar.policy import BlockMeta

#: Buckets of each class dimension.
_USES = 3  # touched by 1, 2, 3+ requests
_TAIL = 2
_PROMPT = 9  # none, then 1, 2-3, 4-7, ..., 128+ blocks
_LABEL = 8  # none, then 7 hash buckets
_SESSION = 3  # none, first request of its session, a session seen before
_DEPTH = 4  # 0, 1-3, 4-15, 16+

#: How many classes there can be, for one tenant.
CLASSES = _USES * _TAIL * _PROMPT * _LABEL * _SESSION * _DEPTH

#: Tenants whose classes are their own (the ones after share the last): one tenant's blocks
#: never score another's class, whatever labels it chooses.
TENANT_CLASSES = 16

#: Where each level's class keys begin (finest, without depth, without hints, all blocks).
_MID = TENANT_CLASSES * CLASSES
_BASE = 2 * _MID
_TOP = 3 * _MID

#: Sessions remembered (least recently seen forgotten first) at most, and at least: between
#: them, one for each block the cache holds (:meth:`SessionTable.resize`), so that a writer
#: naming a new session in every put costs a small cache no more than a large one, per block.
MAX_SESSIONS = 4096
MIN_SESSIONS = 64

#: Follow one block in this many (by key hash) ...
SAMPLE_RATE = 32

#: ... or more, up to all of them, so as to follow about this many at a time in a small cache.
MIN_FOLLOWED = 512

#: Sampling thresholds are 32-bit hashes.
_HASH_SPACE = 1 << 32

#: The horizon, in block touches per block of the largest the cache has held: a block not
#: touched again within it counts as not reused. Several turnovers of the cache, so that what
#: a policy could keep longer than it does today is still seen.
HORIZON_PER_BLOCK = 8

#: The smallest horizon, in block touches.
MIN_HORIZON = 4096

#: Evidence a class borrows from the next coarser one, in outcomes.
PRIOR_WEIGHT = 8.0

#: Outcomes of all blocks together before any estimate is given.
MIN_EVIDENCE = 64.0

#: The statistics halve every this many horizons.
HALF_LIFE = 1.0

#: Decay is applied in this many steps per half-life.
_DECAY_STEPS = 8

#: Estimates are recomputed after this many new outcomes.
_REFRESH = 64


#: The sketch grows by at least this factor at a time.
_SKETCH_STEP = 1.25

#: Each byte value halved, for ``bytes.translate``.
_HALVES = bytes(i >> 1 for i in range(256))


def _log_bucket(n: int, top: int) -> int:
    """1 -> 1, 2-3 -> 2, 4-7 -> 3, ...; capped at ``top``; 0 for none (n < 1)."""
    return 0 if n < 1 else min(top, n.bit_length())


class FrequencySketch:
    """How many times each key was touched lately: a count-min sketch of small counters,
    halved once per window (TinyLFU's), so a key's count covers about one window.

    Four counters a key, one byte each, at least two for each touch of a window (so that few
    keys share all four); counts saturate at 15.
    """

    __slots__ = ("_counts", "_width", "_added", "_window")

    def __init__(self, blocks: int = 0) -> None:
        self._counts = bytearray(0)
        self._width = 1
        self._added = 0
        self._window = 0
        self.resize(blocks)

    def resize(self, blocks: int) -> None:
        """Size for a cache of ``blocks`` blocks; grows only (the counts restart then).

        Two counters per touch of a window, grown in steps of at least :data:`_SKETCH_STEP`
        (each step restarts the counts), not to the next power of two: that had cost up to
        twice the bytes (30 bytes per resident block at 0.10 of the shared trace)."""
        self._window = max(self._window, MIN_HORIZON, HORIZON_PER_BLOCK * blocks)
        if 2 * self._window > len(self._counts):
            width = max(2 * self._window, int(len(self._counts) * _SKETCH_STEP))
            self._counts = bytearray(width)
            self._width = width
            self._added = 0

    def _slots(self, key: bytes) -> tuple[int, int, int, int]:
        """The four counters of ``key``."""
        width = self._width
        h1 = zlib.crc32(key)
        h2 = zlib.crc32(key, 0x9E3779B9) | 1
        return h1 % width, (h1 + h2) % width, (h1 + 2 * h2) % width, (h1 + 3 * h2) % width

    def count(self, key: bytes) -> int:
        """``key``'s count, without a touch."""
        counts = self._counts
        return min(counts[i] for i in self._slots(key))

    def add(self, key: bytes) -> int:
        """Count one touch of ``key``; its count now."""
        counts = self._counts
        a, b, c, d = self._slots(key)
        least = min(counts[a], counts[b], counts[c], counts[d])
        if least < 15:
            # conservative update: only the smallest counters grow (each slot once, also
            # where two of them are the same counter)
            if counts[a] == least:
                counts[a] = least + 1
            if counts[b] == least:
                counts[b] = least + 1
            if counts[c] == least:
                counts[c] = least + 1
            if counts[d] == least:
                counts[d] = least + 1
            least += 1
        self._added += 1
        if self._added >= self._window:
            self._halve()
        return least

    def _halve(self) -> None:
        self._added //= 2
        self._counts = bytearray(self._counts.translate(_HALVES))  # at C speed: many MB a millisecond


class SessionTable:
    """Which sessions each tenant has named, by hash, at most :data:`MAX_SESSIONS` of them
    in all.

    Each tenant's sessions are its own table, so no name of one tenant's can be another's
    (a tenant's first request of a session counts as returning only if that tenant named it
    before). When the node's tables are full, the tenant holding the most sessions forgets
    its least recently seen one: a tenant naming a new session in every put pushes out its
    own sessions once it holds the most, never those of a tenant that holds fewer (one table
    for all had let any tenant without a quota empty every other tenant's sessions, and so
    its blocks' classes of returning sessions).
    """

    __slots__ = ("_seen", "_limit", "_count")

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self._seen: dict[str, OrderedDict[int, None]] = {}
        self._limit = limit
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def resize(self, blocks: int) -> None:
        """Remember as many sessions as the cache holds blocks (within :data:`MIN_SESSIONS`
        and :data:`MAX_SESSIONS`); the largest tables forget first."""
        self._limit = min(MAX_SESSIONS, max(MIN_SESSIONS, blocks))
        while self._count > self._limit:
            self._forget_one()

    def note(self, tenant: str, session: str) -> bool:
        """A request of ``tenant``'s ``session`` starts; True if the tenant named it before.

        Sessions are told apart by a hash behind the process's secret (:mod:`~kvpool_sidecar.keyhash`),
        not by CRC-32: CRC-32 is linear, and a tenant could compute a session name whose CRC
        equalled another's."""
        table = self._seen.get(tenant)
        if table is None:
            table = self._seen[tenant] = OrderedDict()
        h = key_hash(session.encode())
        if h in table:
            table.move_to_end(h)
            return True
        table[h] = None
        self._count += 1
        if self._count > self._limit:
            self._forget_one()
        return False

    def _forget_one(self) -> None:
        """The least recently seen session of the tenant that holds the most."""
        tenant, table = max(self._seen.items(), key=lambda item: len(item[1]))
        table.popitem(last=False)
        self._count -= 1
        if not table:
            del self._seen[tenant]


def block_class(meta: BlockMeta, uses: int, tail: bool, returning: bool, tenant: int = 0) -> int:
    """The class of ``meta`` as touched for the ``uses``-th time; ``returning``: its session
    had been seen before this request; ``tenant``: its tenant's number (< :data:`TENANT_CLASSES`)."""
    h = meta.hints
    prompt = label = session = 0
    if h is not None:
        prompt = _log_bucket(h.prompt_blocks, _PROMPT - 1)
        if h.label is not None:
            label = 1 + zlib.crc32(h.label.encode()) % (_LABEL - 1)
        if h.session is not None:
            session = 2 if returning else 1
    depth = 0 if meta.depth < 1 else min(_DEPTH - 1, (meta.depth.bit_length() + 1) // 2)
    c = min(max(uses, 1), _USES) - 1  # (fewer than one: a class of another tenant's range)
    c = c * _TAIL + tail
    c = c * _PROMPT + prompt
    c = c * _LABEL + label
    c = c * _SESSION + session
    return tenant * CLASSES + c * _DEPTH + depth


def _coarser(cls: int) -> tuple[int, int, int]:
    """``cls`` without depth and without hints (each of its tenant), and all blocks: keys of
    the coarser levels.

    Each level's keys live in a range of their own, apart from the finest level's."""
    tenant, own = divmod(cls, CLASSES)
    no_depth = own // _DEPTH
    base = no_depth // (_PROMPT * _LABEL * _SESSION)
    return _MID + tenant * CLASSES + no_depth, _BASE + tenant * CLASSES + base, _TOP


#: Bits of a class and of a size in :func:`_pack`.
_CLASS_BITS = 20
_SIZE_BITS = 40


def _pack(touch: int, cls: int, size: int) -> int:
    """A followed key's last touch, class and bytes, in one int."""
    return (((touch << _CLASS_BITS) | cls) << _SIZE_BITS) | min(size, (1 << _SIZE_BITS) - 1)


def _unpack(packed: int) -> tuple[int, int, int]:
    rest, size = packed >> _SIZE_BITS, packed & ((1 << _SIZE_BITS) - 1)
    return rest >> _CLASS_BITS, rest & ((1 << _CLASS_BITS) - 1), size


class ClassStats:
    """Three decayed sums per class key (outcomes, reuses, exposure), in one array of
    doubles: a list of three floats a class had taken about 150 bytes more."""

    __slots__ = ("_slot", "_sums", "_free")

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self._sums = array("d")
        #: Slots of classes that died out, for the next new ones.
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, key: int, reused: float, exposure: float) -> None:
        """One outcome of class ``key``."""
        i = self._slot.get(key)
        sums = self._sums
        if i is None:
            if self._free:
                i = self._free.pop()
            else:
                i = len(sums)
                sums.extend((0.0, 0.0, 0.0))
            self._slot[key] = i
        sums[i] += 1.0
        sums[i + 1] += reused
        sums[i + 2] += exposure

    def get(self, key: int) -> tuple[float, float, float] | None:
        """Class ``key``'s (outcomes, reuses, exposure), or None if it has none."""
        i = self._slot.get(key)
        if i is None:
            return None
        sums = self._sums
        return sums[i], sums[i + 1], sums[i + 2]

    def decay(self, factor: float) -> None:
        """Scale every sum by ``factor``; a class left with under 0.01 outcomes is dropped."""
        sums = self._sums
        for k, i in list(self._slot.items()):
            outcomes = sums[i] * factor
            if outcomes < 0.01:
                del self._slot[k]
                sums[i] = sums[i + 1] = sums[i + 2] = 0.0
                self._free.append(i)
            else:
                sums[i], sums[i + 1], sums[i + 2] = outcomes, sums[i + 1] * factor, sums[i + 2] * factor


class ReuseEstimator:
    """Each class's worth (chance of reuse, and hit density), learned from a sample of blocks
    followed over a horizon."""

    __slots__ = ("_followed", "_stats", "_clock", "_horizon", "_next_decay", "_outcomes",
                 "_cache", "_threshold", "_decay")

    def __init__(self) -> None:
        #: Followed keys, least recently touched first: 60 bits of the key's hash (``key_hash``)
        #: -> its last touch, class and bytes in one int (:func:`_pack`). A key and a tuple of
        #: three had taken about 100 bytes more, where most keys followed are no longer resident.
        self._followed: OrderedDict[int, int] = OrderedDict()
        #: Each class key's outcomes, reuses and exposure, at every level.
        self._stats = ClassStats()
        self._clock = 0
        self._horizon = MIN_HORIZON
        self._next_decay = self._horizon // _DECAY_STEPS
        self._outcomes = 0
        self._cache: dict[int, float | None] = {}
        #: Keys whose hash is below this are followed: all of them at first.
        self._threshold = _HASH_SPACE
        self._decay = 0.5 ** (1.0 / (HALF_LIFE * _DECAY_STEPS))

    # ------------------------------------------------------------ learning
    def resize(self, blocks: int) -> None:
        """The cache holds up to ``blocks`` blocks: the horizon and the sample follow (the
        sample only ever shrinks; keys followed already are followed to their outcome)."""
        self._horizon = max(MIN_HORIZON, HORIZON_PER_BLOCK * blocks)
        share = max(1.0 / SAMPLE_RATE, min(1.0, MIN_FOLLOWED / self._horizon))
        self._threshold = min(self._threshold, int(share * _HASH_SPACE))

    def touched(self, key: bytes, cls: int, size: int) -> None:
        """A request touched ``key``, now of class ``cls`` and charged ``size`` bytes."""
        self._clock += 1
        now = self._clock
        followed = self._followed
        horizon = self._horizon
        while followed:
            old = next(iter(followed))
            when, c, b = _unpack(followed[old])
            if now - when <= horizon:
                break
            del followed[old]
            self._score(c, 0.0, float(horizon) * b)
        if now >= self._next_decay:
            self._age()
        h = key_hash(key)  # (two keys that happen to share it only blur a rate)
        last = followed.pop(h, None)
        if last is None and zlib.crc32(key, 0x5BD1E995) >= self._threshold:
            return
        if last is not None:
            when, c, b = _unpack(last)
            self._score(c, 1.0, float(now - when) * b)
        followed[h] = _pack(now, cls, size)

    def _score(self, cls: int, reused: float, exposure: float) -> None:
        stats = self._stats
        for k in (cls, *_coarser(cls)):
            stats.add(k, reused, exposure)
        self._outcomes += 1
        if self._outcomes % _REFRESH == 0:
            self._cache.clear()

    def _age(self) -> None:
        """Decay every class's statistics one step."""
        self._next_decay = self._clock + max(1, int(HALF_LIFE * self._horizon) // _DECAY_STEPS)
        self._stats.decay(self._decay)
        self._cache.clear()

    # ------------------------------------------------------------ estimates
    def relative(self, cls: int) -> float | None:
        """Class ``cls``'s worth against all blocks (see the module's docstring); None
        without evidence."""
        try:
            return self._cache[cls]
        except KeyError:
            pass
        out = self._relative(cls)
        self._cache[cls] = out
        return out

    def _relative(self, cls: int) -> float | None:
        mid, base, top = _coarser(cls)
        s = self._stats.get(top)
        if s is None or s[0] < MIN_EVIDENCE or s[1] <= 0.0:
            return None
        overall, overall_rate = s[1] / s[2], s[1] / s[0]
        density, rate = overall, overall_rate
        for k in (base, mid, cls):
            s = self._stats.get(k)
            if s is None or s[0] <= 0.0:
                continue
            mean = s[2] / s[0]  # exposure of one outcome of this class
            density = (s[1] + PRIOR_WEIGHT * density * mean) / (s[2] + PRIOR_WEIGHT * mean)
            rate = (s[1] + PRIOR_WEIGHT * rate) / (s[0] + PRIOR_WEIGHT)
        return max(min(density / overall, 1.0), rate / overall_rate)

    # ------------------------------------------------------------ reporting
    @property
    def followed(self) -> int:
        """Blocks followed now."""
        return len(self._followed)

    @property
    def classes(self) -> int:
        """Class keys (all levels) with statistics now."""
        return len(self._stats)


class Learning:
    """What a learning policy shares with its shadows: the estimator, how often each key was
    touched lately, the sessions seen, and the facts of the block touched last."""

    __slots__ = ("estimator", "sketch", "sessions", "returning", "uses", "full", "tenants")

    def __init__(self) -> None:
        self.estimator = ReuseEstimator()
        #: How many requests touched each key lately (its class's first dimension).
        self.sketch = FrequencySketch()
        self.sessions = SessionTable()
        #: Whether the current request's session had been seen before.
        self.returning = False
        #: The touches of the block touched last, that touch included.
        self.uses = 1
        #: The largest block seen: a partial tail is charged a whole one.
        self.full = 0
        #: Each tenant's number in the classes, in the order they were first seen.
        self.tenants: dict[str, int] = {}

    def block_class(self, meta: BlockMeta, uses: int | None = None, returning: bool | None = None) -> int:
        """The class of the block touched last (``meta``); or, with ``uses`` and ``returning``,
        of ``meta`` as they say."""
        tenant = self.tenants.get(meta.tenant)
        if tenant is None:
            tenant = min(len(self.tenants), TENANT_CLASSES - 1)
            if len(self.tenants) < TENANT_CLASSES:
                self.tenants[meta.tenant] = tenant
        return block_class(meta, self.uses if uses is None else uses, 0 < meta.size < self.full,
                           self.returning if returning is None else returning, tenant)
