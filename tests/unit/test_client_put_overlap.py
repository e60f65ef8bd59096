"""A put hashes its blocks while the sidecar finds them room, then copies them unhashed; what
it commits is the checksum of the bytes it wrote, however the answer's timing fell."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvpool_client import integrity
from kvpool_client.client import PoolClient
from kvpool_client.protocol import Op, PutStatus
from tests.unit.scripted_sidecar import Peer, scripted_sidecar

BLOCK = 64 * 1024
KEYS = [bytes([i]) * 48 for i in range(3)]
INFO = {"shm": True, "arena_bytes": 1 << 20, "prefault": False}


@pytest.mark.parametrize("answer_late", [True, False])
def test_a_put_commits_the_checksums_of_the_bytes_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          answer_late: bool) -> None:
    hashed_in_copy: list[int] = []
    fused = integrity.copy_with_checksum

    def spy(dst: Any, src: Any) -> int:
        hashed_in_copy.append(src.nbytes)
        return fused(dst, src)

    monkeypatch.setattr(integrity, "copy_with_checksum", spy)
    if not answer_late:  # the answer is there before any block is hashed: all hashed in the copy
        monkeypatch.setattr(PoolClient, "_answered", lambda self: True)
    payloads = [os.urandom(BLOCK) for _ in KEYS]
    seen: dict[str, Any] = {}
    go = threading.Event()

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=1 << 20)
        alloc = peer.read()
        assert alloc[0] == Op.ALLOC
        if answer_late:
            go.wait(0.5)  # (nothing sets it: the client has time to hash every block first)
        peer.answer(alloc[1], [[int(PutStatus.ALLOCATED), 10 + i, [[i * 2 * BLOCK, BLOCK]]]
                               for i in range(len(KEYS))])
        commit = peer.read()
        seen["commit"] = commit
        assert peer.arena is not None
        seen["arena"] = [bytes(peer.arena[i * 2 * BLOCK : i * 2 * BLOCK + BLOCK]) for i in range(len(KEYS))]
        peer.answer(commit[1], [int(PutStatus.STORED)] * len(KEYS))

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=5, prefault=False) as c:
        assert c.put(KEYS, payloads) == [PutStatus.STORED] * len(KEYS)
    assert seen["commit"][0] == Op.COMMIT
    assert seen["commit"][2] == [[10 + i, xxhash.xxh3_64_intdigest(p)] for i, p in enumerate(payloads)]
    assert seen["arena"] == payloads
    # hashed while the answer was awaited (late), or in the copy (at once), never twice
    assert hashed_in_copy == ([] if answer_late else [BLOCK] * len(KEYS))
