"""Helpers shared by the integration tests: keys, payloads, raw wire clients, deadlines."""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool_client.client import PoolClient
from kvpool_client.keys import BlockKey, ModelFingerprint, block_keys
from kvpool_client.protocol import HEADER, NO_FD_BYTE, PROTOCOL_VERSION, Op, PutStatus, decode, encode
from kvpool_sidecar.process import SidecarProcess

FP = ModelFingerprint(model="itest/model", dtype="bfloat16", block_tokens=16, kv_layout="bytes",
                      revision="r1")

#: The token of the tenants that :func:`tcp_tenants` makes: the TCP API needs one.
TCP_TOKEN = b"tcp-tenant-token-0123456789"


def tcp_tenants(workdir: str | os.PathLike[str], *names: str) -> list[dict[str, Any]]:
    """Tenants (``default`` when none is named) reachable over TCP with :data:`TCP_TOKEN`
    and over the Unix socket by this test's own uid."""
    path = os.path.join(workdir, "tenant-token")
    with open(path, "wb") as f:
        f.write(TCP_TOKEN)
    return [{"name": n, "uids": [os.getuid()], "token_file": path} for n in (names or ("default",))]


#: Every wait in these tests is bounded by this many seconds (no pytest timeout plugin).
DEADLINE_S = 20.0

T = TypeVar("T")

_counter = iter(range(1, 1 << 62))


def fresh_keys(n: int, *, fp: ModelFingerprint = FP) -> list[BlockKey]:
    """``n`` chained keys of a prompt no other call of this function has used."""
    salt = next(_counter) * 7919 + random.getrandbits(20) * 1_000_003
    rng = random.Random(salt)
    tokens = [rng.randrange(0, 2**31) for _ in range(n * fp.block_tokens)]
    keys = block_keys(fp, tokens)
    assert len(keys) == n
    return keys


def payload(key: BlockKey | bytes, size: int) -> bytes:
    """Deterministic bytes for ``key`` (different keys get different bytes)."""
    raw = key.raw if isinstance(key, BlockKey) else key
    return random.Random(raw + size.to_bytes(8, "little")).randbytes(size)


def wait_until(pred: Callable[[], T], what: str, timeout: float = DEADLINE_S, interval: float = 0.05) -> T:
    """Poll ``pred`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    last: T = pred()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
        last = pred()
    return last


def put_all(client: PoolClient, keys: Sequence[BlockKey], datas: Sequence[bytes], batch: int = 16
            ) -> list[PutStatus]:
    out: list[PutStatus] = []
    for i in range(0, len(keys), batch):
        out += client.put(keys[i : i + batch], datas[i : i + batch])
    return out


def assert_serves(sp: SidecarProcess, *, size: int = 70_001) -> None:
    """The daemon is alive and a fresh client round-trips a new block byte for byte."""
    assert sp.proc is not None and sp.proc.poll() is None, f"sidecar died: {sp.log_tail()}"
    [key] = fresh_keys(1)
    data = payload(key, size)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.put([key], [data]) == [PutStatus.STORED]
        assert c.lookup([key]).prefix == 1
        [got] = c.get([key])
        assert got is not None and bytes(got) == data
    assert sp.proc.poll() is None, f"sidecar died: {sp.log_tail()}"


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=DEADLINE_S) as r:  # noqa: S310
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_json(port: int, path: str) -> tuple[int, Any]:
    status, body = http_get(port, path)
    return status, json.loads(body)


class RawConn:
    """A bare wire client: frames in and out, every read bounded. It says HELLO as
    ``tenant`` at once unless ``tenant`` is None (then nothing is served until :meth:`hello`).
    ``blocking_connect``: its Unix socket connects without a timeout (waiting for room in a
    full listen backlog, where one with a timeout fails at once)."""

    def __init__(self, socket_path: str | None = None, *, port: int | None = None, tenant: str | None = "default",
                 token: bytes | None = None, blocking_connect: bool = False) -> None:
        self.unix = port is None
        #: Whether the sidecar sent the arena's descriptor after HELLO.
        self.got_fd = False
        if port is not None:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if not blocking_connect:  # (with a timeout, a full listen backlog fails the connect at once)
                self.sock.settimeout(DEADLINE_S)
            assert socket_path is not None
            self.sock.connect(socket_path)  # blocking: waits in the kernel for room in the backlog
            self.sock.settimeout(DEADLINE_S)
            msg, fds, _, _ = socket.recv_fds(self.sock, 1, 4)
            for fd in fds:
                os.close(fd)
            assert msg == b"\x00" and not fds, "the sidecar sent something of value before HELLO"
        self._buf = bytearray()
        self._rid = 0
        self._marker_taken = False
        if tenant is not None:
            _, status, result = self.hello(tenant, token)
            assert status == 0, result

    def hello(self, tenant: object, token: bytes | None = None, version: int = PROTOCOL_VERSION) -> list[Any]:
        """Say HELLO; on a Unix socket, take the byte (and descriptor) sent before its answer."""
        rid = self.request(int(Op.HELLO), version, tenant, token)
        if self.unix and not self._marker_taken:  # sent once, before the first HELLO's answer
            self._marker_taken = True
            msg, fds, _, _ = socket.recv_fds(self.sock, 1, 4)
            self.got_fd = bool(fds)
            for fd in fds:
                os.close(fd)
            assert msg in (b"\x00", b"\x01"), msg
        while True:
            body = self.recv()
            assert body is not None, "the sidecar closed the connection"
            if body[0] == rid:
                return body

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def request(self, op: int, *args: Any) -> int:
        self._rid += 1
        self.sock.sendall(encode([op, self._rid, *args]))
        return self._rid

    def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)  # bounded by the socket timeout
            if not chunk:
                return False
            self._buf += chunk
        return True

    def recv(self) -> list[Any] | None:
        """The next answer, or None when the sidecar closed the connection."""
        if not self._fill(HEADER.size):
            return None
        (n,) = HEADER.unpack_from(self._buf)
        if not self._fill(HEADER.size + n):
            return None
        body = decode(bytes(self._buf[HEADER.size : HEADER.size + n]))
        del self._buf[: HEADER.size + n]
        return body

    def call(self, op: int, *args: Any) -> list[Any]:
        rid = self.request(op, *args)
        while True:
            body = self.recv()
            assert body is not None, "the sidecar closed the connection"
            if body[0] == rid:
                return body

    def closed_by_peer(self) -> bool:
        """True once the sidecar has closed the connection (reads to EOF, bounded)."""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Child:
    """A client in its own process (``python -c script args...``), run from the repo root."""

    def __init__(self, script: str, *args: str) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT,
        )

    def wait_line(self, prefix: str, timeout: float = DEADLINE_S) -> str:
        """The first stdout line starting with ``prefix``; fails if the child exits or stalls."""
        import select

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if r:
                line = self.proc.stdout.readline().decode()
                if line.startswith(prefix):
                    return line.strip()
                if not line:
                    break
            elif self.proc.poll() is not None:
                break
        self.kill()
        err = self.proc.stderr.read().decode() if self.proc.stderr else ""
        raise AssertionError(f"child gave no {prefix!r} line (exit {self.proc.returncode}): {err[-2000:]}")

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait(DEADLINE_S)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return rc


_FLOOD = r"""
import os, socket, sys
path = sys.argv[1]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
held, told = [], False
while True:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
    except BlockingIOError:  # the listen backlog is full: again
        s.close()
        continue
    held.append(s)
    if len(held) > 500:
        held.pop(0).close()
    if not told and len(held) >= 64:
        print("flooding", flush=True)
        told = True
