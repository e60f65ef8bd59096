"""The default policy's eviction order: the walk of one tier's resident blocks, as its ranks
keep them, in the order they should go (:func:`tier_victims`).

Structural victims first (orphans, copies a hotter tier also holds, unread tails), then the
blocks of the order followed (ARC's segments, probation or protected first by ARC's rule; or
recency, plain or learned), the current request's blocks last, and the blocks held back
(pinned ones a search walked past) after every other block of every priority. The policy is
:class:`~kvpool_sidecar.policy.prefix.PrefixAwarePolicy`; its blocks' ranks are kept in
:mod:`~kvpool_sidecar.policy.ranks`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from kvpool_sidecar.policy.base import BlockMeta
from kvpool_sidecar.policy.ranks import Ranks
from kvpool_sidecar.policy.tierstate import (FIRST_HELD, FIRST_PROBATION, FIRST_PROTECTED, HELD, PROBATION,
                                             PROTECTED, TierState, by_recency)

#: The current request's blocks a walk of the recency or learned order sets aside for its
#: end, at most (past them, the rest in their order): the walk passes each one of them.
MAX_SET_ASIDE = 4096


def tier_victims(ranks: Ranks, st: TierState, tenant: str | None,
                 recency: Callable[[], bool]) -> Iterator[BlockMeta]:
    """``st``'s resident blocks (``tenant``'s alone, where given) in the order they should go:
    :meth:`PrefixAwarePolicy.victims <kvpool_sidecar.policy.prefix.PrefixAwarePolicy.victims>`.
    ``recency``: whether the order followed is recency's (plain or learned) rather than ARC's,
    asked as the walk comes to each priority's blocks."""
    if tenant is not None:
        lists = [st.tenants[tenant]] if tenant in st.tenants else []
    else:
        lists = [st.levels[p] for p in sorted(st.levels)]
    # a bounded tenant's own evictions by its own split; the tier's by its unbounded tenants'
    probation_first = st.probation_first(tenant if tenant in ranks.bounded else None)
    slots = st.slots
    for order in lists:
        # by value, never by position: a positional lookup makes the list keep an index
        # that every later insertion and removal must update
        if order[0][0] < PROBATION:  # (the first item is at hand without that index)
            yield from (slots[k[4]].meta for k in order.irange(maximum=FIRST_PROBATION, inclusive=(True, False)))
        if recency():
            merged = heapq.merge(order.irange(FIRST_PROBATION, FIRST_PROTECTED, inclusive=(True, False)),
                                 order.irange(FIRST_PROTECTED, FIRST_HELD, inclusive=(True, False)),
                                 key=by_recency)
            # the current request's blocks last, as below: a learned order places a block
            # of a class worth little before blocks older than it, its own request's
            # parents among them, and room for the request's next block then had to be
            # made from its own chain (the store refuses that put: FULL, where LRU
            # stored every block). At most MAX_SET_ASIDE of them: each walk passes them
            # all, and one request may read tens of thousands of blocks.
            current: list[BlockMeta] = []
            for k in merged:
                slot = slots[k[4]]
                if slot.tick == ranks.tick and len(current) < MAX_SET_ASIDE:
                    current.append(slot.meta)
                else:
                    yield slot.meta
            yield from current
        elif probation_first:
            yield from (slots[k[4]].meta
                        for k in order.irange(FIRST_PROBATION, FIRST_HELD, inclusive=(True, False)))
        else:
            # protected first, but not what the current request just read: that goes last.
            # Placed at the current tick or later: that request's blocks, and any block
            # a learned order placed past now, are never walked before probation (a
            # request that read 30,000 blocks had every later put walk them all).
            now = (PROTECTED, ranks.tick)
            current = []
            for k in order.irange(FIRST_PROTECTED, now, inclusive=(True, False)):
                slot = slots[k[4]]
                if slot.tick == ranks.tick:  # (placed earlier than its touch: learned)
                    current.append(slot.meta)
                else:
                    yield slot.meta
            yield from (slots[k[4]].meta
                        for k in order.irange(FIRST_PROBATION, FIRST_PROTECTED, inclusive=(True, False)))
            yield from current
            yield from (slots[k[4]].meta for k in order.irange(now, FIRST_HELD, inclusive=(True, False)))
    for order in lists:  # held back: after every other block, of every priority
        if order[-1][0] == HELD:  # (the last item is at hand without the index too)
            yield from (slots[k[4]].meta for k in order.irange(FIRST_HELD))


__all__ = ["MAX_SET_ASIDE", "tier_victims"]
