"""The Mooncake peer transport (in its TCP mode) between two in-process stores."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mooncake.engine", reason="the Mooncake Transfer Engine package is not installed")

from kvpool_client.keys import ModelFingerprint, block_keys  # noqa: E402
from kvpool_client.protocol import HEADER, ProtocolError, decode, encode  # noqa: E402
from kvpool_sidecar.config import PeerSettings, SidecarSettings  # noqa: E402
from kvpool_sidecar.membership import make_transport  # noqa: E402
from kvpool_sidecar.peers import StoreSink, StoreSource  # noqa: E402
from kvpool_sidecar.store import TieredStore  # noqa: E402
from kvpool_sidecar.transfer.base import OutgoingBlock  # noqa: E402
from kvpool_sidecar.transfer.mooncake import (  # noqa: E402
    ADDRESS_LIMIT, OP_LOOKUP, OP_RELEASE, MooncakeTransport, MooncakeUnavailable, Piece, _macs, answer_cut,
    pair_extents,
)
from kvpool_sidecar.transfer import auth  # noqa: E402
from kvpool_sidecar.transfer import mooncake as mooncake_module  # noqa: E402
from tests.unit.store_support import close_store, dram, dram_place  # noqa: E402
from tests.unit.store_support import make_store as _make_store  # noqa: E402
from tests.unit.store_support import ask_and_never_read, put, read, until  # noqa: E402
from kvpool_sidecar.transfer.tcp import TcpTransport  # noqa: E402
from kvpool_sidecar.transfer.tcppool import _Conn  # noqa: E402
from kvpool_sidecar.transfer.tcpwire import FRAME_OBJECTS, MAGIC, MAX_KEYS, _recv_sealed  # noqa: E402

TOKEN = b"0123456789abcdef-pool-secret"
FP = ModelFingerprint("m", "bf16", 4, "bytes")
PAGE = 4096


def fragment(store: TieredStore, free_pages: int, hole: int) -> None:
    """Take every page, then free ``free_pages`` in runs of ``hole``: blocks must span many extents."""
    taken = []
    while (ext := dram(store).allocate(PAGE)) is not None:
        taken.append(ext)
    freed = 0
    for i, ext in enumerate(taken):
        if freed < free_pages and i % (hole + 1) < hole:
            dram(store).free(ext)
            freed += 1


def make_store(size: int = 16 << 20, spaces: list[str] | None = None) -> TieredStore:
    return _make_store(size, PAGE, spaces=spaces)


def transport(**kw: object) -> MooncakeTransport:
    try:
        return MooncakeTransport(TOKEN, protocol="tcp", **kw)  # type: ignore[arg-type]
    except MooncakeUnavailable as e:
        pytest.skip(f"the Mooncake engine cannot start here: {e}")


def readers(store: TieredStore) -> int:
    return sum(e.readers for e in store._entries.values())


Pair = tuple[TieredStore, TieredStore, MooncakeTransport, MooncakeTransport, str]


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    a, b = make_store(), make_store()
    ta, tb = transport(lease_timeout_s=0.5), transport()
    addr = await ta.start(StoreSource(a))
    yield a, b, ta, tb, addr
    await ta.close()
    await tb.close()
    close_store(a)
    close_store(b)


def test_pair_extents_cuts_and_merges() -> None:
    local = [(1000, 10), (2000, 30)]
    remote = [(5000, 25), (9000, 15)]
    want: list[Piece] = [(1000, 5000, 10), (2000, 5010, 15), (2015, 9000, 15)]
    assert pair_extents(local, remote) == want
    assert pair_extents([(0, 8), (8, 8)], [(100, 4), (104, 12)]) == [(0, 100, 16)]  # contiguous both sides


async def test_make_transport_builds_it(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(TOKEN)
    settings = dataclasses.replace(SidecarSettings(), peer=PeerSettings(transport="rdma", token_file=str(token),
                                                                        port=0))
    t = make_transport(settings)
    try:
        if not isinstance(t, MooncakeTransport):
            pytest.skip("the Mooncake engine cannot start here (make_transport fell back to tcp)")
        assert t.protocol in ("rdma", "tcp") and t.segment.endswith(f":{t._engine.get_rpc_port()}")
    finally:
        await t.close()


async def test_round_trip_of_mixed_and_multi_extent_blocks(pair: Pair) -> None:
    a, b, ta, tb, addr = pair
    fragment(a, 1500, 1)
    fragment(b, 1500, 3)
    keys = [k.raw for k in block_keys(FP, list(range(4 * 60)))]
    blobs = [os.urandom(PAGE * (i % 7 + 1) + (i * 37) % PAGE + 1) for i in range(len(keys))]
    for k, d in zip(keys, blobs):
        await put(a, k, d)
    assert sum(len(dram_place(a, e) or []) > 1 for e in a._entries.values()) > 10  # multi-extent blocks exist
    missing = os.urandom(48)
    done = await tb.fetch(addr, [*keys, missing], StoreSink(b), timeout=10.0)
    assert done == [True] * len(keys) + [False]
    assert sum(len(dram_place(b, e) or []) > 1 for e in b._entries.values()) > 10
    for k, d in zip(keys, blobs):
        assert await read(b, k) == d
    assert readers(a) == 0  # RELEASE was acknowledged before fetch returned
    assert all(not held for held in ta._held.values())
    # the same connection again, into another store (a second registered arena), and a plain TCP client
    c, e = make_store(), make_store()
    tcp = TcpTransport(TOKEN)
    try:
        assert await tb.fetch(addr, keys[:3], StoreSink(c), timeout=5.0) == [True] * 3
        assert await read(c, keys[2]) == blobs[2]
        assert await tcp.fetch(addr, keys[:5], StoreSink(e), timeout=5.0) == [True] * 5
        assert await read(e, keys[4]) == blobs[4]
    finally:
        await tcp.close()
        await tb.close()  # unregisters c's arena before it goes
        close_store(c)
        close_store(e)


async def test_wrong_token_is_rejected(pair: Pair) -> None:
    a, b, ta, _, addr = pair
    key = block_keys(FP, [1, 2, 3, 4])[0].raw
    await put(a, key, b"x" * 5000)
    intruder = MooncakeTransport(b"not-the-pool-secret-at-all", protocol="tcp")
    try:
        assert await intruder.fetch(addr, [key], StoreSink(b), timeout=2.0) == [False]
    finally:
        await intruder.close()
    assert not b.contains(key)
    # a client that answers the challenge with a proof made from the wrong secret, then asks anyway
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    nonce = os.urandom(32)
    writer.write(MAGIC + nonce)
    server_nonce = (await asyncio.wait_for(reader.readexactly(64), 5))[:32]
    writer.write(auth.proof(b"wrong-secret-wrong-secret", False, server_nonce, nonce) + encode([OP_LOOKUP, 1, [key]]))
    try:
        answer = await asyncio.wait_for(reader.read(100), 5)
    except ConnectionResetError:
        answer = b""
    writer.close()
    assert answer == b""
    assert ta.rejected == 1
    assert readers(a) == 0


async def test_blocks_without_the_connections_mac_are_dropped(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A LOOKUP answer whose MACs were not made with the connection's key (a node relaying
    someone else's handshake cannot make them): no block is committed."""
    from kvpool_sidecar.transfer import mooncake

    a, b, _, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(4 * 4)))]
    for k in keys:
        await put(a, k, os.urandom(2 * PAGE + 7))
    real = mooncake._macs
    monkeypatch.setattr(mooncake, "_macs", lambda key, *rest: real(os.urandom(32), *rest))
    assert await tb.fetch(addr, keys, StoreSink(b), timeout=5.0) == [False] * 4
    assert not any(b.contains(k) for k in keys) and dram(b).used_bytes == 0
    monkeypatch.setattr(mooncake, "_macs", real)
    assert await tb.fetch(addr, keys, StoreSink(b), timeout=5.0) == [True] * 4


