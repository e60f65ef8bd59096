"""A client's calls end by their deadlines whatever the sidecar does: the handshake counts as
one call, and closing a connection to a stuck sidecar does not wait for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool_client.client import AsyncPoolClient, PoolClient
from kvpool_client.errors import ConnectionLostError
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import (
    DEADLINE_S, TCP_TOKEN, SlowLink, StallingSocket, fresh_keys, payload, tcp_tenants,
)

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]

#: The clients' timeout, and the pause before each step of the stalling handshake (each
#: within the timeout; the three of them, or two and the timeout, well past it).
TIMEOUT_S = 1.0
PAUSE_S = 0.9


def test_the_handshake_of_the_blocking_client_ends_by_one_timeout(tmp_path: Path) -> None:
    """Each step had waited a timeout of its own: 2.8 s here for a timeout of 1 s."""
    with StallingSocket(str(tmp_path / "kvpool.sock"), PAUSE_S) as fake:
        start = time.monotonic()
        with pytest.raises(ConnectionLostError):
            PoolClient(fake.path, timeout=TIMEOUT_S)
        assert time.monotonic() - start < 2 * TIMEOUT_S


def test_the_handshake_of_the_async_client_ends_by_one_timeout(tmp_path: Path) -> None:
    async def run() -> None:
        with StallingSocket(str(tmp_path / "kvpool.sock"), PAUSE_S) as fake:
            start = time.monotonic()
            with pytest.raises(ConnectionLostError):
                await AsyncPoolClient.connect(fake.path, timeout=TIMEOUT_S)
            assert time.monotonic() - start < 2 * TIMEOUT_S

    asyncio.run(run())


def test_the_async_client_closes_with_requests_a_stuck_sidecar_never_took(sidecar_factory: Factory,
                                                                          tmp_path: Path) -> None:
    """A put the sidecar never read stays in the client's buffer after its timeout; closing
    had waited for the sidecar to take it, for as long as the sidecar stayed stuck."""
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    [key] = fresh_keys(1)

    async def run(link: SlowLink) -> None:
        c = await AsyncPoolClient.connect(host="127.0.0.1", port=link.port, token=TCP_TOKEN, timeout=TIMEOUT_S)
        link.hold_requests()
        with pytest.raises(ConnectionLostError):
            await c.put([key], [payload(key, 16 << 20)])  # more than the sockets on the way hold
        await asyncio.wait_for(c.close(), DEADLINE_S)  # (a hang fails here)
        link.let_go()

    with SlowLink(sp.ready["tcp_port"]) as link:
        asyncio.run(run(link))
    with PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S) as other:
        assert other.lookup([key]).prefix == 0  # nothing of the torn put was stored
        assert other.put([key], [payload(key, 4096)]) == [PutStatus.STORED]  # and it serves on
