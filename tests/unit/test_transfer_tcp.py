"""The TCP peer transport between two in-process stores over real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import os
import resource
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest

from kvpool_client.integrity import checksum
from kvpool_client.keys import ModelFingerprint, block_keys
from kvpool_client.protocol import HEADER, PutStatus, decode, encode
from kvpool_sidecar.peers import StoreSink, StoreSource
from kvpool_sidecar.store import StoreSettings, TieredStore
from kvpool_sidecar.transfer.base import LocalTransferError, OutgoingBlock, PeerAuthError, PeerError, blames_peer
from kvpool_sidecar.transfer import auth
from kvpool_sidecar.transfer import tcpfetch, tcpio, tcppool, tcpserve, tcpwire
from kvpool_sidecar.transfer.tcp import BULK_WORKERS, TcpTransport
from kvpool_sidecar.transfer.tcpwire import MAGIC
from tests.unit.store_support import ask_and_never_read, make_store, put, read, until
from tests.unit.store_support import dram

TOKEN = b"0123456789abcdef-pool-secret"
FP = ModelFingerprint("m", "bf16", 4, "bytes")


@pytest.fixture(autouse=True, params=["serial", "pipelined"])
def receive_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: receives hashed on their own thread, and pipelined (hashed on a
    second thread), whatever this machine's CPUs would choose."""
    monkeypatch.setattr(tcpio, "PIPELINE_MIN_CPUS", 1 if request.param == "pipelined" else 1 << 30)
    return str(request.param)


@contextlib.asynccontextmanager
async def serving(a: TieredStore, b: TieredStore) -> AsyncIterator[tuple[TcpTransport, TcpTransport, str]]:
    """``a`` served by one transport, ``b``'s transport to fetch with, and ``a``'s address;
    both transports and both stores' arenas are closed afterwards."""
    ta, tb = TcpTransport(TOKEN), TcpTransport(TOKEN)
    try:
        yield ta, tb, await ta.start(StoreSource(a))
    finally:
        await ta.close()
        await tb.close()
        for s in (a, b):
            if dram(s).arena is not None:
                dram(s).arena.close()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]]:
    a, b = make_store(), make_store()
    async with serving(a, b) as (ta, tb, addr):
        yield a, b, ta, tb, addr


async def test_fetch_round_trip_many_blocks(pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    a, b, _, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(4 * 20)))]
    blobs = [os.urandom(4096 * (i % 5 + 1) + i) for i in range(len(keys))]
    for k, d in zip(keys, blobs):
        await put(a, k, d)
    missing = os.urandom(48)
    done = await tb.fetch(addr, [*keys, missing], StoreSink(b), timeout=5.0)
    assert done == [True] * len(keys) + [False]
    for k, d in zip(keys, blobs):
        assert await read(b, k) == d
    # the source's read leases were all given back: it gives them back after its send
    # returns, which may be after the last byte reached us; a server answers one request at
    # a time per connection, so once a second request on the same connection is answered
    # the first answer is wholly done
    assert await tb.fetch(addr, [missing], StoreSink(b), timeout=5.0) == [False]
    assert all(e.readers == 0 for e in a._entries.values())


async def test_send_and_sendfile_paths_agree(pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    a, b, ta, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(8)))]  # two blocks of four tokens
    data = [os.urandom(3 * 4096 + 17), os.urandom(5 * 4096)]
    for k, d in zip(keys, data):
        await put(a, k, d)
    ta.sendfile = False
    assert await tb.fetch(addr, keys[:1], StoreSink(b), timeout=5.0) == [True]
    ta.sendfile = True
    assert await tb.fetch(addr, keys[1:], StoreSink(b), timeout=5.0) == [True]
    assert [await read(b, k) for k in keys] == data


async def test_wrong_token_is_rejected_both_ways(pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    a, b, ta, _, addr = pair
    key = block_keys(FP, [1, 2, 3, 4])[0].raw
    await put(a, key, b"x" * 5000)
    intruder = TcpTransport(b"not-the-pool-secret-at-all")
    try:
        assert await intruder.fetch(addr, [key], StoreSink(b), timeout=2.0) == [False]
    finally:
        await intruder.close()
    assert not b.contains(key)
    # a raw client that skips the handshake gets nothing either
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64)
    try:
        answer = await asyncio.wait_for(reader.read(100), 5)
    except ConnectionResetError:
        answer = b""
    assert answer == b""  # closed without an answer
    writer.close()
    # a client that answers the challenge with a proof made from the wrong secret
    reader, writer = await asyncio.open_connection(host, int(port))
    nonce = os.urandom(32)
    writer.write(MAGIC + nonce)
    server_nonce = (await asyncio.wait_for(reader.readexactly(64), 5))[:32]
    writer.write(auth.proof(b"wrong-secret-wrong-secret", False, server_nonce, nonce))
    try:
        answer = await asyncio.wait_for(reader.read(100), 5)
    except ConnectionResetError:
        answer = b""
    assert answer == b""
    writer.close()
    assert ta.rejected == 2


class LyingSource(StoreSource):
    """A peer that flips a byte of what it sends (after the checksum was fixed)."""

    async def lend(self, keys: Sequence[bytes]) -> list[OutgoingBlock | None]:
        blocks = await super().lend(keys)
        for b in blocks:
            if b is not None:
                b.views[0][0] ^= 0xFF
        return blocks


async def test_corrupt_bytes_from_a_peer_are_a_miss() -> None:
    a, b = make_store(), make_store()
    ta, tb = TcpTransport(TOKEN), TcpTransport(TOKEN)
    addr = await ta.start(LyingSource(a))
    try:
        keys = [k.raw for k in block_keys(FP, list(range(8)))]
        for k in keys:
            await put(a, k, os.urandom(6000))
        assert await tb.fetch(addr, keys, StoreSink(b), timeout=5.0) == [False, False]
        assert not any(b.contains(k) for k in keys)
        assert dram(b).used_bytes == 0  # reserved room was given back
    finally:
        await ta.close()
        await tb.close()


async def test_dead_and_stalled_peers_are_misses_within_the_deadline() -> None:
    b = make_store()
    tb = TcpTransport(TOKEN)
    key = os.urandom(48)
    # a closed port
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = probe.getsockname()[1]
    probe.close()
    # wait_for only guards against a hang; the transport's own deadline must end each fetch
    assert await asyncio.wait_for(tb.fetch(f"127.0.0.1:{dead}", [key], StoreSink(b), timeout=1.0), 30) == [False]
    # a listener that accepts and never says a word
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        fetch = tb.fetch(f"127.0.0.1:{silent.getsockname()[1]}", [key], StoreSink(b), timeout=0.5)
        assert await asyncio.wait_for(fetch, 30) == [False]
    finally:
        silent.close()
        await tb.close()
    assert dram(b).used_bytes == 0


