"""What each access teaches the default policy (:class:`PrefixAccesses`): which request of its
tenant it belongs to (the clock of requests, on which blocks are ranked), the puts admitted
and not landed yet, the estimates it feeds (:mod:`kvpool_sidecar.reuse`), the duel's shadows
and the witness it shows the access to (:mod:`kvpool_sidecar.duel`,
:mod:`kvpool_sidecar.witness`), and the sizes those are kept at.

:class:`~kvpool_sidecar.policy.prefix.PrefixAwarePolicy` is this and its notifications (what
lands in and leaves its tiers, and the order they go in); its constructor sets the state
declared here and says what each part of it is.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool_sidecar.duel import Duel
from kvpool_sidecar.policy.base import BlockMeta
from kvpool_sidecar.policy.ranks import Ranks
from kvpool_sidecar.policy.tierstate import TouchedSlot, ghost_fields, ghost_key, last_touch
from kvpool_sidecar.reuse import Learning
from kvpool_sidecar.witness import LruWitness

#: Puts admitted and not landed yet followed at most: past it, the oldest are taken as failed
#: (a request that admits more than this is counted as two, an ``api.max_batch`` of 4096 as
#: one). They are forgotten when the next request starts, and a writer whose depths only grow
#: never starts one: admitted puts that never land (allocated, then aborted or refused) had
#: grown the table by 94 MiB in 500,000 of them on a quiet node.
MAX_ADMITTED = 8192

#: Tenants whose request (depth, session seen before) is followed at once; the least recent
#: is forgotten past it.
MAX_REQUESTS = 1024


class PrefixAccesses:
    """The default policy's accesses: each tenant's request under way, the puts it admitted,
    and what the estimator, the duel and the witness learn of each access (see the module's
    docstring). Its state is set by :class:`~kvpool_sidecar.policy.prefix.PrefixAwarePolicy`."""

    _ranks: Ranks
    _learning: Learning | None
    _learns: bool
    _duel: Duel | None
    _witness: LruWitness | None
    _contenders: tuple[str, ...]
    _requests: OrderedDict[str, tuple[int | None, bool]]
    _admitted: dict[bytes, int]
    _admitted_bytes: int
    _admitted_cls: dict[bytes, int]
    _touched_cls: int
    _resident: int
    _high_water: int
    _shared_high_water: int
    _most_blocks: int
    _capacity: int
    _size: tuple[int, int]
    _learnt_for: int | None

    def _touch(self, meta: BlockMeta, *, put: bool = False, hit: bool = False) -> None:
        """A request reads ``meta`` (``hit``), or writes it (``put``: a new block, about to
        take room; neither: a block held here, after one the request missed).

        An access whose depth does not grow starts a new request: the clock ticks, and the
        last request's puts have landed or failed. The estimator and the shadows see every
        access but those of a tenant a quota bounds (:meth:`PrefixAwarePolicy.bounded
        <kvpool_sidecar.policy.prefix.PrefixAwarePolicy.bounded>`), whose blocks are
        classed by what the sketch counted of them without counting them. (Its requests still
        tick the clock, as every tenant's do: the clock orders each tenant's own blocks, and
        two tenants' requests interleave whoever they are.)
        """
        tenant = meta.tenant
        shared = tenant not in self._ranks.bounded
        last, returning = self._requests.get(tenant, (None, False))
        started = last is None or meta.depth < 0 or meta.depth <= last  # (a tenant's first touch starts one)
        if started or len(self._admitted) >= MAX_ADMITTED:
            if started:
                self._ranks.tick += 1
                if shared and self._witness is not None:
                    self._witness.clock += 1  # (its clock: requests of tenants no quota bounds)
            self._admitted.clear()
            self._admitted_bytes = 0
            self._admitted_cls.clear()
        learning = self._learning
        if learning is not None:
            if self._learns and shared:
                if started:
                    session = meta.hints.session if meta.hints is not None else None
                    returning = session is not None and learning.sessions.note(tenant, session)
                learning.returning = returning
                learning.uses = learning.sketch.add(meta.key)
            elif self._learns:
                learning.returning = returning = False
                learning.uses = learning.sketch.count(meta.key) + 1  # (this touch, which the sketch does not count)
        requests = self._requests
        requests[tenant] = (meta.depth, returning)
        requests.move_to_end(tenant)
        if len(requests) > MAX_REQUESTS:
            requests.popitem(last=False)
        if learning is not None:
            cls = self._touched_cls = learning.block_class(meta)
            if self._learns and shared:
                learning.estimator.touched(meta.key, cls, learning.full or meta.size)  # (none committed yet)
            if put:
                self._admitted_cls[meta.key] = cls
        if put:
            size = meta.size if shared else 0  # (a bounded tenant's puts size no shadow)
            self._admitted[meta.key] = size
            self._admitted_bytes += size
        if self._duel is not None:
            if started or put:
                self._resize()
            if shared:  # (the shadows know no quota: see bounded())
                self._witness_touch(meta, started, hit)
                self._duel.touch(meta, new_request=started)
            # A new leader: each block takes its place in the new order when it is next
            # touched (placing them all at once would stall the node for a large cache).
            self._ranks.following = self._contenders[self._duel.leader]

    def _witness_touch(self, meta: BlockMeta, started: bool, hit: bool) -> None:
        """Show the witness the access (and the duel what it saw of the request before)."""
        witness, duel = self._witness, self._duel
        if witness is None or duel is None:
            return
        if started:
            ahead, touches = witness.settle()
            if touches:
                duel.witnessed(ahead, touches, len(self._ranks.sizes))
        witness.capacity, witness.blocks = max(0, self._size[0] - witness.bounded_bytes), self._most_blocks
        witness.touch(witness.clock, meta.key, meta.parent, meta.size, last=self._last_touch(meta.key), hit=hit)

    def _touched(self, meta: BlockMeta) -> None:
        """A client read or wrote ``meta`` again: every copy's last touch is now (a copy's
        last touch alone had made a block read in DRAM look as old as its copy on disk once
        the DRAM copy went)."""
        if self._witness is None or meta.tenant in self._ranks.bounded:
            return
        now = self._witness.clock
        for st in self._ranks.tiers.values():
            slot = st.slots.get(meta.key)
            if isinstance(slot, TouchedSlot):
                slot.touched = now

    def _last_touch(self, key: bytes) -> int | None:
        """The witness's tick of ``key``'s last touch, where a tier holds it or a tier's ghosts
        remember it; None where neither does, or the tick is not known."""
        last = 0
        if key in self._ranks.sizes:
            for st in self._ranks.tiers.values():
                slot = st.slots.get(key)
                if slot is not None:
                    last = max(last, last_touch(slot))
        else:
            ghost = ghost_key(key)
            for st in self._ranks.tiers.values():
                value = st.ghosts.get(ghost) if st.ghosts else None
                if value is not None:
                    last = max(last, ghost_fields(value)[2])
        return last or None

    def _landing_class(self, meta: BlockMeta) -> int:
        """The class of a block that lands with none kept from its admission (another tenant's
        request began in between, or it was never admitted: found on disk at the start): from
        its own touches and its own tenant's request. Not from the block touched last, which
        may be another tenant's: a tenant a quota bounds, touching a block of its own between
        another's ALLOC and COMMIT, had landed that block in a class of a third tenant's
        range, and a learned order then evicted it first (a review: a victim's hot set at a
        hit rate of 0.99 against 0.59 in a store in-process, 0.88 against 0.57 on a real
        sidecar)."""
        learning = self._learning
        if learning is None:
            return 0
        shared = meta.tenant not in self._ranks.bounded
        uses = learning.sketch.count(meta.key) + (0 if shared else 1)  # (a bounded tenant's touches are not counted)
        returning = shared and self._requests.get(meta.tenant, (None, False))[1]
        return learning.block_class(meta, uses, returning)

    def _resize(self) -> None:
        learning = self._learning
        full = learning.full if learning is not None else 0
        # the blocks of the tenants no quota bounds (their largest block sets ``full``), at
        # most as many blocks as the tiers ever held: the learning state follows their
        # accesses alone (see bounded()), and a bounded tenant's bytes over another tenant's
        # block of a byte had sized it at a byte a block
        blocks = min(self._shared_high_water // full, self._most_blocks) if full else 0
        size = (max(self._high_water, self._resident + self._admitted_bytes), blocks)
        if size == self._size:
            return
        self._size = size
        if self._duel is not None:
            # Shadows of the cache's size, sampling at the rate for the size its tiers allow:
            # a cache still filling (or kept nearly empty) would otherwise have every block
            # followed by every shadow, three times the work of the policy itself. At least
            # the most blocks it held: one block of the largest size first, after a cold
            # start, had made the size allow few blocks, and the sample kept every key for good.
            blocks_allowed = max(self._high_water, self._capacity) // full if full else 0
            self._duel.resize(size[0], max(blocks_allowed, self._most_blocks) if full else 0)
        if self._learns and learning is not None and blocks != self._learnt_for:
            self._learnt_for = blocks  # (both are sized by the block count alone)
            learning.estimator.resize(blocks)
            learning.sketch.resize(blocks)
            learning.sessions.resize(blocks)


__all__ = ["MAX_ADMITTED", "MAX_REQUESTS", "PrefixAccesses"]
