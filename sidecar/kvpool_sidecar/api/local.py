"""The local API: serving pods on this node talk to the store over a Unix socket or TCP.

One :class:`LocalConnection` per client connection, one store session per connection:
when the connection goes (the client exits, crashes or is killed) its session closes and
every lease and pin it held is released. Frames are parsed by hand from the transport's
buffer; requests that can complete at once (lookup, commit, release, pin, stats) answer
inside ``data_received``, the others run as guarded tasks and answer when done.

Bad input never crashes the daemon: a malformed or oversize frame gets an error answer and
the connection is closed (the stream can no longer be trusted); a well-formed request with
bad arguments gets an error answer and the connection stays.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvpool_client.errors import ProtocolError
from kvpool_client.integrity import checksum, copy_with_checksum
from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_client.protocol import (
    FD_BYTE,
    HEADER,
    NO_FD_BYTE,
    SUPPORTED_VERSIONS,
    ErrorCode,
    Op,
    decode,
    encode,
)
from kvpool_sidecar.api.blockinfo import MAX_BLOCK_TOKENS, MAX_EXTRA_KEYS, parse_engine, parse_hints
from kvpool_sidecar.api.budget import IndexBudget
from kvpool_sidecar.api.unread import Unread
from kvpool_sidecar.errors import RequestError, SidecarError, TierError, UnavailableError, UnknownLeaseError
from kvpool_sidecar.events import EngineRef
from kvpool_sidecar.peers import PeerReader
from kvpool_sidecar.policy import Hints
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.sockdir import check_socket_dir
from kvpool_sidecar.store import Session, TieredStore
from kvpool_sidecar.tenancy import Credentials, KeySpaces, TenantAccess

logger = logging.getLogger(__name__)

_CODES = {
    "bad_request": ErrorCode.BAD_REQUEST,
    "too_large": ErrorCode.TOO_LARGE,
    "unknown_lease": ErrorCode.UNKNOWN_LEASE,
    "quota": ErrorCode.QUOTA,
    "full": ErrorCode.FULL,
    "io": ErrorCode.IO,
    "corrupt": ErrorCode.CORRUPT,
    "unavailable": ErrorCode.UNAVAILABLE,
}


_OP_NAMES = {int(op): op.name.lower() for op in Op}
#: A client refused for ``max_connections`` waits this long at most for its answer; past
#: this many refused clients waiting, a new one is closed without a word.
_REFUSED_LINGER_S = 5.0
#: How long a connection the sidecar closes may take to flush its last answers (the reason
#: it is closed) before it is aborted: a client that does not read them would otherwise keep
#: the connection, its slot, its session and its descriptor for good.
CLOSE_GRACE_S = 1.0
_REFUSED_WAITING = 64


#: The largest frame read from a client that has not said HELLO (a HELLO is a version, a
#: tenant name and a token: well under this). A stranger's frame is decoded before anything
#: else is known of it, so it must stay small: a few MiB of msgpack decode into millions of
#: objects and stall the event loop for seconds.
PRE_HELLO_FRAME_BYTES = 16 << 10

#: Blocks of one ALLOC or ACQUIRE served per turn of the event loop: other clients' requests
#: are served between slices (a put of 1,024 blocks had held another client's lookup for
#: tens of milliseconds).
BATCH_SLICE = 256

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


@dataclass(frozen=True)
class LocalLimits:
    max_frame_bytes: int
    max_batch: int
    node: str
    #: Which tenants share blocks (one space for all when not given).
    spaces: KeySpaces = field(default_factory=lambda: KeySpaces({}))
    #: Requests of one connection that may run at once; past it (or while the client does
    #: not read its answers) the connection is not read, so what the sidecar buffers for one
    #: client stays within about ``(max_inflight + 1) * max_frame_bytes``.
    max_inflight: int = 8
    #: Local connections open at once; a client past it gets UNAVAILABLE and is closed.
    max_connections: int = 1024
    #: Bytes of answers buffered, across the node, for clients that do not read them; past
    #: it the connection holding the most is aborted (see :mod:`kvpool_sidecar.api.unread`).
    #: Bytes of requests not yet whole are bounded apart by the same number.
    max_unread_bytes: int = 256 << 20
    #: Of those, the most one tenant's clients may hold once greeted; a client past it is
    #: answered UNAVAILABLE at HELLO and closed (None: no cap of its own).
    tenant_connections: int | None = None
    #: Slots kept for each of ``tenants`` until its clients hold that many: past its own
    #: reserve, a tenant's client is answered UNAVAILABLE at HELLO when taking a slot would
    #: leave fewer than the other tenants' unused reserves (0: none).
    tenant_reserve: int = 0
    tenants: tuple[str, ...] = ()
    #: A client that has not said HELLO this long after connecting is closed.
    hello_timeout_s: float = 10.0
    #: A frame that stays incomplete this long (a client sending half a request) closes
    #: the connection; its buffered bytes are dropped.
    frame_timeout_s: float = 30.0
    #: Each lookup asks the pool's index about at most this many keys past the local prefix
    #: (a longer prefix is found in later lookups, as the engine proceeds).
    max_index_keys: int = 512
    #: Index lookups (and peer fetches) one tenant may have running at once on this node;
    #: more wait their turn, so one tenant's lookups cannot crowd the index for the others.
    index_concurrency: int = 4
    #: Keys one tenant may ask the index (and peers) about per second on this node; past
    #: it the keys are a miss at once (see :mod:`kvpool_sidecar.api.budget`).
    index_keys_per_s: float = 20000.0
    #: Who may act as which tenant, and who gets the arena mapped (everyone, by default).
    access: TenantAccess = field(default_factory=lambda: TenantAccess.from_settings([_Open()]))


@dataclass(frozen=True)
class _Open:
    """The default tenant with no access rule (tests and single-tenant nodes)."""

    name: str = "default"


def _keys(arg: object, limits: LocalLimits) -> list[bytes]:
    if not isinstance(arg, list):
        raise RequestError("expected a list of keys")
    if len(arg) > limits.max_batch:
        raise RequestError(f"batch of {len(arg)} exceeds the limit of {limits.max_batch}")
    if not all(type(k) is bytes and len(k) == RAW_KEY_BYTES for k in arg):
        raise RequestError(f"a key must be {RAW_KEY_BYTES} raw bytes")
    return arg


def _items(arg: object, limits: LocalLimits, width: int | tuple[int, ...]) -> list[list[Any]]:
    widths = width if isinstance(width, tuple) else (width,)
    if not isinstance(arg, list) or len(arg) > limits.max_batch:
        raise RequestError(f"expected a list of at most {limits.max_batch} items")
    for item in arg:
        if not isinstance(item, list) or len(item) not in widths:
            raise RequestError(f"each item must be a list of {' or '.join(map(str, widths))} fields")
    return arg


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{what} must be an integer")
    return value


#: A block's checksum is an unsigned 64-bit xxh3; anything else is refused at the door (it
#: could never match a block's bytes, and the disk tier's header could not even hold it).
_CHECKSUM_LIMIT = 1 << 64


def _checksum(value: object) -> int:
    csum = _int(value, "checksum")
    if not 0 <= csum < _CHECKSUM_LIMIT:
        raise RequestError("a checksum must be an unsigned 64-bit integer")
    return csum


def _lease_ids(arg: object, limits: LocalLimits) -> list[int]:
    if not isinstance(arg, list) or len(arg) > limits.max_batch:
        raise RequestError(f"expected a list of at most {limits.max_batch} lease ids")
    return [_int(lid, "lease") for lid in arg]


def _parent(value: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) != RAW_KEY_BYTES:
        raise RequestError(f"a parent key must be {RAW_KEY_BYTES} raw bytes or nil")
    return value


def _tokens_fit(engine: EngineRef | None, size: int) -> None:
    """A block's engine token ids (kept in memory for KV events, 4 bytes each) may take no
    more room than the block itself: a tenant's metadata stays bounded by its data."""
    if engine is not None and 4 * len(engine.token_ids) > max(size, 0):
        raise RequestError("an engine block's token ids ({} bytes) may not exceed the block ({} bytes)".format(
            4 * len(engine.token_ids), size))


