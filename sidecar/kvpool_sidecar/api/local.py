"""The local API: serving pods on this node talk to the store over a Unix socket or TCP.

This module is the listener, :class:`LocalServer`: it takes the Unix socket's path (a stale
socket file replaced, a live one refused) and the optional TCP port, accepts clients (on the
Unix socket with the kernel's credentials of each, and nothing of value sent before its
HELLO), holds what the node's connections share (their slots and the connection limit, the
index budget, the bounds on unread answers and unfinished requests, the tenants' turns of
the loop) and drains and closes them when it stops. Each client is one
:class:`~kvpool_sidecar.api.connection.LocalConnection`; the bounds it keeps are
:class:`~kvpool_sidecar.api.limits.LocalLimits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path

from kvpool_client.protocol import NO_FD_BYTE
from kvpool_sidecar.api.budget import IndexBudget
from kvpool_sidecar.api.connection import LocalConnection
from kvpool_sidecar.api.limits import LocalLimits
from kvpool_sidecar.api.slots import Slots
from kvpool_sidecar.api.turns import TenantTurns
from kvpool_sidecar.api.unread import Unread
from kvpool_sidecar.errors import SidecarError, os_reason
from kvpool_sidecar.peers import PeerReader
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.sockdir import make_socket_dir
from kvpool_sidecar.store import TieredStore
from kvpool_sidecar.tenancy import Credentials

__all__ = ["LISTEN_BACKLOG", "LocalLimits", "LocalServer"]

logger = logging.getLogger(__name__)

#: The listen backlog of the local sockets: the most the kernel allows (it caps this at
#: ``net.core.somaxconn``, 4096 by default). A process needing no credentials that connects
#: in a loop keeps a backlog full; the larger it is, the fewer of an engine's connects find it
#: full (a client's non-blocking connect then fails at once with EAGAIN).
LISTEN_BACKLOG = 65535


def _log_once(cause: str, msg: str, *args: object) -> None:
    warn_once(logger, cause, msg, *args)


class LocalServer:
    """Listens on the Unix socket (with the arena's fd) and optionally on TCP."""

    def __init__(self, store: TieredStore, limits: LocalLimits, *, socket_path: str | None,
                 socket_mode: int = 0o660, tcp: tuple[str, int] | None = None,
                 peers: PeerReader | None = None, drain_s: float = 5.0) -> None:
        self.store = store
        #: How long :meth:`stop` lets running requests finish.
        self.drain_s = drain_s
        self.peers = peers
        self.limits = limits
        self.socket_path = socket_path
        self.socket_mode = socket_mode
        self.tcp = tcp
        self.tcp_port: int | None = None
        self._uds: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._tcp_server: asyncio.Server | None = None
        self._conns = Slots()
        self.index_budget = IndexBudget(limits.index_concurrency, limits.index_keys_per_s)
        self.unread: Unread[LocalConnection] = Unread(limits.max_unread_bytes)
        self.inbound: Unread[LocalConnection] = Unread(limits.max_unread_bytes)
        #: The loop's turns between the node's tenants.
        self.turns = TenantTurns()
        #: Sessions of closed connections still giving back their leases.
        self.closing: set[asyncio.Task[None]] = set()

    def _factory(self, shm: bool, raw: socket.socket | None = None,
                 cred: Credentials | None = None) -> Callable[[], LocalConnection]:
        return lambda: LocalConnection(self.store, self.limits, shm=shm, live=self._conns, peers=self.peers,
                                       raw=raw, cred=cred, index_budget=self.index_budget, unread=self.unread,
                                       inbound=self.inbound, turns=self.turns, closing=self.closing)

    async def bind(self) -> None:
        """Take the Unix socket's path and the TCP port, and accept no one yet (:meth:`start`
        does): a sidecar that cannot have them (another sidecar listens there) fails before it
        joins the pool, and a client that connects meanwhile waits in the listen backlog.
        SidecarError, naming the setting, when either cannot be had; :meth:`stop` releases
        what was taken."""
        if self.socket_path and self._uds is None:
            self._uds = _bind_unix(self.socket_path, self.socket_mode)
        if self.tcp is not None and self._tcp_server is None:
            host, port = self.tcp
            try:
                self._tcp_server = await asyncio.get_running_loop().create_server(
                    self._factory(False), host, port, backlog=LISTEN_BACKLOG, start_serving=False
                )
            except OSError as e:
                raise SidecarError(f"api.tcp_host/api.tcp_port: cannot listen on {host}:{port}: "
                                   f"{os_reason(e)}") from e
            self.tcp_port = self._tcp_server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        """:meth:`bind`, where not yet done, and accept clients."""
        await self.bind()
        # the policy's bookkeeping that a tenant's requests queue, applied after their
        # answers, is owed by the tenant (see api/turns.py)
        self.store.policy.charges = self.turns
        if self._uds is not None:
            self._accept = asyncio.get_running_loop().create_task(self._accept_loop(self._uds))
        if self._tcp_server is not None:
            await self._tcp_server.start_serving()

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:  # out of descriptors, most likely: once a minute in the log
                _log_once("accept", "accept on the local socket failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            try:
                pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
                conn.send(NO_FD_BYTE)  # nothing of value before the client proves its tenant
                await loop.connect_accepted_socket(self._factory(True, conn, Credentials(pid, uid, gid)), conn)
            except OSError as e:
                _log_once("handshake", "dropping a local client during its handshake: %s", e)
                conn.close()

    async def stop(self, *, keep_path: bool = False) -> None:
        """Stop accepting; let running requests finish (up to ``drain_s``) while new ones
        get UNAVAILABLE; then close every connection (their sessions release their leases).
        ``keep_path``: the Unix socket stays bound, accepting no one, until :meth:`release`
        (the sidecar holds its path until its node is unpublished, so that no other sidecar
        of the node starts and joins meanwhile: the drain's unpublishing would delete its
        entries)."""
        if self.store.policy.charges is self.turns:
            self.store.policy.charges = None
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        if self._tcp_server is not None:
            self._tcp_server.close()
            await self._tcp_server.wait_closed()
        running = [t for c in list(self._conns) for t in c.requests.drain()]
        if running:
            _, late = await asyncio.wait(running, timeout=self.drain_s)
            if late:
                logger.warning("closing %d local requests still running after %.1fs of draining",
                               len(late), self.drain_s)
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.close()
        await asyncio.sleep(0)
        # their sessions close, large ones as tasks (more may come as connections that flush
        # their last answers go), within the drain time
        deadline = asyncio.get_running_loop().time() + self.drain_s
        while self.closing and (left := deadline - asyncio.get_running_loop().time()) > 0:
            await asyncio.wait(list(self.closing), timeout=left)
        for t in list(self.closing):
            t.cancel()
        if not keep_path:
            self.release()

    def release(self) -> None:
        """Give up the Unix socket's path (after :meth:`stop`; at once on a half-started one)."""
        if self._uds is not None:
            if self.socket_path:  # before the close: while it listens, no other sidecar binds the path
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
            self._uds.close()
            self._uds = None


def _bind_unix(path: str, mode: int) -> socket.socket:
    """Bind and listen on the local socket; replace a stale socket file, refuse a live one.
    SidecarError, naming ``api.socket_path``, when it cannot be had; nothing is left behind."""
    p = Path(path)
    make_socket_dir(p.parent)  # (checked before anything is made, and after)
    try:
        if p.exists() or p.is_symlink():
            if not stat.S_ISSOCK(p.lstat().st_mode):
                raise SidecarError(f"{path} exists and is not a socket")
            if _listening(path):
                raise SidecarError(f"another sidecar is listening on {path}")
            p.unlink(missing_ok=True)  # stale: left by a sidecar that is gone
    except OSError as e:
        raise SidecarError(f"api.socket_path: cannot replace {path}: {os_reason(e)}") from e
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise SidecarError(f"api.socket_path: cannot listen on {path}: {os_reason(e)}") from e
    try:
        os.chmod(path, mode)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # (ours: bound above)
        raise SidecarError(f"api.socket_path: cannot listen on {path}: {os_reason(e)}") from e
    return sock


def _listening(path: str) -> bool:
    """Whether a process listens on the Unix socket ``path``; never waits. A connect that
    would block (EAGAIN: the listen backlog is full, a live sidecar too busy to accept, or
    one that is stuck) counts as live; one refused (ECONNREFUSED: no one listens, the file
    of a sidecar that is gone) or a file gone meanwhile, as not. Any other error (EACCES:
    a socket this user may not connect to) is raised: that file is not ours to replace."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (BlockingIOError, InterruptedError):
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()
    return True
