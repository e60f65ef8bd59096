"""Fairness of the fetch gate (:mod:`kvpool_sidecar.fetchgate`) between tenants that share a
holder: one tenant's queue for a holder does not take every turn of it ahead of another
tenant's read."""

from __future__ import annotations

import asyncio

from kvpool_sidecar.fetchgate import FetchGate


class Transfer:
    """One transfer of a tenant's from a holder, held until :meth:`end`."""

    def __init__(self, gate: FetchGate, tenant: str, holder: str, order: list[str]) -> None:
        self.tenant = tenant
        self.holder = holder
        self.began = asyncio.Event()
        self._ends = asyncio.Event()
        self.task = asyncio.create_task(self._run(gate, holder, order))

    async def _run(self, gate: FetchGate, holder: str, order: list[str]) -> bool:
        loop = asyncio.get_running_loop()
        async with gate.transfer(self.tenant, holder, loop.time() + 60.0) as ok:
            if ok:
                order.append(self.tenant)
                self.began.set()
                await self._ends.wait()
            return ok

    async def end(self) -> None:
        self._ends.set()
        await self.task


async def test_a_holders_turn_goes_to_the_tenant_running_fewest_before_a_flooding_tenants_queue() -> None:
    """Tenant ``a`` runs every turn of holder ``h`` (4) and queues 32 more (its bound); ``b``
    then asks ``h`` for one block. ``b`` had waited for the 32 transfers queued before it
    (33 ends of ``a``'s transfers): a slow but complete holder made every read of ``b``'s a
    miss at its deadline, for as long as ``a`` kept its queue full."""
    gate = FetchGate(transfers=8, per_holder=4, waiting=32)
    order: list[str] = []
    running = [Transfer(gate, "a", "h", order) for _ in range(4)]
    await asyncio.gather(*(t.began.wait() for t in running))
    queued = [Transfer(gate, "a", "h", order) for _ in range(32)]
    await asyncio.sleep(0)  # (each task runs up to its wait: every one of them is queued)
    other = Transfer(gate, "b", "h", order)
    await asyncio.sleep(0)
    assert order == ["a"] * 4 and sum(gate._queued.values()) == 33  # noqa: SLF001
    ends = 0
    pending = list(running)
    while not other.began.is_set():
        done = pending.pop(0)
        await done.end()
        ends += 1
        pending += [t for t in queued if t.began.is_set() and t not in pending and not t.task.done()]
        await asyncio.sleep(0)  # (the one let go runs up to its transfer)
    assert ends == 1  # before: 33
    await other.end()
    for t in running + queued:
        if not t.task.done():
            await t.end()
    assert order.count("a") == 36 and order.count("b") == 1
    assert gate._tenants == {} and gate._holders == {} and gate._queued == {} and not gate._waiting  # noqa: SLF001



def _let_go_by_scanning_all(gate: FetchGate, tenant: str, holder: str) -> list[int]:
    """The waiters (their arrival numbers) an end of ``tenant``'s transfer from ``holder`` lets
    go, chosen by looking at every waiter: the fewest running of its tenant, first come."""
    tenants, holders = gate._tenants.copy(), gate._holders.copy()  # noqa: SLF001
    tenants[tenant] -= 1
    holders[holder] -= 1
    waiting = sorted((w for q in gate._waiting.values() for w in q), key=lambda w: w.seq)  # noqa: SLF001
    chosen: list[int] = []
    while True:
        free = [w for w in waiting if tenants[w.tenant] < gate.transfers and holders[w.holder] < gate.per_holder]
        if not free:
            return chosen
        best = min(free, key=lambda w: (tenants[w.tenant], w.seq))
        waiting.remove(best)
        tenants[best.tenant] += 1
        holders[best.holder] += 1
        chosen.append(best.seq)


async def test_each_end_lets_go_the_waiters_a_scan_of_every_waiter_would() -> None:
    """An end looks only at the queues of its tenant and its holder: on a random mix of
    arrivals and ends, what it lets go is what a scan of every waiter chooses."""
    import random

    rng = random.Random(7)
    gate = FetchGate(transfers=2, per_holder=2, waiting=6)
    order: list[str] = []
    transfers: list[Transfer] = []
    ends = 0
    for _ in range(600):
        running = [t for t in transfers if t.began.is_set() and not t.task.done()]
        if running and rng.random() < 0.45:
            done = rng.choice(running)
            expected = _let_go_by_scanning_all(gate, done.tenant, done.holder)
            before = {w.seq: w.woken for q in gate._waiting.values() for w in q}  # noqa: SLF001
            await done.end()
            assert sorted(s for s, woken in before.items() if woken.done()) == sorted(expected)
            ends += 1
        else:
            transfers.append(Transfer(gate, rng.choice("abcd"), rng.choice(["h1", "h2", "h3"]), order))
        await asyncio.sleep(0)
    assert ends > 100
    await asyncio.gather(*(t.end() for t in transfers))
    assert gate._tenants == {} and gate._holders == {} and not gate._waiting  # noqa: SLF001