def _log_once(cause: str, msg: str, *args: object) -> None:
    warn_once(logger, cause, msg, *args)


class LocalConnection(asyncio.Protocol):
    """One client: frame parsing, dispatch, and the session's lifetime."""

    def __init__(self, store: TieredStore, limits: LocalLimits, *, shm: bool,
                 live: set[LocalConnection] | None = None, peers: PeerReader | None = None,
                 raw: socket.socket | None = None, cred: Credentials | None = None,
                 index_budget: IndexBudget | None = None, unread: Unread[LocalConnection] | None = None,
                 inbound: Unread[LocalConnection] | None = None) -> None:
        self.store = store
        #: Answers buffered for clients that are behind, across the node's connections.
        self._unread: Unread[LocalConnection] = unread if unread is not None else Unread(limits.max_unread_bytes)
        #: Bytes of requests received but not yet whole (or not yet dispatched), across the
        #: node's connections: bounded apart, by the same limit.
        self._inbound: Unread[LocalConnection] = inbound if inbound is not None else Unread(limits.max_unread_bytes)
        #: Per tenant, the index lookups and fetches it may run at once (shared by its connections).
        self._budget = index_budget or IndexBudget(limits.index_concurrency, limits.index_keys_per_s)
        self.limits = limits
        self.shm = shm
        self.peers = peers
        #: The Unix socket itself (the arena's descriptor is sent on it after HELLO) and
        #: what the kernel says of its client; both None over TCP.
        self._raw = raw
        self.cred = cred
        self._marker_sent = False
        #: The index of the arena this client maps (its tenant's key space's); -1: none.
        self._arena = -1
        self._hello_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._live = live if live is not None else set()
        self.session: Session | None = None
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
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._greeted = False
        #: The protocol version this client said hello with.
        self._version = 0
        self._write_paused = False
        self._read_paused = False
        self._processing = False
        self._draining = False
        #: Over ``max_connections``: its first request is answered UNAVAILABLE, then it closes.
        self._refused = False
        #: When it connected (the oldest stranger makes room first: :meth:`_make_room`).
        self._born = time.monotonic()
        #: The transport told it the connection is gone; what aborts one that does not go.
        self._gone = False
        self._abort_timer: asyncio.TimerHandle | None = None

    def _close(self) -> None:
        """Close after the answers already written are flushed, within :data:`CLOSE_GRACE_S`."""
        self._closed = True
        if self.transport is not None and not self._gone:
            self.transport.close()
            if self._abort_timer is None:
                self._abort_timer = asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._drop)

    # -------------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        open_now = sum(not c._refused for c in self._live)
        if open_now >= self.limits.max_connections and self._make_room():
            open_now -= 1
        if open_now >= self.limits.max_connections:
            # told why in the answer to its first request (closing now would break its
            # HELLO before it could read a reason); closed regardless after a moment, and at
            # once when too many refused clients are already waiting
            _log_once("refused", "refusing local clients: %d connections are open (api.max_connections)", open_now)
            self._refused = True
            if len(self._live) - open_now >= _REFUSED_WAITING:
                self._closed = True
                self.transport.close()
                return
            self._live.add(self)
            asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, self._close)
            return
        self.session = self.store.open_session()
        self._live.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(self.limits.hello_timeout_s, self._no_hello)

    def _make_room(self) -> bool:
        """At the connection limit: close the oldest connection that has not said HELLO
        yet, if any (a client says it as it connects; strangers reconnecting as the hello
        timeout closes them would otherwise keep every slot, and every engine, out)."""
        strangers = [c for c in self._live if not c._refused and not c._greeted and not c._closed]
        if not strangers:
            return False
        oldest = min(strangers, key=lambda c: c._born)
        _log_once("stranger-closed", "local connections at api.max_connections (%d): closing the oldest "
                  "that has not said HELLO to let a new one in", self.limits.max_connections)
        self._live.discard(oldest)
        oldest._drop()  # (a stranger is owed no answer: gone at once, not once it reads)
        return True

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
        for t in self._tasks:
            t.cancel()
        if self.session is not None:
            self.store.close_session(self.session)
            self.session = None

    def pause_writing(self) -> None:
        self._write_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._unread.drained(self)
        self._flow()

    def _busy(self) -> bool:
        return self._write_paused or len(self._tasks) >= self.limits.max_inflight

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

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._flow()

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
            (length,) = HEADER.unpack_from(buf, pos)
            limit = self.limits.max_frame_bytes if self._greeted else PRE_HELLO_FRAME_BYTES
            if length > limit:
                self._fatal(0, f"frame of {length} bytes exceeds the limit of {limit}"
                               + ("" if self._greeted else " before HELLO"))
                return
            end = pos + HEADER.size + length
            if len(buf) < end:
                break
            try:
                body = decode(memoryview(buf)[pos + HEADER.size : end], max_items=self._max_items, max_map=MAX_MAP_ITEMS,
                              max_objects=self._max_objects, max_numbers=self._max_numbers)
            except ProtocolError as e:
                self._fatal(0, str(e))
                return
            pos = end
            self._dispatch(body)
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
        self._closed = True
        if self.transport is not None and not self._gone:
            self.transport.abort()

    def _error(self, rid: int, code: ErrorCode, message: str) -> None:
        self._send([rid, int(code), [code.name.lower(), message]])

    def _fatal(self, rid: int, message: str) -> None:
        _log_once("bad-frame", "closing a local connection after a bad frame: %s", message)
        self._error(rid, ErrorCode.BAD_REQUEST, message)
        self._inbound.drained(self)  # (closed: nothing more of it is read or counted)
        self._close()

    def drain(self) -> list[asyncio.Task[None]]:
        """Take no new requests (they get UNAVAILABLE); the requests still running."""
        self._draining = True
        return list(self._tasks)

    def _dispatch(self, body: list[Any]) -> None:
        op, rid, args = body[0], body[1], body[2:]
        if not isinstance(rid, int) or not isinstance(op, int):
            self._fatal(0, "op and request id must be integers")
            return
        if self._refused:
            if op == Op.HELLO and self._raw is not None and not self._marker_sent:
                self._marker_sent = True
                with contextlib.suppress(RequestError):
                    self._send_marker()  # the client reads this byte before any answer to HELLO
            self._error(rid, ErrorCode.UNAVAILABLE,
                        f"the sidecar has {self.limits.max_connections} local connections open, "
                        "its limit (api.max_connections)")
            self._close()
            return
        if self._draining and op != Op.RELEASE:  # giving back what it holds is still welcome
            self._error(rid, ErrorCode.UNAVAILABLE, "the sidecar is shutting down")
            return
        if not self._greeted and op != Op.HELLO:
            self._error(rid, ErrorCode.BAD_REQUEST, "say HELLO first: nothing is served before the client's "
                                                    "tenant is established")
            return
        handler = self._SYNC.get(op) if op != Op.LOOKUP or self.peers is None else None
        started = time.perf_counter()
        try:
            if handler is not None:
                self._send([rid, 0, handler(self, *args)])
                self.store.metrics.observe(_OP_NAMES.get(op, "unknown"), time.perf_counter() - started)
                return
            ahandler = self._ASYNC.get(op)
            if ahandler is None:
                raise RequestError(f"unknown operation {op}")
            coro = ahandler(self, *args)
        except TypeError:
            self._error(rid, ErrorCode.BAD_REQUEST, f"wrong arguments for operation {op}")
            return
        except SidecarError as e:
            self._error(rid, _CODES.get(e.code, ErrorCode.INTERNAL), str(e))
            return
        task = asyncio.get_running_loop().create_task(self._run(rid, op, coro, started))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        self._flow()

    async def _run(self, rid: int, op: int, coro: Awaitable[Any], started: float) -> None:
        """Task guard: every failure becomes an error answer, never a dead daemon."""
        try:
            result = await coro
        except asyncio.CancelledError:
            raise
        except SidecarError as e:
            self._error(rid, _CODES.get(e.code, ErrorCode.INTERNAL), str(e))
            return
        except TypeError:
            self._error(rid, ErrorCode.BAD_REQUEST, f"wrong arguments for operation {op}")
            return
        except Exception:  # noqa: BLE001 - task guard: answer, log, keep serving
            logger.exception("internal error in local operation %s", op)
            self._error(rid, ErrorCode.INTERNAL, "internal error; see the sidecar's log")
            return
        self._send([rid, 0, result])
        self.store.metrics.observe(_OP_NAMES.get(op, "unknown"), time.perf_counter() - started)

    @property
    def _s(self) -> Session:
        if self.session is None:
            raise RequestError("connection is closing")
        return self.session

    def _scoped(self, keys: list[bytes]) -> list[bytes]:
        """The store keys of this client's keys, in its tenant's key space."""
        return self.limits.spaces.scoped(self._s.tenant, keys)

    def _scoped_parent(self, parent: bytes | None) -> bytes | None:
        return None if parent is None else self._scoped([parent])[0]

    # -------------------------------------------------------------- operations
    def _hello(self, version: int, tenant: str, token: object = None) -> dict[str, Any]:
        access = self.limits.access
        admitted = version in SUPPORTED_VERSIONS and isinstance(tenant, str) \
            and self.store.knows_tenant(tenant) \
            and access.admits(tenant, token, self.cred if self._raw is not None else None)
        crowded = self._crowded(tenant) if admitted and not self._greeted else None
        admitted = admitted and crowded is None
        mapped = False
        if not self._marker_sent and self._raw is not None:
            # once per connection, before the first HELLO's answer: the arena's descriptor
            # for an admitted client that may map it, else a plain byte
            self._marker_sent = True
            mapped = admitted and self.shm and self.store.host.keeps_payloads and access.may_map_arena()
            # no arena until the descriptor is on its way: a marker that cannot be sent (HELLO
            # behind unread answers) must not leave the connection mapped for a later HELLO
            self.shm, self._arena = False, -1
            index = self.store.host.arena_index(tenant) if mapped else -1
            self._send_marker(index)
            self.shm, self._arena = mapped, index
        if version not in SUPPORTED_VERSIONS:
            raise RequestError(f"protocol version {version} is not supported (sidecar speaks "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        if crowded is not None:
            _log_once("tenant-connections", "refusing local clients of tenant %r: %s", tenant, crowded)
            asyncio.get_running_loop().call_soon(self._close)  # after the answer below is written
            raise UnavailableError(f"tenant {tenant!r} may not open another local connection on this node: {crowded}")
        if not admitted:
            raise RequestError("tenant refused: unknown, or this client may not act as it")
        if self._greeted and tenant != self._s.tenant:
            raise RequestError("a connection keeps the tenant it said hello with")
        if self._greeted and version != self._version:
            raise RequestError("a connection keeps the protocol version it said hello with")
        self._greeted = True
        self._version = version
        self._s.tenant = tenant
        arena = self.store.host.arena(self._arena) if self.shm and self._arena >= 0 else None
        return {
            "version": version,
            "node": self.limits.node,
            "shm": arena is not None,
            "arena_bytes": arena.size if arena is not None else 0,
            # Arenas of several key spaces are sparse (a page is resident in one at a time):
            # a client that touched all of its arena would make it all resident.
            "prefault": self.store.host.arena_count == 1,
            "max_batch": self.limits.max_batch,
            "max_frame_bytes": self.limits.max_frame_bytes,
            "block_max_bytes": self.store.block_max_bytes,
            # Whether ACQUIRE_DEVICE can hit on this connection (else it answers misses only).
            "device_reads": version >= 3 and self._device_reads(quiet=True),
        }

    def _crowded(self, tenant: str) -> str | None:
        """Why ``tenant`` may not take another slot (None: it may): its greeted connections
        already hold its cap, or hold its reserve while the free slots are the other tenants'
        unused reserves."""
        limits = self.limits
        cap, reserve = limits.tenant_connections, limits.tenant_reserve
        if (cap is None or cap >= limits.max_connections) and not reserve:
            return None
        held: Counter[str] = Counter(c.session.tenant for c in self._live
                                     if c._greeted and not c._closed and c.session is not None)
        mine = held[tenant]
        if cap is not None and mine >= cap:
            return f"it holds {cap} connections, its limit (api.max_connections_per_tenant)"
        if reserve and mine >= reserve:
            kept = sum(max(0, reserve - held[t]) for t in limits.tenants if t != tenant)
            if sum(held.values()) + 1 > limits.max_connections - kept:
                return (f"the slots left are kept for the node's other tenants ({kept} in all, "
                        "api.reserved_connections_per_tenant)")
        return None

    def _send_marker(self, arena_index: int = -1) -> None:
        """One byte on the raw socket, with arena ``arena_index``'s memfd attached (-1: none)."""
        raw = self._raw
        arena = self.store.host.arena(arena_index) if arena_index >= 0 else None
        if raw is None or self.transport is None:
            return
        if self.transport.get_write_buffer_size():
            raise RequestError("HELLO must be the first request")  # the byte would overtake answers
        try:
            if arena is not None:
                raw.sendmsg([FD_BYTE], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [arena.fd]))])
            else:
                raw.send(NO_FD_BYTE)
        except OSError as e:
            raise RequestError(f"cannot send the handshake byte: {e}") from e

    def _lookup(self, keys: object) -> list[Any]:
        # No per-key validation: a malformed key is simply not found (and ends the prefix).
        if not isinstance(keys, list) or len(keys) > self.limits.max_batch:
            raise RequestError(f"expected a list of at most {self.limits.max_batch} keys")
        n, runs = self.store.lookup(self._scoped(keys))
        return [n, runs]

    async def _lookup_pool(self, keys: object) -> list[Any]:
        """Local prefix, then the blocks after it that peers hold (tier ``peer``)."""
        n, runs = self._lookup(keys)
        if self.peers is not None and isinstance(keys, list) and n < len(keys):
            asked = self._scoped(_keys(keys[n : n + self.limits.max_index_keys], self.limits))
            more = 0
            if self._index_allows(len(asked)):
                deadline = self.peers.lookup_deadline()  # (shorter than an engine's lookup timeout)
                async with self._index_turn_by(deadline) as ok:
                    if ok:
                        more = await self.peers.remote_prefix(asked, deadline)
            if more:
                n += more
                runs.append(["peer", more])
        return [n, runs]

    def _put_items(self, items: object, hints: object) -> tuple[list[list[Any]], Hints | None]:
        """A put's items as ``[store key, size or data, depth, store parent, engine]``, all
        checked before anything is reserved: a refused batch must leave no key reserved."""
        if self._version < 3 and hints is not None:
            raise RequestError("hints need protocol version 3")
        checked = []
        for item in _items(items, self.limits, 4 if self._version < 3 else (4, 5)):
            key, second, depth, parent = item[:4]
            checked.append([self._scoped(_keys([key], self.limits))[0], second, _int(depth, "depth"),
                            self._scoped_parent(_parent(parent)), parse_engine(item[4] if len(item) > 4 else None)])
        return checked, parse_hints(hints)

    async def _alloc(self, items: object, hints: object = None) -> list[Any]:
        self._need_shm()
        checked, parsed = self._put_items(items, hints)
        for item in checked:
            _tokens_fit(item[4], _int(item[1], "size"))
        out: list[Any] = []
        lineage = self.store.lineage()
        for n, (key, size, depth, parent, engine) in enumerate(checked, 1):
            status, lease = await self.store.allocate(self._s, key, size, depth=depth, parent=parent,
                                                      hints=parsed, engine=engine, lineage=lineage)
            out.append([int(status), lease.id, self._mapped(lease.place)] if lease else [int(status), 0, None])
            if n % BATCH_SLICE == 0:
                await asyncio.sleep(0)  # other clients' requests between slices of a large batch
        return out

    def _commit(self, items: object) -> list[int]:
        # the whole batch is checked before any of it is applied: a refused batch commits nothing
        checked = [(_int(lease_id, "lease"), _checksum(csum)) for lease_id, csum in _items(items, self.limits, 2)]
        out = []
        for lease_id, csum in checked:
            try:
                out.append(int(self.store.commit(self._s, lease_id, csum)))
            except UnknownLeaseError:
                out.append(-int(ErrorCode.UNKNOWN_LEASE))
        return out

    def _abort(self, lease_ids: object) -> int:
        n = 0
        for lid in _lease_ids(lease_ids, self.limits):
            with contextlib.suppress(UnknownLeaseError):
                self.store.abort(self._s, lid)
                n += 1
        return n

    async def _acquire(self, keys: object) -> list[Any]:
        self._need_shm()
        out: list[Any] = []
        keys = self._scoped(_keys(keys, self.limits))
        await self._fetch(keys)
        await self.store.prefetch(keys)
        for n, k in enumerate(keys, 1):
            if n % BATCH_SLICE == 0:
                await asyncio.sleep(0)  # other clients' requests between slices of a large batch
            lease = await self.store.acquire(self._s, k)
            extents = None if lease is None else self._mapped(lease.place)
            if lease is not None and extents is None:
                self.store.release(self._s, lease.id)  # held in another space's arena: a miss here
            out.append(None if lease is None or extents is None
                       else [lease.id, lease.entry.size, lease.entry.checksum, extents])
        return out

    async def _acquire_device(self, keys: object) -> list[Any]:
        """GPU-tier copies for a local CUDA engine on the same device: per key ``[lease id,
        size, checksum, CUDA IPC descriptor]``, or None (a miss: the engine reads the block
        through ACQUIRE). Never fetches from peers: a GPU-tier hit is local by definition.
        The session's limits hold as for ACQUIRE (the store counts the lease against them)."""
        if self._version < 3:
            raise RequestError("ACQUIRE_DEVICE needs protocol version 3 (this connection said hello "
                               f"with {self._version})")
        keys = self._scoped(_keys(keys, self.limits))
        if not self._device_reads():
            return [None] * len(keys)
        out: list[Any] = []
        for k in keys:
            try:
                got = await self.store.acquire_device(self._s, k)
            except TierError as e:  # torch refused to share the buffer: a miss, the DRAM path serves it
                _log_once("device-share", "GPU-tier reads miss: cannot make a CUDA IPC descriptor: %s", e)
                got = None
            out.append(None if got is None else [got[0].id, got[0].entry.size, got[0].entry.checksum, got[1]])
        return out

    def _device_reads(self, *, quiet: bool = False) -> bool:
        """Whether this connection may read GPU-tier copies in place. A descriptor opens the
        GPU tier's whole buffer, every tenant's blocks in it, for reading and writing: only
        a client that maps the one arena of a node with a single key space (and so reaches
        every block already) gets one."""
        if not self.store.device_reads:
            return False
        if self.store.host.arena_count > 1:
            if not quiet:
                _log_once("device-spaces", "GPU-tier reads answered as misses: this node keeps %d key spaces "
                          "(a CUDA IPC descriptor would open all of them)", self.store.host.arena_count)
            return False
        if not self.shm:
            if not quiet:
                _log_once("device-no-arena", "GPU-tier reads answered as misses for clients that map no "
                          "arena (TCP, or api.shared_arena: never)")
            return False
        return True

    def _mapped(self, extents: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
        """A block's extents as offsets in this client's arena (None: it lies in another)."""
        return self.store.host.offsets(extents, self._arena)

    def _release(self, items: object) -> int:
        checked = [(_int(lease_id, "lease"), bool(corrupt)) for lease_id, corrupt in _items(items, self.limits, 2)]
        n = 0
        for lease_id, corrupt in checked:
            with contextlib.suppress(UnknownLeaseError):
                self.store.release(self._s, lease_id, corrupt=corrupt)
                n += 1
        return n

    def _pin(self, keys: object) -> int:
        return self.store.pin(self._s, self._scoped(_keys(keys, self.limits)))

    def _unpin(self, keys: object) -> int:
        return self.store.unpin(self._s, self._scoped(_keys(keys, self.limits)))

    def _remove(self, keys: object) -> int:
        """Delete blocks of this client's key space (validated like a pin: the whole batch
        first); copies on other nodes are theirs and stay."""
        return self.store.remove(self._s, self._scoped(_keys(keys, self.limits)))

    def _stats(self) -> dict[str, object]:
        return {**self.store.report.stats(), "index_throttled": self._budget.throttled,
                "unread_aborted": self._unread.aborted, "inbound_aborted": self._inbound.aborted}

    async def _put_inline(self, items: object, hints: object = None) -> list[int]:
        """Put for clients without the arena: the sidecar copies and checksums."""
        checked, parsed = self._put_items(items, hints)
        if not all(isinstance(item[1], bytes) for item in checked):
            raise RequestError("inline data must be bytes")
        for item in checked:
            _tokens_fit(item[4], len(item[1]))
        out: list[int] = []
        lineage = self.store.lineage()
        for key, data, depth, parent, engine in checked:
            status, lease = await self.store.allocate(self._s, key, len(data), depth=depth, parent=parent,
                                                      hints=parsed, engine=engine, lineage=lineage)
            if lease is None:
                out.append(int(status))
                continue
            if not self.store.host.keeps_payloads:
                self.store.abort(self._s, lease.id)
                raise RequestError("this sidecar keeps no payloads")
            csum = copy_with_checksum(self.store.host.views(lease.place), memoryview(data))
            out.append(int(self.store.commit(self._s, lease.id, csum)))
        return out

    async def _get_inline(self, keys: object) -> list[bytes | None | bool]:
        """Blocks copied into the answer, which stays under the frame limit: past it, the
        rest are answered ``False`` (not sent: ask again), never built whole in memory."""
        out: list[bytes | None | bool] = []
        keys = self._scoped(_keys(keys, self.limits))
        await self._fetch(keys)
        await self.store.prefetch(keys)
        budget = self.limits.max_frame_bytes - 1024 - 16 * len(keys)  # msgpack framing per item
        for i, k in enumerate(keys):
            lease = await self.store.acquire(self._s, k)
            if lease is None:
                out.append(None)
                continue
            if lease.entry.size > budget:
                self.store.release(self._s, lease.id)
                out += [False] * (len(keys) - i) if out else [None] + [False] * (len(keys) - i - 1)
                break
            data = b"".join(self.store.host.views(lease.place))
            ok = checksum(memoryview(data)) == lease.entry.checksum
            self.store.release(self._s, lease.id, corrupt=not ok)
            out.append(data if ok else None)
            budget -= len(data)
        return out

    @contextlib.asynccontextmanager
    async def _index_turn_by(self, deadline: float) -> AsyncIterator[bool]:
        """This tenant's share of the node's index lookups and peer fetches, if its turn comes
        before ``deadline`` (loop time): yields whether it came (held until the block ends)."""
        turn = self._budget.turn(self._s.tenant)
        try:
            async with asyncio.timeout_at(deadline):
                await turn.acquire()
        except TimeoutError:
            yield False
            return
        try:
            yield True
        finally:
            turn.release()

    def _index_allows(self, keys: int) -> bool:
        """Whether this tenant is within its rate of keys asked of the index and peers."""
        if self._budget.allows(self._s.tenant, keys):
            return True
        warn_once(logger, "index-rate", "a client of tenant %s is past api.index_keys_per_s: its index "
                  "lookups and fetches miss until its rate falls", self._s.tenant)
        return False

    async def _fetch(self, keys: list[bytes]) -> None:
        """Fetch from peers the blocks of ``keys`` this node lacks (within the tenant's budget)."""
        if self.peers is None:
            return
        missing = sum(not self.store.contains(k) for k in keys)
        if missing and self._index_allows(missing):
            deadline = self.peers.deadline()  # a miss by then, however long the turn takes
            async with self._index_turn_by(deadline) as ok:
                if ok:
                    await self.peers.fetch(keys, deadline)

    def _need_shm(self) -> None:
        if not self.shm or not self.store.host.keeps_payloads:
            raise RequestError("this connection has no shared arena; use the inline operations")

    _SYNC: dict[int, Callable[..., Any]] = {
        Op.HELLO: _hello, Op.LOOKUP: _lookup, Op.COMMIT: _commit, Op.ABORT: _abort,
        Op.RELEASE: _release, Op.PIN: _pin, Op.UNPIN: _unpin, Op.STATS: _stats,
        Op.REMOVE: _remove,
    }
    _ASYNC: dict[int, Callable[..., Awaitable[Any]]] = {
        Op.ALLOC: _alloc, Op.ACQUIRE: _acquire, Op.PUT_INLINE: _put_inline, Op.GET_INLINE: _get_inline,
        Op.LOOKUP: _lookup_pool, Op.ACQUIRE_DEVICE: _acquire_device,
    }


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
        self._conns: set[LocalConnection] = set()
        self.index_budget = IndexBudget(limits.index_concurrency, limits.index_keys_per_s)
        self.unread: Unread[LocalConnection] = Unread(limits.max_unread_bytes)
        self.inbound: Unread[LocalConnection] = Unread(limits.max_unread_bytes)

    def _factory(self, shm: bool, raw: socket.socket | None = None,
                 cred: Credentials | None = None) -> Callable[[], LocalConnection]:
        return lambda: LocalConnection(self.store, self.limits, shm=shm, live=self._conns, peers=self.peers,
                                       raw=raw, cred=cred, index_budget=self.index_budget, unread=self.unread,
                                       inbound=self.inbound)

    async def start(self) -> None:
        if self.socket_path:
            self._uds = _bind_unix(self.socket_path, self.socket_mode)
            self._accept = asyncio.get_running_loop().create_task(self._accept_loop(self._uds))
        if self.tcp is not None:
            self._tcp_server = await asyncio.get_running_loop().create_server(
                self._factory(False), self.tcp[0], self.tcp[1]
            )
            self.tcp_port = self._tcp_server.sockets[0].getsockname()[1]

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

    async def stop(self) -> None:
        """Stop accepting; let running requests finish (up to ``drain_s``) while new ones
        get UNAVAILABLE; then close every connection (their sessions release their leases)."""
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept
        if self._uds is not None:
            self._uds.close()
            if self.socket_path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)
        if self._tcp_server is not None:
            self._tcp_server.close()
            await self._tcp_server.wait_closed()
        running = [t for c in list(self._conns) for t in c.drain()]
        if running:
            _, late = await asyncio.wait(running, timeout=self.drain_s)
            if late:
                logger.warning("closing %d local requests still running after %.1fs of draining",
                               len(late), self.drain_s)
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.close()
        await asyncio.sleep(0)


def _bind_unix(path: str, mode: int) -> socket.socket:
    """Bind the local socket; replace a stale socket file, refuse a live one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    check_socket_dir(p.parent)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise SidecarError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            p.unlink()
        else:
            raise SidecarError(f"another sidecar is listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, mode)
    sock.listen(512)
    sock.setblocking(False)
    return sock
