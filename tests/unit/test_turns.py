"""Turns of the event loop between tenants (:mod:`kvpool_sidecar.api.turns`): a tenant with
many connections cannot make another tenant's requests wait behind all of its own."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable
from typing import Any

import pytest

from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_client.protocol import HEADER, PROTOCOL_VERSION, Op, PutStatus, decode, encode
from kvpool_sidecar.api import reads, writes
from kvpool_sidecar.api.local import LocalLimits, LocalServer
from kvpool_sidecar.api.turns import TenantTurns
from kvpool_sidecar.tenancy import KeySpaces, TenantAccess
from tests.unit.store_support import close_store, make_store

TOKENS = {"default": b"t" * 32, "a": b"a" * 32, "b": b"b" * 32}
#: Each request (or step of one run as a task) costs one tick of the counting clock below;
#: a tenant's turn is this many.
TURN = 3
FLOOD_CONNECTIONS = 8
FLOOD_FRAMES = 20


def _counting_clock() -> Callable[[], float]:
    """A clock that advances by a tick each time it is read: a request (or step), timed by
    reading it before and after, costs one tick."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


class Node:
    """A store of tenants ``a`` and ``b`` (and ``default``) behind a real TCP listener."""

    def __init__(self) -> None:
        names = list(TOKENS)
        self.store = make_store(spaces=names)
        self.limits = LocalLimits(8 << 20, 4096, "n", spaces=KeySpaces({n: n for n in names}),
                                  access=TenantAccess.with_tokens(TOKENS))
        self.server = LocalServer(self.store, self.limits, socket_path=None, tcp=("127.0.0.1", 0))
        self.server.turns = TenantTurns(turn_s=TURN, clock=_counting_clock())
        self.socks: list[socket.socket] = []

    async def connect(self, tenant: str) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        self.socks.append(sock)
        assert self.server.tcp_port is not None
        await loop.sock_connect(sock, ("127.0.0.1", self.server.tcp_port))
        await loop.sock_sendall(sock, encode([int(Op.HELLO), 1, PROTOCOL_VERSION, tenant, TOKENS[tenant]]))
        [answer] = await _answers(sock, 1)
        assert answer[1] == 0, answer
        return sock

    def close(self) -> None:
        for s in self.socks:
            s.close()
        close_store(self.store)


