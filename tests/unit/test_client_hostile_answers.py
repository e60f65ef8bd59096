"""The client library against answers no real sidecar sends (a broken or hostile one): each
is a KVPoolError within the call's timeout, never another exception, an allocation of what
the answer claims, or a stream the client keeps reading after it lost its place."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.answers import answer_limit, answer_objects
from kvpool_client.client import AsyncPoolClient, PoolClient
from kvpool_client.errors import ConnectionLostError, KVPoolError, ProtocolError
from kvpool_client.protocol import HEADER, Op, PutStatus, decode, encode
from tests.unit.scripted_sidecar import INFO, Peer, scripted_sidecar

KEYS = [bytes([i]) * 48 for i in range(2)]


def lookup_answered(result: Any) -> Any:
    def script(peer: Peer) -> None:
        peer.hello()
        req = peer.read()
        peer.answer(req[1], result)
        req = peer.read()  # the next call is served
        peer.answer(req[1], [0, []])

    return script


MALFORMED_LOOKUPS = [
    [1, [["dram", 300_000_000]]],  # runs past the prefix: 300 million strings built
    [2, [["dram", 1]]],  # runs that do not cover the prefix
    [3, [["dram", 3]]],  # a prefix longer than the keys asked
    [1, [["dram", -1], ["dram", 2]]],
    [1, [[5, 1]]],
    [1, 5],
    5,
    None,
    [1],
]


@pytest.mark.parametrize("result, prefix, tiers", [
    ([0, []], 0, []),
    ([2, [["dram", 1], ["peer", 1]]], 2, ["dram", "peer"]),
    ([2, [["disk", 2]]], 2, ["disk", "disk"]),
])
def test_what_a_sidecar_answers_a_lookup_is_read(result: Any, prefix: int, tiers: list[str]) -> None:
    with scripted_sidecar(lookup_answered(result)) as where, PoolClient(**where, timeout=5.0) as c:
        got = c.lookup(KEYS)
        assert (got.prefix, got.tiers) == (prefix, tiers)


@pytest.mark.parametrize("result", MALFORMED_LOOKUPS)
def test_a_malformed_lookup_answer_is_a_protocol_error(result: Any) -> None:
    with scripted_sidecar(lookup_answered(result)) as where, PoolClient(**where, timeout=5.0) as c:
        start = time.monotonic()
        with pytest.raises(ProtocolError):
            c.lookup(KEYS)
        assert time.monotonic() - start < 1.0  # nothing of what the answer claims was built
        assert c.lookup(KEYS).prefix == 0


@pytest.mark.parametrize("result", MALFORMED_LOOKUPS[:3])
def test_the_async_client_refuses_a_malformed_lookup_answer(result: Any) -> None:
    async def run() -> None:
        with scripted_sidecar(lookup_answered(result)) as where:
            c = await AsyncPoolClient.connect(**where, timeout=5.0)
            try:
                with pytest.raises(ProtocolError):
                    await c.lookup(KEYS)
                assert (await c.lookup(KEYS)).prefix == 0
            finally:
                await c.close()

    asyncio.run(run())


@pytest.mark.parametrize("info", [5, [1, 2], {"shm": True}, {"shm": True, "arena_bytes": "x"}])
def test_a_malformed_hello_answer_is_a_protocol_error(info: Any) -> None:
    """It had been an AttributeError or a KeyError, which an engine's reconnecting client
    does not take for a lost sidecar."""
    with scripted_sidecar(lambda peer: peer.hello(info)) as where, pytest.raises(ProtocolError):
        PoolClient(**where, timeout=5.0)

    async def run() -> None:
        with scripted_sidecar(lambda peer: peer.hello(info)) as where, pytest.raises(ProtocolError):
            await AsyncPoolClient.connect(**where, timeout=5.0)

    asyncio.run(run())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("answer", [
    {"shm": True},  # a map that does not say the arena's size
    HEADER.pack(5) + b"\xc1" * 5,  # not msgpack
    HEADER.pack(2 << 20),  # longer than an answer before HELLO's may be
])
def test_the_async_client_closes_the_arena_of_a_handshake_that_failed(tmp_path: Path, answer: Any) -> None:
    """The arena's descriptor comes before HELLO's answer: a malformed answer had left it open
    (a sidecar's whole arena kept alive in the engine after the sidecar restarted)."""
    def script(peer: Peer) -> None:
        if isinstance(answer, bytes):
            peer.hello(arena_bytes=1 << 20, raw=answer)
        else:
            peer.hello(answer, arena_bytes=1 << 20)

    async def run() -> None:
        with scripted_sidecar(script, unix_dir=tmp_path) as where, pytest.raises(KVPoolError):
            await AsyncPoolClient.connect(**where, timeout=5.0)

    before = open_fds()
    asyncio.run(run())
    assert open_fds() == before


@pytest.mark.parametrize("info, length", [
    (INFO, (4 << 30) - 1),
    ({**INFO, "max_frame_bytes": 1 << 40, "max_batch": 1 << 40, "block_max_bytes": 1 << 40}, 2 << 30),
], ids=["past_what_the_hello_allows", "past_1GiB_whatever_the_hello_says"])
def test_an_answer_announcing_more_than_a_sidecar_may_send_ends_the_connection(info: dict[str, Any],
                                                                               length: int) -> None:
    """A header of 4 GiB less a byte: every later call had waited for it and timed out, on a connection
    that was never closed. After a HELLO of ``max_frame_bytes = 2**40``, one of 2 GiB had been waited
    for in the same way (the HELLO's numbers set the bound)."""
    def script(peer: Peer) -> None:
        peer.hello(info)
        peer.read()
        peer.send(HEADER.pack(length))

    with scripted_sidecar(script) as where, PoolClient(**where, timeout=5.0) as c:
        start = time.monotonic()
        with pytest.raises(ProtocolError):
            c.lookup(KEYS)
        assert time.monotonic() - start < 2.5  # refused at once, not at the timeout
        with pytest.raises(ConnectionLostError):
            c.lookup(KEYS)

    async def run() -> None:
        with scripted_sidecar(script) as where:
            c = await AsyncPoolClient.connect(**where, timeout=5.0)
            try:
                start = time.monotonic()
                with pytest.raises(ConnectionLostError):
                    await c.lookup(KEYS)
                assert time.monotonic() - start < 2.5  # lost at once, not at the timeout
                with pytest.raises(ConnectionLostError):
                    await c.lookup(KEYS)
            finally:
                await c.close()

    asyncio.run(run())


def test_the_release_of_a_late_answer_is_sent_within_the_call_that_read_it(tmp_path: Path) -> None:
    """A call that reads the late answer of one that timed out gives its leases back within
    its own time: that send had waited a whole timeout more on a sidecar that does not read."""
    timeout = 2.0
    late = threading.Event()

    def script(peer: Peer) -> None:
        peer.hello({"shm": True, "arena_bytes": 1 << 20, "prefault": False}, arena_bytes=1 << 20)
        acquire = peer.read()
        late.wait(10)
        time.sleep(0.8 * timeout)  # most of the next call's time gone
        # the late ACQUIRE answer: its RELEASE is larger than the sockets on the way hold,
        # and this sidecar never reads again
        peer.answer(acquire[1], [[i, 1, 0, [[0, 1]]] for i in range(100_000)])

    with scripted_sidecar(script, unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=timeout, prefault=False) as c:
        with pytest.raises(ConnectionLostError):
            c.get(KEYS[:1])
        late.set()
        start = time.monotonic()
        with pytest.raises(ConnectionLostError):
            c.stats()
        assert time.monotonic() - start < 1.5 * timeout


def test_the_async_client_stops_sending_to_a_sidecar_that_reads_nothing() -> None:
    """Requests to a sidecar that stopped reading had piled up in the client without bound
    (200 puts of 1 MiB: 196 MiB buffered, each to run long after its caller gave up). Past
    the bound on answers (2 MiB here), a call waits for room within its timeout."""
    stop = threading.Event()

    def script(peer: Peer) -> None:
        peer.hello()
        stop.wait(30)

    async def run() -> None:
        with scripted_sidecar(script) as where:
            c = await AsyncPoolClient.connect(**where, timeout=1.0)
            try:
                keys = [bytes([i]) * 48 for i in range(64)]  # 16 MiB in all
                calls = [asyncio.ensure_future(c.put([k], [b"x" * (256 << 10)])) for k in keys]
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                assert all(isinstance(o, ConnectionLostError) for o in outcomes)
                assert c._writer is not None  # noqa: SLF001
                buffered = c._writer.transport.get_write_buffer_size()  # noqa: SLF001
                assert buffered < (2 << 20) + (512 << 10)
                with pytest.raises(ConnectionLostError):
                    await c.put([keys[0]], [b"x" * (256 << 10)])
                assert c._writer.transport.get_write_buffer_size() == buffered  # noqa: SLF001
            finally:
                stop.set()
                c._writer.transport.abort()  # noqa: SLF001 - (closing would wait to send what is buffered)
                await c.close()

    asyncio.run(run())


def test_the_async_client_keeps_a_busy_sidecar_that_reads_slowly() -> None:
    """A sidecar reads a connection's requests only while few of them run: calls that wait
    for room past the bound are served once it reads on, and the connection stays."""
    def script(peer: Peer) -> None:
        peer.hello()
        for _ in range(17):
            time.sleep(0.02)
            req = peer.read()
            peer.answer(req[1], [0, []] if req[0] == Op.LOOKUP else [int(PutStatus.STORED)] * len(req[2]))

    async def run() -> None:
        with scripted_sidecar(script) as where:
            c = await AsyncPoolClient.connect(**where, timeout=5.0)
            try:
                keys = [bytes([i]) * 48 for i in range(16)]  # 4 MiB: past the bound
                got = await asyncio.gather(*(c.put([k], [b"x" * (256 << 10)]) for k in keys))
                assert got == [[PutStatus.STORED]] * 16
                assert (await c.lookup(KEYS)).prefix == 0
            finally:
                await c.close()

    asyncio.run(run())


def test_an_answer_of_more_objects_than_a_sidecar_sends_is_refused() -> None:
    """Five million empty lists (5 MB on the wire, some 280 MB in memory; 12 MiB of them had
    held a call 3.6 s past a 0.5 s timeout) in an answer whose result no check reads, from a
    sidecar whose frames may be that long."""
    def script(peer: Peer) -> None:
        peer.hello({**INFO, "max_frame_bytes": 8 << 20})
        req = peer.read()
        peer.answer(req[1], {"tiers": [[]] * 5_000_000})
        req = peer.read()
        peer.answer(req[1], {"tiers": {}})

    with scripted_sidecar(script) as where, PoolClient(**where, timeout=5.0) as c:
        with pytest.raises(ProtocolError):
            c.stats()
        assert c.stats() == {"tiers": {}}  # (the frame was dropped whole: the next call is served)


@pytest.mark.parametrize("info", [INFO, {**INFO, "max_batch": 4096, "block_max_bytes": 2 << 20}])
def test_the_largest_answer_a_sidecar_sends_fits_the_bounds(info: dict[str, Any]) -> None:
    """An ACQUIRE answer of ``max_batch`` blocks of ``block_max_bytes``, each in 4 KiB pages
    (the most extents a block may have), with the largest numbers: within both bounds."""
    extents = info["block_max_bytes"] // 4096
    block = [2**63, info["block_max_bytes"], 2**64 - 1, [[2**63 + i * 8192, 4096] for i in range(extents)]]
    frame = encode([2**31, 0, [block] * info["max_batch"]])
    assert len(frame) - HEADER.size <= answer_limit(info)
    assert len(decode(frame[HEADER.size:], max_objects=answer_objects(info))[2]) == info["max_batch"]

