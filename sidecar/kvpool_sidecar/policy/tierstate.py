"""One tier's residents as the prefix-aware policy orders them: the sort key and its
eviction classes (:data:`SortKey`), each block's place (:class:`Slot`), and the tier's lists
per priority level and per tenant, with ARC's segments and ghosts (:class:`TierState`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sortedcontainers import SortedList

from kvpool_sidecar.keyhash import key_hash
from kvpool_sidecar.policy.base import BlockMeta

#: Eviction classes, first to go first: blocks whose parent is in no tier (a prefix lookup
#: cannot reach them), copies of blocks a hotter tier also holds, prompt tails never read
#: (smaller than their parent: a partial last block), blocks read once (probation), blocks
#: read again (protected).
ORPHAN, COPY, TAIL, PROBATION, PROTECTED, HELD = range(6)
#: The least sort keys of the probation, protected and held (pinned blocks a search for
#: victims walked past: :meth:`~kvpool_sidecar.policy.prefix.PrefixAwarePolicy.skipped`) classes.
FIRST_PROBATION, FIRST_PROTECTED, FIRST_HELD = (PROBATION,), (PROTECTED,), (HELD,)

#: Probation's share of a tenant's own blocks in a tier, for the evictions its quota makes
#: (:meth:`TierState.probation_first`): it has no ghosts to adapt a target of its own (ARC's
#: rule follows the tenants without a quota), so it keeps 2Q's static split, the one the tier
#: starts from.
BOUNDED_PROBATION_SHARE = 0.25

#: Ghosts one eviction drops beyond the one it adds, at most (:meth:`TierState.trim_ghosts`).
GHOST_TRIM = 16

#: Hotter tiers first; a tier the policy does not know ranks with DRAM.
TIER_RANK = {"gpu": 0, "dram": 1, "disk": 2}

#: ``(class, place, -depth, sequence, key)``; the place is the tick of the block's last touch,
#: moved by what it is worth in the learned order (see ``ranks.Ranks.place``); the
#: sequence is unique, so two sort keys never compare their block keys.
SortKey = tuple[int, int, int, int, bytes]


#: What a tier's ghosts remember of a key: 60 bits of its hash behind the process's secret
#: (:mod:`kvpool_sidecar.keyhash`), an int of 32 bytes where the key and a tuple took about
#: 170. Two keys that happen to share them give one block a second chance.
ghost_key = key_hash

#: Bits of a ghost's value for the block's size (see :func:`ghost_value`).
_GHOST_SIZE_BITS = 40
_GHOST_SIZE_MASK = (1 << _GHOST_SIZE_BITS) - 1


def ghost_value(size: int, protected: bool, touched: int) -> int:
    """What a ghost remembers of a block, in one int: its size (under 1 TiB), whether it was
    protected, and the tick of its last touch (for :class:`~kvpool_sidecar.witness.LruWitness`):
    ``touched << 41 | size << 1 | protected``, an int of 32 bytes for the first 2**19 ticks,
    36 after."""
    return (touched << (_GHOST_SIZE_BITS + 1)) | (size << 1) | protected


def ghost_fields(value: int) -> tuple[int, int, int]:
    """A ghost's ``(size, protected, touched)`` (:func:`ghost_value`)."""
    return (value >> 1) & _GHOST_SIZE_MASK, value & 1, value >> (_GHOST_SIZE_BITS + 1)


def by_recency(sort: SortKey) -> tuple[int, int, int]:
    """A sort key without its class: the order of recency alone (deepest first within a touch)."""
    return sort[1], sort[2], sort[3]


@dataclass(slots=True, eq=False)
class Slot:
    """A resident block's place in its tier's order."""

    meta: BlockMeta
    protected: bool
    sort: SortKey
    #: The tick of the block's last touch.
    tick: int = 0
    #: Its class for the reuse estimator (see reuse.py) at its last touch.
    cls: int = 0


@dataclass(slots=True, eq=False)
class TouchedSlot(Slot):
    """A resident block's place, where the policy also keeps its last touch for the witness
    (:class:`~kvpool_sidecar.witness.LruWitness`; a shadow does not: 8 bytes a block)."""

    #: The tick, on the witness's clock, of the block's last read or write by a client (every
    #: copy's is updated; ``tick`` is also moved by a demotion, as a colder copy whose hotter
    #: one left counts as freshly demoted in its tier's order); 0: not known (a put that landed
    #: after another request began).
    touched: int = 0


def last_touch(slot: Slot) -> int:
    """What a ghost of ``slot`` remembers as its last touch: 0 where it is not kept."""
    return slot.touched if isinstance(slot, TouchedSlot) else 0


