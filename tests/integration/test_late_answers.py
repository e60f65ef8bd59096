"""An answer that arrives after its caller gave up still gives its leases back.

The sidecar is frozen (SIGSTOP) so that a call times out for certain, then thawed; its
answer, leases and all, arrives late. The client releases or aborts them, so the blocks do
not stay held until the connection closes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool_client.client import AsyncPoolClient, PoolClient
from kvpool_client.errors import ConnectionLostError, ProtocolError
from kvpool_client.protocol import PutStatus, encode
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import (
    DEADLINE_S, TCP_TOKEN, SlowLink, fresh_keys, payload, put_all, tcp_tenants, wait_until,
)

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
        c.timeout = 0.3
        with frozen(sp), pytest.raises(ConnectionLostError):
            c.get([key])
        c.timeout = DEADLINE_S
        assert c.lookup([key]).prefix == 1  # reads the late answer and releases its lease
        c.stats()
        others = fresh_keys(16)
        assert put_all(w, others, [payload(k, PAGE) for k in others]) == [PutStatus.STORED] * 16
        assert c.lookup([key]).prefix == 0  # no read lease kept it: it was evicted


def test_a_late_alloc_answer_aborts_its_writes(sidecar_factory: Factory) -> None:
    sp = small(sidecar_factory)
    [key] = fresh_keys(1)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        c.timeout = 0.3
        with frozen(sp), pytest.raises(ConnectionLostError):
            c.put([key], [payload(key, PAGE)])
        c.timeout = DEADLINE_S
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


def test_a_call_ends_at_its_timeout_however_slowly_its_answer_trickles(sidecar_factory: Factory,
                                                                       tmp_path: Path) -> None:
    """The timeout counts from the call's start: an answer that comes a byte at a time, each
    well within the timeout, had held a call with a 1 s timeout for as long as it took."""
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    with SlowLink(sp.ready["tcp_port"]) as link, \
            PoolClient(host="127.0.0.1", port=link.port, token=TCP_TOKEN, timeout=1.0) as c:
        keys = fresh_keys(4)
        link.trickle(0.25)  # the lookup's answer, 15 bytes or so, would take 4 s
        start = time.monotonic()
        with pytest.raises(ConnectionLostError):
            c.lookup(keys)
        assert time.monotonic() - start < 2.5


def test_a_call_that_times_out_part_way_through_an_answer_leaves_the_rest_to_the_next(
        sidecar_factory: Factory, tmp_path: Path) -> None:
    """The part of an answer that came before a call gave up stays in the client's buffer: the
    next call reads the rest of it (and drops it) before its own. Taking the frame's header
    first had left the next call reading the body's first bytes as a header of gigabytes."""
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    with SlowLink(sp.ready["tcp_port"]) as link, \
            PoolClient(host="127.0.0.1", port=link.port, token=TCP_TOKEN, timeout=0.5) as c:
        keys = fresh_keys(2)
        assert c.put(keys[:1], [payload(keys[0], PAGE)]) == [PutStatus.STORED]
        link.hold_after(6)  # the next answer's length and two bytes of its body
        with pytest.raises(ConnectionLostError):
            c.lookup(keys)
        link.let_go()
        c.timeout = DEADLINE_S
        assert c.lookup(keys).prefix == 1
        assert c.get(keys[:1]) == [payload(keys[0], PAGE)]


def test_a_malformed_answer_is_dropped_and_the_next_call_is_served(sidecar_factory: Factory, tmp_path: Path) -> None:
    """A frame that is not an answer fails the call that read it, and leaves the buffer: the
    next call reads on (it had been decoded again by every later call)."""
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    with SlowLink(sp.ready["tcp_port"]) as link, \
            PoolClient(host="127.0.0.1", port=link.port, token=TCP_TOKEN, timeout=DEADLINE_S) as c:
        keys = fresh_keys(2)
        assert c.put(keys[:1], [payload(keys[0], PAGE)]) == [PutStatus.STORED]
        link.inject(encode(["not", "an", "answer"]))
        with pytest.raises(ProtocolError):
            c.lookup(keys)
        assert c.lookup(keys).prefix == 1
        assert c.lookup(keys).prefix == 1


def test_a_request_that_could_not_be_sent_whole_ends_the_connection(sidecar_factory: Factory,
                                                                    tmp_path: Path) -> None:
    """A send that times out part way leaves half a frame with the sidecar, which would read
    the client's next request as its rest: the client closes the connection instead."""
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    with SlowLink(sp.ready["tcp_port"]) as link, \
            PoolClient(host="127.0.0.1", port=link.port, token=TCP_TOKEN, timeout=0.5) as c:
        [key] = fresh_keys(1)
        link.hold_requests()
        with pytest.raises(ConnectionLostError):
            c.put([key], [payload(key, 32 << 20)])  # more than the sockets on the way hold
        link.let_go()
        assert c._sock.fileno() == -1  # noqa: SLF001 - closed, not used again
        with pytest.raises(ConnectionLostError):
            c.stats()
    with PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S) as other:
        assert other.lookup([key]).prefix == 0  # nothing of the torn frame was stored