async def test_a_lying_peer_yields_misses(pair: Pair) -> None:
    a, b, _, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(4 * 6)))]
    for k in keys:
        await put(a, k, os.urandom(3 * PAGE + 100))
    assert dram(a).arena is not None
    for k in keys[::2]:  # rot the bytes behind the committed checksums
        off = (dram_place(a, k) or [])[-1][0]
        dram(a).arena.view[off] ^= 0xFF
    done = await tb.fetch(addr, keys, StoreSink(b), timeout=5.0)
    assert done == [False, True] * 3
    assert not any(b.contains(k) for k in keys[::2])
    assert dram(b).used_bytes == 3 * 4 * PAGE  # only the honest blocks' room is kept
    assert readers(a) == 0


class FarAddresses(MooncakeTransport):
    """A peer holding the pool's secret that answers a real block (its MAC right) at
    addresses ``base + offset`` past the 64-bit address space."""

    base = ADDRESS_LIMIT // 2

    async def _lookup(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, body: list[Any]) -> None:
        rid, keys = body[1], body[2]
        assert self._source is not None
        blocks = await self._source.lend(keys[:1])
        b = blocks[0]
        assert b is not None
        mac = _macs(self._session_keys[sock], rid, keys, blocks)[0]
        items = [[b.size, b.checksum, b.tenant, [[self.base, b.size]], mac]]
        self._source.give_back(blocks)
        await loop.sock_sendall(sock, self._frames[sock].seal([rid, 0, self.segment, self.base, items]))


