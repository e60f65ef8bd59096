"""The local API: serving pods on this node talk to the store over a Unix socket or TCP.

One :class:`LocalConnection` per client connection, one store session per connection once
its HELLO is admitted: when the connection goes (the client exits, crashes or is killed)
its session closes and every lease and pin it held is released. Frames are parsed by hand
from the transport's buffer; requests that can complete at once (lookup, commit, release,
pin, stats) answer inside ``data_received``, the others run as guarded tasks and answer
when done.

This module is the connection itself (framing, flow control, the hello and stalled-frame
watchdogs, the writing of answers, its lifetime) and the listener. What it does with a
request once framed (refused or served, by which handler, at once or as a task, its answer)
is its :class:`~kvpool_sidecar.api.dispatch.Requests`, over the handlers:
:class:`~kvpool_sidecar.api.admission.Admission` (its slot and HELLO),
:class:`~kvpool_sidecar.api.reads.ReadRequests` and
:class:`~kvpool_sidecar.api.writes.WriteRequests`, all reading the client's state from one
:class:`~kvpool_sidecar.api.localclient.LocalClient`.

Bad input never crashes the daemon: a malformed or oversize frame gets an error answer and
the connection is closed (the stream can no longer be trusted); a well-formed request with
bad arguments gets an error answer and the connection stays, except a HELLO refused for its
tenant or proof, which closes it (one guess of a token per connection).
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
from typing import Any, cast

from kvpool_client.errors import ProtocolError
from kvpool_client.protocol import HEADER, NO_FD_BYTE, ErrorCode, decode, encode
from kvpool_sidecar.api.admission import Admission
from kvpool_sidecar.api.blockinfo import MAX_BLOCK_TOKENS, MAX_EXTRA_KEYS
from kvpool_sidecar.api.budget import IndexBudget
from kvpool_sidecar.api.dispatch import Requests
from kvpool_sidecar.api.limits import LocalLimits
from kvpool_sidecar.api.localclient import LocalClient
from kvpool_sidecar.api.slots import Slots
from kvpool_sidecar.api.turns import TenantTurns
from kvpool_sidecar.api.unread import Unread
from kvpool_sidecar.errors import SidecarError, os_reason
from kvpool_sidecar.peers import PeerReader
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.sockdir import make_socket_dir
from kvpool_sidecar.store import Session, TieredStore
from kvpool_sidecar.tenancy import Credentials

__all__ = ["CLOSE_GRACE_S", "LISTEN_BACKLOG", "MAX_MAP_ITEMS", "NUMBERS_PER_BATCH_KEY", "OBJECTS_PER_BATCH_ITEM",
           "PRE_HELLO_FRAME_BYTES", "LocalConnection", "LocalLimits", "LocalServer"]

logger = logging.getLogger(__name__)

#: A client refused for ``max_connections`` waits this long at most for its answer; past
#: this many refused clients waiting, a new one is closed without a word.
_REFUSED_LINGER_S = 5.0
#: How long a connection the sidecar closes may take to flush its last answers (the reason
#: it is closed) before it is aborted: a client that does not read them would otherwise keep
#: the connection, its slot, its session and its descriptor for good.
CLOSE_GRACE_S = 1.0
_REFUSED_WAITING = 64

#: The listen backlog of the local sockets: the most the kernel allows (it caps this at
#: ``net.core.somaxconn``, 4096 by default). A process needing no credentials that connects
#: in a loop keeps a backlog full; the larger it is, the fewer of an engine's connects find it
#: full (a client's non-blocking connect then fails at once with EAGAIN).
LISTEN_BACKLOG = 65535


#: The largest frame read from a client that has not said HELLO (a HELLO is a version, a
#: tenant name and a token: well under this). A stranger's frame is decoded before anything
#: else is known of it, so it must stay small: a few MiB of msgpack decode into millions of
#: objects and stall the event loop for seconds.
PRE_HELLO_FRAME_BYTES = 16 << 10

#: The most objects (lists, maps, their items) a frame before HELLO may decode into: a HELLO
#: is a list of five. 16 KiB of empty lists had held the loop 1.2 ms a frame, from clients
#: that need no token.
PRE_HELLO_OBJECTS = 16

#: Who pays the turns of the loop for connections that have not said HELLO (no tenant is
#: named so: names are checked as Kubernetes names). They share one turn: needing no token,
#: they would otherwise not be charged at all.
STRANGERS = "\0strangers"

#: The most entries a map of a request may hold (hints and engine identities have a few).
MAX_MAP_ITEMS = 64

#: The numbers one frame may hold in lists of more than 16 (a block's tokens), per key of a
#: full batch: a put of ``api.max_batch`` blocks of 256 tokens each, with their engine
#: identities, fits (real engines' blocks are 16 to 64 tokens). 56 MiB of token ids had
#: decoded into 503 MiB and held the loop for 0.9 s.
NUMBERS_PER_BATCH_KEY = 256

#: Objects a frame may hold per block of a full batch (see ``LocalConnection._max_objects``):
#: a put with engine identities of as many extra keys as an identity may have
#: (``MAX_EXTRA_KEYS``) fits. A frame of ``api.max_batch`` (4,096) times this many short
#: strings decodes in about 0.15 s on the development machines.
OBJECTS_PER_BATCH_ITEM = 17 + MAX_EXTRA_KEYS


def _log_once(cause: str, msg: str, *args: object) -> None:
    warn_once(logger, cause, msg, *args)


#: Leases, and pins, of each kind a closing session gives back per step: a client holding
#: 262,144 write leases had stalled the event loop for 1.5 s as it closed (a review), and a
#: step of this many takes about a millisecond.
CLOSE_SLICE = 256

#: ... and as its connection goes, at once, outside the tenant's turns: a session that holds
#: no more closes then (a tenant's hundreds of connections dropped together, each with
#: :data:`CLOSE_SLICE` of each kind, would otherwise hold the loop for their sum).
CLOSE_NOW = 16


async def _close_rest(store: TieredStore, session: Session, turns: TenantTurns, payer: str) -> None:
    """Close ``session`` :data:`CLOSE_SLICE` leases of each kind at a time, the loop turning
    between, each slice a step of ``payer``'s turns."""

    async def slices() -> None:
        while not store.close_session(session, CLOSE_SLICE):
            await asyncio.sleep(0)

    await turns.charged(payer, slices())


