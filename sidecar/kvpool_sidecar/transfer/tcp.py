"""The built-in TCP transport: asyncio, many blocks per request, straight into the arena.

Connection: ``b"KVPP" | version | client nonce``, then the mutual HMAC handshake of
:mod:`kvpool_sidecar.transfer.auth`, which also gives both ends a key for the connection.
Requests are frames ``u32 length | msgpack [op, request id, keys] | tag``; the tag, and the
one at the end of each answer's header, is the MAC of the frame's msgpack bytes under the
connection's key and its place in the connection's sequence (``auth.FrameSeal``): a frame
that fails it ends the connection, before any of it is decoded (version 4; version 3 put the
tag inside the msgpack list, so a forged frame was decoded whole before it was refused).
The answer to a GET is one header frame ``[request id, 0, [[size, checksum, tenant] | nil,
...]] | tag`` (nil for a key not held, and for the copies of a key after its first place in
the request: each block is sent once) followed by each block that was found, in order: the
12-byte nonce of its MAC, its payload, then the MAC's 16-byte tag (AES-256-GMAC under the
connection's key, over the request id, the block's index, key, size, checksum and tenant,
and the payload; the sender counts its nonces, see :mod:`~kvpool_sidecar.transfer.auth`). A block whose MAC is wrong is dropped and the
connection closed: only the node at the other end of the handshake can make one.

The server sends payloads straight from the shared arena (no copy through user space):
``send`` from its mapping by default, or ``sendfile`` from its memfd when configured (on
loopback and veth the kernel splices shmem page by page, which measured slower). The client receives with ``recv_into`` straight into the DRAM
extents the store reserved, verifies each block's checksum and only then commits it; the
blocks after the last one it has room for are not taken off the wire (the connection is
closed instead, and not reused). One
request is in flight per connection; a client keeps a few connections per peer so that
concurrent fetches from one peer run in parallel. A deadline bounds every fetch: a slow or
dead peer yields misses, and its connection is dropped.

The server bounds what an authenticated peer holds too: a connection that brings no request
for :data:`IDLE_TIMEOUT_S` is closed (a client stops using a pooled connection idle for
:data:`POOLED_IDLE_S`, well before), a frame must arrive whole within
:data:`FRAME_TIMEOUT_S` of its length, a request may take at most :data:`MAX_REQUEST_FRAME`
bytes, and a frame's buffer grows as its bytes arrive (never to the length it announced
first). An answer is given within one deadline, from before its blocks are lent to the last
byte of its last block: ``SEND_TIMEOUT_S`` plus its bytes at ``MIN_SEND_RATE``; past it the
connection is closed and the blocks' read leases are given back.

The blocking socket I/O of those sends and receives, and the checks of what a receive
takes, are in :mod:`kvpool_sidecar.transfer.tcpio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpool_client.errors import ProtocolError
from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_client.protocol import HEADER, decode, encode
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.transfer import auth, tcpio
from kvpool_sidecar.transfer.base import BlockSink, BlockSource, PeerAuthError, PeerError, lend_once
from kvpool_sidecar.transfer.tcpio import Outgoing, blocking_recv, blocking_send, pipelined_default, tune

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAGIC = b"KVPP\x04"
OP_GET = 1
#: The answer ``[request id, ERR_UNKNOWN_OP]`` to an operation this node does not serve
#: (e.g. the Mooncake transport's LOOKUP sent to a node on plain TCP); the connection stays.
ERR_UNKNOWN_OP = 1
HANDSHAKE_TIMEOUT_S = 5.0
MAX_FRAME = 16 << 20
MAX_KEYS = 4096
#: Objects (lists, and the items of lists that hold anything but numbers: see
#: :func:`kvpool_client.protocol.decode`) a peer frame may decode into: a request of
#: MAX_KEYS keys, or an answer's header of MAX_KEYS ``[size, checksum, tenant]`` (five
#: each: its place in the list, its list, and its three items).
FRAME_OBJECTS = 5 * MAX_KEYS + 16
#: Numbers in long lists a peer frame may hold: none of its lists holds more than three.
FRAME_NUMBERS = 64
#: A bulk send or receive that makes no progress for this long ends the connection; an
#: answer must be given whole within this plus its bytes at ``MIN_SEND_RATE``, from before
#: its blocks are lent (see :meth:`TcpTransport._answer`).
SEND_TIMEOUT_S = 30.0
#: A served connection that brings no request for this long (after its handshake, or after
#: its last answer) is closed: an authenticated connection had been held for as long as its
#: other end liked (a relay without the secret passes a member's handshake on and keeps the
#: socket; 512 of them took every slot).
IDLE_TIMEOUT_S = 60.0
#: A client opens a new connection instead of one it has not leased for this long, well
#: before the server closes it for its idleness (:data:`IDLE_TIMEOUT_S`).
POOLED_IDLE_S = IDLE_TIMEOUT_S / 2
#: Once a served connection's frame has sent its length, the whole frame must come within
#: this (a length announced, then nothing, had held the connection for good).
FRAME_TIMEOUT_S = HANDSHAKE_TIMEOUT_S
#: The largest request a served connection takes (a frame's bytes after its length): one of
#: MAX_KEYS keys, its operation and request id the widest numbers msgpack has, and its tag.
#: Only an answer's header (taken by the fetching side) may be as long as MAX_FRAME.
MAX_REQUEST_FRAME = len(encode([(1 << 64) - 1, (1 << 64) - 1, [bytes(RAW_KEY_BYTES)] * MAX_KEYS])) - HEADER.size \
    + auth.FRAME_TAG_BYTES
#: A frame is taken at most this many bytes at a time, its buffer grown as they arrive: a
#: peer that announced 16 MiB and sent a byte had held 16 MiB here, zero-filled, while it
#: sent nothing more.
RECV_CHUNK = 256 << 10
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
#: Worker threads per transport for bulk receives, and as many for bulk sends. A transfer
#: waits for a free worker; its deadline still holds while it waits.
BULK_WORKERS = 32


class _PeerClosed(PeerError):
    """The peer closed the connection (its end of stream)."""


class _StaleConnection(PeerError):
    """A pooled connection that had served a fetch was found closed before any of the next
    fetch's answer came: its peer closed it meanwhile (its idleness, a restart). Nothing of
    the fetch was taken, so it goes again on a new connection."""


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    """The next ``n`` bytes, taken :data:`RECV_CHUNK` at most at a time: what is held for them
    is what has arrived."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, min(n - len(buf), RECV_CHUNK))
        if not chunk:
            raise _PeerClosed("the peer closed the connection")
        if len(chunk) == n:
            return chunk  # (all of it at once: no copy)
        buf += chunk
    return bytes(buf)


