"""Turns of the event loop between tenants: one tenant's requests cannot crowd out another's.

The loop serves every connection that has a request ready once per turn, so a tenant with
many connections (within its connection cap) got that many times the loop of a tenant with
one: 256 connections pipelining 4,096-key lookups held another tenant's lookup for 1.4 s,
and its HELLO for 1.5 s. Now each tenant may spend :data:`TURN_S` of the loop per turn
(decoding its frames, its requests answered at once, each step of those run as tasks as it
runs, and their answers' encoding); past that, its connections are not read and its tasks
do not step until the next turn, which starts as soon as the loop has served what was
ready. Connections and tasks that wait take the next turn in the order they waited, those
not served in a turn first; connections that have not said HELLO share one turn (see
``api/connection.py``). A tenant alone on the node loses
nothing but a turn of the loop every :data:`TURN_S`; with others, each gets its turn's
share whatever its number of connections, and a request waits for at most one turn of each
other tenant (plus the one request or step each may overrun it by). A turn is one turn of
the loop (a callback at its end), so a tenant waits only when it spent its share within
one: time spent across idle turns adds up to nothing (that had made a tenant wait, now and
then, behind another's request that came in the same turn though the loop was idle: its
release of a read lease behind another tenant's put that needed the room).

Work that is not a tenant's request (the write-ahead, promotions, peers' fetches, the
index's sweeps) is not charged and never waits; the close of a connection's session, a
slice of its leases at a time, is its tenant's (``api/connection.py``). The policy's bookkeeping
that a tenant's requests queue, applied after their answers (``store/accounting.py``: tens of microseconds
a block, as much as the requests themselves), is the tenant's: it is owed
(:meth:`TenantTurns.owe`), and what a tenant owes counts in what it spends each turn until
turns have paid it, a turn's share each. A tenant reading 4,096 blocks at a time from four
connections had made the loop spend most of each turn on its reads' bookkeeping, uncharged,
and another tenant's 64-key lookups waited 9 ms at the median (2 ms under LRU, whose
bookkeeping is cheap). What a tenant owes counts only where another tenant was served in
this turn or the last: alone, it has no one to wait for (waiting, its connections had paused
and resumed for nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

__all__ = ["TURN_S", "TenantTurns"]

#: The loop time one tenant's requests may take per turn of the loop before they wait for
#: the next turn: a few large requests' worth (a lookup of 4,096 keys takes about 5 ms on
#: the development machines, a slice of an ACQUIRE about 1 ms).
TURN_S = 0.002

T = TypeVar("T")
_Waiter = Callable[[], None] | asyncio.Future[None]


class TenantTurns:
    """What each tenant spent of the loop in this turn, and who waits for the next one (one
    per local API, shared by its connections)."""

    def __init__(self, turn_s: float = TURN_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.turn_s = turn_s
        #: What tells the time spent (tests give one that counts calls).
        self.clock = clock
        self._spent: dict[str, float] = {}
        #: Who waits for the next turn, in order: connections to read again (their resume
        #: callbacks) and tasks (the futures they wait on) alike; those not served in this
        #: turn (``_unserved``) go before those that were.
        self._waiting: list[_Waiter] = []
        self._unserved: list[_Waiter] = []
        #: The loop in which the turn's end is scheduled, if it is (one scheduled in a loop
        #: that has closed never runs).
        self._ends: asyncio.AbstractEventLoop | None = None
        #: Turns ended.
        self.ended = 0
        #: What each tenant owes for work done on its behalf outside its requests, not paid
        #: yet (:meth:`owe`).
        self._owed: dict[str, float] = {}
        #: The tenant whose request (or step of one) the loop runs now; None between them.
        self.payer: str | None = None
        #: What each tenant spent in the last turn (who was served in it).
        self._last: dict[str, float] = {}

    def over(self, tenant: str) -> bool:
        """Whether ``tenant`` spent its share of this turn (what it owes included, where
        another tenant was served in this turn or the last: alone, a tenant that waited for
        turns that take no time paused and resumed its connections for nothing)."""
        spent = self._spent.get(tenant, 0.0)
        owed = self._owed.get(tenant)
        if owed and (any(t != tenant for t in self._spent) or any(t != tenant for t in self._last)):
            spent += owed
        return spent >= self.turn_s

    def owes(self, tenant: str) -> float:
        """The seconds of work on ``tenant``'s behalf that turns have not paid yet."""
        return self._owed.get(tenant, 0.0)

    def charge(self, tenant: str, seconds: float) -> None:
        """``tenant``'s requests took ``seconds`` of the loop; the turn ends as soon as the
        loop has served what is ready now."""
        self._spent[tenant] = self._spent.get(tenant, 0.0) + seconds
        self._end_soon()

    def owe(self, tenant: str, seconds: float) -> None:
        """The loop spent ``seconds`` on ``tenant``'s behalf outside its requests (the
        policy's bookkeeping its requests queued): owed until turns pay it. Inside ``tenant``'s own
        request they are charged already (its step is timed whole); inside another tenant's,
        that tenant is charged for them no more."""
        payer = self.payer
        if payer == tenant or seconds <= 0:
            return
        if payer is not None:
            self._spent[payer] = self._spent.get(payer, 0.0) - seconds
        self._owed[tenant] = self._owed.get(tenant, 0.0) + seconds
        with contextlib.suppress(RuntimeError):  # (no loop runs: the next turn's end pays it)
            self._end_soon()

    def relieve(self, seconds: float) -> None:
        """The loop spent ``seconds`` of the current request's on work no tenant owes (the
        policy's bookkeeping that the write-ahead, promotions or peers' fetches queued):
        not the payer's either."""
        if self.payer is not None and seconds > 0:
            self._spent[self.payer] = self._spent.get(self.payer, 0.0) - seconds

    def _end_soon(self) -> None:
        loop = asyncio.get_running_loop()
        if self._ends is not loop:
            loop.call_soon(self._end)
            self._ends = loop

    def wait(self, resume: Callable[[], None], served: bool) -> None:
        """Call ``resume`` (a connection's, to read it again) when the next turn starts;
        ``served``: it was served in this turn, so it goes after those that were not (a
        tenant's first connection would otherwise take the whole of each of its turns)."""
        (self._waiting if served else self._unserved).append(resume)
        self._end_soon()  # (one is, unless what it waits for is owed: a turn must come)

    def _end(self) -> None:
        self._ends = None
        self.ended += 1
        self._last, self._spent = self._spent, {}
        for tenant, owed in list(self._owed.items()):  # each turn pays a turn's share of it
            if owed > self.turn_s:
                self._owed[tenant] = owed - self.turn_s
            else:
                del self._owed[tenant]
        waiting = self._unserved + self._waiting
        self._unserved, self._waiting = [], []
        call_soon = asyncio.get_running_loop().call_soon
        for resume in waiting:  # each in a callback of its own, in order (one that fails stops no other)
            if isinstance(resume, asyncio.Future):
                if not resume.done():  # (not cancelled meanwhile)
                    resume.set_result(None)  # its task's wakeup is queued here
            else:
                call_soon(resume)
        if self._owed:  # a tenant still owes: the turns go on (alone, they take no time)
            self._end_soon()

    async def _next_turn(self, served: bool) -> None:
        """Wait for the next turn (a task's; ``served``: it stepped in this one)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._waiting if served else self._unserved).append(fut)
        self._end_soon()
        await fut

    def charged(self, tenant: str, work: Awaitable[T]) -> Awaitable[T]:
        """``work`` (a request run as a task) with each of its steps charged to ``tenant``,
        and none begun while ``tenant`` is over its share: it waits for the next turn."""
        return _Charged(self, tenant, work)


class _Charged(Awaitable[T]):
    """Drives an awaitable step by step, timing each step (see :meth:`TenantTurns.charged`)."""

    __slots__ = ("_turns", "_tenant", "_work")

    def __init__(self, turns: TenantTurns, tenant: str, work: Awaitable[T]) -> None:
        self._turns = turns
        self._tenant = tenant
        self._work = work

    def __await__(self) -> Generator[Any, Any, T]:
        turns, tenant = self._turns, self._tenant
        steps = self._work.__await__()
        value: Any = None
        error: BaseException | None = None
        stepped_in = -1  # the turn of its last step
        while True:
            if error is None and turns.over(tenant):
                try:
                    while turns.over(tenant):
                        yield from turns._next_turn(stepped_in == turns.ended).__await__()
                except GeneratorExit:
                    steps.close()
                    raise
                except BaseException as e:  # noqa: BLE001 - cancelled while waiting: the work is told
                    error = e
            started = turns.clock()
            stepped_in = turns.ended
            outer, turns.payer = turns.payer, tenant
            try:
                out = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            finally:
                turns.payer = outer
                turns.charge(tenant, turns.clock() - started)
            value, error = None, None
            try:
                value = yield out
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as e:  # noqa: BLE001 - handed on to the work, as an await would
                error = e