async def test_a_fetch_that_fails_before_its_time_marks_its_holder_failing_and_one_answered_clears_it(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    """What a reader backs a holder off on (peers.py): a refused connection and a handshake
    under another pool's secret fail at once; a peer that answers, even without the blocks, or
    one that says nothing until the time runs out, is not failing."""
    a, b, _, tb, addr = pair
    key = block_keys(FP, [1, 2, 3, 4])[0].raw
    await put(a, key, b"x" * 5000)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    assert await tb.fetch(dead, [key], StoreSink(b), timeout=2.0) == [False]
    assert tb.failing(dead) and not tb.failing(addr)
    assert await tb.fetch(addr, [os.urandom(48)], StoreSink(b), timeout=2.0) == [False]  # answered: lacks it
    assert not tb.failing(addr)
    other_pool = TcpTransport(b"not-the-pool-secret-at-all")
    try:
        assert await other_pool.fetch(addr, [key], StoreSink(b), timeout=2.0) == [False]
        assert other_pool.failing(addr)
    finally:
        await other_pool.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    quiet = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        assert await tb.fetch(quiet, [key], StoreSink(b), timeout=0.5) == [False]
        assert not tb.failing(quiet)  # (ran out of time: judged by the time it took)
    finally:
        silent.close()
    assert await tb.fetch(addr, [key], StoreSink(b), timeout=2.0) == [True]
    tb.forget({addr})
    assert not tb.failing(dead)


async def test_a_fetch_this_node_cannot_make_for_want_of_descriptors_does_not_mark_its_holder_failing(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    """Out of descriptors here (EMFILE at the socket), a fetch is a miss, but its holder is
    not failing: a reader had backed off every holder it met while the shortage lasted."""
    a, b, _, tb, addr = pair
    key = block_keys(FP, [5, 6, 7, 8])[0].raw
    await put(a, key, b"y" * 5000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # every number under the limit taken: the holes too (a socket of an earlier test that the
    # collector closes later leaves one, and the fetch's socket had taken it), and no
    # collection while the fetch runs
    gc.collect()
    gc.disable()
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))) + 1, hard))
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        got = await tb.fetch(addr, [key], StoreSink(b), timeout=2.0)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        gc.enable()
    assert got == [False] and not tb.failing(addr)
    assert await tb.fetch(addr, [key], StoreSink(b), timeout=2.0) == [True]


@pytest.mark.parametrize(("error", "blamed"), [
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (PeerAuthError("another secret"), True),
    (PeerError("malformed peer answer"), True),
    (OSError(errno.EMFILE, "too many open files"), False),
    (OSError(errno.ENFILE, "file table overflow"), False),
    (OSError(errno.ENOBUFS, "no buffer space"), False),
    (OSError(errno.EADDRNOTAVAIL, "no local port"), False),
    (LocalTransferError("mooncake could not register the arena"), False),
    (TimeoutError(), False),
])
def test_a_fetch_error_blames_the_peer_only_for_the_peers_failures(error: BaseException, blamed: bool) -> None:
    assert blames_peer(error) is blamed


@pytest.mark.parametrize("address", ["127.0.0.1:x", "127.0.0.1:70000", "127.0.0.1:0", "a" * 64 + ".example:7070",
                                     "no-port-at-all"])
async def test_a_malformed_peer_address_is_a_miss_not_an_error(address: str) -> None:
    """Whatever a node record says (a writer to Redis may have put it there), a fetch from it
    is a miss: a port that is not a number or out of range, a host name the IDNA codec
    refuses (a label past 63 characters)."""
    b = make_store()
    tb = TcpTransport(TOKEN)
    try:
        assert await asyncio.wait_for(tb.fetch(address, [os.urandom(48)], StoreSink(b), timeout=1.0), 30) == [False]
    finally:
        await tb.close()


async def test_a_peer_stalling_mid_block_leaves_no_writer_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline hits while the receiving thread is inside a block: the thread must be
    stopped before the reserved room is given back, so nothing lands in freed memory."""
    import threading

    release = threading.Event()
    stalled = threading.Event()
    sent = threading.Event()

    def half_then_stall(sock: socket.socket, blocks: list[tcpio.Outgoing], timeout: float) -> None:
        sock.settimeout(timeout)
        block = blocks[0]
        view = block.views[0]
        try:
            sock.sendall(block.mac.nonce)
            half = view[: view.nbytes // 2]
            block.mac.update(half)
            sock.sendall(half)
            stalled.set()
            release.wait(10)
            rest = view[view.nbytes // 2 :]
            block.mac.update(rest)
            sock.sendall(rest)  # too late: must never land
            sock.sendall(block.mac.digest()[auth.NONCE_LEN:])
        except OSError:
            pass
        finally:
            sock.setblocking(False)
            sent.set()

    monkeypatch.setattr(tcpserve, "blocking_send", half_then_stall)
    a, b = make_store(), make_store()
    ta, tb = TcpTransport(TOKEN), TcpTransport(TOKEN)
    addr = await ta.start(StoreSource(a))
    try:
        key = block_keys(FP, [9, 9, 9, 9])[0].raw
        await put(a, key, os.urandom(64 * 4096))
        assert await asyncio.wait_for(tb.fetch(addr, [key], StoreSink(b), timeout=0.5), 30) == [False]
        assert stalled.is_set()  # (the receiving thread was inside the block when the deadline hit)
        assert dram(b).used_bytes == 0 and not b.contains(key)
        # fill b's whole arena with a known pattern, then let the stalled sender go on
        pattern = b"\xab" * (64 * 4096)
        others = [block_keys(FP, [7, 7, 7, i])[0].raw for i in range(dram(b).capacity_bytes // len(pattern))]
        for other in others:
            await put(b, other, pattern)
        release.set()
        assert await asyncio.to_thread(sent.wait, 10)  # the sender sent the rest (or was refused)
        await asyncio.sleep(0.1)  # (and what reached the receiver had time to land)
        assert [await read(b, other) == pattern for other in others] == [True] * len(others)
    finally:
        release.set()
        await ta.close()
        await tb.close()


class SlowFirstSink(StoreSink):
    """A sink whose first reservation waits (for room, a demotion ...)."""

    def __init__(self, store: TieredStore) -> None:
        super().__init__(store)
        self.calls = 0

    async def reserve(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                      parent: bytes | None = None) -> tuple[object, list[memoryview]] | None:
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(10)
        return await super().reserve(key, size, tenant, depth=depth, parent=parent)


async def test_a_cancelled_fetch_never_leaves_its_answer_for_the_next() -> None:
    a, b = make_store(), make_store()
    ta, tb = TcpTransport(TOKEN), TcpTransport(TOKEN)
    addr = await ta.start(StoreSource(a))
    try:
        evil, victim = [k.raw for k in block_keys(FP, list(range(8)))]
        forged = b"FORGED!!" * 512
        # a block whose bytes look like the answer to the next request on the connection
        crafted = encode([2, 0, [[len(forged), checksum(memoryview(forged)), "default"]]]) + forged
        real = os.urandom(4096)
        await put(a, evil, crafted)
        await put(a, victim, real)
        sink = SlowFirstSink(b)
        task = asyncio.create_task(tb.fetch(addr, [evil], sink, timeout=5.0))
        for _ in range(500):  # its header is read; the payload waits in the socket
            if sink.calls:
                break
            await asyncio.sleep(0.01)
        assert sink.calls == 1 and not task.done()
        task.cancel()  # the requester went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await tb.fetch(addr, [victim], sink, timeout=5.0) == [True]
        assert await read(b, victim) == real
    finally:
        await ta.close()
        await tb.close()


async def test_the_deadline_holds_while_the_transfer_waits_for_a_worker() -> None:
    a, b = make_store(), make_store()
    ta, tb = TcpTransport(TOKEN), TcpTransport(TOKEN)
    addr = await ta.start(StoreSource(a))
    gate = threading.Event()
    try:
        keys = [k.raw for k in block_keys(FP, list(range(8)))]
        for k in keys:
            await put(a, k, os.urandom(4096))
        assert await tb.fetch(addr, keys[:1], StoreSink(b), timeout=5.0) == [True]
        for _ in range(BULK_WORKERS):  # every receive worker is busy
            tb._recv_workers.submit(gate.wait, 30)  # noqa: SLF001
        started = time.monotonic()
        assert await tb.fetch(addr, keys[1:], StoreSink(b), timeout=0.5) == [False]
        assert time.monotonic() - started < 5  # not the 30 s the workers are held for
        assert dram(b).used_bytes == 4096  # the reserved room was given back
    finally:
        gate.set()
        await ta.close()
        await tb.close()


async def test_a_block_larger_than_this_node_takes_is_skipped_and_the_rest_arrive() -> None:
    a, b = make_store(), make_store(1 << 20, settings=StoreSettings(block_max_bytes=8192))
    async with serving(a, b) as (_, tb, addr):
        big, small = [k.raw for k in block_keys(FP, list(range(8)))]
        data = os.urandom(3000)
        await put(a, big, os.urandom(20_000))  # a peer configured for larger blocks
        await put(a, small, data)
        assert await tb.fetch(addr, [big, small], StoreSink(b), timeout=5.0) == [False, True]
        assert await read(b, small) == data and not b.contains(big)


async def test_a_peer_announcing_a_giant_block_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = make_store(), make_store()
    ta, tb = TcpTransport(TOKEN), TcpTransport(TOKEN)
    addr = await ta.start(StoreSource(a))
    try:
        key = block_keys(FP, [1, 2, 3, 4])[0].raw
        await put(a, key, os.urandom(4096))
        real_lend = StoreSource.lend

        async def lying_lend(self: StoreSource, keys: Sequence[bytes]) -> list[OutgoingBlock | None]:
            blocks = await real_lend(self, keys)
            return [None if x is None else replace(x, size=1 << 60) for x in blocks]

        monkeypatch.setattr(StoreSource, "lend", lying_lend)
        started = time.monotonic()
        assert await tb.fetch(addr, [key], StoreSink(b), timeout=2.0) == [False]
        assert time.monotonic() - started < 5
        assert dram(b).used_bytes == 0
    finally:
        await ta.close()
        await tb.close()


async def test_fetched_blocks_keep_their_chain_order_for_the_policy() -> None:
    from kvpool_sidecar.policy import PrefixAwarePolicy

    a, b = make_store(), make_store(1 << 20, policy=PrefixAwarePolicy())
    async with serving(a, b) as (_, tb, addr):
        keys = [k.raw for k in block_keys(FP, list(range(4 * 4)))]
        for k in keys:
            await put(a, k, os.urandom(4096))
        assert await tb.fetch(addr, keys, StoreSink(b), timeout=5.0) == [True] * 4
        # the leaf goes first and the root last: the local prefix stays whole longest
        assert [m.key for m in b.policy.victims("dram")] == keys[::-1]


async def _relay_handshake(client: socket.socket, real: str) -> socket.socket:
    """Pass a fetching node's handshake through to a real node (the attacker has no secret)."""
    loop = asyncio.get_running_loop()
    host, _, port = real.rpartition(":")
    upstream = socket.create_connection((host, int(port)))
    upstream.setblocking(False)
    hello = await tcpwire._recv_exact(loop, client, len(MAGIC) + auth.NONCE_BYTES)
    await loop.sock_sendall(upstream, hello)
    await loop.sock_sendall(client, await tcpwire._recv_exact(loop, upstream, auth.NONCE_BYTES + auth.PROOF_BYTES))
    await loop.sock_sendall(upstream, await tcpwire._recv_exact(loop, client, auth.PROOF_BYTES))
    await loop.sock_sendall(client, await tcpwire._recv_exact(loop, upstream, 1))
    return upstream


