"""Policy notifications applied just after the answer that caused them, not before it.

When a put or a read is served, the policy learns of it (``admit``, ``inserted``,
``accessed``) and reorders its lists, its shadow caches and its estimates: tens of
microseconds a block, more than the rest of the request. None of it changes the answer, so
the store applies those notifications when the callback that served the request ends, after
its answer was written: the client copies or verifies its blocks while the sidecar does the
bookkeeping. ``admit`` waits only for a policy that admits every block
(``admits_all = True``): its answer is known before it runs.

The time each notification takes is the tenant's whose request queued it: with
:attr:`DeferredPolicy.charges` set (the local API sets its turns, ``api/turns.py``), what
the notifications a tenant's requests queued took is owed by that tenant, wherever they were
applied. Not the tenant whose block it is: in a key space shared by tenants, one tenant's
reads of another's blocks would have been the other's to pay. Notifications queued outside
any tenant's request (the write-ahead, promotions, peers' fetches) are owed by no one.

Nothing else sees the difference. Every other call on the policy (``admit`` of a policy that
may refuse, ``bypassed``, ``removed``, ``victims``, ``sized``, ``skipped``, ``restored``) first
applies what is queued, in order, so every choice the policy makes is the one it made
before; outside an event loop notifications apply at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from kvpool_sidecar.policy import BlockMeta, EvictionPolicy


#: Notifications applied per turn of the event loop when no call on the policy needs them
#: all at once.
SETTLE_SLICE = 128
#: The most notifications left for later turns: a loop so busy that slices fall behind still
#: applies the rest each turn (one choice of the policy had applied tens of thousands).
MAX_BACKLOG = 1024


class Charges(Protocol):
    """Whose request the event loop serves now, and where the time spent on a tenant's
    behalf after its requests goes (the local API's :class:`~kvpool_sidecar.api.turns.TenantTurns`)."""

    payer: str | None

    def owe(self, tenant: str, seconds: float) -> None: ...

    def relieve(self, seconds: float) -> None: ...


class DeferredPolicy:
    """An :class:`EvictionPolicy` around another whose ``inserted``, ``accessed`` and (for a
    policy that admits every block) ``admit`` wait for the end of the current event-loop
    callback (see the module's docstring). The blocks are passed as they are: the policy
    reads fields of theirs that never change once a block is stored."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.inner = policy
        self.name = policy.name
        self.admits_all: bool = getattr(policy, "admits_all", False)
        #: (notification, tier, block, the tenant whose request queued it), oldest first.
        self._queue: list[tuple[Callable[[str, BlockMeta], object], str, BlockMeta, str | None]] = []
        #: The event loop in which a call of :meth:`_settle_some` waits, if one does: one at
        #: a time (one had been scheduled for each notification that found the queue empty,
        #: though the one before still waited: a callback of the loop per block written where
        #: each put's eviction applies the queue at once).
        self._scheduled: asyncio.AbstractEventLoop | None = None
        #: Asked whose request queues each notification, and told, after each batch
        #: applied, the seconds each tenant's took (None: neither).
        self.charges: Charges | None = None
        self.clock: Callable[[], float] = time.perf_counter

    def _later(self, notify: Callable[[str, BlockMeta], object], tier: str, meta: BlockMeta) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if not self._queue:
                notify(tier, meta)
                return
        else:
            self._schedule(loop)
        charges = self.charges
        self._queue.append((notify, tier, meta, charges.payer if charges is not None else None))

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._scheduled is not loop:  # (one scheduled in a loop that has closed never runs)
            loop.call_soon(self._settle_some)
            self._scheduled = loop

    def settle(self) -> None:
        """Apply the queued notifications, oldest first. One that raises is dropped; the rest
        stay queued, in order, and the error goes to the caller."""
        while self._queue:
            self._apply(len(self._queue))

    def _settle_some(self) -> None:
        """:meth:`settle`, :data:`SETTLE_SLICE` notifications per turn of the event loop: the
        requests that came meanwhile are served between slices (a put of 1,024 blocks queues
        2,048, tens of milliseconds that another client's lookup had waited behind). More
        when more than :data:`MAX_BACKLOG` wait: the next choice of the policy applies them
        all at once, in the request that makes it."""
        self._scheduled = None
        self._apply(max(SETTLE_SLICE, len(self._queue) - MAX_BACKLOG))
        if self._queue:
            self._schedule(asyncio.get_running_loop())

    def _apply(self, most: int) -> None:
        queue, self._queue = self._queue[:most], self._queue[most:]
        charges, clock = self.charges, self.clock
        took: dict[str | None, float] = {}  # (None: queued outside any request)
        tenant: str | None = None  # whose notifications run now (timed from ``at``, a run at a time)
        at = clock() if charges is not None else 0.0
        try:
            for i, (notify, tier, meta, payer) in enumerate(queue):
                if payer != tenant:
                    now = clock()
                    took[tenant] = took.get(tenant, 0.0) + now - at
                    tenant, at = payer, now
                try:
                    notify(tier, meta)
                except BaseException:
                    self._queue[:0] = queue[i + 1:]
                    if self._queue:
                        with contextlib.suppress(RuntimeError):  # no loop: the next call settles
                            self._schedule(asyncio.get_running_loop())
                    raise
        finally:
            if charges is not None:
                took[tenant] = took.get(tenant, 0.0) + clock() - at
                for name, seconds in took.items():
                    if seconds <= 0:
                        continue
                    if name is None:
                        charges.relieve(seconds)  # (no one's: not the request's that applied it)
                    else:
                        charges.owe(name, seconds)

    @property
    def pending(self) -> int:
        """Notifications queued and not applied yet."""
        return len(self._queue)

    # -------------------------------------------------------------- deferred
    def admit(self, tier: str, meta: BlockMeta) -> bool:
        if self.admits_all:
            self._later(self.inner.admit, tier, meta)
            return True
        self.settle()
        return self.inner.admit(tier, meta)

    def inserted(self, tier: str, meta: BlockMeta) -> None:
        self._later(self.inner.inserted, tier, meta)

    def accessed(self, tier: str, meta: BlockMeta, *, again: bool = False) -> None:
        self._later(functools.partial(self.inner.accessed, again=True) if again else self.inner.accessed, tier, meta)

    # ----------------------------------------------------- applied in order
    def bypassed(self, tier: str, meta: BlockMeta) -> None:
        self.settle()
        self.inner.bypassed(tier, meta)

    def sized(self, capacity: int) -> None:
        self.settle()
        self.inner.sized(capacity)

    def bounded(self, tenants: frozenset[str]) -> None:
        self.settle()
        self.inner.bounded(tenants)

    def skipped(self, tier: str, meta: BlockMeta) -> None:
        self.settle()
        self.inner.skipped(tier, meta)

    def restored(self, tier: str, meta: BlockMeta) -> None:
        self.settle()
        self.inner.restored(tier, meta)

    def removed(self, tier: str, meta: BlockMeta, *, evicted: bool = True) -> None:
        self.settle()
        self.inner.removed(tier, meta, evicted=evicted)

    def victims(self, tier: str, tenant: str | None = None) -> Iterator[BlockMeta]:
        self.settle()
        return self.inner.victims(tier, tenant)