@pytest.mark.parametrize("base", [ADDRESS_LIMIT // 2, ADDRESS_LIMIT, -1])
async def test_a_peer_answering_addresses_out_of_range_is_a_miss(base: int) -> None:
    """An answer whose extents lie past 64 bits (or whose base is out of range) is a malformed
    answer: a miss within the deadline. It had reached the engine as a TypeError, and the
    local client's read was answered INTERNAL."""
    a, b = make_store(), make_store()
    try:
        hostile = FarAddresses(TOKEN, protocol="tcp")
    except MooncakeUnavailable as e:
        pytest.skip(f"the Mooncake engine cannot start here: {e}")
    hostile.base = base
    tb = transport()
    try:
        addr = await hostile.start(StoreSource(a))
        keys = [k.raw for k in block_keys(FP, list(range(4 * 2)))]
        for k in keys:
            await put(a, k, os.urandom(2 * PAGE))
        assert await tb.fetch(addr, keys, StoreSink(b), timeout=2.0) == [False, False]
        assert dram(b).used_bytes == 0 and not any(b.contains(k) for k in keys)
    finally:
        await hostile.close()
        await tb.close()
        close_store(a)
        close_store(b)


async def test_an_unforeseen_error_in_a_fetch_is_a_miss(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong while a peer's answer is read, its blocks miss: the error never
    reaches the local client that asked (a task guard)."""
    a, b, _, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(4 * 2)))]
    for k in keys:
        await put(a, k, os.urandom(2 * PAGE))

    def broken(*_: Any) -> list[Piece]:
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(mooncake_module, "pair_extents", broken)
    assert await tb.fetch(addr, keys, StoreSink(b), timeout=2.0) == [False, False]
    assert not any(b.contains(k) for k in keys)
    assert dram(b).used_bytes == 0 and not b._pending  # noqa: SLF001 - the room it took went back


async def test_blocks_read_are_verified_off_the_event_loop(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round may hold 2,048 blocks of 2 MiB: checksummed and MAC'd on the event loop, it
    held every other client of the sidecar for about a second."""
    a, b, _, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(4 * 3)))]
    for k in keys:
        await put(a, k, os.urandom(2 * PAGE))
    threads: list[int] = []
    real = mooncake_module.checksum

    def recorded(views: Any) -> int:
        threads.append(threading.get_ident())
        return real(views)

    monkeypatch.setattr(mooncake_module, "checksum", recorded)
    assert await tb.fetch(addr, keys, StoreSink(b), timeout=5.0) == [True] * 3
    assert len(threads) == 3 and threading.get_ident() not in threads


