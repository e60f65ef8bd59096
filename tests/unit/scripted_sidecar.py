"""A scripted stand-in for a sidecar, for the client library's tests against answers no real
sidecar sends (a broken or hostile one): it speaks the framing and the handshake, and a test's
script answers the rest. Every other test of the client runs against real sidecars."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvpool_client.protocol import FD_BYTE, HEADER, NO_FD_BYTE, decode, encode

#: What the stand-in says at HELLO by default: small limits (answers of at most 2 MiB).
INFO: dict[str, Any] = {"shm": False, "max_frame_bytes": 1 << 20, "max_batch": 64, "block_max_bytes": 1 << 20}


class Peer:
    """The sidecar's end of one client connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: The arena sent at HELLO, mapped here too (what the client wrote into it).
        self.arena: mmap.mmap | None = None

    def read(self) -> list[Any]:
        """The client's next request, decoded."""
        (length,) = HEADER.unpack(self._exact(HEADER.size))
        body: list[Any] = decode(self._exact(length))
        return body

    def answer(self, rid: int, result: Any) -> None:
        self.sock.sendall(encode([rid, 0, result]))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, info: Any = None, *, arena_bytes: int = 0, raw: bytes | None = None,
              sealed: bool = True) -> list[Any]:
        """Read HELLO and answer it with ``info`` (or send ``raw`` bytes instead); on a Unix
        socket with an arena of ``arena_bytes`` (a memfd, ``sealed`` against resizing as the
        sidecar's is), whose descriptor goes before."""
        req = self.read()
        if self.sock.family == socket.AF_UNIX:
            if arena_bytes:
                fd = os.memfd_create("scripted-arena", os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, arena_bytes)
                if sealed:
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                self.arena = mmap.mmap(fd, arena_bytes)
                socket.send_fds(self.sock, [FD_BYTE], [fd])
                os.close(fd)
            else:
                self.sock.sendall(NO_FD_BYTE)
        if raw is not None:
            self.send(raw)
        else:
            self.answer(req[1], INFO if info is None else info)
        return req

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the client closed the connection")
            buf += chunk
        return bytes(buf)


@contextmanager
def scripted_sidecar(script: Callable[[Peer], None], unix_dir: Path | None = None) -> Iterator[dict[str, Any]]:
    """Serve one connection with ``script`` in a thread; yields the client's connect
    arguments (``socket_path``, or ``host`` and ``port``). A Unix socket (in ``unix_dir``)
    sends the plain greeting byte at accept, as a sidecar does."""
    if unix_dir is not None:
        path = str(unix_dir / "scripted.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        where: dict[str, Any] = {"socket_path": path}
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        where = {"host": "127.0.0.1", "port": listener.getsockname()[1]}
    listener.listen(1)
    done = threading.Event()

    def run() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            if unix_dir is not None:
                conn.sendall(NO_FD_BYTE)
            try:
                script(Peer(conn))
            except (OSError, EOFError):
                pass  # the client went away: what the test checks happened on its side
            done.wait(30)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield where
    finally:
        done.set()
        listener.close()
        t.join(30)