async def _answers(sock: socket.socket, n: int) -> list[list[Any]]:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    out: list[list[Any]] = []
    while len(out) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)
        assert chunk, "the sidecar closed the connection"
        buf += chunk
        while len(buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + length:
                break
            out.append(decode(bytes(buf[HEADER.size : HEADER.size + length])))
            del buf[: HEADER.size + length]
    return out


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * (RAW_KEY_BYTES // 4)


@pytest.fixture
async def node() -> Any:
    n = Node()
    await n.server.start()
    try:
        yield n
    finally:
        await n.server.stop()
        n.close()


@pytest.mark.parametrize("op", ["lookup", "put_inline"])
async def test_a_tenant_with_many_connections_takes_a_turn_of_the_loop_not_all_of_it(
        node: Node, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    """Tenant b pipelines requests on 8 connections, then tenant a sends one: a's request is
    served after at most about two of b's turns, not after every request b had sent (a
    lookup is answered at once, an inline put runs as a task, step by step)."""
    served: list[str] = []
    if op == "lookup":
        real_lookup = reads.ReadRequests.lookup

        def noting_lookup(self: reads.ReadRequests, *args: Any) -> Any:
            served.append(self._client.active_session.tenant)
            return real_lookup(self, *args)

        monkeypatch.setattr(reads.ReadRequests, "lookup", noting_lookup)
    else:
        real_put = writes.WriteRequests.put_inline

        async def noting_put(self: writes.WriteRequests, *args: Any) -> Any:
            await asyncio.sleep(0)  # a step of its own before it is served (as room may take)
            served.append(self._client.active_session.tenant)
            return await real_put(self, *args)

        monkeypatch.setattr(writes.WriteRequests, "put_inline", noting_put)

    def frame(rid: int) -> bytes:
        if op == "lookup":
            return encode([int(Op.LOOKUP), rid, [_key(rid)]])
        return encode([int(Op.PUT_INLINE), rid, [[_key(rid), b"x" * 64, 0, None]]])

    flood = [await node.connect("b") for _ in range(FLOOD_CONNECTIONS)]
    victim = await node.connect("a")
    loop = asyncio.get_running_loop()
    rids = itertools.count(10)
    for sock in flood:  # all of it sent before the sidecar reads any (nothing here yields)
        await loop.sock_sendall(sock, b"".join(frame(next(rids)) for _ in range(FLOOD_FRAMES)))
    await loop.sock_sendall(victim, frame(1))
    [answer] = await _answers(victim, 1)
    assert answer[0] == 1 and answer[1] == 0, answer
    for sock in flood:  # every one of b's requests is served too
        got = await _answers(sock, FLOOD_FRAMES)
        assert all(a[1] == 0 for a in got)
        if op == "put_inline":
            assert all(a[2] == [int(PutStatus.STORED)] for a in got)
    before = served.index("a")
    assert served.count("b") == FLOOD_CONNECTIONS * FLOOD_FRAMES
    # without turns, a waited behind most of b's 160 requests
    assert before <= 2 * (TURN + FLOOD_CONNECTIONS), served[: before + 1]
    assert node.server.turns.ended > 0


async def test_a_tenants_connections_take_its_turns_in_turn(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within a tenant's turns, its connections go in turn: the one served in a turn waits
    behind those that were not (the first connection read had taken every turn)."""
    served: list[int] = []
    real_lookup = reads.ReadRequests.lookup

    def noting_lookup(self: reads.ReadRequests, keys: Any) -> Any:
        served.append(keys[0][0])  # which connection (the key's first byte)
        return real_lookup(self, keys)

    monkeypatch.setattr(reads.ReadRequests, "lookup", noting_lookup)
    conns = [await node.connect("b") for _ in range(3)]
    loop = asyncio.get_running_loop()
    for c, sock in enumerate(conns):
        await loop.sock_sendall(sock, b"".join(encode([int(Op.LOOKUP), r, [bytes([c]) * RAW_KEY_BYTES]])
                                               for r in range(1, FLOOD_FRAMES + 1)))
    for sock in conns:
        assert len(await _answers(sock, FLOOD_FRAMES)) == FLOOD_FRAMES
    assert sorted(served) == sorted([0, 1, 2] * FLOOD_FRAMES)
    assert set(served[: 3 * TURN]) == {0, 1, 2}, served


async def test_a_tenant_alone_is_served_whole_turn_after_turn() -> None:
    """A tenant past its share waits for the next turn, which comes once the loop has
    served what was ready: alone, it loses nothing but turns."""
    turns = TenantTurns(turn_s=TURN, clock=_counting_clock())
    resumed: list[int] = []
    for _ in range(TURN):
        turns.charge("b", 1)
    assert turns.over("b") and not turns.over("a")
    turns.wait(lambda: resumed.append(1), True)

    async def work() -> str:
        for _ in range(5):
            await asyncio.sleep(0)
        return "done"

    assert await asyncio.wait_for(turns.charged("b", work()), 5) == "done"
    assert resumed == [1]
    assert turns.ended >= 1


async def test_a_task_cancelled_while_it_waits_for_its_turn_is_told_so() -> None:
    """Cancelling a request that waits for its tenant's next turn cancels the request (its
    clean-up runs where it was), not the turn other requests wait for."""
    turns = TenantTurns(turn_s=TURN, clock=_counting_clock())
    turns._ends = True  # this turn ends when the test says (the loop would end it at once)
    cleaned: list[str] = []
    waiting = asyncio.Event()

    async def work(name: str) -> str:
        try:
            for _ in range(TURN):  # its tenant is past its share: its next step waits
                turns.charge("b", 1)
            waiting.set()
            await asyncio.sleep(0)
            return name
        finally:
            cleaned.append(name)

    first = asyncio.ensure_future(turns.charged("b", work("first")))
    await waiting.wait()
    second = asyncio.ensure_future(turns.charged("b", work("second")))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not first.done() and not second.done() and cleaned == []
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert cleaned == ["first"]  # told where it waited
    turns._end()
    assert await asyncio.wait_for(second, 5) == "second"
    assert cleaned == ["first", "second"]
