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
from kvpool_client.protocol import PROTOCOL_VERSION, Op, PutStatus, encode
from kvpool_sidecar.api import connection, dispatch, reads, writes
from kvpool_sidecar.api.local import LocalLimits, LocalServer
from kvpool_sidecar.api.turns import TenantTurns
from kvpool_sidecar.tenancy import KeySpaces, TenantAccess
from tests.unit.store_support import close_store, make_store, read_answers

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

    async def stranger(self) -> socket.socket:
        """A connection that has not said HELLO."""
        sock = socket.socket()
        sock.setblocking(False)
        self.socks.append(sock)
        assert self.server.tcp_port is not None
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.server.tcp_port))
        return sock

    async def connect(self, tenant: str) -> socket.socket:
        """A connection of ``tenant``, its HELLO answered."""
        sock = await self.stranger()
        await asyncio.get_running_loop().sock_sendall(
            sock, encode([int(Op.HELLO), 1, PROTOCOL_VERSION, tenant, TOKENS[tenant]]))
        [answer] = await read_answers(sock, 1)
        assert answer[1] == 0, answer
        return sock

    def close(self) -> None:
        for s in self.socks:
            s.close()
        close_store(self.store)


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
    [answer] = await read_answers(victim, 1)
    assert answer[0] == 1 and answer[1] == 0, answer
    for sock in flood:  # every one of b's requests is served too
        got = await read_answers(sock, FLOOD_FRAMES)
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
        assert len(await read_answers(sock, FLOOD_FRAMES)) == FLOOD_FRAMES
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
    turns._ends = asyncio.get_running_loop()  # this turn ends when the test says (the loop would end it at once)
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