def test_a_lookup_answer_holds_what_a_peer_frame_may_decode_into() -> None:
    one = OutgoingBlock(os.urandom(48), PAGE, 1, "default", [memoryview(bytearray(PAGE))], [(0, PAGE)], None)
    many = OutgoingBlock(os.urandom(48), 16 * PAGE, 2, "default", [memoryview(bytearray(PAGE)) for _ in range(16)],
                         [(2 * k * PAGE, PAGE) for k in range(16)], None)
    for blocks in ([one] * MAX_KEYS, [many] * 600, [None, one, many] * 1365):
        cut = answer_cut(blocks)
        assert 0 < cut < len(blocks)

        def frame(n: int) -> bytes:
            items = [None if b is None else [b.size, b.checksum, b.tenant, [[2**47 + k * PAGE, v.nbytes]
                                                                            for k, v in enumerate(b.views)],
                                             os.urandom(auth.MAC_BYTES)]
                     for b in blocks[:n]]
            return encode([2**63 - 1, 0, "127.0.0.1:12345", 0, items, os.urandom(16)])[HEADER.size:]

        decode(frame(cut), max_items=MAX_KEYS, max_map=0, max_objects=FRAME_OBJECTS)  # the peer takes it
        with pytest.raises(ProtocolError):  # and one block more it would refuse
            decode(frame(cut + 1), max_items=MAX_KEYS, max_map=0, max_objects=FRAME_OBJECTS)
    assert answer_cut([None] * MAX_KEYS) == MAX_KEYS
    assert answer_cut([many] * 3) == 3
    widest = OutgoingBlock(os.urandom(48), MAX_KEYS * PAGE, 3, "default", [memoryview(b"x")] * MAX_KEYS,
                           [(2 * k * PAGE, PAGE) for k in range(MAX_KEYS)], None)
    assert answer_cut([widest] * 3) == 2  # blocks of as many extents as a list may hold: two fit a frame


async def test_a_fetch_of_more_blocks_than_one_answer_holds_asks_again_for_the_rest() -> None:
    # 2,500 blocks of one extent, then 600 of 16 (a fragmented arena): neither fits one answer
    a, b = make_store(128 << 20), make_store(64 << 20)
    ta, tb = transport(), transport()
    addr = await ta.start(StoreSource(a))
    rounds = 0
    real = ta._lookup

    async def counted(*args: object) -> None:
        nonlocal rounds
        rounds += 1
        await real(*args)  # type: ignore[arg-type]

    ta._lookup = counted  # type: ignore[method-assign]
    source = ta._source
    assert source is not None
    lent = 0
    real_lend = source.lend

    async def lend(keys: Any) -> Any:
        nonlocal lent
        lent += len(keys)
        return await real_lend(keys)

    source.lend = lend  # type: ignore[method-assign]
    try:
        small = [k.raw for k in block_keys(FP, list(range(4 * 2500)))]
        for i, k in enumerate(small):
            await put(a, k, bytes([i % 251]) * 1000)
        done = await tb.fetch(addr, [*small, os.urandom(48)], StoreSink(b), timeout=20.0)
        assert done == [True] * 2500 + [False]
        assert rounds == 2 and lent == 2501  # (each block lent once: lending reads it and counts a hit)
        fragment(a, 9600, 1)
        large = [k.raw for k in block_keys(FP, list(range(10**6, 10**6 + 4 * 600)))]
        blobs = [os.urandom(16 * PAGE) for _ in large]
        for k, d in zip(large, blobs):
            await put(a, k, d)
        assert min(len(dram_place(a, k) or []) for k in large) == 16
        rounds = 0
        assert await tb.fetch(addr, large, StoreSink(b), timeout=20.0) == [True] * len(large)
        assert rounds == 2
        for k, d in list(zip(large, blobs))[::50]:
            assert await read(b, k) == d
        assert await read(b, small[-2]) == bytes([2498 % 251]) * 1000
        assert readers(a) == 0
        assert all(not held for held in ta._held.values())
    finally:
        await ta.close()
        await tb.close()
        close_store(a)
        close_store(b)


