"""Binding the local socket: a live listener is refused at once, even one too busy to
accept (its listen backlog full), and a stale socket file is replaced."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kvpool_sidecar.api.local import _bind_unix
from kvpool_sidecar.errors import SidecarError

#: How long a refusal may take here: the probe never waits, so this bounds a hang only.
BOUND_S = 5.0


def _full_listener(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A listener on ``path`` that never accepts, its backlog (of one) filled: a connect
    that waits for room waits until it closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    held: list[socket.socket] = []
    for _ in range(64):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except BlockingIOError:  # full
            s.close()
            return listener, held
        held.append(s)
    raise AssertionError("the listen backlog never filled")


def test_a_live_listener_with_a_full_backlog_is_refused_without_waiting(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    path = run / "kvpool.sock"
    listener, held = _full_listener(path)
    outcome: list[BaseException | socket.socket] = []

    def bind() -> None:
        try:
            outcome.append(_bind_unix(str(path), 0o660))
        except (SidecarError, OSError) as e:
            outcome.append(e)

    t = threading.Thread(target=bind, daemon=True)
    try:
        t.start()
        t.join(BOUND_S)
        assert not t.is_alive(), f"the probe of a live socket hung for {BOUND_S}s"
    finally:
        listener.close()  # (ends a probe that waits: it is refused, then the file replaced)
        for s in held:
            s.close()
        t.join(BOUND_S)
        for got in outcome:
            if isinstance(got, socket.socket):
                got.close()
    [got] = outcome
    assert isinstance(got, SidecarError) and "another sidecar is listening" in str(got), got
    assert path.exists()


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    path = run / "kvpool.sock"
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(path))  # bound and closed: no one listens
    gone.close()
    sock = _bind_unix(str(path), 0o660)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(BOUND_S)
            c.connect(str(path))
    finally:
        sock.close()


def test_a_path_that_is_no_socket_is_refused_and_kept(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    path = run / "kvpool.sock"
    path.write_text("precious")
    with pytest.raises(SidecarError, match="not a socket"):
        _bind_unix(str(path), 0o660)
    assert path.read_text() == "precious"


async def test_a_draining_sidecar_holds_its_socket_path_until_its_node_is_unpublished(tmp_path: Path) -> None:
    """The socket's path is what keeps a second sidecar of the node from starting: a drain
    that gave it up before unpublishing let another sidecar start and join meanwhile, whose
    entries the unpublishing then deleted (a review: about 4 s for 300,000 blocks)."""
    from kvpool_sidecar.__main__ import Sidecar
    from kvpool_sidecar.config import settings_from_mapping

    path = tmp_path / "s" / "kvpool.sock"
    sidecar = Sidecar(settings_from_mapping({"node_name": "n1", "dram": {"size_bytes": "4Mi"},
                                             "api": {"socket_path": str(path)}}))
    await sidecar.start()
    membership = sidecar.membership
    if membership is None:
        raise AssertionError("the sidecar did not join")
    seen: list[bool] = []
    unpublish = membership.stop

    async def stop() -> None:
        with pytest.raises(SidecarError, match="another sidecar is listening"):
            _bind_unix(str(path), 0o600)  # a second sidecar of the node, starting now
        seen.append(path.exists())
        await unpublish()

    membership.stop = stop  # type: ignore[method-assign]
    await sidecar.stop()
    assert seen == [True]
    assert not path.exists()  # given up once unpublished