async def _recv_sealed(loop: asyncio.AbstractEventLoop, sock: socket.socket, frames: auth.FrameSeal, *,
                       limit: int = MAX_FRAME, idle: float | None = None) -> list[Any]:
    """The next frame, its MAC checked and taken off before any of it is decoded
    (:class:`~kvpool_sidecar.transfer.auth.FrameSeal`); ``limit`` and ``idle`` as for
    :func:`_recv_frame`."""
    payload = frames.open(await _recv_frame(loop, sock, limit, idle))
    if payload is None:
        raise PeerAuthError("a frame's MAC does not match: not from the authenticated peer, or out of turn")
    try:
        return decode(payload, max_items=MAX_KEYS, max_map=0, max_objects=FRAME_OBJECTS, max_numbers=FRAME_NUMBERS)
    except ProtocolError as e:
        raise PeerError(str(e)) from e


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int = MAX_FRAME,
                      idle: float | None = None) -> bytes:
    """The bytes of the next frame, after its length (at most ``limit`` of them). With
    ``idle`` (a served connection waiting for its next request), the length must come within
    ``idle`` seconds and the rest of the frame within :data:`FRAME_TIMEOUT_S` of it."""
    try:
        async with asyncio.timeout(idle):
            (length,) = HEADER.unpack(await _recv_exact(loop, sock, HEADER.size))
    except TimeoutError:
        raise PeerError(f"no request in {idle} s") from None
    if length > limit:
        raise PeerError(f"frame of {length} bytes exceeds {limit}")
    try:
        async with asyncio.timeout(None if idle is None else FRAME_TIMEOUT_S):
            return await _recv_exact(loop, sock, length)
    except TimeoutError:
        raise PeerError(f"a frame of {length} bytes did not arrive within {FRAME_TIMEOUT_S} s") from None


