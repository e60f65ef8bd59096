"""A task of several calls ends by one deadline (``PoolClient.within``); what a client holds
still goes back past it; and the arena's descriptor is never inherited by a child process."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool_client import client as client_module
from kvpool_client.client import PoolClient
from kvpool_client.errors import ConnectionLostError, DeadlineError, ProtocolError
from kvpool_client.protocol import Op, PutStatus
from tests.unit.scripted_sidecar import Peer, scripted_sidecar

INFO = {"shm": True, "arena_bytes": 1 << 20, "prefault": False}
KEY = b"\x01" * 48


def test_a_task_ends_by_its_deadline_however_long_each_call_may_take(tmp_path: Path) -> None:
    """The sidecar answers the first lookup and never the second: inside ``within(0.3)`` the
    second call gives up by the task's deadline, not after the client's 30 s timeout."""
    answered = threading.Event()

    def script(peer: Peer) -> None:
        peer.hello(INFO)
        first = peer.read()
        answered.set()  # (before the answer: the client may read it before this thread runs on)
        peer.answer(first[1], [0, []])
        peer.read()  # the second: never answered

    with scripted_sidecar(script, unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=30, prefault=False) as c:
        started = time.monotonic()
        with c.within(0.3), pytest.raises(ConnectionLostError, match="task's deadline"):
            assert c.lookup([KEY]).prefix == 0
            assert answered.is_set()
            c.lookup([KEY])
        assert time.monotonic() - started < 10  # the task's 0.3 s, far from the call's own 30 s


def test_a_call_begun_past_the_deadline_sends_nothing_but_leases_still_go_back(tmp_path: Path) -> None:
    seen: list[int] = []

    def script(peer: Peer) -> None:
        peer.hello(INFO)
        while True:
            req = peer.read()
            seen.append(req[0])
            if req[0] == Op.LOOKUP:
                peer.answer(req[1], [0, []])
            elif req[0] == Op.RELEASE:
                peer.answer(req[1], 1)

    with scripted_sidecar(script, unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=30, prefault=False) as c:
        with c.within(0):
            with pytest.raises(DeadlineError):
                c.lookup([KEY])
            with pytest.raises(DeadlineError):
                c.put([KEY], [b"x" * 4096])
            c._send(Op.RELEASE, [[7, False]])  # noqa: SLF001 - what HeldBlocks.release sends
        assert c.lookup([KEY]).prefix == 0  # the connection is as it was, and the answer to
        # the release before it was skipped on the way
    assert seen == [Op.RELEASE, Op.LOOKUP]


def test_deadlines_nest_and_the_earlier_one_holds(tmp_path: Path) -> None:
    def script(peer: Peer) -> None:
        peer.hello(INFO)

    with scripted_sidecar(script, unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=30, prefault=False) as c:
        with c.within(0):
            with c.within(60):
                with pytest.raises(DeadlineError):
                    c.lookup([KEY])
        assert c._cap is None  # noqa: SLF001 - nothing left behind by the blocks


def test_the_arena_descriptor_is_received_close_on_exec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Received without ``MSG_CMSG_CLOEXEC``, the arena's descriptor (read-write, every block
    of the space) would pass to any program a thread of the engine started before it was
    mapped and closed."""
    inheritable: list[bool] = []
    marker = client_module.marker_fd

    def spy(msg: bytes, fds: list[int]) -> Any:
        inheritable.extend(os.get_inheritable(fd) for fd in fds)
        return marker(msg, fds)

    monkeypatch.setattr(client_module, "marker_fd", spy)

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=1 << 20)

    with scripted_sidecar(script, unix_dir=tmp_path) as where, PoolClient(**where, timeout=30, prefault=False) as c:
        assert c.shm
    assert inheritable == [False]


def test_an_arena_that_could_shrink_under_the_mapping_is_refused(tmp_path: Path) -> None:
    """Whoever answers on the socket path (a sidecar gone wrong, or a process that took the
    path) sent a memfd not sealed against shrinking, then shrank it: the client mapped it,
    and its next touch of the arena killed the engine with SIGBUS."""
    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=1 << 20, sealed=False)

    with pytest.raises(ProtocolError, match="sealed"):
        with scripted_sidecar(script, unix_dir=tmp_path) as where:
            PoolClient(**where, timeout=30, prefault=False)


def test_a_put_whose_copy_outlasts_the_deadline_still_aborts_and_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What settles a put already begun (the abort of a room it cannot use, the commit of what
    it wrote) waits for its answer the call's own timeout, not the task's deadline that passed
    while the blocks were copied: the commit had never been sent, its leases held until they
    expired, and the put reported a timeout it had not waited for."""
    seen: list[int] = []

    def script(peer: Peer) -> None:
        peer.hello(INFO, arena_bytes=1 << 20)
        while True:
            req = peer.read()
            seen.append(req[0])
            if req[0] == Op.ALLOC:  # the second room lies past the arena: aborted
                peer.answer(req[1], [[int(PutStatus.ALLOCATED), 11, [[0, 4096]]],
                                     [int(PutStatus.ALLOCATED), 12, [[1 << 30, 4096]]]])
            elif req[0] == Op.ABORT:
                peer.answer(req[1], 1)
            elif req[0] == Op.COMMIT:
                peer.answer(req[1], [int(PutStatus.STORED)])

    with scripted_sidecar(script, unix_dir=tmp_path) as where, \
            PoolClient(**where, timeout=30, prefault=False) as c:
        write = PoolClient._write

        def copy_past_the_deadline(self: PoolClient, *args: Any) -> Any:
            out = write(self, *args)
            self._cap = time.monotonic() - 1  # noqa: SLF001 - the copy took the task's whole time
            return out

        monkeypatch.setattr(PoolClient, "_write", copy_past_the_deadline)
        with c.within(30):
            statuses = c.put([b"\x01" * 48, b"\x02" * 48], [b"x" * 4096, b"y" * 4096])
    assert statuses[0] == PutStatus.STORED and statuses[1] != PutStatus.STORED
    assert seen == [Op.ALLOC, Op.ABORT, Op.COMMIT]
