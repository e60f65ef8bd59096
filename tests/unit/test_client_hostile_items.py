"""The clients against the items of answers no real sidecar sends (a broken or hostile one):
an ACQUIRE, ALLOC, COMMIT, PUT_INLINE, GET_INLINE, PIN or STATS answer of the wrong shape is
a ProtocolError (a KVPoolError, never a TypeError or a ValueError that had ended an engine's
load step), the leases it names go back, and the connection serves the next call; extents
past the arena's end are a miss, never bytes verified short and handed out whole; and an
inline answer never pairs one key with another's bytes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvpool_client.client import AsyncPoolClient, PoolClient
from kvpool_client.errors import ProtocolError
from kvpool_client.protocol import Op, PutStatus
from tests.unit.scripted_sidecar import INFO, Peer, scripted_sidecar

KEYS = [bytes([i]) * 48 for i in range(2)]
ARENA = 1 << 20
SHM = {"shm": True, "arena_bytes": ARENA, "prefault": False}
BLOCK = b"\xab" * 4096
GOOD = [7, len(BLOCK), xxhash.xxh3_64_intdigest(BLOCK), [[0, len(BLOCK)]]]

MALFORMED_ACQUIRED = [
    [[7], None], [[], None], [[7, 4096, 1], None], [[7, 4096, 1, [["0", 4096]]], None],
    [[7, 4096, 1, 7], None], [[7, -1, 1, [[0, 4096]]], None], [[7, "x", 1, [[0, 4096]]], None],
    [[-7, 4096, 1, [[0, 4096]]], None], [[7, 4096, 1.5, [[0, 4096]]], None],
    [GOOD, 7],  # a good item beside a broken one: its lease goes back
    [GOOD], [GOOD, None, None], 7, None,
]


def answering(first: Any, then: Any, *, shm: bool = True, seen: list[Any] | None = None) -> Callable[[Peer], None]:
    """A sidecar that answers the first request with ``first`` and, after whatever the client
    sends to give leases back (kept in ``seen``), the next call with ``then``."""
    def script(peer: Peer) -> None:
        peer.hello(SHM if shm else INFO, arena_bytes=ARENA if shm else 0)
        if peer.arena is not None:
            peer.arena[: len(BLOCK)] = BLOCK
        req = peer.read()
        peer.answer(req[1], first)
        while (req := peer.read())[0] in (Op.RELEASE, Op.ABORT):
            if seen is not None:
                seen.append(req)
        peer.answer(req[1], then)

    return script


@pytest.mark.parametrize("result", MALFORMED_ACQUIRED)
@pytest.mark.parametrize("call", ["get", "acquire"])
def test_a_malformed_acquire_answer_is_a_protocol_error_and_its_leases_go_back(
        tmp_path: Path, result: Any, call: str) -> None:
    seen: list[Any] = []
    with scripted_sidecar(answering(result, [0, []], seen=seen), unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=5.0, prefault=False) as c:
        with pytest.raises(ProtocolError):
            if call == "get":
                c.get(KEYS, into=[bytearray(len(BLOCK)) for _ in KEYS])
            else:
                c.acquire(KEYS)
        assert c.lookup(KEYS).prefix == 0  # the next call is served
    if isinstance(result, list) and GOOD in result:
        assert seen == [[int(Op.RELEASE), seen[0][1], [[7, False]]]]


@pytest.mark.parametrize("item", [
    [7, len(BLOCK), xxhash.xxh3_64_intdigest(BLOCK[:1]), [[ARENA - 1, len(BLOCK)]]],  # past the end: a slice has 1 byte
    [7, 1, xxhash.xxh3_64_intdigest(BLOCK[:1]), [[ARENA - 1, 288]]],
    [7, len(BLOCK), xxhash.xxh3_64_intdigest(BLOCK), [[0, len(BLOCK) - 1], [len(BLOCK), 0], [len(BLOCK) - 1, 1]]],
])
@pytest.mark.parametrize("call", ["get", "acquire"])
def test_extents_past_the_arena_or_empty_are_a_miss_and_go_back_as_broken(tmp_path: Path, item: Any,
                                                                          call: str) -> None:
    seen: list[Any] = []
    with scripted_sidecar(answering([item], [0, []], seen=seen), unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=5.0, prefault=False) as c:
        if call == "get":
            assert c.get(KEYS[:1], into=[bytearray(4096)]) == [None]
        else:
            with c.acquire(KEYS[:1]) as held:
                assert held.views == [None] and held.extents == [None]
        assert c.lookup(KEYS).prefix == 0
    assert seen == [[int(Op.RELEASE), seen[0][1], [[7, True]]]]


@pytest.mark.parametrize("result", [
    [[99, 7, None], [0, 0, None]],  # a status no sidecar has
    [[0, 7, [[0, 4096]]]],  # fewer items than keys: its room goes back
    [[0, "7", None], [4, 0, None]], [[0, 7], [4, 0, None]], [5, 6],
])
def test_a_malformed_alloc_answer_is_a_protocol_error(tmp_path: Path, result: Any) -> None:
    seen: list[Any] = []
    with scripted_sidecar(answering(result, [0, []], seen=seen), unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=5.0, prefault=False) as c:
        with pytest.raises(ProtocolError):
            c.put(KEYS, [b"x" * 4096] * 2)
        assert c.lookup(KEYS).prefix == 0
    if result == [[0, 7, [[0, 4096]]]]:
        assert seen == [[int(Op.ABORT), seen[0][1], [7]]]


@pytest.mark.parametrize("statuses", [[99], ["x"], [True], 5, [-1]])
def test_a_malformed_commit_or_inline_put_answer_is_a_protocol_error(tmp_path: Path, statuses: Any) -> None:
    def script(peer: Peer) -> None:
        peer.hello(SHM, arena_bytes=ARENA)
        req = peer.read()
        peer.answer(req[1], [[int(PutStatus.ALLOCATED), 7, [[0, 4096]]]])
        req = peer.read()
        assert req[0] == Op.COMMIT
        peer.answer(req[1], statuses)
        peer.answer(peer.read()[1], [0, []])

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=5.0, prefault=False) as c:
        if statuses == [-1]:  # a lease the sidecar no longer knew: not stored, not malformed
            assert c.put(KEYS[:1], [b"x" * 4096]) == [PutStatus.FULL]
        else:
            with pytest.raises(ProtocolError):
                c.put(KEYS[:1], [b"x" * 4096])
        assert c.lookup(KEYS).prefix == 0
    with scripted_sidecar(answering(statuses, [0, []], shm=False)) as where, PoolClient(**where, timeout=5.0) as c:
        with pytest.raises(ProtocolError):  # (no negative status on the inline path)
            c.put(KEYS[:1], [b"x" * 4096])
        assert c.lookup(KEYS).prefix == 0


@pytest.mark.parametrize("got", [
    [b"a", False, b"c"],  # the second block left out, the third sent: it had become the second key's
    [b"a", 5, False], [False, False, False],
])
def test_an_inline_get_answer_never_pairs_a_key_with_another_keys_bytes(got: list[Any]) -> None:
    keys = [bytes([i]) * 48 for i in range(3)]
    with scripted_sidecar(answering(got, [0, []], shm=False)) as where, PoolClient(**where, timeout=5.0) as c:
        with pytest.raises(ProtocolError):
            c.get(keys)
        assert c.lookup(keys).prefix == 0


@pytest.mark.parametrize("call, result", [
    ("pin", "x"), ("pin", -5), ("unpin", None), ("remove", 1.5), ("remove", True), ("stats", [1, 2]),
])
def test_a_malformed_count_or_stats_answer_is_a_protocol_error(call: str, result: Any) -> None:
    with scripted_sidecar(answering(result, [0, []], shm=False)) as where, PoolClient(**where, timeout=5.0) as c:
        with pytest.raises(ProtocolError):
            getattr(c, call)(*([] if call == "stats" else [KEYS]))
        assert c.lookup(KEYS).prefix == 0


@pytest.mark.parametrize("call, result", [
    ("get", [GOOD]), ("acquire", [[7], None]), ("put", [[99, 7, None], [0, 0, None]]), ("pin", "x"), ("stats", 5),
])
def test_the_async_client_refuses_the_same_answers(tmp_path: Path, call: str, result: Any) -> None:
    seen: list[Any] = []

    async def run() -> None:
        with scripted_sidecar(answering(result, [0, []], seen=seen), unix_dir=tmp_path) as where:
            c = await AsyncPoolClient.connect(**where, timeout=5.0, prefault=False)
            try:
                with pytest.raises(ProtocolError):
                    if call == "put":
                        await c.put(KEYS, [b"x" * 4096] * 2)
                    elif call == "stats":
                        await c.stats()
                    elif call == "pin":
                        await c.pin(KEYS)
                    else:
                        await getattr(c, call)(KEYS)
                assert (await c.lookup(KEYS)).prefix == 0
            finally:
                await c.close()

    asyncio.run(run())
    if call == "get":
        assert [r[2] for r in seen] == [[[7, False]]]
    assert os.getpid()  # (the loop and its client are gone: nothing of this test lingers)


@pytest.mark.parametrize("said", ["x", None, [1]])
def test_a_frame_limit_of_another_type_at_hello_is_taken_for_the_default(said: Any) -> None:
    def script(peer: Peer) -> None:
        peer.hello({**INFO, "max_frame_bytes": said})
        req = peer.read()
        assert req[0] == Op.PUT_INLINE
        peer.answer(req[1], [int(PutStatus.STORED)])

    with scripted_sidecar(script) as where, PoolClient(**where, timeout=5.0) as c:
        assert c.put(KEYS[:1], [b"x" * 4096]) == [PutStatus.STORED]
