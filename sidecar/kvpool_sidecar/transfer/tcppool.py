"""The fetching side's connections to its peers: the client's half of the handshake, and a
pool of connections per peer address.

One request is in flight per connection; a client keeps a few connections per peer so that
concurrent fetches from one peer run in parallel. A connection not leased for
:data:`POOLED_IDLE_S` is closed instead of used, well before its server closes it for its
idleness (:data:`~kvpool_sidecar.transfer.tcpserve.IDLE_TIMEOUT_S`); the connections to
peers that left the pool are closed when asked (:meth:`TcpConnections.forget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from kvpool_sidecar.transfer import auth
from kvpool_sidecar.transfer.base import PeerAuthError, PeerError
from kvpool_sidecar.transfer.tcpio import tune
from kvpool_sidecar.transfer.tcpserve import IDLE_TIMEOUT_S
from kvpool_sidecar.transfer.tcpwire import MAGIC, _recv_exact

#: A client opens a new connection instead of one it has not leased for this long, well
#: before the server closes it for its idleness (:data:`IDLE_TIMEOUT_S`).
POOLED_IDLE_S = IDLE_TIMEOUT_S / 2


@dataclass
class _Conn:
    sock: socket.socket
    address: str = ""
    #: The peer answered an operation of a richer transport as unknown: use plain GETs.
    plain: bool = False
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    rid: int = 0
    #: The connection's key from the handshake: every block it brings carries a MAC under it.
    key: bytes = b""
    #: The MACs of its requests and their answers' headers (under the same key).
    frames: auth.FrameSeal = field(init=False)
    #: When it was opened or last leased to a fetch (time.monotonic): see POOLED_IDLE_S.
    leased: float = field(default_factory=time.monotonic)
    #: Fetches whose answer it carried whole: a connection found closed after one is stale.
    served: int = 0

    def __post_init__(self) -> None:
        self.frames = auth.FrameSeal(self.key, client=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class TcpConnections:
    """The connections of :class:`~kvpool_sidecar.transfer.tcp.TcpTransport` to its peers,
    pooled per peer address."""

    def __init__(self, token: bytes, connections_per_peer: int) -> None:
        self.token = token
        self.connections_per_peer = connections_per_peer
        self._pools: dict[str, list[_Conn]] = {}
        self._turn = 0
        #: Connections to each peer being opened now, and a condition to wait on for them.
        self._opening: Counter[str] = Counter()
        #: Fetches under way, by address (from before their connection is leased to the end).
        self._fetching: Counter[str] = Counter()
        self._opened: dict[str, asyncio.Condition] = {}

    async def _connect(self, address: str) -> _Conn:
        loop = asyncio.get_running_loop()
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            number = int(port)
            if not 0 < number < 65536:
                raise ValueError("port out of range")
            infos = await loop.getaddrinfo(host, number, type=socket.SOCK_STREAM)
        except (ValueError, UnicodeError) as e:  # (a host name past the IDNA codec's bounds)
            raise PeerError(f"peer address {address[:80]!r} is malformed: {e}") from None
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
            tune(sock, receiver=True)
            ours = auth.new_nonce()
            await loop.sock_sendall(sock, MAGIC + ours)
            reply = await _recv_exact(loop, sock, auth.NONCE_BYTES + auth.PROOF_BYTES)
            theirs, answer = reply[: auth.NONCE_BYTES], reply[auth.NONCE_BYTES:]
            if not auth.check(self.token, False, theirs, ours, answer):
                raise PeerAuthError(f"peer {address} does not hold the pool secret")
            await loop.sock_sendall(sock, auth.proof(self.token, False, theirs, ours))
            if await _recv_exact(loop, sock, 1) != b"\x01":
                raise PeerAuthError(f"peer {address} refused our secret")
        except (OSError, PeerError):
            sock.close()
            raise
        return _Conn(sock, address, key=auth.session_key(self.token, ours, theirs))

    async def _lease_conn(self, address: str) -> _Conn:
        """An idle connection to ``address``, else a new one while it has fewer than
        ``connections_per_peer`` open or being opened, else a busy one to queue on (waiting
        for one being opened when there is none yet: a burst of fetches to a new peer opens
        ``connections_per_peer``, not one each). An idle one not leased for
        :data:`POOLED_IDLE_S` is closed instead of used: its server closes it after
        :data:`IDLE_TIMEOUT_S`, and a fetch on a connection closed under it is a miss."""
        pool = self._pools.setdefault(address, [])
        opened = self._opened.setdefault(address, asyncio.Condition())
        while True:
            now = time.monotonic()
            for c in [c for c in pool if not c.busy.locked() and now - c.leased > POOLED_IDLE_S]:
                self._drop(address, c)  # its server closes it soon for its idleness, if not already
            for c in pool:
                if not c.busy.locked():
                    c.leased = now
                    return c
            if len(pool) + self._opening[address] < self.connections_per_peer:
                break
            if pool:
                self._turn += 1
                c = pool[self._turn % len(pool)]
                c.leased = now
                return c
            async with opened:
                await opened.wait()
        self._opening[address] += 1
        try:
            conn = await self._connect(address)
            pool.append(conn)
            return conn
        finally:
            self._opening[address] -= 1
            async with opened:
                opened.notify_all()

    def forget(self, keep: Collection[str]) -> int:
        """Close the idle connections to peers whose address is not in ``keep`` (they left
        the pool, or moved) and drop what was kept for them; how many addresses went. An
        address with a fetch under way (on a connection, or waiting for one) is left for the
        next time (each departed peer had kept its sockets, half closed, until its address
        came back)."""
        gone = [a for a in self._pools if a not in keep and not self._fetching[a]]
        for a in gone:
            for c in self._pools.pop(a):
                c.close()
            self._opened.pop(a, None)
            self._opening.pop(a, None)
        return len(gone)

    def _drop(self, address: str, conn: _Conn) -> None:
        conn.close()
        pool = self._pools.get(address, [])
        if conn in pool:
            pool.remove(conn)
