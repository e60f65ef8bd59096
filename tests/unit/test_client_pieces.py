"""Batches in pieces (kvpool_client.pipeline): each answer is paired with its own keys
whatever order the answers come in, a put that fails part way gives back the room it will
not commit, and an answer of fewer items than keys is refused. Against a scripted sidecar
(answers no real sidecar sends); the real sidecar's side is tests/integration/test_local_api.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvpool_client import integrity, pipeline
from kvpool_client.client import PoolClient
from kvpool_client.errors import ProtocolError, RemoteError
from kvpool_client.protocol import ErrorCode, Op, PutStatus, encode
from tests.unit.scripted_sidecar import Peer, scripted_sidecar

BLOCK = 256 * 1024
KEYS = [bytes([i]) * 48 for i in range(6)]
ARENA = 8 * BLOCK
INFO = {"shm": True, "arena_bytes": ARENA, "prefault": False, "put_pieces": True, "max_batch": 4}
#: Three pieces of two blocks (with the pieces' bounds below).
BOUNDS = [(0, 2), (2, 4), (4, 6)]


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of two blocks each."""
    monkeypatch.setattr(pipeline, "FIRST_PIECE_BYTES", 2 * BLOCK)
    monkeypatch.setattr(pipeline, "MAX_PIECE_BYTES", 2 * BLOCK)


def test_a_batch_goes_in_pieces_that_cover_it_in_order_the_first_small() -> None:
    mib = 1 << 20
    for size in (64 << 10, 512 << 10, 3 * mib // 4):
        bounds = pipeline.pieces([size] * 64, put=False)
        assert bounds is not None and len(bounds) > 1
        assert bounds[0][0] == 0 and bounds[-1][1] == 64
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
        assert (bounds[0][1] - bounds[0][0]) * size <= pipeline.FIRST_PIECE_BYTES
        assert all((b - a) * size <= pipeline.MAX_PIECE_BYTES for a, b in bounds)
    assert pipeline.pieces([512 << 10] * 64, put=False) == [(0, 4), (4, 12), (12, 28), (28, 44), (44, 60), (60, 64)]
    capped = pipeline.pieces([64 << 10] * 64, put=False, most=10)  # (the sidecar's max_batch)
    assert capped is not None and max(b - a for a, b in capped) == 10 and capped[-1][1] == 64
    # whole: a block larger than a piece is a piece of its own, never split
    assert pipeline.pieces([16 * mib, 16 * mib], put=False, ) in (None, [(0, 1), (1, 2)])


@pytest.mark.parametrize("sizes, put", [
    ([], False), ([512 << 10], False),  # one piece
    ([64 << 10] * 64, True),  # a put of small blocks: the sidecar's work, not the copy, is the most of it
    ([64 << 10] * 16, False),  # a first piece holds it all
])
def test_a_batch_that_pieces_would_not_help_goes_whole(sizes: list[int], put: bool) -> None:
    assert pipeline.pieces(sizes, put=put) is None


def test_a_batch_that_several_threads_copy_goes_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = [2 << 20] * 64
    monkeypatch.setattr(integrity, "COPY_THREADS", 4)
    assert pipeline.pieces(sizes, put=True) is None
    monkeypatch.setattr(integrity, "COPY_THREADS", 1)  # one thread copies it: pieces overlap that
    assert pipeline.pieces(sizes, put=True) is not None


def _place(peer: Peer, payloads: list[bytes]) -> None:
    assert peer.arena is not None
    for i, p in enumerate(payloads):
        peer.arena[i * BLOCK:(i + 1) * BLOCK] = p


def test_a_get_in_pieces_pairs_each_answer_with_its_keys_whatever_order_they_come_in(
        tmp_path: Path, small_pieces: None) -> None:
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    seen: dict[str, Any] = {"released": []}

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=ARENA)
        _place(peer, payloads)
        asked = [peer.read() for _ in BOUNDS]  # every piece is asked before any answer comes
        seen["asked"] = [(r[0], r[2]) for r in asked]
        for (lo, hi), req in reversed(list(zip(BOUNDS, asked))):  # the last piece's answer first
            peer.answer(req[1], [[100 + i, BLOCK, xxhash.xxh3_64_intdigest(payloads[i]), [[i * BLOCK, BLOCK]]]
                                 for i in range(lo, hi)])
        for _ in BOUNDS:  # (not answered: the client reads no RELEASE's answer before it closes)
            rel = peer.read()
            seen["released"] += [lease for lease, _ in rel[2]] if rel[0] == Op.RELEASE else []

    outs = [bytearray(BLOCK) for _ in KEYS]
    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=30, prefault=False) as c:
        got = c.get(KEYS, into=outs)
    assert seen["asked"] == [(Op.ACQUIRE, KEYS[lo:hi]) for lo, hi in BOUNDS]
    assert [bytes(g) if g is not None else None for g in got] == payloads
    assert sorted(seen["released"]) == [100 + i for i in range(len(KEYS))]