async def lookup(tb: MooncakeTransport, addr: str, keys: list[bytes]) -> tuple[_Conn, list[object]]:
    conn = await tb._connect(addr)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(conn.sock, conn.frames.seal([OP_LOOKUP, 7, keys]))
    return conn, await _recv_sealed(loop, conn.sock, conn.frames)


async def test_leases_are_released_on_disconnect_and_on_timeout(pair: Pair) -> None:
    a, _, ta, tb, addr = pair
    keys = [k.raw for k in block_keys(FP, list(range(8)))]
    for k in keys:
        await put(a, k, os.urandom(5000))
    conn, answer = await lookup(tb, addr, keys)
    assert answer[2] == ta.segment and readers(a) == 2
    conn.close()  # a client that dies without RELEASE
    assert await until(lambda: readers(a) == 0)
    conn, _ = await lookup(tb, addr, keys)  # a client that stalls: the lease timeout (0.5 s) frees them
    try:
        assert readers(a) == 2
        assert await until(lambda: readers(a) == 0, 3.0)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(conn.sock, conn.frames.seal([OP_RELEASE, 7]))
        assert (await _recv_sealed(loop, conn.sock, conn.frames))[2] is False  # already released
    finally:
        conn.close()


async def test_dead_silent_and_stuck_peers_are_misses_within_the_deadline(pair: Pair) -> None:
    a, b, _, tb, addr = pair
    key = block_keys(FP, [1, 2, 3, 4])[0].raw
    await put(a, key, os.urandom(20000))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = probe.getsockname()[1]
    probe.close()
    assert await asyncio.wait_for(tb.fetch(f"127.0.0.1:{dead}", [key], StoreSink(b), timeout=1.0), 30) == [False]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        fetch = tb.fetch(f"127.0.0.1:{silent.getsockname()[1]}", [key], StoreSink(b), timeout=0.5)
        assert await asyncio.wait_for(fetch, 30) == [False]
    finally:
        silent.close()
    # the control path answers but the data transfer hangs past the deadline
    real = tb._read

    def stuck(segment: str, pieces: list[Piece]) -> int:
        time.sleep(1.5)
        return real(segment, pieces)

    tb._read = stuck  # type: ignore[method-assign]
    tb.failed_read_quarantine_s = 0.2  # (120 s in production: past the engine's own timeouts)
    start = time.monotonic()
    assert await tb.fetch(addr, [key], StoreSink(b), timeout=0.5) == [False]
    assert time.monotonic() - start < 1.2
    assert dram(b).used_bytes > 0  # the room stays reserved while the engine may still write into it
    assert await until(lambda: dram(b).used_bytes == 0)  # and is given back once the read has ended
    assert not b.contains(key)
    tb._read = real  # type: ignore[method-assign]


async def test_a_failed_read_keeps_its_room_for_the_quarantine(pair: Pair) -> None:
    a, b, _, tb, addr = pair
    key = block_keys(FP, [1, 2, 3, 4])[0].raw
    await put(a, key, os.urandom(20000))
    # the engine reports the batch failed while other slices may still be landing
    tb._read = lambda segment, pieces: -1  # type: ignore[method-assign,assignment]
    tb.failed_read_quarantine_s = 0.5
    assert await tb.fetch(addr, [key], StoreSink(b), timeout=5.0) == [False]
    assert dram(b).used_bytes > 0  # not reused at once: a late slice would land in another block
    assert await until(lambda: dram(b).used_bytes == 0, 5.0)
    assert not b.contains(key)
    assert await until(lambda: readers(a) == 0)  # the dropped connection freed the source's leases


def hang_reads(tb: MooncakeTransport, segment: str, wait: Callable[[], object]) -> Callable[[str, list[Piece]], int]:
    """Make ``tb``'s reads from ``segment`` first ``wait()`` (a hung peer); returns the real read."""
    real = tb._read

    def hanging(seg: str, pieces: list[Piece]) -> int:
        if seg == segment:
            wait()
        return real(seg, pieces)

    tb._read = hanging  # type: ignore[method-assign]
    return real