Answer = Callable[[asyncio.AbstractEventLoop, socket.socket, socket.socket, bytes], Awaitable[None]]


def unsealed(frame: bytes) -> list[Any]:
    """What a sealed frame's bytes (after its length) hold, its tag left unchecked: what a
    relay on the path reads."""
    return decode(frame[: -auth.FRAME_TAG_BYTES])


def forged_frame(body: list[Any]) -> bytes:
    """``body`` as a frame with a tag of random bytes: all one without the connection's key can send."""
    payload = encode(body)[HEADER.size:] + os.urandom(auth.FRAME_TAG_BYTES)
    return HEADER.pack(len(payload)) + payload


async def fetch_through_relay(tb: TcpTransport, sink: TieredStore, real: str, key: bytes, answer: Answer) -> list[bool]:
    """``tb`` fetches ``key`` from a fake holder that relays the handshake to ``real`` and
    then lets ``answer(loop, victim, upstream, request)`` reply to the victim's request; the
    relay holds both connections open until the fetch is over."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    fetched = asyncio.Event()

    async def relay() -> None:
        client, _ = await loop.sock_accept(listener)
        client.setblocking(False)
        upstream = await _relay_handshake(client, real)
        try:
            await answer(loop, client, upstream, await tcpwire._recv_frame(loop, client))  # (sealed: its bytes)
            await fetched.wait()
        finally:
            upstream.close()
            client.close()

    task = loop.create_task(relay())
    try:
        return await tb.fetch("127.0.0.1:%d" % listener.getsockname()[1], [key], StoreSink(sink), timeout=0.5)
    finally:
        fetched.set()
        await task
        listener.close()


@pytest.mark.parametrize("mac", ["random", "none"])
async def test_a_node_relaying_a_real_handshake_cannot_get_forged_blocks_accepted(mac: str) -> None:
    """A fake holder (written into Redis by someone without the secret) relays the handshake
    to a real node, then answers with its own bytes under a matching checksum: the fetching
    node must store nothing, because only the real node knows the connection's key."""
    a, b = make_store(), make_store()
    key = block_keys(FP, [3, 1, 4, 1])[0].raw
    forged = b"forged KV" * 1000
    async with serving(a, b) as (_, tb, real):

        async def forge(loop: asyncio.AbstractEventLoop, victim: socket.socket, _: socket.socket,
                        sealed: bytes) -> None:
            request = unsealed(sealed)
            await loop.sock_sendall(victim, forged_frame([request[1], 0, [[len(forged), checksum(memoryview(forged)),
                                                                            "default"]]]))
            trailer = os.urandom(auth.TAG_LEN) if mac == "random" else b""
            await loop.sock_sendall(victim, os.urandom(auth.NONCE_LEN) + forged + trailer)

        done = await fetch_through_relay(tb, b, real, key, forge)
        assert done == [False]
        assert not b.contains(key) and dram(b).used_bytes == 0


async def test_session_keys_differ_per_connection_and_direction() -> None:
    n1, n2 = auth.new_nonce(), auth.new_nonce()
    k = auth.session_key(TOKEN, n1, n2)
    assert k != auth.session_key(TOKEN, n2, n1) and k != auth.session_key(b"another-secret-0123", n1, n2)
    nonce = os.urandom(auth.NONCE_LEN)
    h1 = auth.block_mac(k, 1, 0, b"k" * 48, 10, 5, "t", nonce)
    h2 = auth.block_mac(k, 1, 1, b"k" * 48, 10, 5, "t", nonce)  # the same bytes at another index
    h1.update(b"0123456789")
    h2.update(b"0123456789")
    assert h1.digest() != h2.digest()


def test_a_block_mac_covers_its_nonce_header_and_every_byte_in_any_pieces() -> None:
    k = os.urandom(32)
    sealer = auth.Sealer(k)
    data = os.urandom(100_003)
    sent = sealer.mac(7, 2, b"k" * 48, len(data), 5, "t")
    for i in range(0, len(data), 4099):  # the pieces a receiver sees need not be the sender's
        sent.update(data[i : i + 4099])
    wire = sent.digest()
    assert len(wire) == auth.MAC_BYTES and wire[: auth.NONCE_LEN] == sent.nonce

    def check(rid: int = 7, index: int = 2, bkey: bytes = b"k" * 48, csum: int = 5, tenant: str = "t",
              body: bytes = data, nonce: bytes = sent.nonce) -> bool:
        h = auth.block_mac(k, rid, index, bkey, len(body), csum, tenant, nonce)
        h.update(body)
        return h.digest() == wire

    assert check()
    flipped = bytearray(data)
    flipped[50_000] ^= 1
    assert not check(body=bytes(flipped))
    assert not check(rid=8)  # a block replayed into another request
    assert not check(index=3) and not check(bkey=b"j" * 48) and not check(csum=6) and not check(tenant="u")
    assert not check(nonce=os.urandom(auth.NONCE_LEN))
    with pytest.raises(ValueError):
        auth.block_mac(k, 1, 0, b"k" * 48, 1, 0, "t", b"short")