"""


def flood_as_nobody(socket_path: str) -> Child:
    """A process of another user (uid 65534: the test must run as root, and the socket be
    one that user reaches) that connects to ``socket_path`` in a loop, non-blocking, never
    says HELLO and keeps its last 500 connections: once it prints ``flooding``, the
    sidecar's listen backlog is kept full. :meth:`Child.kill` it."""
    child = Child(_FLOOD, socket_path)
    child.wait_line("flooding")
    return child


class SlowLink:
    """A TCP relay between a client and a sidecar's TCP port whose answers (what the sidecar
    sends) can be held back or trickled: :meth:`hold_after` lets ``n`` more bytes through and
    holds the rest until :meth:`let_go`; :meth:`trickle` passes them one byte at a time.
    :meth:`hold_requests` stops reading what the client sends (until :meth:`let_go`), and
    :meth:`inject` sends the client bytes of the test's own."""

    def __init__(self, port: int) -> None:
        self._upstream = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._allowance: int | None = None  # bytes that may pass before the rest is held (None: all)
        self._delay = 0.0
        self._requests_held = False
        self._client: socket.socket | None = None
        self._closed = threading.Event()
        self._socks: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def hold_after(self, n: int) -> None:
        with self._cond:
            self._allowance = n

    def let_go(self) -> None:
        with self._cond:
            self._allowance, self._delay, self._requests_held = None, 0.0, False
            self._cond.notify_all()

    def hold_requests(self) -> None:
        with self._cond:
            self._requests_held = True

    def inject(self, data: bytes) -> None:
        assert self._client is not None, "no client has connected"
        with self._cond:  # (between the answers' chunks)
            self._client.sendall(data)

    def trickle(self, delay: float) -> None:
        self._delay = delay

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", self._upstream))
        self._client = client
        self._socks += [client, upstream]
        for src, dst, held in ((client, upstream, False), (upstream, client, True)):
            t = threading.Thread(target=self._pump, args=(src, dst, held), daemon=True)
            self._threads.append(t)
            t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, held: bool) -> None:
        try:
            while True:
                if not held:
                    with self._cond:
                        self._cond.wait_for(lambda: self._closed.is_set() or not self._requests_held)
                if self._closed.is_set() or not (chunk := src.recv(65536)):
                    return
                while chunk and held:
                    with self._cond:
                        self._cond.wait_for(lambda: self._closed.is_set() or self._allowance != 0)
                        if self._closed.is_set():
                            return
                        n = len(chunk) if self._allowance is None else min(self._allowance, len(chunk))
                        n = min(n, 1) if self._delay else n
                        if self._allowance is not None:
                            self._allowance -= n
                    dst.sendall(chunk[:n])
                    chunk = chunk[n:]
                    if self._delay:
                        self._closed.wait(self._delay)
                if chunk:
                    dst.sendall(chunk)
        except OSError:
            pass

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a thread blocked in its recv or accept)
            except OSError:
                pass
            sock.close()
        for t in self._threads:
            t.join(DEADLINE_S)


class StallingSocket:
    """A Unix socket that answers a client's handshake one step at a time, ``pause`` seconds
    apart, each well within the client's timeout: the greeting byte, then (after HELLO) the
    marker byte, and then no answer at all (a sidecar slow at every step of the handshake)."""

    def __init__(self, path: str, pause: float) -> None:
        self.path = path
        self.pause = pause
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen()
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        self._conns.append(conn)
        try:
            if self._closed.wait(self.pause):
                return
            conn.sendall(NO_FD_BYTE)
            conn.recv(65536)  # HELLO
            if self._closed.wait(self.pause):
                return
            conn.sendall(NO_FD_BYTE)  # the marker, and then silence
            self._closed.wait()
        except OSError:
            pass

    def __enter__(self) -> StallingSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        for sock in (self._listener, *self._conns):
            sock.close()
        self._thread.join(DEADLINE_S)