async def test_the_room_of_a_read_that_never_started_is_given_back_at_once() -> None:
    """A fetch that runs out of time while its read still waits for a worker: the read never
    runs, so its room goes back now (it had been held for the whole quarantine, 120 s)."""
    a, c, b = make_store(), make_store(), make_store()
    ta, tc, tb = transport(), transport(), transport(workers=1)
    release = threading.Event()
    try:
        addr_a, addr_c = await ta.start(StoreSource(a)), await tc.start(StoreSource(c))
        ka, kc = block_keys(FP, [1, 2, 3, 4])[0].raw, block_keys(FP, [5, 6, 7, 8])[0].raw
        await put(a, ka, os.urandom(20000))
        await put(c, kc, os.urandom(20000))
        hang_reads(tb, tc.segment, lambda: release.wait(10))
        tb.failed_read_quarantine_s = 60.0
        hung = asyncio.ensure_future(tb.fetch(addr_c, [kc], StoreSink(b), timeout=10.0))
        assert await until(lambda: len(tb._running) == 1)  # the only worker is taken
        assert await tb.fetch(addr_a, [ka], StoreSink(b), timeout=0.5) == [False]  # queued, then out of time
        assert await until(lambda: ka not in b._pending, 2.0)  # its room is back, long before 60 s
        release.set()
        assert await hung == [True]
    finally:
        release.set()
        for t in (ta, tc, tb):
            await t.close()
        for s in (a, b, c):
            close_store(s)