def test_a_sender_never_uses_a_nonce_twice_whatever_it_is_asked() -> None:
    """GMAC under one key and one nonce twice gives its authentication key away: the sender
    counts its nonces itself, so the same request asked again still gets new ones."""
    sealer = auth.Sealer(os.urandom(32))
    nonces = {sealer.mac(1, 0, b"k" * 48, 1, 0, "t").nonce for _ in range(1000)}
    assert len(nonces) == 1000


async def test_a_relay_can_neither_slip_in_a_request_nor_alter_an_answers_header(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake holder relays a real handshake. Its own request on the real node's connection
    (it has no key to seal it with) ends that connection unanswered. Passing the victim's
    sealed request on and rewriting the answer's header (a giant size, which would make the
    victim reserve and evict) fails the header's MAC: the victim reserves nothing."""
    a, b = make_store(), make_store()
    key = block_keys(FP, [2, 7, 1, 8])[0].raw
    await put(a, key, b"real KV" * 500)
    kept = block_keys(FP, [5, 5, 5, 5])[0].raw
    await put(b, kept, b"kept" * 4000)
    async with serving(a, b) as (_, tb, real):
        answered: list[bool] = []

        async def own_request(loop: asyncio.AbstractEventLoop, victim: socket.socket, upstream: socket.socket,
                              sealed: bytes) -> None:
            await loop.sock_sendall(upstream, forged_frame([tcpwire.OP_GET, unsealed(sealed)[1], [key]]))
            answered.append(await loop.sock_recv(upstream, 1) != b"")

        assert await fetch_through_relay(tb, b, real, key, own_request) == [False]
        assert answered == [False]  # closed by the real node, no answer

        async def rewrite(loop: asyncio.AbstractEventLoop, victim: socket.socket, upstream: socket.socket,
                          sealed: bytes) -> None:
            await loop.sock_sendall(upstream, HEADER.pack(len(sealed)) + sealed)  # the victim's own
            answer = await tcpwire._recv_frame(loop, upstream)
            header = unsealed(answer)
            header[2][0][0] = 6 << 20  # most of the victim's arena: room it would evict for
            payload = encode(header)[HEADER.size:] + answer[-auth.FRAME_TAG_BYTES:]  # (the real tag)
            await loop.sock_sendall(victim, HEADER.pack(len(payload)) + payload)

        reserved: list[int] = []
        real_reserve = StoreSink.reserve

        async def spy(self: StoreSink, key: bytes, size: int, tenant: str, **kw: Any) -> Any:
            reserved.append(size)
            return await real_reserve(self, key, size, tenant, **kw)

        monkeypatch.setattr(StoreSink, "reserve", spy)
        assert await fetch_through_relay(tb, b, real, key, rewrite) == [False]
        assert reserved == []  # the header failed its MAC before any room was asked for
        assert not b.contains(key) and await read(b, kept) == b"kept" * 4000


async def test_connections_that_never_authenticate_are_capped() -> None:
    """Strangers stuck in the handshake hold at most ``max_unauthenticated`` slots; past it a
    new connection ends the oldest handshake (they had kept every slot, and new members out,
    while they sent a hello and nothing every few seconds), and past an address's share its
    own new one is closed at once."""
    a, b = make_store(), make_store()
    key = block_keys(FP, [5, 5, 5, 5])[0].raw
    async with serving(a, b) as (ta, tb, addr):
        await put(a, key, b"z" * 5000)
        ta.max_unauthenticated = 2
        host, _, port = addr.rpartition(":")
        stuck = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        for _, w in stuck:
            w.write(MAGIC + os.urandom(auth.NONCE_BYTES))  # a hello, and then nothing
            await w.drain()
        await until(lambda: ta._handshaking == 2)
        assert await tb.fetch(addr, [key], StoreSink(b), timeout=5.0) == [True]  # a member still gets in
        assert ta.evicted == 1 and ta.refused == 0
        for _, w in stuck:
            w.close()
        from kvpool_sidecar.transfer.tcpserve import MAX_HANDSHAKES_PER_ADDRESS
        ta.max_unauthenticated = 64
        own = [await asyncio.open_connection(host, int(port)) for _ in range(MAX_HANDSHAKES_PER_ADDRESS + 1)]
        assert await asyncio.wait_for(own[-1][0].read(10), 5) == b""  # past its address's share: closed at once
        assert ta.refused == 1
        for _, w in own:
            w.close()
        assert await until(lambda: ta._handshaking == 0)  # the slots come back as they go
        later = block_keys(FP, [6, 6, 6, 6])[0].raw
        await put(a, later, b"y" * 5000)
        assert await tb.fetch(addr, [later], StoreSink(b), timeout=5.0) == [True]


async def test_handshakes_ended_before_their_task_ran_give_their_slots_back() -> None:
    """Connections waiting together are accepted in one burst, and past the limit each ends
    the oldest handshake, which may be one accepted in that burst whose task never ran: its
    slot (and its address's count) must still come back."""
    a, b = make_store(), make_store()
    async with serving(a, b) as (ta, tb, addr):
        ta.max_unauthenticated = 1
        host, _, port = addr.rpartition(":")
        waiting = [socket.create_connection((host, int(port))) for _ in range(6)]  # (the loop is not running)
        assert await until(lambda: ta.evicted == 5)
        for c in waiting:
            c.close()
        assert await until(lambda: ta._handshaking == 0 and not ta._handshakes_from)
        key = block_keys(FP, [7, 7, 7, 7])[0].raw
        await put(a, key, b"x" * 5000)
        assert await tb.fetch(addr, [key], StoreSink(b), timeout=5.0) == [True]


async def test_a_fetched_block_of_a_tenant_no_space_here_names_is_not_kept() -> None:
    """With an arena per key space, a fetched block whose writer no space of this node names
    is a miss: counted as the default tenant's it would land in the default space's arena."""
    a = make_store(spaces=["default", "stranger"])
    b = make_store(spaces=["default", "team"])
    async with serving(a, b) as (_, tb, addr):
        key = block_keys(FP, [9, 9, 9, 9])[0].raw
        await put(a, key, b"secret" * 1000, tenant="stranger")
        assert await tb.fetch(addr, [key], StoreSink(b), timeout=5.0) == [False]
        assert not b.contains(key)
        assert all(bytes(arena.view).find(b"secret" * 10) < 0 for arena in dram(b).arenas)
        # one arena for all tenants (no isolation to keep): the block is kept, as the default's
        c = make_store()
        sink = StoreSink(c)
        assert await tb.fetch(addr, [key], sink, timeout=5.0) == [True]
        assert c.contains(key)
        dram(c).arena.close()  # type: ignore[union-attr]


