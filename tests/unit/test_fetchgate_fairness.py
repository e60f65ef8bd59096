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
    assert order == ["a"] * 4 and len(gate._waiting) == 33  # noqa: SLF001
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

