"""The local API under pressure: clients that do not read their answers, and draining on stop."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_client.protocol import ErrorCode, Op, PutStatus, encode
from kvpool_client.protocol import PROTOCOL_VERSION
from kvpool_sidecar.api.local import LocalLimits, LocalServer
from kvpool_sidecar.tenancy import TenantAccess
from tests.conftest import LoopTurns
from tests.unit.store_support import make_store, put, read_answers, store_key, until
from tests.unit.store_support import dram

BLOCK = 256 << 10
COPIES = 16  # one answer: 4 MiB
REQUESTS = 20


TOKEN = b"pressure-test-token-0123456789"
#: The TCP API admits by token only.
ACCESS = TenantAccess.with_tokens({"default": TOKEN})


async def _connected(server: LocalServer) -> socket.socket:
    """A TCP client of ``server`` that said HELLO (non-blocking, for the loop's sock_ calls)."""
    assert server.tcp_port is not None
    sock = socket.socket()
    sock.connect(("127.0.0.1", server.tcp_port))
    sock.setblocking(False)
    await _hello(sock)
    return sock


async def _hello(sock: socket.socket) -> None:
    """Say HELLO (with the token TCP needs) and take its answer."""
    await asyncio.get_running_loop().sock_sendall(sock, encode([int(Op.HELLO), 9999, PROTOCOL_VERSION, "default",
                                                                 TOKEN]))
    [answer] = await read_answers(sock, 1)
    assert answer[0] == 9999 and answer[1] == 0, answer


async def test_a_client_that_does_not_read_cannot_make_the_sidecar_buffer_without_bound() -> None:
    store = make_store(size=8 << 20)
    key = b"\x07" * RAW_KEY_BYTES
    data = bytes(range(256)) * (BLOCK // 256)
    await put(store, store_key(key), data)
    limits = LocalLimits(8 << 20, 4096, "n", max_inflight=2, access=ACCESS)
    server = LocalServer(store, limits, socket_path=None, tcp=("127.0.0.1", 0))
    await server.start()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        assert server.tcp_port is not None
        client.connect(("127.0.0.1", server.tcp_port))
        client.setblocking(False)
        await _hello(client)
        request = encode([int(Op.GET_INLINE), 0, [key] * COPIES])
        loop = asyncio.get_running_loop()
        for rid in range(1, REQUESTS + 1):  # about 50 KB of requests asking for 80 MiB
            await loop.sock_sendall(client, encode([int(Op.GET_INLINE), rid, [key] * COPIES]))
        await asyncio.sleep(1.0)
        [conn] = server._conns  # noqa: SLF001
        assert conn.transport is not None
        buffered = conn.transport.get_write_buffer_size()
        assert buffered <= (limits.max_inflight + 1) * COPIES * BLOCK + len(request), buffered
        # nothing is lost: reading now, every answer arrives, whole
        answers = await read_answers(client, REQUESTS)
        assert sorted(a[0] for a in answers) == list(range(1, REQUESTS + 1))  # type: ignore[type-var]
        assert all(a[1] == 0 and a[2] == [data] * COPIES for a in answers)
    finally:
        client.close()
        await server.stop()


async def test_stop_lets_running_requests_finish_and_refuses_new_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(size=8 << 20)
    key = b"\x08" * RAW_KEY_BYTES
    await put(store, store_key(key), b"y" * 5000)
    real_acquire = store.acquire

    async def slow_acquire(session: Any, k: bytes) -> Any:
        await asyncio.sleep(0.5)
        return await real_acquire(session, k)

    monkeypatch.setattr(store, "acquire", slow_acquire)
    server = LocalServer(store, LocalLimits(8 << 20, 4096, "n", access=ACCESS), socket_path=None,
                         tcp=("127.0.0.1", 0),
                         drain_s=5.0)
    await server.start()
    client = await _connected(server)
    try:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client, encode([int(Op.GET_INLINE), 1, [key]]))
        await asyncio.sleep(0.1)  # it is running
        stopping = asyncio.create_task(server.stop())
        await asyncio.sleep(0.1)
        await loop.sock_sendall(client, encode([int(Op.LOOKUP), 2, [key]]))
        answers = {a[0]: a for a in await read_answers(client, 2)}
        assert answers[1][1] == 0 and answers[1][2] == [b"y" * 5000]  # finished, not cut off
        assert answers[2][1] == int(ErrorCode.UNAVAILABLE)
        await stopping
        assert await asyncio.wait_for(loop.sock_recv(client, 1), 5) == b""  # then closed
    finally:
        client.close()


async def test_a_client_past_max_connections_is_told_unavailable(tmp_path: Any) -> None:
    from kvpool_client.client import AsyncPoolClient
    from kvpool_client.errors import KVPoolError

    store = make_store(size=4 << 20)
    limits = LocalLimits(8 << 20, 4096, "n", max_connections=2)
    path = str(tmp_path / "kvpool.sock")
    server = LocalServer(store, limits, socket_path=path)
    await server.start()
    clients = [await AsyncPoolClient.connect(path, timeout=5.0) for _ in range(2)]
    try:
        with pytest.raises(KVPoolError, match="api.max_connections"):
            await AsyncPoolClient.connect(path, timeout=5.0)
        assert len(store._sessions) == 2  # noqa: SLF001 - the refused client never had one
        await clients.pop().close()
        for _ in range(100):
            if len(server._conns) < 2:  # noqa: SLF001 - the refused one and the closed one are gone
                break
            await asyncio.sleep(0.01)
        clients.append(await AsyncPoolClient.connect(path, timeout=5.0))  # room again
        assert (await clients[-1].lookup([b"\x01" * RAW_KEY_BYTES])).prefix == 0
    finally:
        for c in clients:
            await c.close()
        await server.stop()
        if dram(store).arena is not None:
            dram(store).arena.close()


async def test_clients_that_do_not_read_are_aborted_past_the_nodes_bound_on_unread_answers() -> None:
    """One connection's unread answers are bounded by its requests in flight; many
    connections' together by ``max_unread_bytes``: past it the connection holding the most
    is aborted (its answers dropped), and a client that reads is still served whole."""
    store = make_store(size=8 << 20)
    key = b"\x09" * RAW_KEY_BYTES
    data = bytes(range(256)) * (BLOCK // 256)
    await put(store, store_key(key), data)
    answer = COPIES * BLOCK
    limit = answer // 2  # (the kernel takes a good part of each answer off the transport's buffer)
    limits = LocalLimits(8 << 20, 4096, "n", max_inflight=2, max_unread_bytes=limit, access=ACCESS)
    server = LocalServer(store, limits, socket_path=None, tcp=("127.0.0.1", 0))
    await server.start()
    loop = asyncio.get_running_loop()
    slow = [socket.socket() for _ in range(4)]
    good = socket.socket()
    try:
        assert server.tcp_port is not None
        for s in (*slow, good):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", server.tcp_port))
            s.setblocking(False)
            await _hello(s)
        for s in slow:  # each asks for 80 MiB and reads nothing
            for rid in range(1, REQUESTS + 1):
                await loop.sock_sendall(s, encode([int(Op.GET_INLINE), rid, [key] * COPIES]))
        assert await until(lambda: server.unread.aborted >= 2, limit=10.0), server.unread.aborted
        assert server.unread.total <= limit
        live = [c for c in server._conns if c.transport is not None]  # noqa: SLF001
        # what waits for the slow clients: the counted answers, and at most one answer each
        # written before its transport said the reader was behind
        assert sum(c.transport.get_write_buffer_size() for c in live) <= limit + len(live) * (answer + (64 << 10))
        await loop.sock_sendall(good, encode([int(Op.GET_INLINE), 1, [key]]))
        [got] = await read_answers(good, 1)
        assert got == [1, 0, [data]]
        dropped = 0
        for s in slow:  # an aborted client sees its connection end before its answers do
            try:
                await read_answers(s, REQUESTS)
            except (AssertionError, ConnectionResetError):
                dropped += 1
        assert dropped == server.unread.aborted >= 2
    finally:
        for s in (*slow, good):
            s.close()
        await server.stop()


@pytest.mark.parametrize("op", ["put", "get", "put_inline", "put_inline_bytes", "get_inline", "get_inline_bytes"])
async def test_a_large_batch_lets_other_requests_in_between_its_slices(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, op: str, loop_turns: LoopTurns) -> None:
    """An ALLOC, ACQUIRE or PUT_INLINE of many blocks is served a slice at a time, the event
    loop turning between slices (another client's lookup had waited behind all of it); an
    inline put's slices are also bounded in bytes."""
    from kvpool_client.client import PoolClient
    from kvpool_sidecar.api import reads, writes

    monkeypatch.setattr(reads, "BATCH_SLICE", 10 if op != "get_inline_bytes" else 4096)
    monkeypatch.setattr(writes, "BATCH_SLICE", 10 if op != "put_inline_bytes" else 4096)
    monkeypatch.setattr(writes, "SLICE_BYTES", 1000)  # 10 of the blocks below
    monkeypatch.setattr(reads, "SLICE_BYTES", 1000)
    store = make_store(size=8 << 20)
    n = 50
    keys = [bytes([i]) * RAW_KEY_BYTES for i in range(n)]
    inline = "inline" in op
    server = LocalServer(store, LocalLimits(8 << 20, 4096, "n", access=ACCESS), socket_path=str(tmp_path / "s.sock"),
                         tcp=("127.0.0.1", 0) if inline else None)
    await server.start()
    seen: list[int] = []
    getting = op.startswith("get")
    name = "acquire" if getting else "allocate"
    real = getattr(store, name)

    async def noting(*args: Any, **kw: Any) -> Any:
        seen.append(loop_turns.count)
        return await real(*args, **kw)

    try:
        if inline:  # over TCP the data travels inline
            c = await asyncio.to_thread(PoolClient, host="127.0.0.1", port=server.tcp_port, token=TOKEN)
        else:
            c = await asyncio.to_thread(PoolClient, str(tmp_path / "s.sock"), token=TOKEN, prefault=False)
        try:
            if getting:
                assert await asyncio.to_thread(c.put, keys, [b"z" * 100] * n) == [PutStatus.STORED] * n
            monkeypatch.setattr(store, name, noting)
            if not getting:
                got = await asyncio.to_thread(c.put, [bytes([i + 100]) * RAW_KEY_BYTES for i in range(n)],
                                              [b"z" * 100] * n)
                assert got == [PutStatus.STORED] * n
            else:
                assert [bytes(g) for g in await asyncio.to_thread(c.get, keys) if g is not None] == [b"z" * 100] * n
        finally:
            await asyncio.to_thread(c.close)
    finally:
        await server.stop()
    assert len(seen) == n
    # the loop turned between each slice of 10 blocks of the one request
    assert len(set(seen)) >= n // 10


@pytest.mark.parametrize("op", ["commit", "pin", "unpin", "remove"])
async def test_a_long_commit_pin_unpin_or_remove_lets_other_requests_in_between_its_slices(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, op: str, loop_turns: LoopTurns) -> None:
    """A COMMIT, PIN, UNPIN or REMOVE of many blocks is served a slice at a time too (one of
    4,096 had held the loop for up to 130 ms), with the answer it had at once."""
    from kvpool_client.client import PoolClient
    from kvpool_sidecar.api import writes

    monkeypatch.setattr(writes, "BATCH_SLICE", 10)
    store = make_store(size=8 << 20)
    n = 50
    keys = [bytes([i]) * RAW_KEY_BYTES for i in range(n)]
    server = LocalServer(store, LocalLimits(8 << 20, 4096, "n", access=ACCESS), socket_path=str(tmp_path / "s.sock"))
    await server.start()
    seen: list[int] = []
    real = getattr(store, op)

    def noting(*args: Any, **kw: Any) -> Any:
        seen.append(loop_turns.count)
        return real(*args, **kw)

    try:
        c = await asyncio.to_thread(PoolClient, str(tmp_path / "s.sock"), token=TOKEN, prefault=False)
        try:
            if op != "commit":
                assert await asyncio.to_thread(c.put, keys, [b"z" * 100] * n) == [PutStatus.STORED] * n
                if op == "unpin":
                    assert await asyncio.to_thread(c.pin, keys) == n
            monkeypatch.setattr(store, op, noting)
            if op == "commit":
                assert await asyncio.to_thread(c.put, keys, [b"z" * 100] * n) == [PutStatus.STORED] * n
            else:
                assert await asyncio.to_thread(getattr(c, op), keys) == n
        finally:
            await asyncio.to_thread(c.close)
    finally:
        await server.stop()
    assert len(seen) == (n if op == "commit" else n // 10)
    assert len(set(seen)) >= n // 10  # the loop turned between each slice of 10
    if op == "remove":
        assert not any(store.contains(store_key(k)) for k in keys)


@pytest.mark.parametrize("op", [Op.REMOVE, Op.UNPIN])
async def test_a_connections_requests_after_a_sliced_one_wait_for_it(monkeypatch: pytest.MonkeyPatch,
                                                                      op: Op) -> None:
    """A long REMOVE or UNPIN was answered at once, so what the client sent after it on the
    connection saw all of it done; served a slice at a time, it still is: the connection's
    next requests wait for its last slice (a LOOKUP had found the removed block there, and
    a PIN pipelined after an UNPIN of the same key had been undone)."""
    from kvpool_sidecar.api import writes

    monkeypatch.setattr(writes, "BATCH_SLICE", 10)
    store = make_store(size=8 << 20)
    keys = [bytes([i + 1]) * RAW_KEY_BYTES for i in range(50)]
    for k in keys:
        await put(store, store_key(k), b"z" * 100)
    server = LocalServer(store, LocalLimits(8 << 20, 4096, "n", access=ACCESS), socket_path=None,
                         tcp=("127.0.0.1", 0))
    await server.start()
    loop = asyncio.get_running_loop()
    s = await _connected(server)
    try:
        if op == Op.UNPIN:
            await loop.sock_sendall(s, encode([int(Op.PIN), 1, keys]))
            assert (await read_answers(s, 1))[0] == [1, 0, 50]
        after = [int(Op.LOOKUP), 3, [keys[-1]]] if op == Op.REMOVE else [int(Op.PIN), 3, [keys[-1]]]
        await loop.sock_sendall(s, encode([int(op), 2, keys]) + encode(after))
        answers = await read_answers(s, 2)
        assert [a[:3] for a in answers][0] == [2, 0, 50]
        if op == Op.REMOVE:
            assert answers[1][:2] == [3, 0] and answers[1][2][0] == 0, answers[1]  # gone already
        else:
            assert answers[1] == [3, 0, 1]
            sessions = [sess for sess in store._sessions.values() if sess.pins]  # noqa: SLF001
            assert [dict(sess.pins) for sess in sessions] == [{store_key(keys[-1]): 1}]
    finally:
        s.close()
        await server.stop()


@pytest.mark.parametrize("op", ["put", "get"])
async def test_an_inline_block_larger_than_a_slice_is_copied_a_piece_at_a_time(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, op: str, loop_turns: LoopTurns) -> None:
    """One block of an inline put or get larger than ``SLICE_BYTES`` is copied and
    checksummed in pieces, the loop turning between them (a 60 MiB block had held the loop
    40 to 130 ms), and arrives whole and verified."""
    from kvpool_client.client import PoolClient
    from kvpool_sidecar.api import pieces, reads, writes

    monkeypatch.setattr(writes, "SLICE_BYTES", 4096)
    monkeypatch.setattr(reads, "SLICE_BYTES", 4096)
    turns: list[int] = []
    real = pieces.copy_hashing if op == "put" else pieces.gather_hashing

    def noting(*args: Any) -> None:
        turns.append(loop_turns.count)
        real(*args)

    store = make_store(size=8 << 20)
    server = LocalServer(store, LocalLimits(8 << 20, 4096, "n", access=ACCESS), socket_path=None,
                         tcp=("127.0.0.1", 0))
    await server.start()
    key = b"\x11" * RAW_KEY_BYTES
    data = bytes(range(256)) * 160  # 40 KiB: ten pieces
    try:
        c = await asyncio.to_thread(PoolClient, host="127.0.0.1", port=server.tcp_port, token=TOKEN)
        try:
            if op == "put":
                monkeypatch.setattr(pieces, "copy_hashing", noting)
            assert await asyncio.to_thread(c.put, [key], [data]) == [PutStatus.STORED]
            if op == "get":
                monkeypatch.setattr(pieces, "gather_hashing", noting)
            [got] = await asyncio.to_thread(c.get, [key])
            assert got is not None and bytes(got) == data
        finally:
            await asyncio.to_thread(c.close)
    finally:
        await server.stop()
    assert len(turns) == 10
    assert len(set(turns)) == 10  # the loop turned between every two pieces
