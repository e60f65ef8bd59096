"""An answer that arrives after its caller gave up still gives its leases back.

The sidecar is frozen (SIGSTOP) so that a call times out for certain, then thawed; its
answer, leases and all, arrives late. The client releases or aborts them, so the blocks do
not stay held until the connection closes.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvpool_client.client import AsyncPoolClient, PoolClient
from kvpool_client.errors import ConnectionLostError
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S, fresh_keys, payload, put_all, wait_until

pytestmark = pytest.mark.integration

PAGE = 64 << 10
Factory = Callable[..., SidecarProcess]


@contextmanager
def frozen(sp: SidecarProcess) -> Iterator[None]:
    os.kill(sp.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sp.pid, signal.SIGCONT)


def small(sidecar_factory: Factory) -> SidecarProcess:
    return sidecar_factory({"dram": {"size_bytes": 16 * PAGE, "page_bytes": PAGE}, "policy": {"name": "lru"}})


def test_a_late_acquire_answer_releases_its_blocks(sidecar_factory: Factory) -> None:
    sp = small(sidecar_factory)
    [key] = fresh_keys(1)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c, PoolClient(sp.socket_path, timeout=DEADLINE_S) as w:
        assert c.put([key], [payload(key, PAGE)]) == [PutStatus.STORED]
        c._sock.settimeout(0.3)  # noqa: SLF001
        with frozen(sp), pytest.raises(ConnectionLostError):
            c.get([key])
        c._sock.settimeout(DEADLINE_S)  # noqa: SLF001
        assert c.lookup([key]).prefix == 1  # reads the late answer and releases its lease
        c.stats()
        others = fresh_keys(16)
        assert put_all(w, others, [payload(k, PAGE) for k in others]) == [PutStatus.STORED] * 16
        assert c.lookup([key]).prefix == 0  # no read lease kept it: it was evicted


def test_a_late_alloc_answer_aborts_its_writes(sidecar_factory: Factory) -> None:
    sp = small(sidecar_factory)
    [key] = fresh_keys(1)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        c._sock.settimeout(0.3)  # noqa: SLF001
        with frozen(sp), pytest.raises(ConnectionLostError):
            c.put([key], [payload(key, PAGE)])
        c._sock.settimeout(DEADLINE_S)  # noqa: SLF001
        # The late ALLOC runs as a task on the sidecar, so a STATS read with it can be answered
        # before it reserves anything: wait for its answer to have come (and its ABORT sent,
        # which the sidecar handles before any later request) as well as for the count.
        wait_until(lambda: c.stats()["pending_writes"] == 0 and not c._leasing,  # noqa: SLF001
                   "the late allocation to be answered and aborted")
        assert c.put([key], [payload(key, PAGE)]) == [PutStatus.STORED]  # not PENDING


def test_the_async_client_gives_back_what_a_cancelled_call_got(sidecar_factory: Factory) -> None:
    sp = small(sidecar_factory)
    [key] = fresh_keys(1)

    async def run() -> None:
        c = await AsyncPoolClient.connect(sp.socket_path, timeout=DEADLINE_S)
        try:
            assert await c.put([key], [payload(key, PAGE)]) == [PutStatus.STORED]
            with frozen(sp):
                task = asyncio.create_task(c.get([key]))
                await asyncio.sleep(0.2)
                task.cancel()  # the engine dropped the request
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert (await c.lookup([key])).prefix == 1
            await c.stats()
            others = fresh_keys(16)
            assert await c.put(others, [payload(k, PAGE) for k in others]) == [PutStatus.STORED] * 16
            assert (await c.lookup([key])).prefix == 0
        finally:
            await c.close()

    asyncio.run(run())