def test_a_put_that_fails_part_way_commits_what_it_copied_and_gives_back_the_rest(
        tmp_path: Path, small_pieces: None) -> None:
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    seen: dict[str, Any] = {}

    def room(lo: int, hi: int) -> list[Any]:
        return [[int(PutStatus.ALLOCATED), 100 + i, [[i * BLOCK, BLOCK]]] for i in range(lo, hi)]

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=ARENA)
        allocs = [peer.read() for _ in BOUNDS]
        seen["asked"] = [(r[0], [item[0] for item in r[2]]) for r in allocs]
        peer.answer(allocs[2][1], room(4, 6))  # the third piece's room comes first (kept)
        peer.answer(allocs[0][1], room(0, 2))
        seen["commit"] = peer.read()  # the first piece, copied and committed at once
        peer.sock.sendall(encode([allocs[1][1], int(ErrorCode.FULL), ["full", "no room for the second piece"]]))
        seen["abort"] = peer.read()  # the third piece's room, which nothing will commit
        assert peer.arena is not None
        seen["arena"] = [bytes(peer.arena[i * BLOCK:(i + 1) * BLOCK]) for i in range(2)]
        peer.answer(seen["commit"][1], [int(PutStatus.STORED)] * 2)
        peer.answer(seen["abort"][1], 2)

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=30, prefault=False) as c:
        with pytest.raises(RemoteError, match="second piece"):
            c.put(KEYS, payloads)
    assert seen["asked"] == [(Op.ALLOC, KEYS[lo:hi]) for lo, hi in BOUNDS]
    assert seen["commit"][0] == Op.COMMIT
    assert seen["commit"][2] == [[100 + i, xxhash.xxh3_64_intdigest(payloads[i])] for i in range(2)]
    assert seen["arena"] == payloads[:2]
    assert seen["abort"][0] == Op.ABORT and seen["abort"][2] == [104, 105]


@pytest.mark.parametrize("op", ["get", "put"])
def test_an_answer_of_fewer_items_than_keys_is_refused(tmp_path: Path, op: str) -> None:
    payloads = [os.urandom(BLOCK) for _ in KEYS[:3]]

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=ARENA)
        _place(peer, payloads)
        req = peer.read()
        if req[0] == Op.ACQUIRE:  # the second and third keys' blocks, answered as the first two keys'
            peer.answer(req[1], [[100 + i, BLOCK, xxhash.xxh3_64_intdigest(payloads[i]), [[i * BLOCK, BLOCK]]]
                                 for i in (1, 2)])
        else:
            peer.answer(req[1], [[int(PutStatus.ALLOCATED), 100 + i, [[i * BLOCK, BLOCK]]] for i in (1, 2)])
        peer.read()  # whatever the client sends next, if anything

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=5, prefault=False) as c:
        with pytest.raises(ProtocolError, match="2 items for 3 keys"):
            if op == "get":
                c.get(KEYS[:3], into=[bytearray(BLOCK) for _ in range(3)])
            else:
                c.put(KEYS[:3], payloads)


