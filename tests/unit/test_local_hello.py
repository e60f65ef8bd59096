"""The local API's HELLO on one connection object, with a transport that keeps what is
written (the answers a client has not read yet): what a HELLO maps, whatever came before it."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import weakref
from typing import Any

import pytest

from kvpool_client.protocol import HEADER, PROTOCOL_VERSION, Op, decode, encode
from kvpool_sidecar.api import local
from kvpool_sidecar.api.local import LocalConnection, LocalLimits
from kvpool_sidecar.tenancy import Credentials
from tests.unit.store_support import make_store


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


async def test_a_hello_behind_unread_answers_leaves_the_connection_unmapped_for_the_next_hello() -> None:
    """The arena's descriptor goes on the socket before the first HELLO's answer; a HELLO
    behind answers the client has not read cannot send it (it would overtake them) and is
    refused. A second HELLO must not then find the connection mapped without a descriptor,
    nor able to take GPU-tier leases."""
    store = make_store()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn = LocalConnection(store, LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n"), shm=True,
                               raw=ours, cred=Credentials(os.getpid(), os.getuid(), os.getgid()))
        transport = HeldTransport()
        conn.connection_made(transport)
        conn.data_received(encode([int(Op.STATS), 7]) + encode([int(Op.HELLO), 8, PROTOCOL_VERSION, "default"]))
        first = transport.read()
        assert [a[0] for a in first] == [7, 8] and first[1][1] != 0, first  # "say HELLO first", then refused
        conn.data_received(encode([int(Op.HELLO), 9, PROTOCOL_VERSION, "default"]))
        (again,) = transport.read()
        assert again[:2] == [9, 0], again
        assert again[2]["shm"] is False and again[2]["device_reads"] is False, again
        assert not conn.shm
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing was sent on the socket, a descriptor least of all
            theirs.recv(16)
    finally:
        conn.connection_lost(None)
        ours.close()
        theirs.close()


async def test_a_connection_closed_for_a_stalled_or_bad_frame_holds_no_inbound_bytes() -> None:
    """What a connection buffers of an unfinished request counts against the node's bound
    until the connection closes for it, not until its transport is gone (a client that
    does not read can keep that from happening)."""
    store = make_store()
    conns = []
    try:
        for stall in (True, False):
            conn = LocalConnection(store, LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n"), shm=False)
            conns.append(conn)
            conn.connection_made(HeldTransport())
            frame = HEADER.pack(1000) + b"\xc1" * 1000  # (0xc1 is never msgpack)
            conn.data_received(frame[:500])
            assert conn._inbound.total == 500
            if stall:
                conn._frame_stalled()
            else:
                conn.data_received(frame[500:])
            assert conn._closed and conn._inbound.total == 0
    finally:
        for conn in conns:
            conn.connection_lost(None)


async def test_a_connection_closed_with_answers_its_client_does_not_read_is_aborted_after_a_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad frame closes the connection once its answer (the reason) is flushed; a client
    that never reads it had kept the connection, its slot and its session for good."""
    monkeypatch.setattr(local, "CLOSE_GRACE_S", 0.05)
    conn = LocalConnection(make_store(), LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n"), shm=False)
    transport = HeldTransport()
    conn.connection_made(transport)
    try:
        conn.data_received(encode([int(Op.HELLO), 1, PROTOCOL_VERSION, "default"]) + HEADER.pack(1 << 30))
        assert transport.closed and not transport.aborted  # closed, its answers waiting to be read
        assert transport.read()[-1][1] != 0  # the reason
        await asyncio.sleep(0.2)
        assert transport.aborted
    finally:
        conn.connection_lost(None)


async def test_a_connection_gone_within_the_grace_is_not_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "CLOSE_GRACE_S", 0.05)
    conn = LocalConnection(make_store(), LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n"), shm=False)
    transport = HeldTransport()
    conn.connection_made(transport)
    conn.data_received(HEADER.pack(1 << 30))
    assert transport.closed
    conn.connection_lost(None)  # the client read the reason and went
    await asyncio.sleep(0.2)
    assert not transport.aborted


async def test_a_closed_connection_is_freed_without_the_cycle_collector() -> None:
    """The daemon runs a full collection once an hour (:mod:`kvpool_sidecar.collector`): a
    closed connection kept by a reference cycle would hold its buffer (an unfinished request
    of up to ``max_frame_bytes``) until then. Reference counting alone must free it."""
    store = make_store()
    conn = LocalConnection(store, LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n"), shm=False)
    conn.connection_made(HeldTransport())
    conn.data_received(encode([int(Op.HELLO), 1, PROTOCOL_VERSION, "default"]) + HEADER.pack(100_000) + b"x" * 5000)
    ref = weakref.ref(conn)
    gc.collect()
    gc.disable()
    try:
        conn.connection_lost(None)
        del conn
        await asyncio.sleep(0)  # (what the loop was asked to call soon runs)
        assert ref() is None, gc.get_referrers(ref())
    finally:
        gc.enable()


async def test_a_connection_being_closed_gives_its_slot_to_a_new_one_at_the_limit() -> None:
    """A connection closed after a bad frame waits up to ``CLOSE_GRACE_S`` for its client to
    read its last answers. At the connection limit it had kept its slot (only strangers not
    yet closed made room), and clients that never read kept every engine out (a review: 58
    of 79 refused at ``max_connections`` 64). The oldest connection being closed now goes at
    once, its answers dropped."""
    store = make_store()
    limits = LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n", max_connections=2)
    live: set[LocalConnection] = set()
    held = []
    try:
        for _ in range(2):
            conn = LocalConnection(store, limits, shm=False, live=live)
            transport = HeldTransport()
            conn.connection_made(transport)
            conn.data_received(HEADER.pack(1 << 20))  # a frame no client may send before HELLO
            assert transport.closed and not transport.aborted and conn in live  # closing, its answer unread
            held.append((conn, transport))
        newcomer = LocalConnection(store, limits, shm=False, live=live)
        newcomer.connection_made(HeldTransport())
        assert not newcomer._refused and newcomer in live
        assert held[0][1].aborted and held[0][0] not in live  # the oldest being closed went
        assert not held[1][1].aborted
    finally:
        store.close()
