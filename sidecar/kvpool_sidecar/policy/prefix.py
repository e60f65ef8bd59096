"""The default policy: adaptive recency/frequency (ARC) over prefix chains, aware of tails,
orphans and copies, with a duel of orders and a learned one (:class:`PrefixAwarePolicy`).

This module holds the policy and its notifications: what lands in its tiers and what leaves
them. Its tiers' residents are kept in :mod:`~kvpool_sidecar.policy.tierstate` and ranked in
:mod:`~kvpool_sidecar.policy.ranks`, walked in the order they go in
:mod:`~kvpool_sidecar.policy.victims`; what each access teaches it (the clock of requests,
the estimates, the duel and the witness) is :mod:`~kvpool_sidecar.policy.accesses`, its
tail rule :mod:`~kvpool_sidecar.policy.tails`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator

from kvpool_sidecar.duel import Duel
from kvpool_sidecar.errors import ConfigError
from kvpool_sidecar.policy.accesses import PrefixAccesses
from kvpool_sidecar.policy.base import BlockMeta
from kvpool_sidecar.policy.ranks import ARC, LEARNED, MAX_RELATIVE_VALUE, ORDERS, RECENCY, Ranks, is_tail
from kvpool_sidecar.policy.tails import TailWatch
from kvpool_sidecar.policy.tierstate import (PROBATION, TAIL, TIER_RANK, Slot, TierState, TouchedSlot, ghost_fields,
                                             ghost_key, ghost_value, last_touch)
from kvpool_sidecar.policy.victims import tier_victims
from kvpool_sidecar.reuse import Learning
from kvpool_sidecar.witness import LruWitness

#: Children of one parent followed at most (to rank them as orphans when it leaves, and back
#: when it returns): each arrival or departure of the parent relinks them all, and a client
#: that names one parent for thousands of blocks, then puts and removes it in a loop, made
#: that thousands of relinks a request. A child past it keeps its class until it is touched:
#: one that arrived while its parent was away stays ranked an orphan (evicted first) after
#: the parent returns, and one that arrived with it is not ranked an orphan when it leaves.
MAX_CHILDREN = 32

#: How much of the evictions' record (how long blocks stayed, ``Ranks.aged``) each eviction
#: keeps: about the last 256 count.
_DELTA_KEEP = 1.0 - 1.0 / 256

#: Probation's share of a tier when it first fills, before ARC's rule adapts it (the split
#: 2Q's authors recommend; ARC's own start, 0, adapts slowly when most evicted probation
#: blocks are one-shot).
_INITIAL_PROBATION_SHARE = 0.25
#: Ghosts a tier keeps whatever it holds (beside twice ``history`` times its blocks).
_MIN_GHOSTS = 64

#: The orders a duel runs, the first leading at the start. ARC first: starting from recency
#: (LRU's order) had ARC prove itself on too few sampled hits (the shared trace at 0.05 fell
#: from .1675 to .1608), as did letting the order ahead lead, sure or not, for the first half
#: window (.1603); both gained on tool outputs re-read once (0.10: -.0118 below LRU to .0000
#: and -.0015), which ARC's protected segment, full of blocks read twice, serves late.
CONTENDERS = (ARC, RECENCY, LEARNED)


class PrefixAwarePolicy(PrefixAccesses):
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
      evicted blocks (:class:`TailWatch`: a writer that sends the same partial block again
      makes the rule step aside). A copy that a hotter tier also holds costs nothing to drop
      (the pool keeps the block), so it goes before other blocks of its tier; when the hotter
      copy leaves, the colder one counts as freshly demoted.

    - Orders for the blocks that are not structural victims (orphans, copies, tails):
      ARC's segments (above); plain *recency* (the request that last touched a block,
      deepest first), which follows a working set that moves faster than ARC adapts; and the
      *learned* order: recency with each block's place moved by what blocks of its class
      (its uses, depth, tail or not, and its writer's hints) have proved worth: their chance
      of being read again (reuse.py learns that online; see :meth:`Ranks.place`). The learned
      order has no tail rule: tails have classes of their own. With ``duel`` (the default)
      the policy runs the orders on shadow caches of its size (keys only, see duel.py;
      sampled when learning) and follows whichever has had the most hits lately (the
      learned order only when it is also surely ahead of recency), and falls back to recency
      once the real cache's own accesses show that LRU of its size would surely have served
      more of them (witness.py: every access, where the shadows follow one in sixteen); so it
      does about as well as the best of them, and never much below LRU. ``order`` fixes one
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
                 learning: Learning | None = None, tails: TailWatch | None = None) -> None:
        """``order``: the order when there is no duel (:data:`ORDERS`); ``learn``: whether the
        duel has the learned order among its contenders. ``learning`` and ``tails``: the
        estimates and the tail rule of the policy this one shadows (it then feeds them nothing)."""
        if history <= 0:
            raise ConfigError("policy history must be positive")
        if order not in ORDERS:
            raise ConfigError(f"policy order must be one of {', '.join(ORDERS)}")
        self._history = history
        self._order = order
        #: Whether tails go first, from what became of the tails evicted lately: a shadow
        #: follows its owner's rule, fed by the owner's evictions alone. Each shadow had one of
        #: its own, fed by its sample of the blocks: seldom as many tails as the rule needs to
        #: be judged (:class:`TailWatch`), so the orders were compared under a rule the cache
        #: itself did not follow.
        self._tails = tails if tails is not None else TailWatch()
        self._watches = tails is None
        #: Whether evicted keys are remembered (ARC's ghosts): unless the order is fixed to
        #: one that has no use for them.
        self._ghosts = duel or order == ARC
        self.name = ("prefix" if learn else "prefix-nolearn") if duel else f"prefix-{order}"
        #: The estimates, and whether this policy feeds them (a shadow only reads them).
        needed = learn if duel else order == LEARNED
        self._learning = learning if learning is not None else Learning() if needed else None
        self._learns = learning is None and needed
        #: Bytes resident in some tier (each key once), and the most there ever were: the
        #: size the shadows simulate (a cache that just evicted is as large as it gets).
        self._resident = 0
        self._high_water = 0
        #: Of those, the bytes of tenants a quota bounds; and the most bytes the others held
        #: at once, which (over the largest block they committed) sizes the learning state.
        #: Every tenant's had sized it over the others' largest block: a tenant without a
        #: quota that committed one block of a byte made the sketch take 16 bytes per byte a
        #: bounded tenant stored (1.2 GiB for 64 MiB of blocks; a GiB of them, out of memory).
        self._bounded_resident = 0
        self._shared_high_water = 0
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
        self._contenders = CONTENDERS if learn else tuple(o for o in CONTENDERS if o != LEARNED)
        #: The resident blocks in their tiers' orders, ranked for the order followed (the
        #: duel's leader, or the one fixed), on the clock of requests; and the record of
        #: evictions that learned places are measured by (see :class:`Ranks`).
        self._ranks = Ranks(self._contenders[0] if duel else order, self._tails, self._learning)
        self._duel = Duel([PrefixAwarePolicy(history, duel=False, order=o, learning=self._learning, tails=self._tails)
                           for o in self._contenders],
                          _shadow_copy, sampled=learn,
                          simpler={self._contenders.index(LEARNED): self._contenders.index(RECENCY)} if learn else None,
                          fallback=self._contenders.index(RECENCY)) if duel else None
        #: What LRU of the cache's size would have served of the accesses the cache saw, every
        #: one followed: the duel's evidence for recency against the order the cache follows.
        #: (Resident blocks keep the tick of their last touch on its clock, ``TouchedSlot``,
        #: and so do their ghosts; a shadow has none.)
        self._witness = LruWitness() if duel else None
        #: Keys the current request admitted and that have not landed yet, with their sizes:
        #: a batch of puts takes room before its first block lands, and a put retried after
        #: its allocation failed is the same access, not another one.
        self._admitted: dict[bytes, int] = {}
        self._admitted_bytes = 0
        #: The class each of those keys had when admitted (when learning).
        self._admitted_cls: dict[bytes, int] = {}
        #: Each tenant's request under way: the depth it touched last, and whether its
        #: session had been seen before it started. Per tenant: one tenant's touches had
        #: told another's request it was new, and its session not seen before.
        self._requests: OrderedDict[str, tuple[int | None, bool]] = OrderedDict()
        #: The class of the block touched last, as its touch found it (when learning).
        self._touched_cls = 0

    # ------------------------------------------------------------ notifications
    def admit(self, tier: str, meta: BlockMeta) -> bool:
        # A block whose parent is held nowhere here is still admitted: in a pool its parent
        # may live on another node (a lookup counts peers' blocks), or it was just evicted;
        # refusing would refuse the whole chain on every put. It ranks as an orphan instead.
        key = meta.key
        if key not in self._ranks.sizes:  # a new block, not a move between tiers
            if key in self._admitted:
                return True  # the same put again, after its allocation failed
            self._touch(meta, put=True)
        return True

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        ranks = self._ranks
        st = ranks.tiers.get(tier)
        if st is None:
            st = ranks.tiers[tier] = TierState(TIER_RANK.get(tier, 1))
        key = meta.key
        witness = self._witness
        # a put admitted in the request under way (the table is emptied when any tenant's
        # request begins): now on the witness's clock; one that lands later, or a put of a
        # tenant a quota bounds (which the witness does not follow): not known
        admitted_at = witness.clock if witness is not None and key in self._admitted \
            and meta.tenant not in self._ranks.bounded else 0
        self._admitted_bytes -= self._admitted.pop(key, 0)
        cls = self._admitted_cls.pop(key, None)
        old = st.slots.get(key)
        if old is not None:
            ranks.unlink(st, old)
        protected = old is not None and old.protected
        ghost = st.ghosts.pop(ghost_key(key), None) if st.ghosts else None
        copies = ranks.copies.get(key, 1) if key in ranks.sizes else 0  # tiers holding it
        shared = meta.tenant not in self._ranks.bounded
        if old is None and not copies and shared and self._watches:
            self._tails.arrived(key)
        if ghost is not None:
            size, was_protected, _ = ghost_fields(ghost)
            st.ghost_bytes[was_protected] -= size
            if shared:
                st.adapt(bool(was_protected), meta.size)
            protected = True
        arrived = False
        if old is None:
            arrived = not copies
            if copies:
                ranks.copies[key] = copies + 1
            ranks.sizes[key] = meta.size
            if arrived:
                self._resident += meta.size
                if not shared:
                    self._bounded_resident += meta.size
                    if witness is not None:
                        witness.bounded_bytes += meta.size
                self._high_water = max(self._high_water, self._resident)
                self._shared_high_water = max(self._shared_high_water, self._resident - self._bounded_resident)
                if self._learning is not None and self._learns and shared:  # (a refused put says nothing of sizes)
                    self._learning.full = max(self._learning.full, meta.size)
                if len(ranks.sizes) > self._most_blocks:  # (before the resize: it bounds the learning state)
                    self._most_blocks = len(ranks.sizes)
                    if self._duel is not None:
                        self._duel.cap_blocks(self._most_blocks)
                self._resize()
            if meta.parent is not None:
                children = ranks.children.setdefault(meta.parent, set())
                if len(children) < MAX_CHILDREN:
                    children.add(key)
        slot = Slot(meta, protected, (0, ranks.tick, 0, 0, key), ranks.tick) if self._witness is None \
            else TouchedSlot(meta, protected, (0, ranks.tick, 0, 0, key), ranks.tick, touched=admitted_at)
        # a move between tiers: the class and the last touch of another copy
        other = next((o.slots[key] for o in ranks.tiers.values() if o is not st and key in o.slots),
                     None) if old is None and copies else None
        was = old if old is not None else other
        if was is not None:
            slot.cls = was.cls
            if isinstance(slot, TouchedSlot) and isinstance(was, TouchedSlot):
                slot.touched = was.touched
        if old is None and cls is not None:
            slot.cls = cls
        elif old is None and other is None and self._learning is not None:
            slot.cls = self._landing_class(meta)
        st.slots[key] = slot
        ranks.link(st, slot, ranks.place(st, slot))
        if arrived:
            ranks.relink_children(key)
        elif old is None:
            ranks.relink_copies(key, st.rank, demoted=False)

    def accessed(self, tier: str, meta: BlockMeta, *, again: bool = False) -> None:
        ranks = self._ranks
        st = ranks.tiers.get(tier)
        slot = st.slots.get(meta.key) if st is not None else None
        if st is None or slot is None:
            return
        if not again:  # (the same read told for another copy had counted twice: estimates, shadows, witness)
            self._touch(meta, hit=True)
            self._touched(meta)
        ranks.unlink(st, slot)
        slot.protected = True
        slot.tick = ranks.tick
        if self._learning is not None:
            slot.cls = self._touched_cls
        ranks.link(st, slot, ranks.place(st, slot))

    def sized(self, capacity: int) -> None:
        if capacity < 0:
            raise ConfigError("policy capacity must not be negative")
        self._capacity = capacity
        self._size = (0, 0)  # the next touch resizes

    def bounded(self, tenants: frozenset[str]) -> None:
        self._ranks.bounded = frozenset(tenants)
        # what they hold, counted again (each key once), and each tier's split
        self._bounded_resident = sum(self._ranks.sizes[key] for key in {
            key for st in self._ranks.tiers.values() for key, slot in st.slots.items()
            if slot.meta.tenant in self._ranks.bounded})
        if self._witness is not None:
            self._witness.bounded_bytes = self._bounded_resident
        for st in self._ranks.tiers.values():
            st.recount(self._ranks.bounded)

    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        # The order here does not change (the block was not read), but the shadows see the
        # access: one of them might have served it.
        if meta.key in self._ranks.sizes:
            self._touch(meta)
            self._touched(meta)

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        # a class of its own, after every other (whatever class it had: an orphan or a copy
        # ranks first); its place and last touch stay, for when it is restored
        st = self._ranks.tiers.get(tier)
        slot = st.slots.get(meta.key) if st is not None else None
        if st is not None and slot is not None and meta.key not in st.held:
            st.held.add(meta.key)
            self._ranks.relink(st, slot, slot.sort[1])

    def restored(self, tier: str, meta: BlockMeta) -> None:
        st = self._ranks.tiers.get(tier)
        slot = st.slots.get(meta.key) if st is not None else None
        if st is not None and slot is not None and meta.key in st.held:
            st.held.discard(meta.key)
            self._ranks.relink(st, slot, slot.sort[1])

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        ranks = self._ranks
        st = ranks.tiers.get(tier)
        slot = st.slots.pop(meta.key, None) if st is not None else None
        if st is None or slot is None:
            return
        key = meta.key
        st.held.discard(key)
        shared = meta.tenant not in self._ranks.bounded
        if st.target is None and shared:
            st.target = _INITIAL_PROBATION_SHARE * st.resident_bytes
        ranks.unlink(st, slot)
        if evicted and slot.sort[0] >= PROBATION and shared:  # not lost, nor a structural eviction
            if self._learning is not None:
                r = self._learning.estimator.relative(slot.cls)
                ranks.aged = ranks.aged * _DELTA_KEEP + (ranks.tick - slot.tick)
                ranks.valued = ranks.valued * _DELTA_KEEP + (1.0 if r is None else min(r, MAX_RELATIVE_VALUE))
        copies = ranks.copies.get(key, 1)  # (resident here: in sizes)
        if evicted and slot.sort[0] >= TAIL and copies == 1 and shared and self._watches:  # its last copy: gone
            # a tail counts as one whatever its class now (the rule stepped aside, or it was
            # read): so the rule sees tails stop coming back, and comes back itself
            m = slot.meta
            tail = slot.sort[0] == TAIL or (not slot.protected and is_tail(
                m, ranks.sizes.get(m.parent) if m.parent is not None else None, self._learning))
            self._tails.evicted(key, tail, len(st.slots) + 1)
        if evicted and slot.sort[0] >= PROBATION and self._ghosts and shared:
            ghost = ghost_key(key)
            other = st.ghosts.pop(ghost, None)  # another key's of the same hash, if ever
            if other is not None:
                size, was_protected, _ = ghost_fields(other)
                st.ghost_bytes[was_protected] -= size
            st.ghosts[ghost] = ghost_value(meta.size, slot.protected, last_touch(slot))
            st.ghost_bytes[slot.protected] += meta.size
            limit = self._history * st.resident_bytes
            # and by count: blocks of a byte each (which the tiers charge a page) had left
            # about as many ghosts as the resident bytes, without any useful bound
            st.trim_ghosts(limit, round(2 * self._history * len(st.slots)) + _MIN_GHOSTS)
        if copies > 1:
            if copies > 2:
                ranks.copies[key] = copies - 1
            else:
                del ranks.copies[key]
            ranks.relink_copies(key, st.rank, demoted=True)
            return
        size = ranks.sizes.pop(key)
        self._resident -= size
        if not shared:
            self._bounded_resident -= size
            if self._witness is not None:
                self._witness.bounded_bytes -= size
        parent = meta.parent
        siblings = ranks.children.get(parent) if parent is not None else None
        if parent is not None and siblings is not None:
            siblings.discard(key)
            if not siblings:
                del ranks.children[parent]
        ranks.relink_children(key)

    def resident(self, tier: str, key: bytes) -> BlockMeta | None:
        st = self._ranks.tiers.get(tier)
        slot = st.slots.get(key) if st is not None else None
        return slot.meta if slot is not None else None

    def resident_keys(self, tier: str) -> Collection[bytes]:
        st = self._ranks.tiers.get(tier)
        return st.slots.keys() if st is not None else ()

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        st = self._ranks.tiers.get(tier)
        if st is None:
            return
        yield from tier_victims(self._ranks, st, tenant, lambda: self.recency)

    def learning_state(self) -> dict[str, object]:
        """The structures this policy keeps besides its order of the resident blocks: its
        learning state and its duel's shadows (for measuring what they cost)."""
        out: dict[str, object] = {}
        if self._learning is not None:
            out["learning"] = self._learning
        if self._duel is not None:
            out["shadows"] = self._duel
            out["witness"] = self._witness
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



def _shadow_copy(meta: BlockMeta) -> BlockMeta:
    """What a shadow cache keeps of a block: its metadata, never the store's entry."""
    return BlockMeta(meta.key, meta.size, meta.tenant, meta.priority, meta.depth, meta.parent, hints=meta.hints)