def test_an_acquire_given_sizes_goes_in_pieces_and_holds_every_lease_until_released(
        tmp_path: Path, small_pieces: None) -> None:
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    seen: dict[str, Any] = {}

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=ARENA)
        _place(peer, payloads)
        asked = [peer.read() for _ in BOUNDS]
        seen["asked"] = [(r[0], r[2]) for r in asked]
        for (lo, hi), req in reversed(list(zip(BOUNDS, asked))):
            peer.answer(req[1], [[100 + i, BLOCK, xxhash.xxh3_64_intdigest(payloads[i]), [[i * BLOCK, BLOCK]]]
                                 for i in range(lo, hi)])
        seen["release"] = [peer.read() for _ in range(2)]

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=30, prefault=False) as c:
        with c.acquire(KEYS, [BLOCK] * len(KEYS)) as held:
            assert [b"".join(bytes(v) for v in vs) if vs is not None else None for vs in held.views] == payloads
            assert held.extents == [[(i * BLOCK, BLOCK)] for i in range(len(KEYS))]
    assert seen["asked"] == [(Op.ACQUIRE, KEYS[lo:hi]) for lo, hi in BOUNDS]
    # six leases, given back in RELEASEs of at most the sidecar's max_batch (4): one of six was refused
    assert [r[0] for r in seen["release"]] == [Op.RELEASE] * 2
    assert [item for r in seen["release"] for item in r[2]] == [[100 + i, False] for i in range(len(KEYS))]
    assert [len(r[2]) for r in seen["release"]] == [4, 2]


def test_a_sidecar_that_does_not_say_it_keeps_a_chain_put_in_pieces_gets_it_whole(
        tmp_path: Path, small_pieces: None) -> None:
    """(An older sidecar's lineage stops at blocks pending in another ALLOC: a chain put in
    pieces there could evict its own head.)"""
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    seen: dict[str, Any] = {}

    def script(peer: Peer) -> None:
        peer.hello({**INFO, "put_pieces": None, "max_batch": len(KEYS)}, arena_bytes=ARENA)  # (one ALLOC may hold it)
        alloc = peer.read()
        seen["alloc"] = (alloc[0], len(alloc[2]))
        peer.answer(alloc[1], [[int(PutStatus.EXISTS), 0, None]] * len(KEYS))

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=30, prefault=False) as c:
        assert c.put(KEYS, payloads, chain=True) == [PutStatus.EXISTS] * len(KEYS)
    assert seen["alloc"] == (Op.ALLOC, len(KEYS))


def test_an_acquire_that_fails_part_way_gives_back_what_it_held(tmp_path: Path, small_pieces: None) -> None:
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    seen: dict[str, Any] = {"released": []}

    def held(lo: int, hi: int) -> list[Any]:
        return [[100 + i, BLOCK, xxhash.xxh3_64_intdigest(payloads[i]), [[i * BLOCK, BLOCK]]] for i in range(lo, hi)]

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=ARENA)
        _place(peer, payloads)
        asked = [peer.read() for _ in BOUNDS]
        peer.answer(asked[2][1], held(4, 6))  # kept while the first is read
        peer.answer(asked[0][1], held(0, 2))
        peer.sock.sendall(encode([asked[1][1], int(ErrorCode.QUOTA), ["quota", "the session holds its share"]]))
        for _ in range(2):
            rel = peer.read()
            seen["released"] += rel[2] if rel[0] == Op.RELEASE else []

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=30, prefault=False) as c:
        with pytest.raises(RemoteError, match="its share"):
            c.acquire(KEYS, [BLOCK] * len(KEYS))
    assert sorted(lease for lease, _ in seen["released"]) == [100, 101, 104, 105]