class LocalConnection(asyncio.Protocol):
    """One client: frame parsing, flow control, watchdogs, answers and the session's
    lifetime; its requests, once framed, are its :attr:`requests`."""

    def __init__(self, store: TieredStore, limits: LocalLimits, *, shm: bool,
                 live: Slots | None = None, peers: PeerReader | None = None,
                 raw: socket.socket | None = None, cred: Credentials | None = None,
                 index_budget: IndexBudget | None = None, unread: Unread[LocalConnection] | None = None,
                 inbound: Unread[LocalConnection] | None = None, turns: TenantTurns | None = None,
                 closing: set[asyncio.Task[None]] | None = None) -> None:
        self.store = store
        #: The node's sessions still closing, a slice at a time (:meth:`connection_lost`).
        self._closing = closing if closing is not None else set()
        #: The loop's turns between the node's tenants (see :mod:`~kvpool_sidecar.api.turns`).
        self._turns = turns if turns is not None else TenantTurns()
        #: Answers buffered for clients that are behind, across the node's connections.
        self._unread: Unread[LocalConnection] = unread if unread is not None else Unread(limits.max_unread_bytes)
        #: Bytes of requests received but not yet whole (or not yet dispatched), across the
        #: node's connections: bounded apart, by the same limit.
        self._inbound: Unread[LocalConnection] = inbound if inbound is not None else Unread(limits.max_unread_bytes)
        self.limits = limits
        self.peers = peers
        #: Its session, protocol version and arena, which its requests read.
        self.client = LocalClient(store, limits, shm=shm)
        self._hello_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        #: The node's local connections, by state (see :mod:`~kvpool_sidecar.api.slots`).
        self._live = live if live is not None else Slots()
        #: The longest list the decoder builds: twice what any field takes (a batch of keys or
        #: items, one block's tokens), so a list just past a field's limit gets that field's
        #: clear error and the connection stays, while a decode bomb is refused unbuilt.
        self._max_items = 2 * max(limits.max_batch, MAX_BLOCK_TOKENS)
        #: The most lists, maps, map entries and items of lists of other things than numbers
        #: one frame may hold (see :func:`decode`): a full batch of puts with engine identities
        #: takes 17 per item, and one more per extra key (its place in the items' list, its
        #: list and five fields, an identity's map and seven entries, its tokens, the list of
        #: its extra keys and each of them, at most ``MAX_EXTRA_KEYS``).
        self._max_objects = OBJECTS_PER_BATCH_ITEM * limits.max_batch + 64
        self._max_numbers = NUMBERS_PER_BATCH_KEY * limits.max_batch
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._closed = False
        #: Said HELLO and was admitted (set by :meth:`Admission.hello`): until then frames are
        #: small and nothing but HELLO is served.
        self._greeted = False
        self._write_paused = False
        self._read_paused = False
        #: Its tenant spent its turn of the loop: not read until the next turn.
        self._waiting_turn = False
        self._processing = False
        #: Over ``max_connections``: its first request is answered UNAVAILABLE, then it closes.
        self._refused = False
        #: The transport told it the connection is gone; what aborts one that does not go.
        self._gone = False
        self._abort_timer: asyncio.TimerHandle | None = None
        self._admission = Admission(self, self.client, self._live, raw=raw, cred=cred)
        #: What it does with its requests once framed, and those running (see
        #: :mod:`~kvpool_sidecar.api.dispatch`).
        self.requests = Requests(
            self, self.client, limits, self._admission, peers=peers, turns=self._turns,
            budget=index_budget or IndexBudget(limits.index_concurrency, limits.index_keys_per_s),
            unread=self._unread, inbound=self._inbound)

    @property
    def shm(self) -> bool:
        """Whether its client maps an arena (see :attr:`LocalClient.shm`)."""
        return self.client.shm

    def _close(self) -> None:
        """Close after the answers already written are flushed, within :data:`CLOSE_GRACE_S`."""
        self._set_closed()
        if self.transport is not None and not self._gone:
            self.transport.close()
            if self._abort_timer is None:
                self._abort_timer = asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._drop)

    def _set_closed(self) -> None:
        if not self._closed:
            self._closed = True
            self._live.close(self)  # (it keeps its slot until it is gone)

    def _greet(self, tenant: str) -> None:
        """Its first HELLO was admitted, as ``tenant`` (see :meth:`Admission.hello`)."""
        self._greeted = True
        self._live.greet(self, tenant)

    # -------------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if not self._admission.make_room():
            # told why in the answer to its first request (closing now would break its
            # HELLO before it could read a reason); closed regardless after a moment, and at
            # once when too many refused clients are already waiting
            _log_once("refused", "refusing local clients: %d connections are open (api.max_connections)",
                      self._live.open)
            self._refused = True
            if self._live.refused >= _REFUSED_WAITING:
                self._closed = True
                self.transport.close()
                return
            self._live.add_refused(self)
            asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, self._close)
            return
        # (its store session is opened at HELLO: a stranger costs none)
        self._live.add(self, self._admission.uid)
        self._hello_timer = asyncio.get_running_loop().call_later(self.limits.hello_timeout_s, self._no_hello)

    def _no_hello(self) -> None:
        if not self._greeted and not self._closed:
            _log_once("hello-timeout", "closing local clients that do not say HELLO within %.0f s",
                      self.limits.hello_timeout_s)
            self._drop()

    def _frame_stalled(self) -> None:
        self._frame_timer = None
        if self._buf and not self._closed:
            _log_once("frame-timeout", "closing local clients that leave a frame incomplete for %.0f s",
                      self.limits.frame_timeout_s)
            self._buf.clear()
            self._inbound.drained(self)
            self._close()

    def _watch_partial(self) -> None:
        """Time a partial frame left in the buffer; stop timing once it is complete."""
        if self._buf and not self._read_paused:
            if self._frame_timer is None and not self._closed:
                self._frame_timer = asyncio.get_running_loop().call_later(self.limits.frame_timeout_s,
                                                                         self._frame_stalled)
        elif self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._gone = True
        if self._abort_timer is not None:
            self._abort_timer.cancel()
            self._abort_timer = None
        self._live.discard(self)
        self._unread.drained(self)
        self._inbound.drained(self)
        for timer in (self._hello_timer, self._frame_timer):
            if timer is not None:
                timer.cancel()
        for t in self.requests.tasks:
            t.cancel()
        session = self.client.session
        if session is not None:
            payer = self._payer()
            self.client.session = None
            begun = self._turns.clock()
            closed = self.store.close_session(session, CLOSE_NOW)
            self._turns.charge(payer, self._turns.clock() - begun)
            if not closed:  # the rest a slice at a time, each a step of its tenant's turns
                task = asyncio.get_running_loop().create_task(_close_rest(self.store, session, self._turns, payer))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._unread.drained(self)
        self._flow()

    def _busy(self) -> bool:
        requests = self.requests
        return self._write_paused or self._waiting_turn or len(requests.tasks) >= self.limits.max_inflight \
            or requests.ordered is not None

    def _payer(self) -> str:
        """Whose turn its requests take: its tenant's or, before HELLO, the one all the
        connections that have not said HELLO share (:data:`STRANGERS`)."""
        return self.client.active_session.tenant if self._greeted else STRANGERS

    def _wait_turn(self, served: bool) -> None:
        """Its tenant spent its turn of the loop: read nothing more until the next turn
        (``served``: after some of its requests were served in this one)."""
        self._waiting_turn = True
        self._turns.wait(self._next_turn, served)
        self._flow()

    def _next_turn(self) -> None:
        if not self._closed and self._turns.over(self._payer()):
            # its tenant's turn is spent already (by its connections resumed before it):
            # wait on, still paused, first in line (resumed, it would only pause again: two
            # system calls per connection and turn, a third of a 256-connection tenant's loop)
            self._turns.wait(self._next_turn, False)
            return
        self._waiting_turn = False
        self._flow()

    def _flow(self) -> None:
        """Backpressure: stop reading a client that does not read its answers or already has
        ``max_inflight`` requests running; go on (frames already buffered first) when not."""
        if self.transport is None or self._closed:
            return
        if self._busy():
            if not self._read_paused:
                self._read_paused = True
                self.transport.pause_reading()
        elif self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
            self._process()
            self._watch_partial()  # a partial frame left over is timed again from here

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._process()
        self._watch_partial()

    def _process(self) -> None:
        """Dispatch the complete frames buffered so far, unless the connection is busy."""
        if self._processing:  # a callback while dispatching: the running loop goes on
            return
        self._processing = True
        try:
            self._dispatch_buffered()
        finally:
            self._processing = False
        self._count_inbound()

    def _count_inbound(self) -> None:
        """Count what this connection buffers of requests; past the node's bound (partial
        frames of up to ``api.max_frame_bytes`` on every connection would hold far more than
        a node has), abort the connection that buffers the most."""
        if self._closed:
            return
        if not self._buf:
            if self._inbound.held(self):
                self._inbound.drained(self)
            return
        worst = self._inbound.behind(self, len(self._buf))
        if worst is not None:
            _log_once("inbound", "aborting local clients that send requests faster than they complete them: more "
                      "than %d bytes of requests not yet whole were buffered (api.max_unread_bytes)",
                      self._inbound.limit)
            worst._buf.clear()
            worst._drop()

    def _dispatch_buffered(self) -> None:
        buf = self._buf
        pos = 0
        while len(buf) - pos >= HEADER.size and not self._busy():
            if self._turns.over(self._payer()):
                self._wait_turn(pos > 0)
                break
            (length,) = HEADER.unpack_from(buf, pos)
            limit = self.limits.max_frame_bytes if self._greeted else PRE_HELLO_FRAME_BYTES
            if length > limit:
                self._fatal(0, f"frame of {length} bytes exceeds the limit of {limit}"
                               + ("" if self._greeted else " before HELLO"))
                return
            end = pos + HEADER.size + length
            if len(buf) < end:
                break
            decoding = self._turns.clock()
            try:
                if self._greeted:
                    body = decode(memoryview(buf)[pos + HEADER.size : end], max_items=self._max_items,
                                  max_map=MAX_MAP_ITEMS, max_objects=self._max_objects, max_numbers=self._max_numbers)
                else:  # a HELLO is one list of five: a frame of thousands of empty lists is refused unbuilt
                    body = decode(memoryview(buf)[pos + HEADER.size : end], max_items=PRE_HELLO_OBJECTS,
                                  max_map=PRE_HELLO_OBJECTS, max_objects=PRE_HELLO_OBJECTS,
                                  max_numbers=PRE_HELLO_OBJECTS, uncounted_bytes=0)
            except ProtocolError as e:
                self._fatal(0, str(e))
                return
            finally:
                self._turns.charge(self._payer(), self._turns.clock() - decoding)  # decoding is the tenant's too
            pos = end
            self.requests.dispatch(self, body, self._payer())
            if self._closed:
                return
        if pos:
            del buf[:pos]
            if self._frame_timer is not None:
                # a frame came whole: what is left is the next one's start, timed from now
                # (a client whose reads always end part way through a frame was closed
                # after frame_timeout_s however many frames it completed)
                self._frame_timer.cancel()
                self._frame_timer = None

    # -------------------------------------------------------------- replies
    def _send(self, body: list[Any]) -> None:
        if self.transport is None or self._closed:
            return
        self.transport.write(encode(body))
        if self._write_paused:  # its reader is behind: what it has not read waits in the sidecar's memory
            worst = self._unread.behind(self, self.transport.get_write_buffer_size())
            if worst is not None:
                _log_once("unread", "aborting local clients that do not read their answers: more than %d bytes "
                          "of answers were waiting for them (api.max_unread_bytes)", self._unread.limit)
                worst._drop()

    def _drop(self) -> None:
        """Close at once, dropping the answers buffered for the client."""
        self._set_closed()
        if self.transport is not None and not self._gone:
            self.transport.abort()

    def _fatal(self, rid: int, message: str) -> None:
        _log_once("bad-frame", "closing a local connection after a bad frame: %s", message)
        self.requests.error(self, rid, ErrorCode.BAD_REQUEST, message)
        self._inbound.drained(self)  # (closed: nothing more of it is read or counted)
        self._close()


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
