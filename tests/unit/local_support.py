"""Helpers for tests that drive local API connections in process: a transport that keeps
what is written (the answers a client has not read yet), connections made as a client of a
given user, their HELLOs, and what the connection code runs, counted."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from kvpool_client.protocol import HEADER, PROTOCOL_VERSION, Op, decode, encode
from kvpool_sidecar.api.connection import LocalConnection
from kvpool_sidecar.api.local import LocalServer
from kvpool_sidecar.api.turns import TenantTurns
from kvpool_sidecar.tenancy import Credentials

#: The directory of the local API's modules, whose lines :func:`api_lines` counts.
API_DIR = os.path.dirname(sys.modules[LocalConnection.__module__].__file__ or "")


class HeldTransport(asyncio.Transport):
    """Keeps every answer until :meth:`read` (a client that has not read them yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.closed = False
        self.aborted = False

    def write(self, data: Any) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return len(self.data)

    def read(self) -> list[list[Any]]:
        out, pos = [], 0
        while pos < len(self.data):
            (n,) = HEADER.unpack_from(self.data, pos)
            out.append(decode(bytes(self.data[pos + HEADER.size : pos + HEADER.size + n])))
            pos += HEADER.size + n
        self.data.clear()
        return out

    def close(self) -> None:
        self.closed = True  # (and the answers wait until they are read: no connection_lost yet)

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


class Clients:
    """Connections made to ``server`` as it makes them for its Unix socket, each as a client
    of a given uid (the kernel's word for it, over a socket pair), with their transports,
    served without waiting for turns of the loop."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        # no time passes on the turns' clock: every request is served as it comes (strangers
        # share one turn, which a test's burst of HELLOs would spend)
        server.turns = TenantTurns(clock=lambda: 0.0)
        self.made: list[tuple[LocalConnection, HeldTransport]] = []
        self._sockets: list[socket.socket] = []

    def connect(self, uid: int | None) -> tuple[LocalConnection, HeldTransport]:
        """A new connection (``uid`` None: one without a Unix socket, as over TCP)."""
        if uid is None:
            conn = self.server._factory(False)()  # noqa: SLF001
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sockets += [ours, theirs]
            conn = self.server._factory(False, ours, Credentials(os.getpid(), uid, uid))()  # noqa: SLF001
        transport = HeldTransport()
        conn.connection_made(transport)
        self.made.append((conn, transport))
        return conn, transport

    def close(self) -> None:
        for conn, _ in self.made:
            conn.connection_lost(None)
        for s in self._sockets:
            s.close()


def say_hello(conn: LocalConnection, transport: HeldTransport, tenant: str = "default") -> list[Any]:
    """``conn``'s client says HELLO as ``tenant``; its answer (the last one written)."""
    conn.data_received(encode([int(Op.HELLO), 1, PROTOCOL_VERSION, tenant]))
    answers = transport.read()
    assert answers, "no answer to HELLO"
    return answers[-1]


@contextmanager
def api_lines() -> Iterator[Callable[[], int]]:
    """Count the lines of the local API's modules run in this thread (a genexpr over every
    connection runs one per connection): the count so far, from the function yielded."""
    count = 0
    before = sys.gettrace()

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.startswith(API_DIR):
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        yield lambda: count
    finally:
        sys.settrace(before)
