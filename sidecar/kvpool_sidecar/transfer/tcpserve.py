"""The serving side of the TCP transport: the listener, the admission of peer connections,
the server's half of the handshake, and the answers to requests (the wire format is in
:mod:`kvpool_sidecar.transfer.tcpwire`).

The server sends payloads straight from the shared arena (no copy through user space):
``send`` from its mapping by default, or ``sendfile`` from its memfd when configured (on
loopback and veth the kernel splices shmem page by page, which measured slower).

It admits connections within limits: in all, in their handshake, and from one address
(:data:`MAX_PEER_CONNECTIONS`, :data:`MAX_UNAUTHENTICATED`, :data:`MAX_HANDSHAKES_PER_ADDRESS`,
:data:`MAX_CONNECTIONS_PER_ADDRESS`). It bounds what an authenticated peer holds too: a
connection that brings no request for :data:`IDLE_TIMEOUT_S` is closed (a client stops using
a pooled connection idle for :data:`~kvpool_sidecar.transfer.tcppool.POOLED_IDLE_S`, well
before), a frame must arrive whole within
:data:`~kvpool_sidecar.transfer.tcpwire.FRAME_TIMEOUT_S` of its length, a request may take
at most :data:`MAX_REQUEST_FRAME` bytes, and a frame's buffer grows as its bytes arrive
(never to the length it announced first). An answer is given within one deadline, from
before its blocks are lent to the last byte of its last block: ``SEND_TIMEOUT_S`` plus its
bytes at ``MIN_SEND_RATE``; past it the connection is closed and the blocks' read leases are
given back.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_client.protocol import HEADER, encode
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.transfer import auth, tcpio
from kvpool_sidecar.transfer.base import BlockSource, PeerAuthError, PeerError, lend_once
from kvpool_sidecar.transfer.tcpio import Outgoing, _bulk, blocking_send, tune
from kvpool_sidecar.transfer.tcpwire import (
    ERR_UNKNOWN_OP,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    MAX_KEYS,
    OP_GET,
    _recv_exact,
    _recv_sealed,
)

logger = logging.getLogger(__name__)

#: A bulk send or receive that makes no progress for this long ends the connection; an
#: answer must be given whole within this plus its bytes at ``MIN_SEND_RATE``, from before
#: its blocks are lent (see :meth:`TcpServer._answer`).
SEND_TIMEOUT_S = 30.0
#: A served connection that brings no request for this long (after its handshake, or after
#: its last answer) is closed: an authenticated connection had been held for as long as its
#: other end liked (a relay without the secret passes a member's handshake on and keeps the
#: socket; 512 of them took every slot).
IDLE_TIMEOUT_S = 60.0
#: The largest request a served connection takes (a frame's bytes after its length): one of
#: MAX_KEYS keys, its operation and request id the widest numbers msgpack has, and its tag.
#: Only an answer's header (taken by the fetching side) may be as long as MAX_FRAME.
MAX_REQUEST_FRAME = len(encode([(1 << 64) - 1, (1 << 64) - 1, [bytes(RAW_KEY_BYTES)] * MAX_KEYS])) - HEADER.size \
    + auth.FRAME_TAG_BYTES
#: Peer connections served at once, and of those still in their handshake (not yet proved
#: to hold the pool secret): past the first, a new connection is closed at once; past the
#: second, it ends the oldest handshake (unless its address holds its share already).
MAX_PEER_CONNECTIONS = 512
MAX_UNAUTHENTICATED = 32
#: Connections accepted between turns of the event loop at most (a flood of connections
#: waiting to be accepted had held the loop for a whole backlog of them).
ACCEPTS_PER_TURN = 16
#: Of those in their handshake, at most this many from one address: one host holding idle
#: sockets open cannot take every handshake slot (and shut the node off from its peers).
MAX_HANDSHAKES_PER_ADDRESS = 8
#: Authenticated connections one address may hold at once (or four times the node's own
#: ``connections_per_peer``, where more): a member opens ``connections_per_peer`` to a node.
#: A new one past it ends that address's longest idle connection (one waiting for a
#: request), or is closed where none is idle: a host at a departed member's address that
#: relayed members' handshakes and kept the connections had held all 512 slots.
MAX_CONNECTIONS_PER_ADDRESS = 64
#: The peer's first bytes (magic and nonce, 37 bytes) must come within this, and its proof
#: within as long after this node sent its own (an honest peer answers in a round trip); the
#: whole handshake within HANDSHAKE_TIMEOUT_S.
HELLO_TIMEOUT_S = 1.0


class TcpServer:
    """The serving side of :class:`~kvpool_sidecar.transfer.tcp.TcpTransport`: it listens,
    admits and authenticates peers, and answers their requests from a
    :class:`~kvpool_sidecar.transfer.base.BlockSource`."""

    def __init__(self, token: bytes, host: str, port: int, *, advertise: str | None, connections_per_peer: int,
                 sendfile: bool, send_workers: ThreadPoolExecutor) -> None:
        self.token = token
        self.sendfile = sendfile
        self.host = host
        self.port = port
        self.advertise = advertise
        self._listener: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._source: BlockSource | None = None
        #: Each served connection's key from its handshake, and its MAC nonces; and the MACs
        #: of its control frames.
        self._session_keys: dict[socket.socket, auth.Sealer] = {}
        self._frames: dict[socket.socket, auth.FrameSeal] = {}
        self.rejected = 0
        self.max_connections = MAX_PEER_CONNECTIONS
        self.max_unauthenticated = MAX_UNAUTHENTICATED
        #: The tasks of the connections in their handshake, oldest first, and the address each
        #: came from: at the limit, a new connection ends the oldest (a stranger's, most likely:
        #: a member's takes a round trip).
        self._handshakes: dict[asyncio.Task[None], str] = {}
        self.evicted = 0
        #: Handshakes under way per source address (see MAX_HANDSHAKES_PER_ADDRESS).
        self._handshakes_from: Counter[str] = Counter()
        #: Authenticated connections per source address, oldest first, each with whether
        #: it waits for a request now (see MAX_CONNECTIONS_PER_ADDRESS).
        self._authed_from: dict[str, dict[asyncio.Task[None], bool]] = {}
        self.max_per_address = max(MAX_CONNECTIONS_PER_ADDRESS, 4 * connections_per_peer)
        #: Idle connections ended for a new one from their address, and new ones closed
        #: because every connection of their address was busy.
        self.displaced = 0
        self.refused = 0
        #: The bulk sends' workers (the transport's own: see its ``__init__``).
        self._send_workers = send_workers

    async def start(self, source: BlockSource) -> str:
        self._source = source
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(256)
        sock.setblocking(False)
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accept = asyncio.get_running_loop().create_task(self._accept_loop(sock))
        return self.advertise or f"{self.host}:{self.port}"

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        accepted = 0
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as e:
                logger.warning("peer accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            accepted += 1
            if accepted % ACCEPTS_PER_TURN == 0:
                await asyncio.sleep(0)  # (an accept of a connection already waiting does not yield)
            source = str(addr[0]) if isinstance(addr, tuple) and addr else "?"
            if self._handshaking >= self.max_unauthenticated and self._handshakes \
                    and len(self._serving) < self.max_connections \
                    and self._handshakes_from[source] < MAX_HANDSHAKES_PER_ADDRESS:
                # the oldest handshake goes, not the new one: strangers that send a hello and
                # then nothing (from many addresses) had kept every slot, and new members out
                oldest = next(iter(self._handshakes))
                self._handshake_over(oldest)  # (now: a task cancelled before it ran has no finally)
                oldest.cancel()
                self.evicted += 1
                warn_once(logger, "peer-evicted", "ending the oldest peer handshakes to take new connections: %d in "
                          "their handshake (limit %d)", self._handshaking, self.max_unauthenticated)
            elif len(self._serving) >= self.max_connections or self._handshaking >= self.max_unauthenticated \
                    or self._handshakes_from[source] >= MAX_HANDSHAKES_PER_ADDRESS:
                self.refused += 1
                conn.close()
                warn_once(logger, "peer-refused", "refusing peer connections: %d open, %d in their handshake, "
                          "%d of them from %s (limits %d, %d, %d an address)", len(self._serving), self._handshaking,
                          self._handshakes_from[source], source, self.max_connections, self.max_unauthenticated,
                          MAX_HANDSHAKES_PER_ADDRESS)
                continue
            conn.setblocking(False)
            tune(conn, receiver=False)
            # counted from the accept, not from when the task first runs: a burst of accepts
            # cannot pass the limits before any of its tasks has started
            task = loop.create_task(self._serve(conn))
            self._handshakes[task] = source
            self._handshakes_from[source] += 1
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
            task.add_done_callback(self._handshake_over)

    @property
    def _handshaking(self) -> int:
        """Connections in their handshake now."""
        return len(self._handshakes)

    def _handshake_over(self, task: asyncio.Task[None]) -> None:
        """``task``'s connection is no longer in its handshake (done with it, ended, or gone)."""
        source = self._handshakes.pop(task, None)
        if source is None:
            return
        self._handshakes_from[source] -= 1
        if self._handshakes_from[source] <= 0:
            del self._handshakes_from[source]

    async def _serve(self, sock: socket.socket) -> None:
        """Task guard for one peer connection (counted in its handshake from its accept):
        authenticate, then answer GETs."""
        loop = asyncio.get_running_loop()
        peer = "?"
        task = asyncio.current_task()
        source = self._handshakes.get(task, "?") if task is not None else "?"
        mine: dict[asyncio.Task[None], bool] | None = None
        try:
            try:
                peer = str(sock.getpeername())
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                    key = await self._server_handshake(loop, sock)
                self._session_keys[sock] = auth.Sealer(key)
                frames = self._frames[sock] = auth.FrameSeal(key, client=False)
            finally:
                if task is not None:
                    self._handshake_over(task)
            if task is not None:
                mine = self._admit_authed(source, task)
            while True:
                if mine is not None and task is not None:
                    mine[task] = not self._holds_leases(sock)  # (displaceable while it waits, lending nothing)
                body = await _recv_sealed(loop, sock, frames, limit=MAX_REQUEST_FRAME, idle=IDLE_TIMEOUT_S)
                if mine is not None and task is not None:
                    del mine[task]
                    mine[task] = False  # (last in the table: its order is that of the latest requests)
                await self._answer(loop, sock, body)
        except PeerAuthError as e:
            self.rejected += 1
            warn_once(logger, "peer-rejected", "rejected peer %s: %s", peer, e)
        except (PeerError, OSError, TimeoutError) as e:
            logger.debug("peer connection %s ended: %s", peer, e)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - task guard: one bad peer never stops the server
            logger.exception("peer connection %s failed", peer)
        finally:
            if mine is not None and task is not None:
                mine.pop(task, None)
                if not mine and self._authed_from.get(source) is mine:
                    del self._authed_from[source]
            self._session_keys.pop(sock, None)
            self._frames.pop(sock, None)
            sock.close()

    def _holds_leases(self, sock: socket.socket) -> bool:
        """Whether ``sock``'s peer holds blocks of this node between its requests (a richer
        transport's leases): such a connection is never ended for a new one."""
        return False

    def _admit_authed(self, source: str, task: asyncio.Task[None]) -> dict[asyncio.Task[None], bool]:
        """Count ``task``'s connection, just authenticated, against its address's share
        (:data:`MAX_CONNECTIONS_PER_ADDRESS`): at the share, the address's longest idle
        connection is ended (PeerError where none is idle: the new one is closed instead).
        The address's table, in which ``task`` now is."""
        mine = self._authed_from.setdefault(source, {})
        if len(mine) >= self.max_per_address:
            idle = next((t for t, waiting in mine.items() if waiting), None)
            self.displaced += 1
            warn_once(logger, "peer-per-address", "%s holds %d authenticated peer connections (limit %d): %s",
                      source, len(mine), self.max_per_address,
                      "ending its longest idle one" if idle is not None else "closing the new one, all are busy")
            if idle is None:
                raise PeerError(f"{source} holds {len(mine)} peer connections, all busy")
            del mine[idle]
            idle.cancel()
        mine[task] = False
        return mine

    async def _server_handshake(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
        """Authenticate the peer; the connection's key."""
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            hello = await _recv_exact(loop, sock, len(MAGIC) + auth.NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            raise PeerAuthError("not a kvpool peer (bad magic)")
        theirs = hello[len(MAGIC):]
        ours = auth.new_nonce()
        await loop.sock_sendall(sock, ours + auth.proof(self.token, True, theirs, ours))
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            answer = await _recv_exact(loop, sock, auth.PROOF_BYTES)
        if not auth.check(self.token, True, theirs, ours, answer):
            raise PeerAuthError("wrong pool secret")
        await loop.sock_sendall(sock, b"\x01")
        return auth.session_key(self.token, theirs, ours)

    async def _answer(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, body: list[Any]) -> None:
        """Answer one request. A GET's answer runs to one deadline, from before its blocks are
        lent: ``SEND_TIMEOUT_S`` plus its bytes at ``MIN_SEND_RATE``, its header's send and
        the wait for a send worker within it (a reader that never read had kept the header's
        send, and every block's read lease, for good). Past it the connection is closed
        (TimeoutError) and the leases are given back."""
        start = loop.time()
        if len(body) >= 2 and type(body[0]) is int and body[0] != OP_GET and type(body[1]) is int:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await loop.sock_sendall(sock, self._frames[sock].seal([body[1], ERR_UNKNOWN_OP]))
            return
        if len(body) != 3 or body[0] != OP_GET or not isinstance(body[2], list) or len(body[2]) > MAX_KEYS:
            raise PeerError("malformed peer request")
        rid, keys = body[1], body[2]
        if not all(type(k) is bytes and len(k) == RAW_KEY_BYTES for k in keys):
            raise PeerError("malformed key in peer request")
        source = self._source
        if source is None:
            raise PeerError("not serving")
        sealer = self._session_keys.get(sock)
        if sealer is None:
            raise PeerAuthError("no session key: the connection did not authenticate")
        async with asyncio.timeout(SEND_TIMEOUT_S) as deadline:
            blocks = await lend_once(source, keys)  # (a lend cut short gives back what it took)
            try:
                total = sum(v.nbytes for b in blocks if b is not None for v in b.views)
                deadline.reschedule(start + SEND_TIMEOUT_S + total / tcpio.MIN_SEND_RATE)
                header = [rid, 0, [None if b is None else [b.size, b.checksum, b.tenant] for b in blocks]]
                await loop.sock_sendall(sock, self._frames[sock].seal(header))
                out = [Outgoing(list(b.extents), list(b.views),
                                 sealer.mac(rid, i, keys[i], b.size, b.checksum, b.tenant),
                                 b.fd if self.sendfile else None)
                       for i, b in enumerate(blocks) if b is not None]
                if out:  # (the worker's own deadline counts from when it starts; the answer's ends a wait too)
                    left = max(0.0, start + SEND_TIMEOUT_S - loop.time())
                    await _bulk(self._send_workers, sock, blocking_send, out, left)
            finally:
                source.give_back([b for b in blocks if b is not None])
