"""A client connecting while the sidecar's listen queue is full waits for room, within its
timeout: a Unix socket's non-blocking connect had failed at once (``EAGAIN``), so any process
that kept the queue full with connections it never greeted kept every engine out."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_client.aclient import AsyncPoolClient
from kvpool_client.client import PoolClient
from kvpool_client.errors import ConnectionLostError
from kvpool_client.unixconnect import connect_unix


@pytest.fixture
def full_queue(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A listening socket (never accepting by itself) whose queue is full."""
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)
    queued: list[socket.socket] = []
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    try:
        yield path, server
    finally:
        for c in queued:
            c.close()
        server.close()


def _waiting_in_the_kernel(thread: threading.Thread, limit: float = 10.0) -> bool:
    """Whether ``thread`` comes to wait for room in a listen queue (its kernel wait channel)
    within ``limit`` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with open(f"/proc/self/task/{thread.native_id}/wchan") as f:
            if f.read() == "unix_wait_for_peer":
                return True
        time.sleep(0.005)
    return False


def test_a_connect_waits_for_room_in_a_full_queue_and_gets_in(full_queue: tuple[str, socket.socket]) -> None:
    path, server = full_queue
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    failed: list[BaseException] = []

    def connect() -> None:
        try:
            connect_unix(sock, path, 30.0)
        except OSError as e:
            failed.append(e)

    thread = threading.Thread(target=connect)
    thread.start()
    try:
        assert _waiting_in_the_kernel(thread)
        server.accept()[0].close()  # room for one
    finally:
        thread.join()
    try:
        assert not failed and sock.getpeername() == path
        assert sock.gettimeout() is None  # (blocking, no send timeout left: the caller sets its own)
    finally:
        sock.close()


def test_a_full_queue_past_the_timeout_is_a_clear_connection_error(full_queue: tuple[str, socket.socket]) -> None:
    path, _ = full_queue
    with pytest.raises(ConnectionLostError, match="took no connection within"):
        PoolClient(path, timeout=0.2)


async def test_the_async_client_waits_for_room_too(full_queue: tuple[str, socket.socket]) -> None:
    """asyncio's connect had taken the failure for a connection made (the handshake then
    failed with ``EINVAL``)."""
    path, _ = full_queue
    with pytest.raises(ConnectionLostError, match="took no connection within"):
        await AsyncPoolClient.connect(path, timeout=0.2)