class TierState:
    """One tier's residents, in eviction order per priority level and per tenant.

    While the tier holds blocks of one priority and one tenant (the common case), its level
    list and its tenant list hold the same blocks in the same order: they are then one
    ``SortedList``, so a block costs one insertion, not two. A second level or tenant splits
    them (a copy of the list); once one of each is left they become one list again, but only
    after as many changes as the list holds, so that a tenant whose one block comes and goes
    cannot make every one of its puts copy the tier's list.
    """

    __slots__ = ("rank", "slots", "levels", "tenants", "calm", "segment_bytes", "own_bytes", "target", "ghosts",
                 "ghost_bytes", "held")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: dict[bytes, Slot] = {}
        self.levels: dict[int, SortedList] = {}
        self.tenants: dict[str, SortedList] = {}
        #: Changes left before one level and one tenant, left in two lists, become one (0: not
        #: counting).
        self.calm = 0
        #: Resident bytes in probation [0] and protected [1] of the tenants no quota bounds:
        #: ARC's split is theirs. A tenant with a quota had counted too: its blocks, all read
        #: twice, left probation to another tenant's one-shot blocks and set the tier
        #: protected-first, so that a third tenant's quota evicted its hot set before its
        #: one-shot blocks (a review: a victim's hit rate 0.986 against 0.774).
        self.segment_bytes = [0, 0]
        #: The same, per tenant (every tenant: whether a quota bounds one may change).
        self.own_bytes: dict[str, list[int]] = {}
        #: ARC's adaptive target: bytes probation may hold before it is evicted first; set when
        #: the tier first loses a block of a tenant no quota bounds (it is full then).
        self.target: float | None = None
        #: Keys recently evicted from a segment, oldest first: ``ghost_key(key) ->
        #: ghost_value(size, was protected, last touch)``; and their bytes per segment.
        self.ghosts: OrderedDict[int, int] = OrderedDict()
        self.ghost_bytes = [0, 0]
        #: Keys of pinned blocks a search for victims walked past (class ``HELD``, last).
        self.held: set[bytes] = set()

    @property
    def resident_bytes(self) -> int:
        """Bytes resident of the tenants no quota bounds."""
        return self.segment_bytes[0] + self.segment_bytes[1]

    def count(self, tenant: str, protected: bool, size: int, shared: bool) -> None:
        """``size`` bytes of ``tenant`` (``shared``: no quota bounds it) arrive in a segment
        (leave it: negative)."""
        own = self.own_bytes.get(tenant)
        if own is None:
            own = self.own_bytes[tenant] = [0, 0]
        own[protected] += size
        if not own[0] and not own[1]:
            del self.own_bytes[tenant]
        if shared:
            self.segment_bytes[protected] += size

    def recount(self, bounded: frozenset[str]) -> None:
        """The tenants a quota bounds are now ``bounded``: the split's bytes are counted again."""
        self.segment_bytes = [sum(own[s] for t, own in self.own_bytes.items() if t not in bounded) for s in (0, 1)]

    def probation_first(self, tenant: str | None) -> bool:
        """Whether probation goes before protected: in the tier's order (``tenant`` None, or a
        tenant no quota bounds), ARC's rule, over the bytes of the tenants no quota bounds
        (while the tier holds none of theirs, probation first, as ARC starts); in the
        evictions a bounded ``tenant``'s quota makes, its own static split
        (:data:`BOUNDED_PROBATION_SHARE`), which no other tenant's blocks move."""
        if tenant is not None:
            own = self.own_bytes.get(tenant)
            return own is not None and own[0] > BOUNDED_PROBATION_SHARE * (own[0] + own[1])
        if not self.resident_bytes:
            return True
        return self.segment_bytes[0] > (self.target or 0.0)

    def trim_ghosts(self, limit: float, most: int) -> None:
        """Drop the oldest ghosts while they are more than ``limit`` bytes or ``most`` keys,
        at most :data:`GHOST_TRIM` + 1 of them (one eviction adds one): a bound that shrank
        at once (a tenant that swapped full blocks for blocks of a byte, which the tiers charge
        a page each) is reached over the next evictions. All at once, one eviction had
        dropped 131,070 ghosts (57 ms of a sidecar's loop; 462 ms on a 1 GiB tier)."""
        ghosts, ghost_bytes = self.ghosts, self.ghost_bytes
        for _ in range(GHOST_TRIM + 1):
            if not ghosts or (ghost_bytes[0] + ghost_bytes[1] <= limit and len(ghosts) <= most):
                return
            size, was_protected, _ = ghost_fields(ghosts.popitem(last=False)[1])
            ghost_bytes[was_protected] -= size

    def adapt(self, was_protected: bool, size: int) -> None:
        """ARC's learning rule, in bytes."""
        probation, protected = self.ghost_bytes
        target = self.target or 0.0
        if was_protected:
            self.target = max(0.0, target - size * max(1.0, probation / max(protected, 1)))
        else:
            self.target = min(float(self.resident_bytes + size), target + size * max(1.0, protected / max(probation, 1)))

    def add(self, sort: SortKey, priority: int, tenant: str) -> None:
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

    def discard(self, sort: SortKey, priority: int, tenant: str) -> None:
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