async def _bulk(workers: ThreadPoolExecutor, sock: socket.socket, fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking bulk transfer on ``sock`` in one of ``workers``.

    If the caller is cancelled (a deadline) before a worker took the job, the job is
    dropped. If a worker runs it, the socket is shut down so the worker's blocking call
    returns at once, and the worker is waited for before the cancellation goes on, through
    any further cancellation too (a deadline, then the requester's connection closing): a
    socket shut down still hands over what it had queued, so the worker may copy into the
    arena for a while yet, and nobody may release or reuse the extents it touches until it
    has returned.
    """
    job = workers.submit(fn, sock, *args)
    work = asyncio.wrap_future(job)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        if job.cancel():  # never started: it touched nothing
            raise
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        while not work.done():
            try:
                await asyncio.wait({work})
            except asyncio.CancelledError:
                continue  # cancelled again: the worker still writes, wait on
        if not work.cancelled():
            work.exception()  # retrieved: how it ended is of no use to anyone now
        raise


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


class TcpTransport:
    """Peer transfers over TCP with zero-copy sends and receives into the arena."""

    name = "tcp"
    max_keys = MAX_KEYS

    def __init__(self, token: bytes, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 connections_per_peer: int = 4, sendfile: bool = False, pipelined: bool | None = None) -> None:
        self.token = token
        self.sendfile = sendfile
        self.host = host
        self.port = port
        self.advertise = advertise
        self.connections_per_peer = connections_per_peer
        self._listener: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._pools: dict[str, list[_Conn]] = {}
        self._source: BlockSource | None = None
        #: Each served connection's key from its handshake, and its MAC nonces; and the MACs
        #: of its control frames.
        self._session_keys: dict[socket.socket, auth.Sealer] = {}
        self._frames: dict[socket.socket, auth.FrameSeal] = {}
        self._turn = 0
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
        #: Connections to each peer being opened now, and a condition to wait on for them.
        self._opening: Counter[str] = Counter()
        #: Fetches under way, by address (from before their connection is leased to the end).
        self._fetching: Counter[str] = Counter()
        self._opened: dict[str, asyncio.Condition] = {}
        self.refused = 0
        #: Answers whose remaining blocks had no room here: their connection was closed
        #: instead of taking the rest off the wire (see :meth:`_fetch_on`).
        self.cut_short = 0
        #: Fetches that found their pooled connection closed and went again on a new one.
        self.stale_retries = 0
        self.recv_timeout_s = SEND_TIMEOUT_S
        # Own workers, apart from each other and from the loop's default executor (disk
        # I/O): a slow peer's sends never hold up this node's fetches.
        self._recv_workers = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="kvpool-peer-recv")
        self._send_workers = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="kvpool-peer-send")
        #: Threads that hash what the receive workers take (pipelined receives; None: each
        #: receive hashes as it goes, on its own thread). As many as receive workers, and
        #: nothing else submits to them: a receive waits for its verifier's job, which must
        #: always find a thread.
        if pipelined is None:
            pipelined = pipelined_default()
        self._hash_workers = ThreadPoolExecutor(BULK_WORKERS, thread_name_prefix="kvpool-peer-hash") \
            if pipelined else None

    # ------------------------------------------------------------------ server
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

    # ------------------------------------------------------------------ client
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

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        """Fetch ``keys`` from ``address`` within ``timeout``: which arrived (a failure, a
        dead or slow peer, is a miss). A pooled connection found closed before any of the
        answer came (:class:`_StaleConnection`) is dropped and the fetch goes once more, on a
        new connection, within the same deadline."""
        done = [False] * len(keys)
        used: _Conn | None = None  # the connection this fetch talked on
        clean = False
        self._fetching[address] += 1  # (forget() leaves the address alone meanwhile)
        try:
            async with asyncio.timeout(timeout):
                for again in (False, True):
                    conn = await self._lease_conn(address)
                    async with conn.busy:
                        used = conn
                        try:
                            clean = await self._fetch_on(conn, keys, sink, done)
                        except _StaleConnection as e:
                            if again:
                                raise
                            logger.debug("a pooled connection to %s was closed under a fetch (%s); "
                                         "fetching again on a new one", address, e.__cause__ or e)
                            # its idle siblings most likely went with it (the peer restarted,
                            # or closed them for their idleness too): the retry opens a new one
                            for c in [c for c in self._pools.get(address, []) if c is conn or not c.busy.locked()]:
                                self._drop(address, c)
                            used = None
                            self.stale_retries += 1
                            continue
                        if clean:
                            conn.served += 1
                        else:
                            self.cut_short += 1
                    break
        except (PeerError, OSError, TimeoutError) as e:
            logger.info("fetch of %d blocks from %s failed: %s", len(keys), address, e or type(e).__name__)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - task guard: whatever a peer's answer does, its blocks miss
            warn_once(logger, "peer-fetch-failed", "fetch of %d blocks from %s failed: %r", len(keys), address, e)
        finally:
            # Failed, timed out or cancelled (the requester went away) part way through an
            # answer, or the rest of it left unread: it may still be in the socket, so the
            # connection is never used again.
            if used is not None and not clean:
                self._drop(address, used)
            self._fetching[address] -= 1
            if not self._fetching[address]:
                del self._fetching[address]
        return done

    async def _fetch_on(self, conn: _Conn, keys: Sequence[bytes], sink: BlockSink, done: list[bool]) -> bool:
        """One GET of ``keys`` on ``conn``; whether its answer was taken whole (False: the
        connection is left mid-answer and must be closed).

        The blocks after the last one there is room for are not taken off the wire: a node
        that keeps none of them (its tenant over quota, the node full of blocks in use, a
        writer no key space here names) had read every byte into scratch and dropped it, on
        every read. The connection is closed instead; the holder's send fails and it gives
        its leases back."""
        loop = asyncio.get_running_loop()
        conn.rid = auth.new_request_id()
        try:
            await loop.sock_sendall(conn.sock, conn.frames.seal([OP_GET, conn.rid, list(keys)]))
            header = await _recv_sealed(loop, conn.sock, conn.frames)
        except (ConnectionError, _PeerClosed) as e:
            if conn.served:  # (nothing of this fetch was taken yet: no room reserved, no byte kept)
                raise _StaleConnection(f"connection to {conn.address} closed before its answer") from e
            raise
        if len(header) != 3 or header[0] != conn.rid or header[1] != 0 or not isinstance(header[2], list) \
                or len(header[2]) != len(keys):
            raise PeerError("malformed peer answer")
        plan: list[tuple[int, object | None, int]] = []  # (index, lease, checksum)
        incoming: list[tuple[list[memoryview] | None, int, Callable[[bytes], Any]]] = []
        sums: list[int | None] = []
        try:
            for i, (key, item) in enumerate(zip(keys, header[2])):
                if item is None:
                    continue
                if not isinstance(item, list) or len(item) != 3:
                    raise PeerError("malformed block header from peer")
                size, csum, tenant = item
                if not isinstance(size, int) or not isinstance(csum, int) or not isinstance(tenant, str) or size <= 0:
                    raise PeerError("malformed block header from peer")
                room = await sink.reserve(key, size, tenant, depth=i, parent=keys[i - 1] if i else None)
                plan.append((i, None if room is None else room[0], csum))
                mac = functools.partial(auth.block_mac, conn.key, conn.rid, i, key, size, csum, tenant)
                incoming.append((None if room is None else room[1], size, mac))
            wanted = max((n + 1 for n, (views, _, _) in enumerate(incoming) if views is not None), default=0)
            if wanted:
                await _bulk(self._recv_workers, conn.sock, blocking_recv, incoming[:wanted], self.recv_timeout_s,
                            sums, self._hash_workers)
            if wanted < len(incoming):
                logger.debug("no room here for the last %d blocks of an answer from %s; its connection is closed "
                             "instead of drained", len(incoming) - wanted, conn.address)
                return False
            return True
        finally:
            # whole, verified blocks are kept even when the transfer was cut short
            for n, (i, lease, csum) in enumerate(plan):
                if lease is None:
                    continue
                if n < len(sums) and sums[n] == csum:
                    sink.commit(lease, csum)
                    done[i] = True
                else:
                    if n < len(sums):
                        logger.warning("peer sent block %s with a wrong checksum or MAC; dropped", keys[i].hex())
                    sink.abort(lease)

    async def close(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        for t in list(self._serving):
            t.cancel()
        for t in list(self._serving):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._listener is not None:
            self._listener.close()
        for pool in self._pools.values():
            for c in pool:
                c.close()
        self._pools.clear()
        self._recv_workers.shutdown(wait=False, cancel_futures=True)
        self._send_workers.shutdown(wait=False, cancel_futures=True)
        if self._hash_workers is not None:
            self._hash_workers.shutdown(wait=False)  # a receive still running waits for its checks
