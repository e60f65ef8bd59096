"""Which blocks to admit and which to evict: the policy interface and its implementations.

A policy sees each tier's resident blocks through four notifications (``inserted``,
``accessed``, ``removed``, ``admit``) and answers one question, ``victims(tier)``: the
resident blocks of that tier in the order they should go. The store skips victims it may
not evict (pinned or being read) and stops iterating before it changes anything, so a
policy may yield straight from its live structures.

Priorities come first in every policy here: a block of a lower-priority tenant goes before
any block of a higher-priority one. ``victims(tier, tenant)`` restricts the order to one
tenant's blocks, which the store uses when that tenant is over its quota.

Tiers are named by strings (``"dram"``, ``"disk"``, ``"gpu"``) so that this module
depends on nothing else in the sidecar; the trace replay drives the same classes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from sortedcontainers import SortedList

from kvpool_sidecar.duel import Duel
from kvpool_sidecar.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Hints:
    """What the writer said about the request that produced a block (all optional)."""

    #: The request's prompt length in blocks; -1 when not given.
    prompt_blocks: int = -1
    #: The conversation (or agent run) the request belongs to.
    session: str | None = None
    #: A class chosen by the engine or router ("system", "document", "turn", ...).
    label: str | None = None


@dataclass(slots=True, eq=False)
class BlockMeta:
    """What a policy may know about a block."""

    key: bytes
    size: int
    tenant: str = "default"
    priority: int = 0
    #: Position in its prefix chain (0 = first block); -1 when unknown.
    depth: int = -1
    parent: bytes | None = None
    hits: int = 0
    #: The writer's hints, when it gave any (never part of the key).
    hints: Hints | None = None


class EvictionPolicy(Protocol):
    """The interface every policy implements."""

    name: str

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        """Whether a new block is worth a place in ``tier`` at all."""

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        """``meta`` became resident in ``tier``."""

    def accessed(self, tier: str, meta: BlockMeta) -> None:
        """``meta`` was read from ``tier`` (a hit)."""

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        """A request wrote ``meta`` again while ``tier`` holds it: it came after a block the
        request missed, so the request could not use it (no hit)."""

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        """``meta`` left ``tier``: evicted or demoted, or (``evicted`` False) lost: found
        corrupt or unreadable, which says nothing about its worth."""

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        """Resident blocks of ``tier`` (of ``tenant`` only, if given), first to go first."""


class LRUPolicy:
    """Least recently used within each priority level; lower priorities go first.

    Admits everything. Each (tier, priority) and each (tier, tenant) keeps an ordered
    dict, so every notification is O(1) and ``victims`` yields from the cold end.
    """

    name = "lru"

    def __init__(self) -> None:
        self._levels: dict[str, dict[int, OrderedDict[bytes, BlockMeta]]] = {}
        self._tenants: dict[str, dict[str, OrderedDict[bytes, BlockMeta]]] = {}

    def _level(self, tier: str, meta: BlockMeta) -> OrderedDict[bytes, BlockMeta]:
        return self._levels.setdefault(tier, {}).setdefault(meta.priority, OrderedDict())

    def _tenant(self, tier: str, meta: BlockMeta) -> OrderedDict[bytes, BlockMeta]:
        return self._tenants.setdefault(tier, {}).setdefault(meta.tenant, OrderedDict())

    def admit(self, tier: str, meta: BlockMeta) -> bool:
        return True

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        self._level(tier, meta)[meta.key] = meta
        self._tenant(tier, meta)[meta.key] = meta

    def accessed(self, tier: str, meta: BlockMeta) -> None:
        level = self._level(tier, meta)
        if meta.key in level:
            level.move_to_end(meta.key)
            self._tenant(tier, meta).move_to_end(meta.key)

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        pass

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        self._level(tier, meta).pop(meta.key, None)
        self._tenant(tier, meta).pop(meta.key, None)

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        if tenant is not None:
            yield from self._tenants.get(tier, {}).get(tenant, OrderedDict()).values()
            return
        levels = self._levels.get(tier, {})
        for priority in sorted(levels):
            yield from levels[priority].values()


# --------------------------------------------------------------------- prefix-aware

#: Eviction classes, first to go first: blocks whose parent is in no tier (a prefix lookup
#: cannot reach them), copies of blocks a hotter tier also holds, prompt tails never read
#: (smaller than their parent: a partial last block), blocks read once (probation), blocks
#: read again (protected).
_ORPHAN, _COPY, _TAIL, _PROBATION, _PROTECTED = range(5)

#: Hotter tiers first; a tier the policy does not know ranks with DRAM.
_TIER_RANK = {"gpu": 0, "dram": 1, "disk": 2}

#: Probation's share of a tier when it first fills, before ARC's rule adapts it (the split
#: 2Q's authors recommend; ARC's own start, 0, adapts slowly when most evicted probation
#: blocks are one-shot).
_INITIAL_PROBATION_SHARE = 0.25

#: ``(class, tick, -depth, sequence, key)``; the sequence is unique, so two sort keys
#: never compare their block keys.
_SortKey = tuple[int, int, int, int, bytes]


@dataclass(slots=True, eq=False)
class _Slot:
    meta: BlockMeta
    protected: bool
    sort: _SortKey


class _TierState:
    """One tier's residents, in eviction order per priority level and per tenant."""

    __slots__ = ("rank", "slots", "levels", "tenants", "segment_bytes", "target", "ghosts", "ghost_bytes")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: dict[bytes, _Slot] = {}
        self.levels: dict[int, SortedList] = {}
        self.tenants: dict[str, SortedList] = {}
        #: Resident bytes in probation [0] and protected [1].
        self.segment_bytes = [0, 0]
        #: ARC's adaptive target: bytes probation may hold before it is evicted first; set when
        #: the tier first loses a block (it is full then).
        self.target: float | None = None
        #: Keys recently evicted from a segment: ``key -> (was protected, size)``, oldest first,
        #: and their bytes per segment.
        self.ghosts: OrderedDict[bytes, tuple[bool, int]] = OrderedDict()
        self.ghost_bytes = [0, 0]

    @property
    def resident_bytes(self) -> int:
        return self.segment_bytes[0] + self.segment_bytes[1]