async def test_a_tenants_requests_run_as_tasks_get_turns_beside_its_pipelining_connections(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request run as a task (an inline put) waits its turn in line with the tenant's
    connections: connections resumed at each turn's start had used the turn up before the
    waiting tasks ran, so a tenant's own put waited until its lookups stopped coming."""
    served: list[str] = []
    real_lookup = reads.ReadRequests.lookup
    real_put = writes.WriteRequests.put_inline

    def noting_lookup(self: reads.ReadRequests, *args: Any) -> Any:
        served.append("lookup")
        return real_lookup(self, *args)

    async def noting_put(self: writes.WriteRequests, *args: Any) -> Any:
        for _ in range(4):  # steps of its own, each to be charged and to wait its turn
            await asyncio.sleep(0)
        served.append("put")
        return await real_put(self, *args)

    monkeypatch.setattr(reads.ReadRequests, "lookup", noting_lookup)
    monkeypatch.setattr(writes.WriteRequests, "put_inline", noting_put)
    flood = [await node.connect("b") for _ in range(FLOOD_CONNECTIONS)]
    writer = await node.connect("b")
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(writer, encode([int(Op.PUT_INLINE), 1, [[_key(1), b"x" * 64, 0, None]]]))
    for sock in flood:
        await loop.sock_sendall(sock, b"".join(encode([int(Op.LOOKUP), r, [_key(r)]]) for r in range(2, 2 + 4 * FLOOD_FRAMES)))
    [answer] = await read_answers(writer, 1)
    assert answer[1] == 0 and answer[2] == [int(PutStatus.STORED)], answer
    for sock in flood:
        assert len(await read_answers(sock, 4 * FLOOD_FRAMES)) == 4 * FLOOD_FRAMES
    assert served.count("lookup") == FLOOD_CONNECTIONS * 4 * FLOOD_FRAMES
    # the put's steps took turns with the lookups, it did not wait for all of them
    assert served.index("put") <= 8 * (TURN + FLOOD_CONNECTIONS), served.index("put")


async def test_connections_that_have_not_said_hello_share_one_turn(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests before HELLO (answered "say HELLO first") are charged to one turn that all
    such connections share: they need no token, and had not been charged at all, so a
    client's HELLO waited behind every stranger's frames."""
    from kvpool_sidecar.api.admission import Admission
    from kvpool_sidecar.api.dispatch import Requests

    refused = [0]
    at_hello: list[int] = []
    real_error, real_hello = Requests.error, Admission.hello

    def counting_error(self: Requests, *args: Any) -> None:
        refused[0] += 1
        real_error(self, *args)

    def noting_hello(self: Admission, *args: Any) -> Any:
        at_hello.append(refused[0])
        return real_hello(self, *args)

    monkeypatch.setattr(Requests, "error", counting_error)
    monkeypatch.setattr(Admission, "hello", noting_hello)
    loop = asyncio.get_running_loop()
    *strangers, victim = [await node.stranger() for _ in range(FLOOD_CONNECTIONS + 1)]  # then the client
    frames = dispatch.PRE_HELLO_REQUESTS - 1  # (all a stranger may send before it is closed)
    for sock in strangers:
        await loop.sock_sendall(sock, b"".join(encode([int(Op.LOOKUP), r, [_key(r)]]) for r in range(1, frames + 1)))
    await loop.sock_sendall(victim, encode([int(Op.HELLO), 1, PROTOCOL_VERSION, "a", TOKENS["a"]]))
    [hello] = await read_answers(victim, 1)
    assert hello[1] == 0, hello
    for sock in strangers:
        got = await read_answers(sock, frames)
        assert all(a[1] != 0 for a in got)  # each one refused: say HELLO first
    assert refused[0] == FLOOD_CONNECTIONS * frames
    # the client's HELLO took its turn among the strangers' frames, not after all of them
    assert at_hello[0] <= 2 * (TURN + FLOOD_CONNECTIONS), at_hello


async def test_a_client_that_sends_requests_before_hello_is_closed_after_a_few(node: Node) -> None:
    """Each request before HELLO is answered "say HELLO first"; past
    :data:`~kvpool_sidecar.api.dispatch.PRE_HELLO_REQUESTS` of them the connection closes, and
    what it sent after them is not read: strangers that each pipelined 400 had kept a new
    engine's HELLO waiting 1.2 s at the median in the turn they share (a review)."""
    loop = asyncio.get_running_loop()
    limit = dispatch.PRE_HELLO_REQUESTS
    for frame in (lambda r: encode([int(Op.LOOKUP), r, [_key(r)]]),
                  lambda r: encode([int(Op.HELLO), r, 999, "a", TOKENS["a"]]),  # HELLOs that fail count too
                  lambda r: encode([int(Op.HELLO), r])):
        stranger = await node.stranger()
        await loop.sock_sendall(stranger, b"".join(frame(r) for r in range(1, 400)))
        got = await read_answers(stranger, limit)
        assert [a[0] for a in got] == list(range(1, limit + 1)) and all(a[1] != 0 for a in got), got
        async with asyncio.timeout(5):
            while chunk := await loop.sock_recv(stranger, 1 << 16):  # nothing more: closed
                raise AssertionError(f"answered past the limit: {chunk[:64]!r}")
    client = await node.connect("a")  # a client that says HELLO first is served as ever
    await loop.sock_sendall(client, encode([int(Op.LOOKUP), 5, [_key(5)]]))
    [answer] = await read_answers(client, 1)
    assert answer[:2] == [5, 0]


async def test_a_frame_before_hello_that_decodes_into_many_objects_is_refused_unbuilt(node: Node) -> None:
    """A HELLO is a list of five: a frame from a client that has not said HELLO with more
    objects than a few is refused before it is built and the connection closed (16 KiB of
    empty lists had held the loop 1.2 ms a frame, for clients that need no token)."""
    loop = asyncio.get_running_loop()
    sock = await node.stranger()
    await loop.sock_sendall(sock, encode([int(Op.HELLO), 1, [[[]] * 8] * 8]))
    [answer] = await read_answers(sock, 1)
    assert answer[1] != 0
    assert await asyncio.wait_for(loop.sock_recv(sock, 1024), 10) == b""  # closed
    good = await node.connect("a")  # and others are served
    await loop.sock_sendall(good, encode([int(Op.LOOKUP), 2, [_key(1)]]))
    [answer] = await read_answers(good, 1)
    assert answer[1] == 0


async def test_decoding_a_frame_is_charged_to_its_tenant(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame's decoding is part of what its tenant takes of the loop: a frame that is
    costly to decode but refused at once (an unknown operation) had cost its tenant nothing."""
    from kvpool_sidecar.api import connection

    charged: list[tuple[str, float]] = []
    turns = node.server.turns
    real_charge, real_decode, clock = turns.charge, connection.decode, turns.clock

    def noting_charge(tenant: str, seconds: float) -> None:
        charged.append((tenant, seconds))
        real_charge(tenant, seconds)

    def slow_decode(*args: Any, **kw: Any) -> Any:
        for _ in range(100):  # a hundred ticks of the counting clock
            clock()
        return real_decode(*args, **kw)

    monkeypatch.setattr(turns, "charge", noting_charge)
    monkeypatch.setattr(connection, "decode", slow_decode)
    sock = await node.connect("b")
    await asyncio.get_running_loop().sock_sendall(sock, b"".join(encode([99, r]) for r in range(1, 6)))
    got = await read_answers(sock, 5)
    assert all(a[1] != 0 for a in got)  # unknown operation
    assert sum(s for t, s in charged if t == "b") >= 5 * 100


async def test_what_a_tenant_owes_counts_turn_after_turn_until_turns_pay_it() -> None:
    """Work done on a tenant's behalf outside its requests (the policy's bookkeeping its
    requests queued) is owed: it counts in what the tenant spends, a turn's share paid each turn;
    inside the tenant's own request it is charged already, inside another's it is no longer
    that tenant's. Alone, a tenant that owes does not wait: there is no one to wait for."""
    turns = TenantTurns(turn_s=TURN, clock=_counting_clock())
    turns.owe("a", 2.5 * TURN)
    assert turns.owes("a") == 2.5 * TURN and not turns.over("a")  # alone
    turns.charge("b", 1)  # another tenant is served in this turn
    assert turns.over("a") and not turns.over("b")
    resumed: list[int] = []
    turns.wait(lambda: resumed.append(turns.ended), True)
    await asyncio.sleep(0)
    assert resumed == [] and turns.over("a")  # b was served in the last turn: a waits on
    for _ in range(10):
        await asyncio.sleep(0)
    assert turns.owes("a") == 0 and not turns.over("a")  # paid by the turns that followed, with no one charged
    assert resumed and turns.ended >= 3

    turns.payer = "a"  # within a's own request: its step is timed whole
    turns.owe("a", 5 * TURN)
    assert turns.owes("a") == 0
    turns.payer = "b"  # within b's request: a's, not b's
    turns.charge("b", 2)
    turns.owe("a", 2)
    assert not turns.over("b") and turns.owes("a") == 2
    turns.payer = None


async def test_a_tenants_policy_bookkeeping_is_its_own_to_pay(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tenant b puts 32 blocks, then pipelines lookups; tenant a sends as many lookups at
    once. The policy's bookkeeping of b's put runs after its answer and costs a tick a
    notification here: b owes it, and waits turns while a is served (it had been charged to
    no one: a tenant reading 4,096 blocks at a time on four connections made another's 64-key
    lookups wait 9 ms at the median, against 0.6 ms now)."""
    now = [0.0]
    inner = node.store.policy.inner
    for name in ("admit", "inserted"):
        def slow(tier: str, meta: Any, real: Any = getattr(inner, name)) -> Any:
            now[0] += 1
            return real(tier, meta)

        monkeypatch.setattr(inner, name, slow)
    node.store.policy.clock = lambda: now[0]
    served: list[str] = []
    real_lookup = reads.ReadRequests.lookup

    def noting_lookup(self: reads.ReadRequests, *args: Any) -> Any:
        served.append(self._client.active_session.tenant)
        return real_lookup(self, *args)

    monkeypatch.setattr(reads.ReadRequests, "lookup", noting_lookup)
    writer, reader = await node.connect("b"), await node.connect("a")
    loop = asyncio.get_running_loop()
    put = encode([int(Op.PUT_INLINE), 1, [[_key(i), b"x" * 64, 0, None] for i in range(32)]])
    await loop.sock_sendall(writer, put)
    [answer] = await read_answers(writer, 1)
    assert answer[1] == 0 and answer[2] == [int(PutStatus.STORED)] * 32
    await loop.sock_sendall(writer, b"".join(encode([int(Op.LOOKUP), r, [_key(r)]]) for r in range(2, 12)))
    await loop.sock_sendall(reader, b"".join(encode([int(Op.LOOKUP), r, [_key(r)]]) for r in range(2, 12)))
    assert len(await read_answers(reader, 10)) == 10
    assert len(await read_answers(writer, 10)) == 10
    assert served.count("a") == served.count("b") == 10
    # what b owed came before its lookups: a's went first, but for b's one turn's worth at most
    # (turn by turn, each tenant's three had alternated)
    assert served[:10].count("a") >= 10 - TURN, served


def test_a_turn_comes_in_a_loop_after_one_that_closed_with_a_turns_end_pending() -> None:
    """A turn's end scheduled in a loop that closed never runs: turns used by a second loop
    (a server started again) still come (what a tenant owes kept one pending to the end)."""
    turns = TenantTurns(turn_s=TURN, clock=_counting_clock())

    async def first() -> None:
        turns.charge("b", 1)
        turns.owe("a", 100 * TURN)

    asyncio.run(first())  # closed with an end pending, what a owes unpaid
    assert turns.owes("a") > 0

    async def second() -> bool:
        resumed = asyncio.Event()
        turns.wait(resumed.set, True)
        await asyncio.wait_for(resumed.wait(), 5)
        return True

    assert asyncio.run(second())


async def test_a_closed_connections_session_closes_in_slices_between_other_tenants_requests(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection's session was closed in one callback, charged to no one: a client that
    held 262,144 write leases stalled the loop for 1.5 s as it closed (a review). Now
    :data:`CLOSE_SLICE` of each kind a step, each step its tenant's: another tenant's lookup
    is served while the session still holds pins, and once it is closed every pin is gone."""
    monkeypatch.setattr(connection, "CLOSE_SLICE", 4)
    held: list[int] = []
    real_lookup = reads.ReadRequests.lookup

    def noting_lookup(self: reads.ReadRequests, *args: Any) -> Any:
        held.append(sum(len(s.pins) for s in node.store._sessions.values() if s.tenant == "b"))  # noqa: SLF001
        return real_lookup(self, *args)

    monkeypatch.setattr(reads.ReadRequests, "lookup", noting_lookup)
    a, b = await node.connect("a"), await node.connect("b")
    loop = asyncio.get_running_loop()
    n = 400
    await loop.sock_sendall(b, encode([int(Op.PUT_INLINE), 2, [[_key(i), b"x", -1, None] for i in range(n)]]))
    [put] = await read_answers(b, 1)
    assert put[2] == [int(PutStatus.STORED)] * n, put
    await loop.sock_sendall(b, encode([int(Op.PIN), 3, [_key(i) for i in range(n)]]))
    [pinned] = await read_answers(b, 1)
    assert pinned[1] == 0 and pinned[2] == n, pinned
    b.close()
    node.socks.remove(b)
    async with asyncio.timeout(10):
        while not node.server.closing:  # the sidecar saw the close: the rest goes a slice a step
            await asyncio.sleep(0)
    await loop.sock_sendall(a, encode([int(Op.LOOKUP), 4, [_key(0)]]))
    [answer] = await read_answers(a, 1)
    assert answer[1] == 0
    assert held and held[-1] > 0  # served while b's session was closing
    await asyncio.wait(list(node.server.closing))
    assert not [s for s in node.store._sessions.values() if s.tenant == "b"]  # noqa: SLF001
    assert not node.store._pins.pinners  # noqa: SLF001
    assert all(e.pins == 0 for e in node.store._entries.values())  # noqa: SLF001