async def test_one_address_holding_idle_sockets_cannot_shut_a_node_off_from_its_peers(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    """Sockets that never say a word, all from one address, take at most that address's
    share of the handshake slots: its next ones are closed at once, and a peer from another
    address still fetches."""
    a, b, ta, tb, addr = pair
    host, port = addr.rsplit(":", 1)
    idle = []
    for _ in range(tcpserve.MAX_HANDSHAKES_PER_ADDRESS + 4):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.connect((host, int(port)))
        idle.append(s)
    try:
        # the ones past the address's share were closed at accept: they read end of stream
        extra = idle[-1]
        extra.settimeout(5.0)
        assert await asyncio.to_thread(extra.recv, 1) == b""
        assert ta.refused >= 4
        key = block_keys(FP, [7, 7, 7, 7])[0].raw
        await put(a, key, b"z" * 9000)
        assert await tb.fetch(addr, [key], StoreSink(b), timeout=5.0) == [True]
    finally:
        for s in idle:
            s.close()


async def test_a_burst_of_fetches_to_a_new_peer_opens_only_its_connections(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    a, b, ta, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(4 * 20)))]
    for i, k in enumerate(keys):
        await put(a, k, bytes([i]) * 3000)
    done = await asyncio.gather(*(tb.fetch(addr, [k], StoreSink(b), timeout=5.0) for k in keys))
    assert done == [[True]] * len(keys)
    assert len(tb._pools[addr]) <= tb.connections_per_peer  # noqa: SLF001
    assert ta.refused == 0


