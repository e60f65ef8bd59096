"""One local client's connection (:class:`LocalConnection`), as the listener
(:class:`~kvpool_sidecar.api.local.LocalServer`) accepted it on the Unix socket or TCP.

One store session per connection once its HELLO is admitted: when the connection goes (the
client exits, crashes or is killed) its session closes and every lease and pin it held is
released. Frames are parsed by hand from the transport's buffer, within the bounds of
:mod:`~kvpool_sidecar.api.framebounds`; requests that can complete at once (lookup, commit,
release, pin, stats) answer inside ``data_received``, the others run as guarded tasks and
answer when done.

This module is the connection itself (framing, flow control, the hello and stalled-frame
watchdogs, the writing of answers, its lifetime). What it does with a request once framed
(refused or served, by which handler, at once or as a task, its answer) is its
:class:`~kvpool_sidecar.api.dispatch.Requests`, over the handlers:
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
import logging
import socket
from typing import Any, cast

from kvpool_client.errors import ProtocolError
from kvpool_client.protocol import HEADER, ErrorCode, decode, encode
from kvpool_sidecar.api.admission import Admission
from kvpool_sidecar.api.blockinfo import MAX_BLOCK_TOKENS
from kvpool_sidecar.api.budget import IndexBudget
from kvpool_sidecar.api.dispatch import Requests
from kvpool_sidecar.api.framebounds import (
    MAX_MAP_ITEMS, NUMBERS_PER_BATCH_KEY, OBJECTS_PER_BATCH_ITEM, PRE_HELLO_FRAME_BYTES, PRE_HELLO_OBJECTS,
)
from kvpool_sidecar.api.limits import LocalLimits
from kvpool_sidecar.api.localclient import LocalClient
from kvpool_sidecar.api.slots import Slots
from kvpool_sidecar.api.turns import TenantTurns
from kvpool_sidecar.api.unread import Unread
from kvpool_sidecar.peers import PeerReader
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store import Session, TieredStore
from kvpool_sidecar.tenancy import Credentials

__all__ = ["CLOSE_GRACE_S", "CLOSE_NOW", "CLOSE_SLICE", "STRANGERS", "LocalConnection"]

logger = logging.getLogger(__name__)

#: A client refused for ``max_connections`` waits this long at most for its answer; past
#: this many refused clients waiting, a new one is closed without a word.
_REFUSED_LINGER_S = 5.0
#: How long a connection the sidecar closes may take to flush its last answers (the reason
#: it is closed) before it is aborted: a client that does not read them would otherwise keep
#: the connection, its slot, its session and its descriptor for good.
CLOSE_GRACE_S = 1.0
_REFUSED_WAITING = 64

#: Who pays the turns of the loop for connections that have not said HELLO (no tenant is
#: named so: names are checked as Kubernetes names). They share one turn: needing no token,
#: they would otherwise not be charged at all.
STRANGERS = "\0strangers"


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