async def test_throughput_against_the_tcp_transport(capsys: pytest.CaptureFixture[str]) -> None:
    n, size = 16, 4 << 20
    a = make_store(80 << 20)
    keys = [k.raw for k in block_keys(FP, list(range(4 * n)))]
    for k in keys:
        await put(a, k, os.urandom(size))
    tm, tt, client_m, client_t = transport(), TcpTransport(TOKEN), transport(), TcpTransport(TOKEN)
    addr_m, addr_t = await tm.start(StoreSource(a)), await tt.start(StoreSource(a))
    results: dict[str, float] = {}
    try:
        for label, client, addr in (("mooncake/tcp", client_m, addr_m), ("tcp", client_t, addr_t)):
            best = 0.0
            for _ in range(3):
                b = make_store(80 << 20)
                try:
                    start = time.perf_counter()
                    done = await client.fetch(addr, keys, StoreSink(b), timeout=30.0)
                    elapsed = time.perf_counter() - start
                finally:
                    close_store(b)
                assert all(done)
                best = max(best, n * size / elapsed / 1e9)
            results[label] = best
    finally:
        for t in (tm, tt, client_m, client_t):
            await t.close()
        close_store(a)
    with capsys.disabled():
        print("\n16 x 4 MiB peer fetch, best of 3: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in results.items()))


async def test_a_node_on_plain_tcp_is_read_by_get() -> None:
    """A node that fell back to TCP answers LOOKUP as unknown; a mooncake node then GETs."""
    a, b = make_store(), make_store()
    plain, tb = TcpTransport(TOKEN), transport()
    try:
        addr = await plain.start(StoreSource(a))
        keys = [k.raw for k in block_keys(FP, list(range(4 * 3)))]
        blobs = [os.urandom(30000 + i) for i in range(3)]
        for k, d in zip(keys, blobs):
            await put(a, k, d)
        assert await tb.fetch(addr, keys[:2], StoreSink(b), timeout=5.0) == [True, True]
        assert all(c.plain for c in tb._pools[addr])
        assert await tb.fetch(addr, keys[2:], StoreSink(b), timeout=5.0) == [True]  # by GET at once
        for k, d in zip(keys, blobs):
            assert await read(b, k) == d
        assert len(tb._pools[addr]) == 1  # the connection stayed in use: nothing was cut
    finally:
        await plain.close()
        await tb.close()
        close_store(a)
        close_store(b)


async def test_a_hung_peer_cannot_starve_fetches_from_the_others() -> None:
    a, c, b = make_store(), make_store(), make_store()
    ta, tc, tb = transport(), transport(), transport(workers=4)  # at most one read per peer
    try:
        assert tb.reads_per_peer == 1
        addr_a, addr_c = await ta.start(StoreSource(a)), await tc.start(StoreSource(c))
        ka = [block_keys(FP, list(range(i * 100, i * 100 + 4)))[0].raw for i in range(1, 6)]
        kc = block_keys(FP, [900, 901, 902, 903])[0].raw
        for k in ka:
            await put(a, k, os.urandom(20000))
        await put(c, kc, os.urandom(20000))
        real = hang_reads(tb, ta.segment, lambda: time.sleep(2.0))
        tb.failed_read_quarantine_s = 0.2
        # a read from a hangs past its deadline; the next fetches from a are refused at once
        # (without the limit each would take one of the four workers), leaving nothing behind
        assert await tb.fetch(addr_a, [ka[0]], StoreSink(b), timeout=0.25) == [False]
        for k in ka[1:4]:
            assert await tb.fetch(addr_a, [k], StoreSink(b), timeout=1.0) == [False]
            assert k not in b._pending
        assert sum(not f.done() for f in tb._running) == 1  # only the hung read holds a worker
        assert len(tb._pools[addr_a]) >= 1  # refusals keep their connection
        assert await tb.fetch(addr_c, [kc], StoreSink(b), timeout=1.0) == [True]  # c is served
        tb._read = real  # type: ignore[method-assign]
        assert await until(lambda: not any(not f.done() for f in tb._running), 5.0)
        assert await until(lambda: ka[0] not in b._pending, 5.0)  # the hung read's quarantine ended
        assert await tb.fetch(addr_a, ka, StoreSink(b), timeout=5.0) == [True] * 5  # a healthy again
        assert not b._pending
    finally:
        for t in (ta, tc, tb):
            await t.close()
        for s in (a, b, c):
            close_store(s)


async def test_a_read_dropped_by_close_before_it_started_is_a_miss() -> None:
    import concurrent.futures
    import threading

    tb = transport()
    gate = threading.Event()
    try:
        tb._pool = concurrent.futures.ThreadPoolExecutor(1)  # one worker, kept busy
        tb._pool.submit(gate.wait, 10)
        late: list[bool] = []
        reading = asyncio.ensure_future(tb._transfer("peer:1", [(0, 0, 1)], lambda: late.append(True)))
        await asyncio.sleep(0.05)  # queued behind the busy worker
        tb._pool.shutdown(wait=False, cancel_futures=True)  # as close() does
        assert await asyncio.wait_for(reading, 5) is None  # not started: a plain miss
        assert late == []
    finally:
        gate.set()
        await tb.close()


async def test_blocks_of_another_key_space_go_arena_to_arena() -> None:
    """Each side keeps one arena per key space; a block of tenant b is read from b's arena
    on one node into b's arena on the other (the addresses name the arena)."""
    a, b = make_store(spaces=["default", "b"]), make_store(spaces=["default", "b"])
    ta, tb = transport(), transport()
    try:
        addr = await ta.start(StoreSource(a))
        keys = [k.raw for k in block_keys(FP, list(range(4 * 3)))]
        blobs = [os.urandom(PAGE * 2 + i) for i in range(len(keys))]
        for i, (k, d) in enumerate(zip(keys, blobs)):
            await put(a, k, d, tenant="b" if i % 2 else "default")
        assert await tb.fetch(addr, keys, StoreSink(b), timeout=10.0) == [True] * len(keys)
        for i, (k, d) in enumerate(zip(keys, blobs)):
            assert await read(b, k) == d
            e = b._entries[k]
            assert e.tenant == ("b" if i % 2 else "default") and dram_place(b, e) is not None
            arena, _ = dram(b).file_extents(dram_place(b, e) or [])
            assert arena is dram(b).arenas[i % 2]
    finally:
        await ta.close()
        await tb.close()
        close_store(a)
        close_store(b)


async def test_a_key_repeated_in_a_lookup_is_lent_once(pair: Pair) -> None:
    """A lookup naming one block many times had it lent (a read lease each, held until its
    release, against the lending account) once per copy: its later copies answer nil."""
    a, _, _, tb, addr = pair
    key, other = (k.raw for k in block_keys(FP, list(range(8))))
    await put(a, key, os.urandom(5000))
    await put(a, other, os.urandom(6000))
    conn, answer = await lookup(tb, addr, [key] * 100 + [other, key])
    try:
        items = answer[4]
        assert isinstance(items, list) and len(items) == 102
        assert [item is not None for item in items] == [True] + [False] * 99 + [True, False]
        assert readers(a) == 2
    finally:
        conn.close()
    assert await until(lambda: readers(a) == 0)


async def test_a_lookup_answer_never_read_closes_its_connection_at_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A member asks for many held blocks and never reads: the LOOKUP's answer had been sent
    with no deadline, the connection (one of the node's slots) held for good. Past the send
    deadline it is closed, and the blocks' leases go back with it."""
    from kvpool_sidecar.transfer import tcpserve

    monkeypatch.setattr(tcpserve, "SEND_TIMEOUT_S", 1.0)
    real_tune = tcpserve.tune

    def small_send_buffer(sock: socket.socket, *, receiver: bool) -> None:
        real_tune(sock, receiver=receiver)
        if not receiver:  # (the answer, some hundreds of KB, never fits what the kernel holds)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    monkeypatch.setattr(tcpserve, "tune", small_send_buffer)
    a = make_store(64 << 20)
    ta = transport(lease_timeout_s=60.0)  # (the leases outlast the test: only the close frees them)
    keys = [k.raw for k in block_keys(FP, list(range(4 * 2048)))]
    try:
        for k in keys[:2048]:
            await put(a, k, b"m" * 4096)
        addr = await ta.start(StoreSource(a))
        s = await ask_and_never_read(addr, TOKEN, OP_LOOKUP, keys[:2048])
        try:
            assert await until(lambda: readers(a) > 0, 10)  # lent
            assert await until(lambda: not ta._serving, 10)  # noqa: SLF001 - closed at the deadline
            assert await until(lambda: readers(a) == 0, 10)
        finally:
            s.close()
    finally:
        await ta.close()
        close_store(a)


async def test_a_connection_holding_lent_blocks_is_never_ended_for_a_new_one_from_its_address() -> None:
    """Past an address's share of authenticated connections a new one ends its longest idle
    one; a connection between a LOOKUP and its RELEASE is not idle (its peer may be reading
    the lent blocks from this node's memory right then): the new one is closed instead, and
    the lent blocks stay lent."""
    a = make_store()
    ta = transport(lease_timeout_s=60.0)
    keys = [k.raw for k in block_keys(FP, list(range(4)))]
    try:
        await put(a, keys[0], b"n" * 4096)
        addr = await ta.start(StoreSource(a))
        ta.max_per_address = 1
        holder = await ask_and_never_read(addr, TOKEN, OP_LOOKUP, keys[:1])  # (an answer this small is sent whole)
        try:
            assert await until(lambda: readers(a) == 1, 10)
            assert await until(lambda: ta._authed_from.get("127.0.0.1") and all(  # noqa: SLF001 - waiting, lending
                not idle for idle in ta._authed_from["127.0.0.1"].values()), 10)  # noqa: SLF001
            newcomer = await ask_and_never_read(addr, TOKEN, OP_LOOKUP, keys[:1])
            try:
                assert await until(lambda: ta.displaced == 1, 10)
                assert await until(lambda: len(ta._serving) == 1, 10)  # noqa: SLF001 - the new one closed
                assert readers(a) == 1  # the holder's lease stays
            finally:
                newcomer.close()
        finally:
            holder.close()
    finally:
        await ta.close()
        close_store(a)