async def test_connections_to_a_peer_that_left_are_closed_and_forgotten(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    """A peer that left the pool (a new address for a rescheduled pod) had kept its
    connections here, half closed, and their state, until the same address came back."""
    a, b, ta, tb, addr = pair
    key, again = (k.raw for k in block_keys(FP, list(range(8))))  # (a block is four tokens)
    await put(a, key, b"x" * 3000)
    await put(a, again, b"y" * 3000)
    assert await tb.fetch(addr, [key], StoreSink(b), timeout=5.0) == [True]
    conns = list(tb._pools[addr])  # noqa: SLF001
    assert conns and tb.forget({addr}) == 0 and tb._pools[addr] == conns  # noqa: SLF001 - still a peer
    assert tb.forget(set()) == 1
    assert addr not in tb._pools and addr not in tb._opened and addr not in tb._opening  # noqa: SLF001
    assert all(c.sock.fileno() == -1 for c in conns)
    assert await tb.fetch(addr, [again], StoreSink(b), timeout=5.0) == [True]  # back again: a new connection


async def test_a_peer_with_fetches_under_way_is_not_forgotten_under_them(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    """A fetch queued on a busy connection takes it once the fetch before it is done: between
    the two the connection was not in use, and forgetting the address closed it under the
    fetch about to send on it (a miss)."""
    a, b, ta, tb, addr = pair
    tb.connections_per_peer = 1
    keys = [k.raw for k in block_keys(FP, list(range(8)))]
    for k in keys:
        await put(a, k, b"z" * 3000)
    assert await tb.fetch(addr, keys[:1], StoreSink(b), timeout=5.0) == [True]
    (conn,) = tb._pools[addr]  # noqa: SLF001
    await conn.busy.acquire()  # another fetch is on it
    queued = asyncio.create_task(tb.fetch(addr, keys[1:], StoreSink(b), timeout=5.0))
    await asyncio.sleep(0.05)  # queued on the busy connection
    conn.busy.release()  # the other is done; the queued one has not taken it yet
    assert tb.forget(set()) == 0
    assert await queued == [True]
    assert tb.forget(set()) == 1


async def test_a_peer_frame_of_more_lists_than_a_request_holds_is_refused() -> None:
    """Even an authenticated peer's frame is decoded within what a request or an answer's
    header holds: 2,000 lists of 100 empty ones (200 KB on the wire, some 13 MB of Python
    objects) end the connection instead of being built."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    key = os.urandom(32)
    sender, receiver = auth.FrameSeal(key, client=True), auth.FrameSeal(key, client=False)
    try:
        row = b"\xdc" + (100).to_bytes(2, "big") + b"\x90" * 100
        body = b"\x93\x01\x01\xdc" + (2000).to_bytes(2, "big") + row * 2000
        await loop.sock_sendall(b, sender.seal_payload(body))
        with pytest.raises(PeerError, match="lists, maps and items"):
            await tcpwire._recv_sealed(loop, a, receiver)
        await loop.sock_sendall(b, sender.seal([tcpwire.OP_GET, 2, [b"k" * 48] * tcpwire.MAX_KEYS]))  # a full request
        assert len((await tcpwire._recv_sealed(loop, a, receiver))[2]) == tcpwire.MAX_KEYS
        # a full answer's header: every block there, each [size, checksum, tenant]
        answer = [2, 0, [[1 << 20, (1 << 64) - 1, "tenant-of-a-long-name"]] * tcpwire.MAX_KEYS]
        await loop.sock_sendall(b, sender.seal(answer))
        assert await tcpwire._recv_sealed(loop, a, receiver) == answer
    finally:
        a.close()
        b.close()


async def test_a_frame_without_the_connections_key_is_refused_before_any_of_it_is_decoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host on the path (or at a departed member's address, relaying a handshake) sends a
    frame of 16 MiB of lists under a tag it made up: it had been decoded whole, and encoded
    again for its MAC, before it was refused (about a second of the event loop each)."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    decoded: list[int] = []
    real_decode = tcpwire.decode

    def counting(payload: Any, **kw: Any) -> list[Any]:
        decoded.append(len(payload))
        return real_decode(payload, **kw)

    monkeypatch.setattr(tcpwire, "decode", counting)
    receiver = auth.FrameSeal(os.urandom(32), client=False)
    row = b"\xdc" + (4096).to_bytes(2, "big") + b"\x01" * 4096
    bomb = b"\x93\x01\x01\xdc" + (4000).to_bytes(2, "big") + row * 4000 + os.urandom(auth.FRAME_TAG_BYTES)
    assert len(bomb) <= tcpwire.MAX_FRAME
    try:
        sending = loop.create_task(loop.sock_sendall(b, HEADER.pack(len(bomb)) + bomb))
        with pytest.raises(PeerAuthError):
            await tcpwire._recv_sealed(loop, a, receiver)
        await sending
        assert decoded == []
        sender = auth.FrameSeal(receiver.key, client=True)  # the real peer's next frame is still read
        await loop.sock_sendall(b, sender.seal([tcpwire.OP_GET, 3, [b"k" * 48]]))
        assert await tcpwire._recv_sealed(loop, a, receiver) == [tcpwire.OP_GET, 3, [b"k" * 48]] and len(decoded) == 1
    finally:
        a.close()
        b.close()


def test_sendfile_waits_for_room_on_a_descriptor_past_1023(tmp_path: Any) -> None:
    """The sidecar raises its descriptor limit to serve more clients, so a peer's socket may be
    numbered past 1,023, where select(2) refuses it: a sendfile that has to wait for room
    must still finish (it polls)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip("the hard descriptor limit is below 1,100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1050)
    sender = socket.socket(fileno=high)
    a.close()
    data = os.urandom(4 << 20)
    path = tmp_path / "block"
    path.write_bytes(data)
    got = bytearray()

    def drain() -> None:
        while len(got) < len(data):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.001)  # slower than the sender: it meets a full buffer

    reader = threading.Thread(target=drain)
    reader.start()
    fd = os.open(path, os.O_RDONLY)
    try:
        sender.setblocking(False)
        tcpio._sendfile(sender, fd, [(0, len(data))], 10.0)
    finally:
        os.close(fd)
        reader.join(10)
        sender.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert bytes(got) == data


async def test_a_transfer_cancelled_twice_still_waits_for_its_worker() -> None:
    """A deadline, then the requester going away: the second cancellation must not end the
    wait either. A socket shut down still hands over what it had queued, so the worker may
    write into the reserved room after the shutdown, and that room is freed when _bulk ends."""
    left, right = socket.socketpair()
    started, release = threading.Event(), threading.Event()
    wrote: list[float] = []

    def worker(sock: socket.socket) -> None:
        started.set()
        release.wait(10)  # still copying what was queued
        wrote.append(time.monotonic())

    pool = ThreadPoolExecutor(1)
    task = asyncio.get_running_loop().create_task(tcpio._bulk(pool, left, worker))
    try:
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        task.cancel()  # the deadline
        await asyncio.sleep(0.05)
        task.cancel()  # the requester's connection closes
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting for the worker
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert wrote  # the room outlived every write into it
    finally:
        release.set()
        pool.shutdown(wait=True)
        left.close()
        right.close()


@pytest.mark.parametrize("use_sendfile", [False, True])
def test_an_answer_taken_a_trickle_at_a_time_ends_at_its_deadline(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Any, use_sendfile: bool) -> None:
    """A reader that takes the answer slowly (each piece well within the timeout) must not
    hold the sending worker, and the answer's read leases, for as long as it likes: the whole
    answer has a deadline."""
    monkeypatch.setattr(tcpio, "MIN_SEND_RATE", 1 << 40)  # the deadline is the timeout alone
    data = os.urandom(8 << 20)
    path = tmp_path / "arena"
    path.write_bytes(data)
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:  # about 4 MB/s: each 512 KiB piece within the timeout, not all 8 MiB
        while not stop.is_set():
            if not b.recv(1 << 16):
                return
            stop.wait(0.015)

    reader = threading.Thread(target=trickle)
    reader.start()
    fd = os.open(path, os.O_RDONLY)
    block = tcpio.Outgoing([(0, len(data))], [memoryview(data)], auth.Sealer(os.urandom(32)).mac(1, 0, b"k" * 48,
                          len(data), 0, "default"), fd if use_sendfile else None)
    try:
        a.setblocking(False)
        with pytest.raises((PeerError, OSError)):
            tcpio.blocking_send(a, [block], 0.3)
    finally:
        stop.set()
        a.close()
        reader.join(10)
        b.close()
        os.close(fd)


def test_a_receive_cut_short_by_a_bad_mac_keeps_the_whole_blocks_before_it(receive_mode: str) -> None:
    """Three blocks, the second under a MAC for other bytes: the first is kept (its checksum
    in ``sums``), the second is refused and the receive ends there, hashed on the receiving
    thread or on a second one."""
    key = os.urandom(32)
    sealer = auth.Sealer(key)
    blobs = [os.urandom((1 << 20) + 37 * i) for i in range(3)]
    sums_sent = [checksum(memoryview(d)) for d in blobs]
    outgoing = [tcpio.Outgoing([(0, len(d))], [memoryview(d)],
                              sealer.mac(7, i, b"k" * 48, len(d), sums_sent[i] ^ (i == 1), "default"))
                for i, d in enumerate(blobs)]
    dests = [memoryview(bytearray(len(d))) for d in blobs]
    incoming = [([dest], len(d), functools.partial(auth.block_mac, key, 7, i, b"k" * 48, len(d), sums_sent[i],
                                                   "default"))
                for i, (d, dest) in enumerate(zip(blobs, dests))]
    a, b = socket.socketpair()

    def send() -> None:
        with contextlib.suppress(OSError, PeerError):  # the receiver hangs up at the bad block
            tcpio.blocking_send(a, outgoing, 10)

    sender = threading.Thread(target=send)
    hashers = ThreadPoolExecutor(2) if receive_mode == "pipelined" else None
    sums: list[int | None] = []
    try:
        a.setblocking(False)
        sender.start()
        with pytest.raises(PeerAuthError):
            tcpio.blocking_recv(b, incoming, 10, sums, hashers)
        assert sums == [sums_sent[0], None]
        assert bytes(dests[0]) == blobs[0]
    finally:
        b.close()
        sender.join(10)
        a.close()
        if hashers is not None:
            hashers.shutdown()


async def test_what_peers_hold_is_an_account_of_its_own_not_the_default_tenants() -> None:
    """A local client of the ``default`` tenant that holds its whole share of DRAM leaves
    peers' fetches from the node whole; and what is lent to peers never counts against that
    tenant's share (its puts are not refused QUOTA while blocks are lent)."""
    a, b = make_store(settings=StoreSettings(session_share=0.5)), make_store()
    async with serving(a, b) as (_, tb, addr):
        keys = [k.raw for k in block_keys(FP, list(range(4 * 16)))]
        for k in keys:  # 16 x 256 KiB: half of the 8 MiB tier, the default tenant's whole share
            await put(a, k, os.urandom(256 << 10))
        local = a.open_session()
        held = [await a.acquire(local, k) for k in keys]
        assert all(lease is not None for lease in held)
        assert await a.acquire(a.open_session(), keys[0]) is None  # the tenant's share is taken
        assert await tb.fetch(addr, keys[:4], StoreSink(b), timeout=5.0) == [True] * 4
        for lease in held:
            assert lease is not None
            a.release(local, lease.id)
        lender = StoreSource(a)
        lent = await lender.lend(keys)  # everything, held as if on the wire to a peer
        assert all(block is not None for block in lent)
        status, lease = await a.allocate(local, os.urandom(48), 4096)
        assert status == PutStatus.ALLOCATED and lease is not None  # not QUOTA
        a.abort(local, lease.id)
        lender.give_back([block for block in lent if block is not None])


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, record: Callable[[Any], None]) -> None:
    """Wrap ``<name>`` (a blocking send, as the serving side calls it, or a blocking receive,
    as the fetching side does), recording its second argument."""
    module = tcpserve if name == "blocking_send" else tcpfetch
    real = getattr(module, name)

    def spy(sock: socket.socket, blocks: Any, *rest: Any) -> Any:
        record(blocks)
        return real(sock, blocks, *rest)

    monkeypatch.setattr(module, name, spy)


async def test_a_key_repeated_in_a_request_is_lent_and_sent_once(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request naming one block many times had it lent (a read lease each, against the
    lending account) and sent once per copy: its later copies are answered as not held."""
    a, b, _, tb, addr = pair
    key, other = (k.raw for k in block_keys(FP, list(range(8))))
    await put(a, key, b"k" * 9000)
    await put(a, other, b"o" * 7000)
    sent: list[int] = []
    _spy(monkeypatch, "blocking_send", lambda blocks: sent.extend(sum(v.nbytes for v in b.views) for b in blocks))
    done = await tb.fetch(addr, [key] * 100 + [other, key], StoreSink(b), timeout=5.0)
    assert done == [True] + [False] * 99 + [True, False]
    assert sent == [9000, 7000]  # each block on the wire once
    assert a.metrics.counts["get_hit"] == 2  # and lent once
    assert await read(b, key) == b"k" * 9000 and await read(b, other) == b"o" * 7000
    assert await until(lambda: all(e.readers == 0 for e in a._entries.values()))


async def test_the_rest_of_an_answer_with_no_room_here_is_left_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks this node has no room for had each been read into scratch and dropped, on every
    read: once no block left in the answer has room, the connection is closed instead (and
    counted), and the next fetch takes a new one."""
    a, b = make_store(), make_store(1 << 20, settings=StoreSettings(block_max_bytes=8192))
    async with serving(a, b) as (ta, tb, addr):
        keys = [k.raw for k in block_keys(FP, list(range(4 * 7)))]
        sizes = [3000, 20_000, 4000, 20_000, 20_000, 5000, 20_000]  # (b takes no block over 8 KiB)
        for k, size in zip(keys, sizes):
            await put(a, k, bytes([size % 251]) * size)
        taken: list[list[int]] = []
        _spy(monkeypatch, "blocking_recv", lambda blocks: taken.append([size for _, size, _ in blocks]))
        assert await tb.fetch(addr, keys[:5], StoreSink(b), timeout=5.0) == [True, False, True, False, False]
        assert taken == [[3000, 20_000, 4000]]  # up to the last block there is room for
        assert tb.cut_short == 1 and tb._pools[addr] == []  # noqa: SLF001 - closed, not reused
        assert await tb.fetch(addr, [keys[6], keys[3]], StoreSink(b), timeout=5.0) == [False, False]
        assert taken == [[3000, 20_000, 4000]] and tb.cut_short == 2  # nothing taken at all
        assert await tb.fetch(addr, keys[5:6], StoreSink(b), timeout=5.0) == [True]
        assert tb.cut_short == 2 and len(tb._pools[addr]) == 1  # noqa: SLF001 - a whole answer: kept
        kept = [bytes([size % 251]) * size for size in (3000, 4000, 5000)]
        assert [await read(b, keys[i]) for i in (0, 2, 5)] == kept
        assert await until(lambda: all(e.readers == 0 for e in a._entries.values()))  # the holder gave them back


async def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closes ``sock`` within 10 s (its end of stream, or a reset where
    it left bytes unread), nothing read before."""
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), 10) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def test_an_authenticated_connection_that_brings_no_request_is_closed(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay without the secret passes a member's handshake on and keeps the connection:
    it had been served for good (512 of them took every slot, and honest members were
    refused). One that brings no request for ``IDLE_TIMEOUT_S`` is closed."""
    _, _, ta, tb, addr = pair
    monkeypatch.setattr(tcpserve, "IDLE_TIMEOUT_S", 0.2)
    kept = await tb._connect(addr)  # noqa: SLF001 - a member's handshake, and then nothing
    try:
        assert await _closed_by_peer(kept.sock)
        assert await until(lambda: not ta._serving)  # noqa: SLF001 - its slot is back
    finally:
        kept.close()


async def _still_open(sock: socket.socket) -> bool:
    """Whether ``sock`` is open at both ends: nothing to read from it, and no end of stream."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


async def test_one_address_holds_at_most_its_share_of_authenticated_connections(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    """A host at a departed member's address that relays members' handshakes and keeps the
    connections had held every one of the node's 512 slots. Past its address's share, a new
    authenticated connection ends that address's longest idle one."""
    a, b, ta, tb, addr = pair
    ta.max_per_address = 2
    first, second = await tb._connect(addr), await tb._connect(addr)  # noqa: SLF001 - idle, authenticated
    assert await until(lambda: len(ta._authed_from.get("127.0.0.1", ())) == 2)  # noqa: SLF001
    third = await tb._connect(addr)  # noqa: SLF001
    try:
        assert await _closed_by_peer(first.sock)
        assert await _still_open(second.sock) and await _still_open(third.sock)
        assert ta.displaced == 1 and len(ta._authed_from["127.0.0.1"]) == 2  # noqa: SLF001
        keys = [k.raw for k in block_keys(FP, list(range(4)))]
        await put(a, keys[0], b"r" * 5000)
        assert await tb.fetch(addr, keys, StoreSink(b), timeout=5.0) == [True]  # (its own pool: a new one)
    finally:
        for c in (first, second, third, *tb._pools.get(addr, ())):  # noqa: SLF001
            c.close()
    assert await until(lambda: not ta._authed_from)  # noqa: SLF001 - every table goes with its connections


async def test_past_its_share_an_address_whose_connections_are_all_lending_gets_no_more(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection whose peer holds blocks lent between its requests (the Mooncake
    transport's) is never ended for a new one: past the share, the new one is closed."""
    _, _, ta, tb, addr = pair
    ta.max_per_address = 2
    monkeypatch.setattr(ta, "_holds_leases", lambda sock: True)
    first, second = await tb._connect(addr), await tb._connect(addr)  # noqa: SLF001
    assert await until(lambda: len(ta._authed_from.get("127.0.0.1", ())) == 2)  # noqa: SLF001
    third = await tb._connect(addr)  # noqa: SLF001
    try:
        assert await _closed_by_peer(third.sock)
        assert await _still_open(first.sock) and await _still_open(second.sock)
        assert ta.displaced == 1
    finally:
        for c in (first, second, third):
            c.close()


async def test_a_frame_announced_and_not_sent_holds_neither_its_connection_nor_its_length(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """After a member's handshake a relay sent the length of a 16 MiB frame and one byte: the
    node zero-filled 16 MiB for it and waited for the rest for good (32 such took 512 MiB). A
    request longer than one of MAX_KEYS keys is refused at its length, and a frame must
    arrive whole within ``FRAME_TIMEOUT_S`` of its length. The longest request is served."""
    a, b, ta, tb, addr = pair
    monkeypatch.setattr(tcpwire, "FRAME_TIMEOUT_S", 0.2)
    loop = asyncio.get_running_loop()
    too_long, stalled = await tb._connect(addr), await tb._connect(addr)  # noqa: SLF001
    try:
        await loop.sock_sendall(too_long.sock, HEADER.pack(tcpwire.MAX_FRAME) + b"\0")
        await loop.sock_sendall(stalled.sock, HEADER.pack(1000) + b"\0")
        assert [await _closed_by_peer(conn.sock) for conn in (too_long, stalled)] == [True, True]
        assert await until(lambda: not ta._serving)  # noqa: SLF001
    finally:
        too_long.close()
        stalled.close()
    held = block_keys(FP, [8, 8, 8, 8])[0].raw
    await put(a, held, b"h" * 5000)
    keys = [os.urandom(len(held)) for _ in range(tcpwire.MAX_KEYS - 1)] + [held]
    assert await tb.fetch(addr, keys, StoreSink(b), timeout=5.0) == [False] * (tcpwire.MAX_KEYS - 1) + [True]


def _pending(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes waiting to be read."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


async def test_a_frames_buffer_grows_as_its_bytes_arrive() -> None:
    """A frame's buffer had been the length its peer announced, zero-filled before any of it
    came: 16 MiB held for a frame of which one byte was sent. Now what is held is what came."""
    import tracemalloc

    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    tracemalloc.start()
    try:
        b.send(b"x")
        before = tracemalloc.get_traced_memory()[0]
        receiving = loop.create_task(tcpwire._recv_exact(loop, a, tcpwire.MAX_FRAME))
        assert await until(lambda: not _pending(a))  # the byte is taken; the rest is waited for
        held = tracemalloc.get_traced_memory()[0] - before
        rest = os.urandom(tcpwire.MAX_FRAME - 1)
        await loop.sock_sendall(b, rest)
        assert await receiving == b"x" + rest
        assert held < 1 << 20, held
    finally:
        tracemalloc.stop()
        a.close()
        b.close()


async def test_peer_connections_keep_alive_at_both_ends(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str]) -> None:
    """A peer whose host died without a FIN kept its connections, at either end, until a byte
    was sent on them: both ends probe an idle connection."""
    a, b, ta, tb, addr = pair
    key = block_keys(FP, [4, 4, 4, 4])[0].raw
    await put(a, key, b"k" * 5000)
    assert await tb.fetch(addr, [key], StoreSink(b), timeout=5.0) == [True]
    socks = [c.sock for c in tb._pools[addr]] + list(ta._session_keys)  # noqa: SLF001 - fetching, served
    assert len(socks) == 2
    for s in socks:
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == tcpio.KEEPALIVE_IDLE_S
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == tcpio.KEEPALIVE_INTERVAL_S
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == tcpio.KEEPALIVE_PROBES


async def _fetched_then_idle(pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str],
                             monkeypatch: pytest.MonkeyPatch, *, pooled_idle_s: float) -> tuple[list[bytes], Any]:
    """Eight blocks held by the server, the first fetched on a pooled connection that the
    server then closes for its idleness: the keys and that connection."""
    a, b, ta, tb, addr = pair
    monkeypatch.setattr(tcpserve, "IDLE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(tcppool, "POOLED_IDLE_S", pooled_idle_s)
    keys = [k.raw for k in block_keys(FP, list(range(8)))]
    for k in keys:
        await put(a, k, b"p" * 5000)
    assert await tb.fetch(addr, keys[:1], StoreSink(b), timeout=5.0) == [True]
    (conn,) = tb._pools[addr]  # noqa: SLF001
    assert await until(lambda: not ta._serving)  # noqa: SLF001 - closed by the server for its idleness
    return keys, conn


async def test_a_fetch_on_a_pooled_connection_its_server_closed_goes_again_on_a_new_one(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes a connection idle for ``IDLE_TIMEOUT_S`` (or restarts). A client that
    kept it pooled longer (one of an older version) sends its next fetch on a closed
    connection: nothing of the answer came, so the fetch goes again on a new connection and
    its blocks arrive (it had been a miss); the closed one is dropped."""
    a, b, ta, tb, addr = pair
    keys, closed = await _fetched_then_idle(pair, monkeypatch, pooled_idle_s=1e9)  # (kept as long as it likes)
    assert await tb.fetch(addr, keys[1:], StoreSink(b), timeout=5.0) == [True]
    assert closed not in tb._pools[addr] and tb.stale_retries == 1  # noqa: SLF001


async def test_a_fetch_finding_every_pooled_connection_closed_goes_again_on_a_new_one(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that restarted (or closed its idle connections) closed every pooled one: the
    retry opens a new connection rather than take the next closed one from the pool."""
    a, b, ta, tb, addr = pair
    monkeypatch.setattr(tcpserve, "IDLE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(tcppool, "POOLED_IDLE_S", 1e9)
    keys = [k.raw for k in block_keys(FP, list(range(12)))]
    for k in keys:
        await put(a, k, b"s" * 5000)
    assert await asyncio.gather(*(tb.fetch(addr, [k], StoreSink(b), timeout=5.0) for k in keys[:2])) == [[True]] * 2
    assert len(tb._pools[addr]) == 2  # noqa: SLF001 - two pooled connections
    assert await until(lambda: not ta._serving)  # noqa: SLF001 - both closed by the server
    assert await tb.fetch(addr, keys[2:], StoreSink(b), timeout=5.0) == [True]
    assert tb.stale_retries == 1 and len(tb._pools[addr]) == 1  # noqa: SLF001


async def _closing_every_request(loop: asyncio.AbstractEventLoop, sock: socket.socket, body: list[Any]) -> None:
    raise ConnectionResetError("closed on its request")


async def test_a_connection_closed_under_its_first_fetch_is_a_miss_and_a_retry_goes_once(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a connection that had carried an answer whole is taken for stale: a peer that
    closes a new connection on its request is a miss at once, and one that closes every
    connection on its request costs a fetch on a pooled connection one new connection more,
    not a loop of them."""
    a, b, ta, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(12)))]
    for k in keys:
        await put(a, k, b"q" * 5000)
    opened: list[str] = []
    connect = tb._connect  # noqa: SLF001

    async def counting(address: str) -> Any:
        opened.append(address)
        return await connect(address)

    monkeypatch.setattr(tb, "_connect", counting)
    assert await tb.fetch(addr, keys[:1], StoreSink(b), timeout=5.0) == [True]
    monkeypatch.setattr(ta, "_answer", _closing_every_request)
    assert await tb.fetch(addr, keys[1:2], StoreSink(b), timeout=5.0) == [False]  # pooled: stale, then a new one
    assert len(opened) == 2 and tb.stale_retries == 1
    assert await tb.fetch(addr, keys[2:], StoreSink(b), timeout=5.0) == [False]  # new, so never retried
    assert len(opened) == 3 and tb.stale_retries == 1


async def test_a_pooled_connection_idle_past_its_limit_is_replaced_before_its_server_closes_it(
        pair: tuple[TieredStore, TieredStore, TcpTransport, TcpTransport, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A client opens a new connection instead of one not leased for ``POOLED_IDLE_S`` (half
    the server's ``IDLE_TIMEOUT_S``): its fetches never find one closed under them for its
    idleness, and miss nothing."""
    a, b, ta, tb, addr = pair
    keys, old = await _fetched_then_idle(pair, monkeypatch, pooled_idle_s=0.0)  # (every idle one is past it)
    assert await tb.fetch(addr, keys[1:], StoreSink(b), timeout=5.0) == [True]
    assert old.sock.fileno() == -1 and tb._pools[addr] != [old]  # noqa: SLF001 - closed here too, replaced


async def test_an_answer_never_read_gives_its_leases_back_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member (or a relay passing a member's request on) asks for 4,096 held blocks and never
    reads: the answer's header was sent without a deadline (only its blocks had one), so
    every block stayed lent, 4,096 read leases in the lending account, for good. The header
    goes within the answer's deadline; past it the connection is closed and the leases go back."""
    monkeypatch.setattr(tcpserve, "SEND_TIMEOUT_S", 1.0)
    monkeypatch.setattr(tcpio, "MIN_SEND_RATE", 1 << 40)  # the deadline is the timeout alone
    real_tune = tcpio.tune

    def small_send_buffer(sock: socket.socket, *, receiver: bool) -> None:
        real_tune(sock, receiver=receiver)
        if not receiver:  # (the header, some 90 KB, never fits what the kernel holds for it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    monkeypatch.setattr(tcpserve, "tune", small_send_buffer)
    bulk: list[int] = []
    _spy(monkeypatch, "blocking_send", lambda blocks: bulk.append(len(blocks)))
    a, b = make_store(64 << 20, settings=StoreSettings(session_share=0.5)), make_store()
    keys = [k.raw for k in block_keys(FP, list(range(4 * tcpwire.MAX_KEYS)))]
    for k in keys:
        await put(a, k, b"n" * 4096)
    async with serving(a, b) as (ta, _, addr):
        s = await ask_and_never_read(addr, TOKEN, tcpwire.OP_GET, keys)
        try:
            assert await until(lambda: a.metrics.counts["get_hit"] == len(keys), 10)  # all of them lent
            assert await until(lambda: all(e.readers == 0 for e in a._entries.values()), 10)
            assert await until(lambda: not ta._serving)  # noqa: SLF001 - and the connection closed
            assert bulk == []  # (the header never went)
        finally:
            s.close()


async def test_an_answer_waiting_for_a_send_worker_past_its_deadline_gives_its_leases_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every send worker is busy: an answer's blocks wait for one with their read leases held.
    Past the answer's deadline the wait ends, the connection is closed and the leases go
    back; the fetching node reads misses."""
    monkeypatch.setattr(tcpserve, "SEND_TIMEOUT_S", 0.5)
    monkeypatch.setattr(tcpio, "MIN_SEND_RATE", 1 << 40)
    a, b = make_store(), make_store()
    keys = [k.raw for k in block_keys(FP, list(range(16)))]
    for k in keys:
        await put(a, k, b"w" * 5000)
    gate = threading.Event()
    async with serving(a, b) as (ta, tb, addr):
        try:
            for _ in range(BULK_WORKERS):
                ta._send_workers.submit(gate.wait, 30)  # noqa: SLF001
            fetch = asyncio.get_running_loop().create_task(tb.fetch(addr, keys, StoreSink(b), timeout=20.0))
            assert await until(lambda: a.metrics.counts["get_hit"] == len(keys), 10)  # all of them lent
            assert await until(lambda: all(e.readers == 0 for e in a._entries.values()), 10)
            assert await fetch == [False] * len(keys)
        finally:
            gate.set()