class PrefixAwarePolicy:
    """Adaptive recency/frequency (ARC) over prefix chains, aware of tails, orphans and copies.

    - Two segments per tier, as in ARC: a block enters *probation*; a second read, or a
      re-insert of a block evicted not long ago (a "ghost" hit), makes it *protected*. One-shot
      blocks (most of a real trace's distinct blocks) churn through probation without flushing
      reused ones. Which segment goes first adapts online: a ghost hit on a block evicted from
      probation grows probation's target, one evicted from protected shrinks it (probation
      starts at a quarter of the tier when it first fills). Ghosts (keys only) cover
      ``history`` times the tier's resident bytes. What the current request has just read
      goes last.
    - Prefix awareness: a block is useless without its parent, so blocks whose parent is in no
      tier go first (such a block is still admitted: in a pool its parent may be held by
      another node, and refusing it would refuse the rest of its chain). Within a segment,
      blocks go in the order of the request that last touched them, deepest first, so a chain
      is shortened from its leaf and shared roots (touched by every request) stay longest.
    - Cost awareness: a block smaller than its parent is a partial prompt tail: it saves fewer
      tokens per page and a continuing conversation replaces it, so unless it was read it goes
      before other unread blocks. A copy that a hotter tier also holds costs nothing to drop
      (the pool keeps the block), so it goes before other blocks of its tier; when the hotter
      copy leaves, the colder one counts as freshly demoted.

    - Two orders for the blocks that are not structural victims (orphans, copies, tails):
      ARC's segments (above), or plain *recency* (the request that last touched a block,
      deepest first), which follows a working set that moves faster than ARC adapts. With
      ``duel`` (the default) the policy runs both orders on shadow caches of its own size
      (keys only, see duel.py) and follows whichever has had more prefix hits lately; so it
      does about as well as the better of the two, and never much below LRU. ``recency``
      fixes the order instead (``duel`` False).

    Request boundaries are inferred from depths: an access whose depth does not grow starts a
    new tick. Priorities come first, as in every policy here.
    """

    name = "prefix"

    def __init__(self, history: float = 2.0, *, duel: bool = True, recency: bool = False) -> None:
        if history <= 0:
            raise ConfigError("policy history must be positive")
        self._history = history
        self._recency = recency
        self.name = "prefix" if duel else "prefix-recency" if recency else "prefix-arc"
        #: Bytes resident in some tier (each key once), and the most there ever were: the
        #: size the shadows simulate (a cache that just evicted is as large as it gets).
        self._resident = 0
        self._high_water = 0
        self._duel = Duel(PrefixAwarePolicy(history, duel=False), PrefixAwarePolicy(history, duel=False, recency=True),
                          _shadow_copy) if duel else None
        #: Keys the current request admitted and that have not landed yet, with their sizes:
        #: a batch of puts takes room before its first block lands, and a put retried after
        #: its allocation failed is the same access, not another one.
        self._admitted: dict[bytes, int] = {}
        self._admitted_bytes = 0
        self._tiers: dict[str, _TierState] = {}
        #: Tiers holding each key, and each resident key's size.
        self._copies: Counter[bytes] = Counter()
        self._sizes: dict[bytes, int] = {}
        #: Resident children of each parent key (the parent itself may be gone).
        self._children: dict[bytes, set[bytes]] = {}
        self._seq = itertools.count()
        self._tick = 0
        self._depth = -1

    # ------------------------------------------------------------ notifications
    def admit(self, tier: str, meta: BlockMeta) -> bool:
        # A block whose parent is held nowhere here is still admitted: in a pool its parent
        # may live on another node (a lookup counts peers' blocks), or it was just evicted;
        # refusing would refuse the whole chain on every put. It ranks as an orphan instead.
        key = meta.key
        if not self._copies[key]:  # a new block, not a move between tiers
            if key in self._admitted:
                return True  # the same put again, after its allocation failed
            self._touch(meta, put=True)
        return True

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        st = self._tiers.get(tier)
        if st is None:
            st = self._tiers[tier] = _TierState(_TIER_RANK.get(tier, 1))
        key = meta.key
        self._admitted_bytes -= self._admitted.pop(key, 0)
        old = st.slots.get(key)
        if old is not None:
            self._unlink(st, old)
        protected = old is not None and old.protected
        ghost = st.ghosts.pop(key, None)
        if ghost is not None:
            was_protected, size = ghost
            st.ghost_bytes[was_protected] -= size
            self._adapt(st, was_protected, meta.size)
            protected = True
        arrived = False
        if old is None:
            arrived = not self._copies[key]
            self._copies[key] += 1
            self._sizes[key] = meta.size
            if arrived:
                self._resident += meta.size
                self._high_water = max(self._high_water, self._resident)
                self._resize()
            if meta.parent is not None:
                self._children.setdefault(meta.parent, set()).add(key)
        slot = _Slot(meta, protected, (0, self._tick, 0, 0, key))
        st.slots[key] = slot
        self._link(st, slot, self._tick)
        if arrived:
            self._relink_children(key)
        elif old is None:
            self._relink_copies(key, st.rank, demoted=False)

    def accessed(self, tier: str, meta: BlockMeta) -> None:
        st = self._tiers.get(tier)
        slot = st.slots.get(meta.key) if st is not None else None
        if st is None or slot is None:
            return
        self._touch(meta)
        self._unlink(st, slot)
        slot.protected = True
        self._link(st, slot, self._tick)

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        # The order here does not change (the block was not read), but the shadows see the
        # access: one of them might have served it.
        if self._copies[meta.key]:
            self._touch(meta)

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        st = self._tiers.get(tier)
        slot = st.slots.pop(meta.key, None) if st is not None else None
        if st is None or slot is None:
            return
        key = meta.key
        if st.target is None:
            st.target = _INITIAL_PROBATION_SHARE * st.resident_bytes
        self._unlink(st, slot)
        if evicted and slot.sort[0] >= _PROBATION:  # not lost, nor a structural eviction (orphan, copy, tail)
            st.ghosts[key] = (slot.protected, meta.size)
            st.ghost_bytes[slot.protected] += meta.size
            limit = self._history * st.resident_bytes
            while st.ghosts and st.ghost_bytes[0] + st.ghost_bytes[1] > limit:
                _, (was_protected, size) = st.ghosts.popitem(last=False)
                st.ghost_bytes[was_protected] -= size
        self._copies[key] -= 1
        if self._copies[key] > 0:
            self._relink_copies(key, st.rank, demoted=True)
            return
        del self._copies[key]
        self._resident -= self._sizes.pop(key)
        parent = meta.parent
        siblings = self._children.get(parent) if parent is not None else None
        if parent is not None and siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
        self._relink_children(key)

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        st = self._tiers.get(tier)
        if st is None:
            return
        if tenant is not None:
            lists = [st.tenants[tenant]] if tenant in st.tenants else []
        else:
            lists = [st.levels[p] for p in sorted(st.levels)]
        probation_first = st.segment_bytes[0] > (st.target or 0.0)
        slots = st.slots
        for order in lists:
            i = order.bisect_left((_PROBATION,))
            j = order.bisect_left((_PROTECTED,))
            if self.recency:
                yield from (slots[k[4]].meta for k in order.islice(0, i))
                merged = heapq.merge(order.islice(i, j), order.islice(j, None), key=_by_recency)
                yield from (slots[k[4]].meta for k in merged)
                continue
            if probation_first:
                runs: tuple[tuple[int, int | None], ...] = ((0, i), (i, None))
            else:  # protected first, but not what the current request just read
                k = order.bisect_left((_PROTECTED, self._tick))
                runs = ((0, i), (j, k), (i, j), (k, None))
            for lo, hi in runs:
                for k in order.islice(lo, hi):
                    yield slots[k[4]].meta

    @property
    def recency(self) -> bool:
        """Whether the blocks that are not structural victims go in order of recency now
        (rather than by ARC's segments)."""
        if self._duel is not None:
            return self._duel.leader == 1
        return self._recency

    # ------------------------------------------------------------ internals
    def _touch(self, meta: BlockMeta, *, put: bool = False) -> None:
        """A request reads ``meta``, or writes it (``put``: a new block, about to take room).

        An access whose depth does not grow starts a new request: the clock ticks, and the
        last request's puts have landed or failed. The shadows see every access.
        """
        started = meta.depth < 0 or meta.depth <= self._depth
        self._depth = meta.depth
        if started:
            self._tick += 1
            self._admitted.clear()
            self._admitted_bytes = 0
        if put:
            self._admitted[meta.key] = meta.size
            self._admitted_bytes += meta.size
        if self._duel is not None:
            if started or put:
                self._resize()
            self._duel.touch(meta, new_request=started)

    def _resize(self) -> None:
        if self._duel is not None:
            self._duel.resize(max(self._high_water, self._resident + self._admitted_bytes))

    def _adapt(self, st: _TierState, was_protected: bool, size: int) -> None:
        """ARC's learning rule, in bytes."""
        probation, protected = st.ghost_bytes
        target = st.target or 0.0
        if was_protected:
            st.target = max(0.0, target - size * max(1.0, probation / max(protected, 1)))
        else:
            st.target = min(float(st.resident_bytes + size), target + size * max(1.0, protected / max(probation, 1)))

    def _class(self, st: _TierState, slot: _Slot) -> int:
        m = slot.meta
        parent_size = self._sizes.get(m.parent) if m.parent is not None else None
        if m.parent is not None and parent_size is None:
            return _ORPHAN
        if self._copies[m.key] > 1:
            for other in self._tiers.values():
                if other.rank < st.rank and m.key in other.slots:
                    return _COPY
        if not slot.protected and parent_size is not None and m.size < parent_size:
            return _TAIL
        return _PROTECTED if slot.protected else _PROBATION

    def _link(self, st: _TierState, slot: _Slot, tick: int) -> None:
        m = slot.meta
        slot.sort = (self._class(st, slot), tick, -m.depth, next(self._seq), m.key)
        level = st.levels.get(m.priority)
        if level is None:
            level = st.levels[m.priority] = SortedList()
        level.add(slot.sort)
        own = st.tenants.get(m.tenant)
        if own is None:
            own = st.tenants[m.tenant] = SortedList()
        own.add(slot.sort)
        st.segment_bytes[slot.protected] += m.size

    def _unlink(self, st: _TierState, slot: _Slot) -> None:
        m = slot.meta
        level = st.levels[m.priority]
        level.remove(slot.sort)
        if not level:
            del st.levels[m.priority]
        own = st.tenants[m.tenant]
        own.remove(slot.sort)
        if not own:
            del st.tenants[m.tenant]
        st.segment_bytes[slot.protected] -= m.size

    def _relink(self, st: _TierState, slot: _Slot, tick: int) -> None:
        self._unlink(st, slot)
        self._link(st, slot, tick)

    def _relink_children(self, key: bytes) -> None:
        """``key`` arrived in or left its last tier: its children change class."""
        for child in self._children.get(key, ()):
            for st in self._tiers.values():
                slot = st.slots.get(child)
                if slot is not None:
                    self._relink(st, slot, slot.sort[1])

    def _relink_copies(self, key: bytes, rank: int, *, demoted: bool) -> None:
        """A copy of ``key`` arrived in or left a tier of ``rank``: colder copies change class.

        A colder copy whose hotter one left counts as demoted now.
        """
        for st in self._tiers.values():
            slot = st.slots.get(key)
            if slot is not None and st.rank > rank:
                self._relink(st, slot, self._tick if demoted else slot.sort[1])


def _by_recency(sort: _SortKey) -> tuple[int, int, int]:
    return sort[1], sort[2], sort[3]


def _shadow_copy(meta: BlockMeta) -> BlockMeta:
    """What a shadow cache keeps of a block: its metadata, never the store's entry."""
    return BlockMeta(meta.key, meta.size, meta.tenant, meta.priority, meta.depth, meta.parent)


#: The policies by name. ``prefix`` is the default; ``prefix-arc`` and ``prefix-recency``
#: are its two orders alone (what its duel chooses between), for comparisons.
POLICIES: Mapping[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "prefix": PrefixAwarePolicy,
    "prefix-arc": lambda: PrefixAwarePolicy(duel=False),
    "prefix-recency": lambda: PrefixAwarePolicy(duel=False, recency=True),
}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``; raises ConfigError for an unknown name."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"policy.name: unknown policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory()
