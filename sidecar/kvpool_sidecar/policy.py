"""Which blocks to admit and which to evict: the policy interface and its implementations.

A policy sees each tier's resident blocks through its notifications (``inserted``,
``accessed``, ``removed``, ``admit``, and ``bypassed``, ``skipped``, ``restored``) and answers
one question, ``victims(tier)``: the resident blocks of that tier in the order they should
go. The store skips victims it may not evict (pinned or being read) and stops iterating
before it changes anything, so a policy may yield straight from its live structures. The
pinned blocks it walked past it then reports as ``skipped`` (they go last until their last
pin goes: ``restored``).

Priorities come first in every policy here: a block of a lower-priority tenant goes before
any block of a higher-priority one. ``victims(tier, tenant)`` restricts the order to one
tenant's blocks, which the store uses when that tenant is over its quota.

Tiers are named by strings (``"dram"``, ``"disk"``, ``"gpu"``) so that this module
depends on nothing else in the sidecar; the trace replay drives the same classes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from sortedcontainers import SortedList

from kvpool_sidecar.duel import Duel
from kvpool_sidecar.errors import ConfigError
from kvpool_sidecar.reuse import Learning


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

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        """The store passed ``meta`` over while it looked for a victim in ``tier`` (a client
        pinned it): it goes after every block that may be evicted, without counting as an
        access, so that the next search does not walk past it again."""

    def restored(self, tier: str, meta: BlockMeta) -> None:
        """``meta``, skipped before, may be evicted again (its last pin went): it takes back
        the place it would have had."""

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        """Resident blocks of ``tier`` (of ``tenant`` only, if given), first to go first."""

    def sized(self, capacity: int) -> None:
        """The tiers this policy orders can hold ``capacity`` bytes together (the store says
        so once, before its first block); a policy may size what it keeps by it."""


class LRUPolicy:
    """Least recently used within each priority level; lower priorities go first.

    Admits everything. Each (tier, priority) and each (tier, tenant) keeps an ordered
    dict, so every notification is O(1) and ``victims`` yields from the cold end.
    """

    name = "lru"
    #: ``admit`` is always True (the store may then apply it later: :mod:`kvpool_sidecar.store.accounting`).
    admits_all = True

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

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        self.accessed(tier, meta)  # (LRU's order is its recency: the same move)

    def restored(self, tier: str, meta: BlockMeta) -> None:
        pass  # (its old place is not kept: it stays at the recent end)

    def sized(self, capacity: int) -> None:
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
_ORPHAN, _COPY, _TAIL, _PROBATION, _PROTECTED, _HELD = range(6)
#: The least sort keys of the probation, protected and held (pinned blocks a search for
#: victims walked past: :meth:`PrefixAwarePolicy.skipped`) classes.
_FIRST_PROBATION, _FIRST_PROTECTED, _FIRST_HELD = (_PROBATION,), (_PROTECTED,), (_HELD,)

#: Children of one parent followed at most (to rank them as orphans when it leaves, and back
#: when it returns): each arrival or departure of the parent relinks them all, and a client
#: that names one parent for thousands of blocks, then puts and removes it in a loop, made
#: that thousands of relinks a request. A child past it keeps its class until it is touched:
#: one that arrived while its parent was away stays ranked an orphan (evicted first) after
#: the parent returns, and one that arrived with it is not ranked an orphan when it leaves.
MAX_CHILDREN = 256

#: Hotter tiers first; a tier the policy does not know ranks with DRAM.
_TIER_RANK = {"gpu": 0, "dram": 1, "disk": 2}

#: How much of the evictions' record (how long blocks stayed, see ``_aged``) each eviction
#: keeps: about the last 256 count.
_DELTA_KEEP = 1.0 - 1.0 / 256

#: Probation's share of a tier when it first fills, before ARC's rule adapts it (the split
#: 2Q's authors recommend; ARC's own start, 0, adapts slowly when most evicted probation
#: blocks are one-shot).
_INITIAL_PROBATION_SHARE = 0.25
#: Ghosts a tier keeps whatever it holds (beside twice ``history`` times its blocks).
_MIN_GHOSTS = 64

#: The orders of the blocks that are not structural victims: ARC's segments, recency, and
#: recency with places learned (see ``PrefixAwarePolicy._place``).
ARC, RECENCY, LEARNED = "arc", "recency", "learned"
ORDERS = (ARC, RECENCY, LEARNED)

#: How much longer than an average block a block of the most valuable class may stay
#: untouched (see :class:`Learning`): a bound on what a wrong estimate can cost.
MAX_RELATIVE_VALUE = 16.0

#: ``(class, place, -depth, sequence, key)``; the place is the tick of the block's last touch,
#: moved by what it is worth in the learned order (see ``PrefixAwarePolicy._place``); the
#: sequence is unique, so two sort keys never compare their block keys.
_SortKey = tuple[int, int, int, int, bytes]


#: How much of the tail rule's record each eviction of its kind keeps (see :class:`_TailWatch`).
_TAIL_KEEP = 1.0 - 1.0 / 512

#: Tails evicted (decayed) before the tail rule may be judged by what became of them.
_TAIL_EVIDENCE = 32.0

#: One ordinary eviction in this many (by the key's first byte) is followed by the tail rule.
_TAIL_SAMPLE = 32

#: A followed key is kept as 30 bits of its hash: an int of the smallest size CPython makes
#: (28 bytes; a whole hash takes 32 or 36, as the process's hash seed falls), and two keys
#: that share them only blur a rate.
_GHOST_BITS = (1 << 30) - 1


class _TailWatch:
    """Whether partial tails should go before other unread blocks: while they come back (are
    written again after they went) no more often than blocks evicted in the ordinary order,
    each within the same number of evictions after it went.

    Where engines store only full blocks, or a conversation's next turn replaces its tail, a
    tail seldom comes back and the rule gains. Where the same partial block is written again
    (its key unchanged when the prompt grows), evicting tails first throws away what the next
    request reads: there the tails' ghosts come back and the rule steps aside until they stop.
    It follows every evicted tail and one ordinary eviction in :data:`_TAIL_SAMPLE`, by a hash
    of the key, for ``horizon`` evictions each; both rates are decayed by each eviction of
    their kind.
    """

    __slots__ = ("ghosts", "evictions", "out", "back", "tail_out", "tail_back")

    def __init__(self) -> None:
        #: Keys followed (hashed), oldest first: the eviction count when each went, negative
        #: for a tail.
        self.ghosts: dict[int, int] = {}
        self.evictions = 0
        self.out = self.back = self.tail_out = self.tail_back = 0.0

    def evicted(self, key: bytes, tail: bool, horizon: int) -> None:
        """A block left (``tail``: as a tail); what went more than ``horizon`` evictions ago
        is no longer followed."""
        self.evictions += 1
        ghosts = self.ghosts
        if tail:
            self.tail_out, self.tail_back = self.tail_out * _TAIL_KEEP + 1.0, self.tail_back * _TAIL_KEEP
        elif key[0] % _TAIL_SAMPLE == 0:
            self.out, self.back = self.out * _TAIL_KEEP + 1.0, self.back * _TAIL_KEEP
        if tail or key[0] % _TAIL_SAMPLE == 0:
            h = hash(key) & _GHOST_BITS
            ghosts.pop(h, None)  # (a key followed again goes to the end: the oldest stay first)
            ghosts[h] = -self.evictions if tail else self.evictions
        oldest = self.evictions - horizon
        while ghosts:
            first = next(iter(ghosts))
            if abs(ghosts[first]) >= oldest:
                break
            del ghosts[first]

    def arrived(self, key: bytes) -> None:
        """``key`` came into the cache anew."""
        went = self.ghosts.pop(hash(key) & _GHOST_BITS, 0) if self.ghosts else 0
        if went < 0:
            self.tail_back += 1.0
        elif went > 0:
            self.back += 1.0

    @property
    def tails_first(self) -> bool:
        if self.tail_out < _TAIL_EVIDENCE:
            return True
        return self.tail_back * max(self.out, 1.0) <= self.back * self.tail_out


@dataclass(slots=True, eq=False)
class _Slot:
    meta: BlockMeta
    protected: bool
    sort: _SortKey
    #: The tick of the block's last touch.
    tick: int = 0
    #: Its class for the reuse estimator (see reuse.py) at its last touch.
    cls: int = 0


class _TierState:
    """One tier's residents, in eviction order per priority level and per tenant.

    While the tier holds blocks of one priority and one tenant (the common case), its level
    list and its tenant list hold the same blocks in the same order: they are then one
    ``SortedList``, so a block costs one insertion, not two. A second level or tenant splits
    them (a copy of the list); once one of each is left they become one list again, but only
    after as many changes as the list holds, so that a tenant whose one block comes and goes
    cannot make every one of its puts copy the tier's list.
    """

    __slots__ = ("rank", "slots", "levels", "tenants", "calm", "segment_bytes", "target", "ghosts", "ghost_bytes", "held")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: dict[bytes, _Slot] = {}
        self.levels: dict[int, SortedList] = {}
        self.tenants: dict[str, SortedList] = {}
        #: Changes left before one level and one tenant, left in two lists, become one (0: not
        #: counting).
        self.calm = 0
        #: Resident bytes in probation [0] and protected [1].
        self.segment_bytes = [0, 0]
        #: ARC's adaptive target: bytes probation may hold before it is evicted first; set when
        #: the tier first loses a block (it is full then).
        self.target: float | None = None
        #: Keys recently evicted from a segment: ``key -> (was protected, size)``, oldest first,
        #: and their bytes per segment.
        self.ghosts: OrderedDict[bytes, tuple[bool, int]] = OrderedDict()
        self.ghost_bytes = [0, 0]
        #: Keys of pinned blocks a search for victims walked past (class ``_HELD``, last).
        self.held: set[bytes] = set()

    @property
    def resident_bytes(self) -> int:
        return self.segment_bytes[0] + self.segment_bytes[1]

    def add(self, sort: _SortKey, priority: int, tenant: str) -> None:
        """Put ``sort`` in its level's and its tenant's order."""
        level, own = self.levels.get(priority), self.tenants.get(tenant)
        if level is None or own is None:
            if not self.levels:  # the first block: one list for both
                level = own = self.levels[priority] = self.tenants[tenant] = SortedList()
            else:
                self._split()
                level, own = self.levels.get(priority), self.tenants.get(tenant)  # (the split may copy one)
                if level is None:
                    level = self.levels[priority] = SortedList()
                if own is None:
                    own = self.tenants[tenant] = SortedList()
        level.add(sort)
        if own is not level:
            own.add(sort)
            self._settled()

    def discard(self, sort: _SortKey, priority: int, tenant: str) -> None:
        """Take ``sort`` out of its level's and its tenant's order."""
        level, own = self.levels[priority], self.tenants[tenant]
        level.remove(sort)
        if own is level:
            if not level:
                del self.levels[priority], self.tenants[tenant]
            return
        own.remove(sort)
        if not level:
            del self.levels[priority]
        if not own:
            del self.tenants[tenant]
        self._settled()

    def _settled(self) -> None:
        """After a change to two lists: once one level and one tenant have been left for as
        many changes as their list holds, they are one list again (the same blocks in the
        same order); the copy a split made is paid for by then."""
        if len(self.levels) != 1 or len(self.tenants) != 1:
            self.calm = 0
            return
        only = next(iter(self.levels.values()))
        if not self.calm:  # one of each just left: count down from the list's length
            self.calm = len(only)
        self.calm -= 1
        if not self.calm:
            self.tenants[next(iter(self.tenants))] = only

    def _split(self) -> None:
        """A second level or tenant arrives: the shared list becomes two."""
        if len(self.levels) == 1 and len(self.tenants) == 1:
            (t, own), = self.tenants.items()
            if own is next(iter(self.levels.values())):
                self.tenants[t] = SortedList(own)


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
      before other unread blocks, while evicted tails come back no more often than other
      evicted blocks (:class:`_TailWatch`: a writer that sends the same partial block again
      makes the rule step aside). A copy that a hotter tier also holds costs nothing to drop
      (the pool keeps the block), so it goes before other blocks of its tier; when the hotter
      copy leaves, the colder one counts as freshly demoted.

    - Orders for the blocks that are not structural victims (orphans, copies, tails):
      ARC's segments (above); plain *recency* (the request that last touched a block,
      deepest first), which follows a working set that moves faster than ARC adapts; and the
      *learned* order: recency with each block's place moved by what blocks of its class
      (its uses, depth, tail or not, and its writer's hints) have proved worth, per byte and
      per unit of time kept (reuse.py learns that online; see :meth:`_place`). The learned
      order has no tail rule: tails have classes of their own. With ``duel`` (the default)
      the policy runs the orders on shadow caches of its size (keys only, see duel.py;
      sampled when learning) and follows whichever has had the most hits lately; so it does
      about as well as the best of them, and never much below LRU. ``order`` fixes one
      instead (``duel`` False). ``learn`` False leaves the learned order out (and then the
      shadows follow every block, as before learning existed).
    - The estimator learns from every access the policy sees, whichever order leads; the
      shadows learn nothing themselves but place blocks by the same estimates. When the
      duel's leader changes, each resident block takes its place in the new order when it is
      next touched (the places differ by at most a few turnovers of the cache).

    Request boundaries are inferred from depths: an access whose depth does not grow starts a
    new tick. Priorities come first, as in every policy here.
    """

    name = "prefix"
    #: ``admit`` is always True: a block whose parent is gone ranks as an orphan instead.
    admits_all = True

    def __init__(self, history: float = 2.0, *, duel: bool = True, order: str = ARC, learn: bool = True,
                 learning: Learning | None = None) -> None:
        """``order``: the order when there is no duel (:data:`ORDERS`); ``learn``: whether the
        duel has the learned order among its contenders. ``learning``: the estimates of the
        policy this one shadows (it then learns nothing itself)."""
        if history <= 0:
            raise ConfigError("policy history must be positive")
        if order not in ORDERS:
            raise ConfigError(f"policy order must be one of {', '.join(ORDERS)}")
        self._history = history
        self._order = order
        #: Whether tails go first, from what became of the tails evicted lately.
        self._tails = _TailWatch()
        #: Whether evicted keys are remembered (ARC's ghosts): unless the order is fixed to
        #: one that has no use for them.
        self._ghosts = duel or order == ARC
        self.name = ("prefix" if learn else "prefix-nolearn") if duel else f"prefix-{order}"
        #: The estimates, and whether this policy feeds them (a shadow only reads them).
        needed = learn if duel else order == LEARNED
        self._learning = learning if learning is not None else Learning() if needed else None
        self._learns = learning is None and needed
        #: Over the recent evictions (decayed): the ticks the evicted blocks had stayed
        #: untouched, and their relative values. Their ratio is how long a block of average
        #: value stays (see :class:`Learning`).
        self._aged = 0.0
        self._valued = 0.0
        #: Bytes resident in some tier (each key once), and the most there ever were: the
        #: size the shadows simulate (a cache that just evicted is as large as it gets).
        self._resident = 0
        self._high_water = 0
        #: The most blocks resident at once (the shadows' count bound follows it).
        self._most_blocks = 0
        #: What the tiers can hold together, when the store said (:meth:`sized`): the duel
        #: samples for the cache this will be, not for the few blocks it holds yet.
        self._capacity = 0
        #: What the shadows were last sized for: (bytes, blocks); and the estimator (blocks).
        self._size = (0, 0)
        self._learnt_for: int | None = None
        #: The orders the duel runs, in its shadows' order, and the one the resident blocks
        #: are placed for.
        self._contenders = (ARC, RECENCY, LEARNED) if learn else (ARC, RECENCY)
        self._following = self._contenders[0] if duel else order
        self._duel = Duel([PrefixAwarePolicy(history, duel=False, order=o, learning=self._learning)
                           for o in self._contenders],
                          _shadow_copy, sampled=learn) if duel else None
        #: Keys the current request admitted and that have not landed yet, with their sizes:
        #: a batch of puts takes room before its first block lands, and a put retried after
        #: its allocation failed is the same access, not another one.
        self._admitted: dict[bytes, int] = {}
        self._admitted_bytes = 0
        #: The class each of those keys had when admitted (when learning).
        self._admitted_cls: dict[bytes, int] = {}
        self._tiers: dict[str, _TierState] = {}
        #: Tiers holding each key, and each resident key's size.
        self._copies: dict[bytes, int] = {}
        self._sizes: dict[bytes, int] = {}
        #: Resident children of each parent key (the parent itself may be gone).
        self._children: dict[bytes, set[bytes]] = {}
        self._seq = itertools.count()
        self._tick = 0
        self._depth = -1
        #: The class of the block touched last, as its touch found it (when learning).
        self._touched_cls = 0

    # ------------------------------------------------------------ notifications
    def admit(self, tier: str, meta: BlockMeta) -> bool:
        # A block whose parent is held nowhere here is still admitted: in a pool its parent
        # may live on another node (a lookup counts peers' blocks), or it was just evicted;
        # refusing would refuse the whole chain on every put. It ranks as an orphan instead.
        key = meta.key
        if key not in self._copies:  # a new block, not a move between tiers
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
        cls = self._admitted_cls.pop(key, None)
        old = st.slots.get(key)
        if old is not None:
            self._unlink(st, old)
        protected = old is not None and old.protected
        ghost = st.ghosts.pop(key, None)
        copies = self._copies.get(key, 0)
        if old is None and not copies:
            self._tails.arrived(key)
        if ghost is not None:
            was_protected, size = ghost
            st.ghost_bytes[was_protected] -= size
            self._adapt(st, was_protected, meta.size)
            protected = True
        arrived = False
        if old is None:
            arrived = not copies
            self._copies[key] = copies + 1
            self._sizes[key] = meta.size
            if arrived:
                self._resident += meta.size
                self._high_water = max(self._high_water, self._resident)
                if self._learning is not None and self._learns:  # (a put refused later says nothing of sizes)
                    self._learning.full = max(self._learning.full, meta.size)
                self._resize()
                if self._duel is not None and len(self._sizes) > self._most_blocks:
                    self._most_blocks = len(self._sizes)
                    self._duel.cap_blocks(self._most_blocks)
            if meta.parent is not None:
                children = self._children.setdefault(meta.parent, set())
                if len(children) < MAX_CHILDREN:
                    children.add(key)
        slot = _Slot(meta, protected, (0, self._tick, 0, 0, key), self._tick)
        if old is not None:
            slot.cls = old.cls
        elif cls is not None:
            slot.cls = cls
        elif self._learning is not None:  # a move between tiers: the class of another copy
            for o in self._tiers.values():
                other = o.slots.get(key) if o is not st else None
                if other is not None:
                    slot.cls = other.cls
                    break
            else:
                slot.cls = self._learning.block_class(meta)
        st.slots[key] = slot
        self._link(st, slot, self._place(slot))
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
        slot.tick = self._tick
        if self._learning is not None:
            slot.cls = self._touched_cls
        self._link(st, slot, self._place(slot))

    def sized(self, capacity: int) -> None:
        if capacity < 0:
            raise ConfigError("policy capacity must not be negative")
        self._capacity = capacity
        self._size = (0, 0)  # the next touch resizes

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        # The order here does not change (the block was not read), but the shadows see the
        # access: one of them might have served it.
        if meta.key in self._copies:
            self._touch(meta)

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        # a class of its own, after every other (whatever class it had: an orphan or a copy
        # ranks first); its place and last touch stay, for when it is restored
        st = self._tiers.get(tier)
        slot = st.slots.get(meta.key) if st is not None else None
        if st is not None and slot is not None and meta.key not in st.held:
            st.held.add(meta.key)
            self._relink(st, slot, slot.sort[1])

    def restored(self, tier: str, meta: BlockMeta) -> None:
        st = self._tiers.get(tier)
        slot = st.slots.get(meta.key) if st is not None else None
        if st is not None and slot is not None and meta.key in st.held:
            st.held.discard(meta.key)
            self._relink(st, slot, slot.sort[1])

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        st = self._tiers.get(tier)
        slot = st.slots.pop(meta.key, None) if st is not None else None
        if st is None or slot is None:
            return
        key = meta.key
        st.held.discard(key)
        if st.target is None:
            st.target = _INITIAL_PROBATION_SHARE * st.resident_bytes
        self._unlink(st, slot)
        if evicted and slot.sort[0] >= _PROBATION:  # not lost, nor a structural eviction (orphan, copy, tail)
            if self._learning is not None:
                r = self._learning.estimator.relative(slot.cls)
                self._aged = self._aged * _DELTA_KEEP + (self._tick - slot.tick)
                self._valued = self._valued * _DELTA_KEEP + (1.0 if r is None else min(r, MAX_RELATIVE_VALUE))
        copies = self._copies[key]
        if evicted and slot.sort[0] >= _TAIL and copies == 1:  # its last copy: gone from the cache
            # a tail counts as one whatever its class now (the rule stepped aside, or it was
            # read): so the rule sees tails stop coming back, and comes back itself
            m = slot.meta
            tail = slot.sort[0] == _TAIL or (not slot.protected and self._is_tail(
                slot, self._sizes.get(m.parent) if m.parent is not None else None))
            self._tails.evicted(key, tail, round(self._history * len(st.slots)) + 1)
        if evicted and slot.sort[0] >= _PROBATION and self._ghosts:
            st.ghosts[key] = (slot.protected, meta.size)
            st.ghost_bytes[slot.protected] += meta.size
            limit = self._history * st.resident_bytes
            # and by count: blocks of a byte each (which the tiers charge a page) had left
            # about as many ghosts as the resident bytes, without any useful bound
            most = round(2 * self._history * len(st.slots)) + _MIN_GHOSTS
            while st.ghosts and (st.ghost_bytes[0] + st.ghost_bytes[1] > limit or len(st.ghosts) > most):
                _, (was_protected, size) = st.ghosts.popitem(last=False)
                st.ghost_bytes[was_protected] -= size
        if copies > 1:
            self._copies[key] = copies - 1
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
            # by value, never by position: a positional lookup makes the list keep an index
            # that every later insertion and removal must update
            if order[0][0] < _PROBATION:  # (the first item is at hand without that index)
                yield from (slots[k[4]].meta for k in order.irange(maximum=_FIRST_PROBATION, inclusive=(True, False)))
            if self.recency:
                merged = heapq.merge(order.irange(_FIRST_PROBATION, _FIRST_PROTECTED, inclusive=(True, False)),
                                     order.irange(_FIRST_PROTECTED, _FIRST_HELD, inclusive=(True, False)),
                                     key=_by_recency)
                yield from (slots[k[4]].meta for k in merged)
            elif probation_first:
                yield from (slots[k[4]].meta
                            for k in order.irange(_FIRST_PROBATION, _FIRST_HELD, inclusive=(True, False)))
            else:
                # protected first, but not what the current request just read: that goes last
                current = []
                for k in order.irange(_FIRST_PROTECTED, _FIRST_HELD, inclusive=(True, False)):
                    slot = slots[k[4]]
                    if slot.tick == self._tick:
                        current.append(slot.meta)
                    else:
                        yield slot.meta
                yield from (slots[k[4]].meta
                            for k in order.irange(_FIRST_PROBATION, _FIRST_PROTECTED, inclusive=(True, False)))
                yield from current
        for order in lists:  # held back: after every other block, of every priority
            if order[-1][0] == _HELD:  # (the last item is at hand without the index too)
                yield from (slots[k[4]].meta for k in order.irange(_FIRST_HELD))

    def learning_state(self) -> dict[str, object]:
        """The structures this policy keeps besides its order of the resident blocks: its
        learning state and its duel's shadows (for measuring what they cost)."""
        out: dict[str, object] = {}
        if self._learning is not None:
            out["learning"] = self._learning
        if self._duel is not None:
            out["shadows"] = self._duel
        out["tails"] = self._tails
        return out

    @property
    def order(self) -> str:
        """The order of the blocks that are not structural victims now (:data:`ORDERS`)."""
        if self._duel is not None:
            return self._contenders[self._duel.leader]
        return self._order

    @property
    def recency(self) -> bool:
        """Whether the blocks that are not structural victims go in order of recency now
        (plain or learned, rather than by ARC's segments)."""
        return self.order != ARC

    # ------------------------------------------------------------ internals
    def _touch(self, meta: BlockMeta, *, put: bool = False) -> None:
        """A request reads ``meta``, or writes it (``put``: a new block, about to take room).

        An access whose depth does not grow starts a new request: the clock ticks, and the
        last request's puts have landed or failed. The estimator and the shadows see every
        access.
        """
        started = meta.depth < 0 or meta.depth <= self._depth
        self._depth = meta.depth
        if started:
            self._tick += 1
            self._admitted.clear()
            self._admitted_bytes = 0
            self._admitted_cls.clear()
        learning = self._learning
        if learning is not None:
            if self._learns:
                if started:
                    session = meta.hints.session if meta.hints is not None else None
                    learning.returning = session is not None and learning.sessions.note(session)
                learning.uses = learning.sketch.add(meta.key)
            cls = self._touched_cls = learning.block_class(meta)
            if self._learns:
                learning.estimator.touched(meta.key, cls, learning.full or meta.size)  # (none committed yet)
            if put:
                self._admitted_cls[meta.key] = cls
        if put:
            self._admitted[meta.key] = meta.size
            self._admitted_bytes += meta.size
        if self._duel is not None:
            if started or put:
                self._resize()
            self._duel.touch(meta, new_request=started)
            # A new leader: each block takes its place in the new order when it is next
            # touched (placing them all at once would stall the node for a large cache).
            self._following = self._contenders[self._duel.leader]

    def _resize(self) -> None:
        learning = self._learning
        full = learning.full if learning is not None else 0
        blocks = self._high_water // full if full else 0
        size = (max(self._high_water, self._resident + self._admitted_bytes), blocks)
        if size == self._size:
            return
        self._size = size
        if self._duel is not None:
            # Shadows of the cache's size, sampling at the rate for the size its tiers allow:
            # a cache still filling (or kept nearly empty) would otherwise have every block
            # followed by every shadow, three times the work of the policy itself.
            self._duel.resize(size[0], max(self._high_water, self._capacity) // full if full else 0)
        if self._learns and learning is not None and blocks != self._learnt_for:
            self._learnt_for = blocks  # (both are sized by the block count alone)
            learning.estimator.resize(blocks)
            learning.sketch.resize(blocks)

    def _place(self, slot: _Slot) -> int:
        """Where a block just touched goes in its order: the tick of its last touch, moved in
        the learned order by ``D * (r - 1)``.

        ``r`` is its class's hit density relative to all blocks (the estimator's, capped at
        :data:`MAX_RELATIVE_VALUE`; 1 where it has too little evidence) and ``D`` how long an
        average block stays untouched before it goes (over the recent evictions, the ticks
        the evicted blocks had stayed over the sum of their ``r``). It is GreedyDual's rule
        in ticks: a block worth ``r`` times the average stays ``r`` times as long, and every
        touch gives it a new term.
        """
        learning = self._learning
        if self._following != LEARNED or learning is None or self._valued <= 0.0:
            return slot.tick
        r = learning.estimator.relative(slot.cls)
        if r is None:
            return slot.tick
        return slot.tick + round(self._aged / self._valued * (min(r, MAX_RELATIVE_VALUE) - 1.0))

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
        if m.key in st.held:
            return _HELD
        parent_size = self._sizes.get(m.parent) if m.parent is not None else None
        if m.parent is not None and parent_size is None:
            return _ORPHAN
        if self._copies.get(m.key, 0) > 1:
            for other in self._tiers.values():
                if other.rank < st.rank and m.key in other.slots:
                    return _COPY
        if not slot.protected and self._following != LEARNED and self._tails.tails_first \
                and self._is_tail(slot, parent_size):
            return _TAIL  # (a learned order knows what tails are worth: they have classes of their own)
        return _PROTECTED if slot.protected else _PROBATION

    def _is_tail(self, slot: _Slot, parent_size: int | None) -> bool:
        """A partial block: smaller than its parent; without one (as a sampled shadow follows
        blocks), a block past the root smaller than the largest block seen."""
        m = slot.meta
        if m.parent is not None:
            return parent_size is not None and m.size < parent_size
        return self._learning is not None and m.depth > 0 and m.size < self._learning.full

    def _link(self, st: _TierState, slot: _Slot, tick: int) -> None:
        m = slot.meta
        slot.sort = (self._class(st, slot), tick, -m.depth, next(self._seq), m.key)
        st.add(slot.sort, m.priority, m.tenant)
        st.segment_bytes[slot.protected] += m.size

    def _unlink(self, st: _TierState, slot: _Slot) -> None:
        m = slot.meta
        st.discard(slot.sort, m.priority, m.tenant)
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
                if demoted:
                    slot.tick = self._tick
                self._relink(st, slot, self._place(slot) if demoted else slot.sort[1])


def _by_recency(sort: _SortKey) -> tuple[int, int, int]:
    return sort[1], sort[2], sort[3]


def _shadow_copy(meta: BlockMeta) -> BlockMeta:
    """What a shadow cache keeps of a block: its metadata, never the store's entry."""
    return BlockMeta(meta.key, meta.size, meta.tenant, meta.priority, meta.depth, meta.parent, hints=meta.hints)


#: The policies by name. ``prefix`` is the default; ``prefix-arc``, ``prefix-recency`` and
#: ``prefix-learned`` are its orders alone (what its duel chooses between), and
#: ``prefix-nolearn`` is its duel of ARC and recency without learning, for comparisons.
POLICIES: Mapping[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "prefix": PrefixAwarePolicy,
    "prefix-arc": lambda: PrefixAwarePolicy(duel=False),
    "prefix-recency": lambda: PrefixAwarePolicy(duel=False, order=RECENCY),
    "prefix-learned": lambda: PrefixAwarePolicy(duel=False, order=LEARNED),
    "prefix-nolearn": lambda: PrefixAwarePolicy(learn=False),
}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``; raises ConfigError for an unknown name."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"policy.name: unknown policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory()
