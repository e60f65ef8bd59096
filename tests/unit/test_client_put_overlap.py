"""A put hashes its blocks while the sidecar finds them room, then copies them unhashed; what
it commits is the checksum of the bytes it wrote, however the answer's timing fell."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvpool_client import client as client_module
from kvpool_client import integrity
from kvpool_client.client import PoolClient
from kvpool_client.errors import ConnectionLostError
from kvpool_client.protocol import Op, PutStatus
from tests.unit.scripted_sidecar import Peer, scripted_sidecar

BLOCK = 256 * 1024  # one block per question of whether the answer has come (integrity.CHUNK)
KEYS = [bytes([i]) * 48 for i in range(3)]
ARENA = 8 * BLOCK
INFO = {"shm": True, "arena_bytes": ARENA, "prefault": False}


@pytest.fixture
def hashed_in_copy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the blocks hashed while they were copied (not ahead)."""
    seen: list[int] = []
    fused = integrity.copy_with_checksum

    def spy(dst: Any, src: Any) -> int:
        seen.append(src.nbytes)
        return fused(dst, src)

    monkeypatch.setattr(integrity, "copy_with_checksum", spy)
    return seen


def answers(monkeypatch: pytest.MonkeyPatch, said: list[bool]) -> None:
    """``PoolClient._answered`` says ``said`` in turn, then True."""
    it: Iterator[bool] = iter(said)
    monkeypatch.setattr(PoolClient, "_answered", lambda self: next(it, True))


def put_through(tmp_path: Path, payloads: list[bytes], hold_answer: threading.Event | None = None
                ) -> tuple[list[PutStatus], dict[str, Any]]:
    """A put against a scripted sidecar that answers ALLOC (after ``hold_answer`` is set, where
    given) with room at every other block; what it was sent and what its arena holds."""
    seen: dict[str, Any] = {}

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=ARENA)
        alloc = peer.read()
        assert alloc[0] == Op.ALLOC
        if hold_answer is not None:
            assert hold_answer.wait(30)
        peer.answer(alloc[1], [[int(PutStatus.ALLOCATED), 10 + i, [[i * 2 * BLOCK, BLOCK]]]
                               for i in range(len(payloads))])
        commit = peer.read()
        seen["commit"] = commit
        assert peer.arena is not None
        seen["arena"] = [bytes(peer.arena[i * 2 * BLOCK : i * 2 * BLOCK + BLOCK]) for i in range(len(payloads))]
        peer.answer(commit[1], [int(PutStatus.STORED)] * len(payloads))

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=30, prefault=False) as c:
        statuses = c.put(KEYS[: len(payloads)], payloads)
    return statuses, seen


def committed_right(seen: dict[str, Any], payloads: list[bytes]) -> None:
    assert seen["commit"][0] == Op.COMMIT
    assert seen["commit"][2] == [[10 + i, xxhash.xxh3_64_intdigest(p)] for i, p in enumerate(payloads)]
    assert seen["arena"] == payloads


def test_a_put_whose_room_comes_late_hashes_every_block_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed_in_copy: list[int]) -> None:
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    hashed_ahead = threading.Event()
    ahead = client_module.checksums_until

    def then_answer(*args: Any, **kw: Any) -> list[int | None]:
        out = ahead(*args, **kw)
        hashed_ahead.set()  # the sidecar answers only now
        return out

    monkeypatch.setattr(client_module, "checksums_until", then_answer)
    statuses, seen = put_through(tmp_path, payloads, hold_answer=hashed_ahead)
    assert statuses == [PutStatus.STORED] * len(KEYS)
    committed_right(seen, payloads)
    assert hashed_in_copy == []  # none hashed twice, none in the copy


@pytest.mark.parametrize("said, in_copy", [([], 3), ([False], 2), ([False, False], 1)])
def test_blocks_not_hashed_by_the_answer_are_hashed_in_the_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed_in_copy: list[int], said: list[bool],
        in_copy: int) -> None:
    answers(monkeypatch, said)
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    statuses, seen = put_through(tmp_path, payloads)
    assert statuses == [PutStatus.STORED] * len(KEYS)
    committed_right(seen, payloads)
    assert hashed_in_copy == [BLOCK] * in_copy


def test_an_answer_is_seen_on_a_descriptor_past_1023() -> None:
    """(``select()`` refuses descriptors from 1024 up: hashing ahead had stopped at once there.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    high = 1500
    if hard != resource.RLIM_INFINITY and hard <= high:
        pytest.skip(f"descriptors are limited to {hard} here")
    if soft <= high:
        resource.setrlimit(resource.RLIMIT_NOFILE, (high + 1, hard))
    a, b = socket.socketpair()
    try:
        os.dup2(a.fileno(), high)
        c = PoolClient.__new__(PoolClient)  # only what _answered reads: no sidecar
        c._rbuf = bytearray()  # noqa: SLF001
        c._sock = socket.socket(fileno=high)  # noqa: SLF001
        try:
            assert not c._answered()  # noqa: SLF001
            b.sendall(b"x")
            assert c._answered()  # noqa: SLF001
        finally:
            c._sock.close()  # noqa: SLF001
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_time_spent_hashing_ahead_counts_in_the_calls_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timeout = 1.0
    done = threading.Event()

    def slow_hash(views: Any, answered: Any) -> list[int | None]:
        done.wait(0.8 * timeout)  # (nothing sets it: most of the call's time goes here)
        return [None] * len(views)

    monkeypatch.setattr(client_module, "checksums_until", slow_hash)

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=ARENA)
        peer.read()  # ALLOC, never answered
        try:
            peer.read()
        except (EOFError, OSError):
            pass

    with scripted_sidecar(script, unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=timeout, prefault=False) as c:
        start = time.monotonic()
        with pytest.raises(ConnectionLostError):
            c.put(KEYS[:1], [b"x" * BLOCK])
        assert time.monotonic() - start < 1.5 * timeout  # it had waited a whole timeout more
