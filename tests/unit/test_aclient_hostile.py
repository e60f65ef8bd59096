"""The asyncio client against a sidecar that answers what was never asked, stops answering,
or is given up on mid-handshake: it drops a connection whose stream it cannot trust, keeps
nothing for calls whose callers gave up, and leaves no socket or task behind a cancelled
connect."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from kvpool_client import aclient
from kvpool_client.aclient import AsyncPoolClient
from kvpool_client.errors import ConnectionLostError
from kvpool_client.protocol import encode
from tests.unit.scripted_sidecar import Peer, scripted_sidecar

KEYS = [bytes([i]) * 48 for i in range(2)]
#: How long a test waits for what must come at once (a hang guard, far from any timing).
GUARD_S = 10.0


def silent(hello: bool, closed: threading.Event, read: threading.Event | None = None) -> Any:
    """A sidecar that (after HELLO, where ``hello``) reads every request and answers none;
    ``read`` is set at the first request read, ``closed`` once the client closed its end."""
    def script(peer: Peer) -> None:
        if hello:
            peer.hello()
        peer.sock.settimeout(GUARD_S)
        try:
            while True:
                peer.read()
                if read is not None:
                    read.set()
        except EOFError:
            closed.set()
        except socket.timeout:
            pass

    return script


async def test_a_cancelled_connect_leaves_no_socket_and_no_task() -> None:
    """A connect cancelled while it waited for HELLO's answer (an engine's own timeout around
    it) had kept its TCP socket open and its reader task running, for each attempt."""
    closed, read = threading.Event(), threading.Event()
    with scripted_sidecar(silent(False, closed, read)) as where:
        connecting = asyncio.create_task(AsyncPoolClient.connect(**where, timeout=60.0))
        assert await asyncio.to_thread(read.wait, GUARD_S)  # HELLO sent, its answer never comes
        connecting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await connecting
        assert await asyncio.to_thread(closed.wait, GUARD_S)  # before: the socket stayed open
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def test_calls_given_up_keep_nothing_while_their_answers_never_come() -> None:
    """Each call that timed out or was cancelled had kept its future until its answer came:
    forever, from a sidecar that stopped answering (200 calls: 200 futures)."""
    closed = threading.Event()
    with scripted_sidecar(silent(True, closed)) as where:
        c = await AsyncPoolClient.connect(**where, timeout=0.05)
        try:
            for _ in range(5):
                with pytest.raises(ConnectionLostError):
                    await c.lookup(KEYS)
            calls = [asyncio.create_task(c.get(KEYS)) for _ in range(200)]
            await asyncio.sleep(0)  # (each sends its request and waits)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            assert c._waiting == {}  # noqa: SLF001 - before: 205 futures, kept until the answers came
        finally:
            await c.close()


async def test_past_the_bound_on_requests_given_up_the_connection_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What an unanswered request leaves is small, but a sidecar that never answers had made
    it grow without bound: past :data:`~kvpool_client.aclient.MOST_ABANDONED` of them, the
    next call fails at once and the connection closes (its leases go back with it)."""
    monkeypatch.setattr(aclient, "MOST_ABANDONED", 8)
    closed = threading.Event()
    with scripted_sidecar(silent(True, closed)) as where:
        c = await AsyncPoolClient.connect(**where, timeout=60.0)
        try:
            calls = [asyncio.create_task(c.lookup(KEYS)) for _ in range(8)]
            await asyncio.sleep(0)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            with pytest.raises(ConnectionLostError):
                await asyncio.wait_for(c.lookup(KEYS), GUARD_S)  # (before: it waited its 60 s)
            assert await asyncio.to_thread(closed.wait, GUARD_S)
            with pytest.raises(ConnectionLostError):
                await c.lookup(KEYS)
        finally:
            await c.close()


def flooding(peer: Peer) -> None:
    """HELLO answered, then answers to a request never sent, as fast as the client takes them."""
    peer.hello()
    frames = encode([1_000_000, 0, None]) * 4096
    while True:
        peer.send(frames)  # (until the client closes: OSError ends the script)


def answering_twice(peer: Peer) -> None:
    """Each request answered twice (a sidecar that lost its place in the stream)."""
    peer.hello()
    while True:
        req = peer.read()
        peer.answer(req[1], [0, []])
        peer.answer(req[1], [0, []])


@pytest.mark.parametrize("script", [flooding, answering_twice])
async def test_an_answer_to_no_request_awaiting_one_drops_the_connection(script: Any) -> None:
    """Answers to requests never sent had been read and dropped one by one for as long as
    the sidecar sent them: the engine's event loop turned 67 times in 2 s under such a flood
    (30 ms a turn at the median), and each call waited out its timeout. A repeated answer
    had been taken for nothing amiss, on a stream that had lost its place."""
    with scripted_sidecar(script) as where:
        c = await AsyncPoolClient.connect(**where, timeout=60.0)
        try:
            with pytest.raises(ConnectionLostError):
                for _ in range(2):  # (the first call of the twice-answering sidecar is served)
                    await asyncio.wait_for(c.lookup(KEYS), GUARD_S)
            with pytest.raises(ConnectionLostError):
                await asyncio.wait_for(c.lookup(KEYS), GUARD_S)
        finally:
            await c.close()
