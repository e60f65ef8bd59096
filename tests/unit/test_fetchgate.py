"""The bounds on what one tenant's reads make a node fetch from peers
(:mod:`kvpool_sidecar.fetchgate`): transfers handed over first come, first served, a bound on
waiters, and the pause of a tenant whose blocks find no room."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpool_client.protocol import PutStatus
from kvpool_sidecar import fetchgate
from kvpool_sidecar.fetchgate import FetchGate, Landing


async def _hold(gate: FetchGate, tenant: str, holder: str, release: asyncio.Event, out: list[bool],
                deadline_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    async with gate.transfer(tenant, holder, loop.time() + deadline_s) as ok:
        out.append(ok)
        if ok:
            await release.wait()


async def test_a_transfer_that_ends_hands_its_turn_to_the_first_waiter_only() -> None:
    """Waiters are served in order, one per turn that comes back; the others stay asleep (every
    waiter had been woken at each transfer's end to look again: thousands of one tenant's
    waiters cost the loop 22 ms each time any transfer ended)."""
    gate = FetchGate(transfers=1, per_holder=4)
    first, rest = asyncio.Event(), asyncio.Event()
    got: list[bool] = []
    running = asyncio.create_task(_hold(gate, "a", "h", first, got))
    await asyncio.sleep(0)
    assert got == [True]
    waiters = [asyncio.create_task(_hold(gate, "a", "h", rest, got)) for _ in range(5)]
    await asyncio.sleep(0)
    assert got == [True]
    loop = asyncio.get_running_loop()
    made = 0
    real = loop.create_future

    def counted() -> asyncio.Future[Any]:
        nonlocal made
        made += 1
        return real()

    first.set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "create_future", counted)
        await running
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert made == 1  # the one served waits on its event; before, the four left woke, looked again and waited anew
    assert got == [True, True]  # the first waiter runs, the four others wait on
    rest.set()
    await asyncio.gather(*waiters)
    assert got == [True] * 6
    assert gate._tenants == {} and gate._holders == {} and not gate._waiting  # noqa: SLF001


async def test_past_its_waiters_bound_a_tenants_transfer_is_a_miss_at_once_and_others_wait_on() -> None:
    gate = FetchGate(transfers=1, per_holder=8, waiting=3)
    release = asyncio.Event()
    got: list[bool] = []
    tasks = [asyncio.create_task(_hold(gate, "a", "h", release, got)) for _ in range(6)]
    await asyncio.sleep(0)
    assert got == [True, False, False]  # one runs, three wait, two more are misses
    other: list[bool] = []
    b = asyncio.create_task(_hold(gate, "b", "h", release, other))
    await asyncio.sleep(0)
    assert other == [True]  # another tenant's bound is its own
    release.set()
    await asyncio.gather(*tasks, b)
    assert got == [True, False, False, True, True, True]
    assert gate._tenants == {} and gate._queued == {} and not gate._waiting  # noqa: SLF001


async def test_a_waiter_that_times_out_or_goes_away_leaves_nothing_behind() -> None:
    gate = FetchGate(transfers=1, per_holder=8)
    release = asyncio.Event()
    got: list[bool] = []
    running = asyncio.create_task(_hold(gate, "a", "h", release, got))
    await asyncio.sleep(0)
    late = asyncio.create_task(_hold(gate, "a", "h", release, got, deadline_s=0.01))
    gone = asyncio.create_task(_hold(gate, "a", "h", release, got))
    await late
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert got == [True, False]
    assert gate._queued == {} and not gate._waiting  # noqa: SLF001
    release.set()
    await running
    assert gate._tenants == {} and gate._holders == {}  # noqa: SLF001


async def test_a_served_waiter_in_a_task_that_once_swallowed_a_cancel_counts_its_turn_once() -> None:
    """A task that caught a cancellation earlier (``cancelling()`` stays 1) and then waited
    for a turn had its turn given back twice: one more of the tenant ran than its bound."""
    gate = FetchGate(transfers=1, per_holder=8)
    first, second = asyncio.Event(), asyncio.Event()
    got: list[bool] = []
    running = asyncio.create_task(_hold(gate, "a", "h", first, got))
    await asyncio.sleep(0)

    async def swallowing() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # (swallowed, not uncancelled)
        await _hold(gate, "a", "h", second, got)

    task = asyncio.create_task(swallowing())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sum(len(q) for q in gate._waiting.values()) == 1  # noqa: SLF001
    first.set()
    await running
    await asyncio.sleep(0)
    assert got == [True, True] and gate._tenants == {"a": 1}  # noqa: SLF001  # before: 0 while it ran
    second.set()
    await task
    assert gate._tenants == {} and gate._holders == {}  # noqa: SLF001


class _Sink:
    def __init__(self, status: PutStatus) -> None:
        self.status = status

    async def place(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                    parent: bytes | None = None) -> tuple[PutStatus, None]:
        return self.status, None

    def commit(self, lease: object, checksum: int) -> None: ...

    def abort(self, lease: object) -> None: ...

    def arena_views(self) -> list[memoryview]:
        return []


@pytest.mark.parametrize("status,writer,no_room", [
    (PutStatus.QUOTA, "reader", True),
    (PutStatus.QUOTA, "other", False),  # another tenant's quota: nothing of the reader's room
    (PutStatus.REJECTED, "other", True),  # a writer no key space here names: never room for it
    (PutStatus.FULL, "other", False),  # (behind another tenant's block refused, say)
    (PutStatus.FULL, "reader", True),
    (PutStatus.EXISTS, "reader", False),
])
async def test_only_what_says_the_reader_has_no_room_pauses_it(status: PutStatus, writer: str, no_room: bool) -> None:
    """A tenant in a key space another shares read that tenant's blocks, refused for that
    tenant's quota: it had been paused, and its own fetches with it, the node empty."""
    landing = Landing(_Sink(status), "reader")
    assert await landing.reserve(b"k" * 32, 4096, writer) is None
    assert landing.found_no_room is no_room
    gate = FetchGate()
    gate.landed("reader", landing, 0)
    assert gate.takes("reader") is not no_room


def test_the_pause_doubles_while_it_goes_on_and_starts_over_once_long_over(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(fetchgate.time, "monotonic", lambda: now[0])
    landing = Landing(_Sink(PutStatus.FULL), "t")
    asyncio.run(landing.reserve(b"k" * 32, 4096, "t"))
    gate = FetchGate()
    pauses = []
    for _ in range(7):
        gate.landed("t", landing, 0)
        pauses.append(gate._paused["t"][1])  # noqa: SLF001
        now[0] = gate._paused["t"][0]  # noqa: SLF001  # its next read, as the pause ends
    assert pauses == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    now[0] += 3600.0  # an hour without a fetch: the next brief fullness pauses it 2 s, not 60
    gate.landed("t", landing, 0)
    assert gate._paused["t"][1] == 2.0  # noqa: SLF001
