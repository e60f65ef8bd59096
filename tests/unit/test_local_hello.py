"""The local API's HELLO on one connection object, with a transport that keeps what is
written (the answers a client has not read yet): what a HELLO maps, whatever came before it."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import weakref

import pytest

from kvpool_client.protocol import HEADER, PROTOCOL_VERSION, Op, encode
from kvpool_sidecar.api import connection
from kvpool_sidecar.api.connection import LocalConnection
from kvpool_sidecar.api.local import LocalLimits, LocalServer
from kvpool_sidecar.api.slots import STRANGERS_PER_UID, Slots
from kvpool_sidecar.tenancy import Credentials
from tests.unit.local_support import Clients, HeldTransport, api_lines, say_hello
from tests.unit.store_support import make_store


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
    monkeypatch.setattr(connection, "CLOSE_GRACE_S", 0.05)
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
    monkeypatch.setattr(connection, "CLOSE_GRACE_S", 0.05)
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
    live = Slots()
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


#: Two users' clients: the node's engines' and a process's that connects in a loop.
ENGINE, FLOODER = 1000, 2000


async def test_a_user_flooding_the_socket_displaces_only_its_own_connections() -> None:
    """A process that needs no credentials, connecting in a loop, kept the node's slots
    full of strangers; at the limit each new connection ended the oldest stranger of any
    user: an engine's, connected a moment before its HELLO came. Its own go first now, and
    the greeted ones never."""
    store = make_store()
    limits = LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n", max_connections=8)
    clients = Clients(LocalServer(store, limits, socket_path=None))
    try:
        greeted = [clients.connect(ENGINE) for _ in range(3)]
        for conn, transport in greeted:
            assert say_hello(conn, transport)[1] == 0
        joining, joining_t = clients.connect(ENGINE)  # its HELLO on the way
        flood = [clients.connect(FLOODER) for _ in range(50)]
        assert not any(t.closed for _, t in greeted) and not joining_t.closed
        assert say_hello(joining, joining_t)[1] == 0
        late, late_t = clients.connect(ENGINE)  # an engine connecting in the flood gets a slot
        assert not late._refused and say_hello(late, late_t)[1] == 0
        assert not any(t.closed for _, t in greeted)
        assert sum(not t.closed for _, t in flood) == limits.max_connections - 5  # the newest of its own
        assert all(not t.closed for _, t in flood[-(limits.max_connections - 5):])
    finally:
        clients.close()
        store.close()


async def test_a_user_holds_a_bounded_number_of_connections_that_have_not_said_hello() -> None:
    """Below the node's limit too: past ``STRANGERS_PER_UID`` strangers, a user's oldest
    goes for its new one, and another user's strangers stay."""
    store = make_store()
    limits = LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n")
    clients = Clients(LocalServer(store, limits, socket_path=None))
    try:
        joining, joining_t = clients.connect(ENGINE)
        flood = [clients.connect(FLOODER) for _ in range(STRANGERS_PER_UID + 20)]
        assert [t.closed for _, t in flood] == [True] * 20 + [False] * STRANGERS_PER_UID
        assert not joining_t.closed and say_hello(joining, joining_t)[1] == 0
    finally:
        clients.close()
        store.close()


@pytest.mark.parametrize("unix", [True, False], ids=["unix", "tcp"])
async def test_a_connection_costs_the_same_however_many_are_open(unix: bool) -> None:
    """Each accept had scanned every open connection twice, and each HELLO once more: a
    process connecting in a loop held the sidecar to about 1,400 accepts a second at
    ``api.max_connections`` 1024. The local API's lines run for two connections at the limit
    (each ending a stranger) and a HELLO are counted with 8 and 512 open: the same."""
    counts = []
    for n in (8, 512):
        store = make_store()
        limits = LocalLimits(max_frame_bytes=1 << 20, max_batch=64, node="n", max_connections=n,
                             tenant_reserve=1, tenants=("default", "b"))  # (HELLO counts the tenants' slots)
        clients = Clients(LocalServer(store, limits, socket_path=None))
        try:
            for _ in range(n // 2):
                assert say_hello(*clients.connect(ENGINE))[1] == 0
            users = iter(range(FLOODER, FLOODER + 2 * n))  # strangers of as many users (else: none)
            while len(clients.made) < n:
                clients.connect(next(users) if unix else None)
            clients.connect(next(users) if unix else None)  # (the first at the limit: its warning logged)
            with api_lines() as lines:
                clients.connect(next(users) if unix else None)
                assert say_hello(*clients.connect(ENGINE))[1] == 0
                counts.append(lines())
            assert sum(t.closed for _, t in clients.made) == 3  # the oldest strangers made room
        finally:
            clients.close()
            store.close()
    assert counts[0] == counts[1], counts
