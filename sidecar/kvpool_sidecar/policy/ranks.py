"""Where each resident block stands in its tier's order, for the default policy
(:class:`Ranks`): its class (structural victims first: orphans, copies a hotter tier also
holds, unread tails) and its place within the class (the tick of its last touch, moved by
what its class has proved worth in the learned order).

The policy (:mod:`~kvpool_sidecar.policy.prefix`) decides what happens to a block; this
module keeps the blocks in order as it does, and relinks the blocks whose class another
block's arrival or departure changes (a parent's children, a block's colder copies).
"""

from __future__ import annotations

import itertools

from kvpool_sidecar.policy.base import BlockMeta
from kvpool_sidecar.policy.tails import TailWatch
from kvpool_sidecar.policy.tierstate import COPY, HELD, ORPHAN, PROBATION, PROTECTED, TAIL, Slot, TierState
from kvpool_sidecar.reuse import Learning

#: The orders of the blocks that are not structural victims: ARC's segments, recency, and
#: recency with places learned (see :meth:`Ranks.place`).
ARC, RECENCY, LEARNED = "arc", "recency", "learned"
ORDERS = (ARC, RECENCY, LEARNED)

#: How much longer than an average block a block of the most valuable class may stay
#: untouched (see :class:`Learning`): a bound on what a wrong estimate can cost. 4, not 16 as
#: it was: a class that seems worth 16 times the average keeps its blocks for 16 turnovers of
#: the cache, which the next shift of the workload pays for.
MAX_RELATIVE_VALUE = 4.0


class Ranks:
    """The tiers' resident blocks, each key's size, copies and resident children, and each
    block's rank (:attr:`Slot.sort`) in its tier's lists.

    The policy sets what ranks depend on as it changes: the order it follows, the clock
    (``tick``, one per request), the tenants a quota bounds, and the decayed record of its
    evictions (``aged`` ticks over ``valued`` relative worth: how long a block of average
    value stays).
    """

    def __init__(self, order: str, tails: TailWatch, learning: Learning | None) -> None:
        self.tiers: dict[str, TierState] = {}
        #: Each resident key's size, and how many tiers hold it where that is more than one
        #: (most blocks have one copy: an entry for each had cost every shadow 4 bytes a block).
        self.sizes: dict[bytes, int] = {}
        self.copies: dict[bytes, int] = {}
        #: Resident children of each parent key (the parent itself may be gone).
        self.children: dict[bytes, set[bytes]] = {}
        #: The order the resident blocks are placed for (:data:`ORDERS`).
        self.following = order
        self.tick = 0
        #: Tenants a quota bounds (:meth:`PrefixAwarePolicy.bounded`): their traffic moves
        #: nothing the policy shares between tenants (the duel's shadows, each tier's split, the
        #: tail rule, how long a block stays, the block size, the sketch's counts, the
        #: estimator, sessions), which their quota, not the policy, keeps within their share.
        self.bounded: frozenset[str] = frozenset()
        self.aged = 0.0
        self.valued = 0.0
        self._tails = tails
        self._learning = learning
        self._seq = itertools.count()

    def place(self, st: TierState, slot: Slot) -> int:
        """Where a block just touched goes in its order: the tick of its last touch, moved in
        the learned order by ``D * (r - 1)``.

        ``r`` is its class's worth against all blocks (the estimator's, capped at
        :data:`MAX_RELATIVE_VALUE`; 1 where it has too little evidence) and ``D`` how long an
        average block stays untouched before it goes (over the recent evictions, the ticks
        the evicted blocks had stayed over the sum of their ``r``). It is GreedyDual's rule
        in ticks: a block worth ``r`` times the average stays ``r`` times as long, and every
        touch gives it a new term.
        """
        learning = self._learning
        if self.following != LEARNED or learning is None or self.valued <= 0.0:
            return slot.tick
        r = learning.estimator.relative(slot.cls)
        if r is None:
            return slot.tick
        place = slot.tick + round(self.aged / self.valued * (min(r, MAX_RELATIVE_VALUE) - 1.0))
        # Never after its parent here: depth is part of a class, so values need not fall along
        # a chain, and a parent placed before its children took them all with it (orphans go
        # first) while they were worth more.
        parent = slot.meta.parent
        held = st.slots.get(parent) if parent is not None else None
        return place if held is None else min(place, held.sort[1])

    def class_of(self, st: TierState, slot: Slot) -> int:
        """The block's class in its tier: held back, orphan, copy, tail, or its ARC segment."""
        m = slot.meta
        if m.key in st.held:
            return HELD
        parent_size = self.sizes.get(m.parent) if m.parent is not None else None
        if m.parent is not None and parent_size is None:
            return ORPHAN
        if self.copies.get(m.key, 0) > 1:
            for other in self.tiers.values():
                if other.rank < st.rank and m.key in other.slots:
                    return COPY
        if not slot.protected and self.following != LEARNED and self._tails.tails_first \
                and is_tail(m, parent_size, self._learning):
            return TAIL  # (a learned order knows what tails are worth: they have classes of their own)
        return PROTECTED if slot.protected else PROBATION

    def link(self, st: TierState, slot: Slot, tick: int) -> None:
        m = slot.meta
        slot.sort = (self.class_of(st, slot), tick, -m.depth, next(self._seq), m.key)
        st.add(slot.sort, m.priority, m.tenant)
        st.count(m.tenant, slot.protected, m.size, m.tenant not in self.bounded)

    def unlink(self, st: TierState, slot: Slot) -> None:
        m = slot.meta
        st.discard(slot.sort, m.priority, m.tenant)
        st.count(m.tenant, slot.protected, -m.size, m.tenant not in self.bounded)

    def relink(self, st: TierState, slot: Slot, tick: int) -> None:
        self.unlink(st, slot)
        self.link(st, slot, tick)

    def relink_children(self, key: bytes) -> None:
        """``key`` arrived in or left its last tier: its children change class."""
        for child in self.children.get(key, ()):
            for st in self.tiers.values():
                slot = st.slots.get(child)
                if slot is not None:
                    self.relink(st, slot, slot.sort[1])

    def relink_copies(self, key: bytes, rank: int, *, demoted: bool) -> None:
        """A copy of ``key`` arrived in or left a tier of ``rank``: colder copies change class.

        A colder copy whose hotter one left counts as demoted now.
        """
        for st in self.tiers.values():
            slot = st.slots.get(key)
            if slot is not None and st.rank > rank:
                if demoted:
                    slot.tick = self.tick
                self.relink(st, slot, self.place(st, slot) if demoted else slot.sort[1])


def is_tail(m: BlockMeta, parent_size: int | None, learning: Learning | None) -> bool:
    """A partial block: smaller than its parent; without one (as a sampled shadow follows
    blocks), a block past the root smaller than the largest block seen."""
    if m.parent is not None:
        return parent_size is not None and m.size < parent_size
    return learning is not None and m.depth > 0 and m.size < learning.full
