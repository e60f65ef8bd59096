"""Who gets a local connection's slot, and as which tenant: the connection limit and HELLO.

A client past ``api.max_connections`` takes the slot of the oldest connection being closed,
else of the oldest that has not said HELLO yet, its own user's first (else the connection
refuses it: its first request is answered UNAVAILABLE); and a user with
:data:`~kvpool_sidecar.api.slots.STRANGERS_PER_UID` such connections already gives its
oldest up for its new one, so a user that connects in a loop displaces only its own. No
store session is opened before HELLO is admitted. Its HELLO names a protocol version and a
tenant, which the node's access rules admit by its token or by what the kernel says of the
client (Unix socket); a tenant past its own cap of connections, or into the slots kept for
the node's other tenants, is answered UNAVAILABLE and closed. A HELLO whose tenant is
unknown, or does not admit the client (its token, its uid or gid), is answered BAD_REQUEST,
counted (``hello_refused``) and its connection closed: one guess per connection. Once per
connection, before the first HELLO's answer, one byte goes on the raw socket: with the
arena's descriptor attached for an admitted client that may map it.
"""

from __future__ import annotations

import array
import asyncio
import logging
import socket
import weakref
from typing import TYPE_CHECKING, Any

from kvpool_client.protocol import FD_BYTE, NO_FD_BYTE, SUPPORTED_VERSIONS
from kvpool_sidecar.api.localclient import LocalClient
from kvpool_sidecar.api.slots import STRANGERS_PER_UID, Slots
from kvpool_sidecar.errors import RequestError, UnavailableError
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.tenancy import Credentials

if TYPE_CHECKING:
    from kvpool_sidecar.api.connection import LocalConnection

logger = logging.getLogger(__name__)


class HelloRefused(RequestError):
    """A HELLO refused for its tenant or the client's proof (the same for both: no tenant
    names leak). The connection closes once the answer is written: before, one TCP
    connection had answered 112,000 token guesses a second."""


class Admission:
    """One connection's way in: its slot among the node's connections, and its HELLO."""

    def __init__(self, conn: LocalConnection, client: LocalClient, live: Slots, *,
                 raw: socket.socket | None, cred: Credentials | None) -> None:
        #: A weak reference: the connection holds this object (its HELLO handler), and a
        #: cycle would keep a closed connection, and its buffer, until a full collection,
        #: which the daemon runs once an hour (:mod:`kvpool_sidecar.collector`).
        self._conn: LocalConnection = weakref.proxy(conn)
        self._client = client
        self.store = client.store
        self.limits = client.limits
        #: The node's local connections (this one's among them once it is made).
        self._live = live
        #: The Unix socket itself (the arena's descriptor is sent on it after HELLO) and
        #: what the kernel says of its client; both None over TCP.
        self.raw = raw
        self.cred = cred
        #: Its client's user, whose connections that have not said HELLO are capped together.
        self.uid = cred.uid if raw is not None and cred is not None else None
        self.marker_sent = False

    def make_room(self) -> bool:
        """Whether the new connection gets a slot, made if need be (each step costs the same
        however many connections are open: :class:`~kvpool_sidecar.api.slots.Slots`).

        Its user's oldest connection that has not said HELLO goes first when that user has
        :data:`~kvpool_sidecar.api.slots.STRANGERS_PER_UID` of them. At the connection limit,
        the oldest connection being closed goes (waiting for its client to read its last
        answers, :data:`~kvpool_sidecar.api.connection.CLOSE_GRACE_S` at most: strangers closed
        after a bad frame, who never read, had kept engines out), else the oldest that has
        not said HELLO yet, of this user if it has one, else of any (a client says it as it
        connects; strangers reconnecting as the hello timeout closes them would otherwise
        keep every slot, and every engine, out)."""
        slots, limit = self._live, self.limits.max_connections
        uid = self.uid
        if uid is not None and slots.strangers_of(uid) >= STRANGERS_PER_UID:
            warn_once(logger, "user-strangers", "closing the oldest local connection of a user (uid %d) with %d "
                      "connections that have not said HELLO, for its new one", uid, STRANGERS_PER_UID)
            self._end(slots.oldest_stranger(uid))
        if slots.open < limit:
            return True
        oldest = slots.oldest_closing() or slots.oldest_stranger(uid)
        if oldest is None:
            return False
        warn_once(logger, "stranger-closed", "local connections at api.max_connections (%d): ending the oldest "
                  "being closed, or else that has not said HELLO, to let a new one in", limit)
        self._end(oldest)
        return slots.open < limit

    def _end(self, conn: LocalConnection | None) -> None:
        """End ``conn`` at once, its answers dropped, its slot free now."""
        if conn is not None:
            self._live.discard(conn)
            conn._drop()

    def hello(self, version: int, tenant: str, token: object = None) -> dict[str, Any]:
        conn, client = self._conn, self._client
        access = self.limits.access
        admitted = version in SUPPORTED_VERSIONS and isinstance(tenant, str) \
            and self.store.knows_tenant(tenant) \
            and access.admits(tenant, token, self.cred if self.raw is not None else None)
        crowded = self._crowded(tenant) if admitted and not conn._greeted else None
        admitted = admitted and crowded is None
        mapped = False
        if not self.marker_sent and self.raw is not None:
            # once per connection, before the first HELLO's answer: the arena's descriptor
            # for an admitted client that may map it, else a plain byte
            self.marker_sent = True
            mapped = admitted and client.shm and self.store.host.keeps_payloads and access.may_map_arena()
            # no arena until the descriptor is on its way: a marker that cannot be sent (HELLO
            # behind unread answers) must not leave the connection mapped for a later HELLO
            client.shm, client.arena = False, -1
            index = self.store.host.arena_index(tenant) if mapped else -1
            self.send_marker(index)
            client.shm, client.arena = mapped, index
        if version not in SUPPORTED_VERSIONS:
            raise RequestError(f"protocol version {version} is not supported (sidecar speaks "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        if crowded is not None:
            warn_once(logger, "tenant-connections", "refusing local clients of tenant %r: %s", tenant, crowded)
            asyncio.get_running_loop().call_soon(conn._close)  # after the answer below is written
            raise UnavailableError(f"tenant {tenant!r} may not open another local connection on this node: {crowded}")
        if not admitted:
            self.store.metrics.hello_refused()
            warn_once(logger, "hello-refused", "refusing local clients' HELLO for a tenant they may not act as "
                      "(unknown, or not admitted by its token or rules) and closing their connections")
            raise HelloRefused("tenant refused: unknown, or this client may not act as it")
        if conn._greeted and tenant != client.active_session.tenant:
            raise RequestError("a connection keeps the tenant it said hello with")
        if conn._greeted and version != client.version:
            raise RequestError("a connection keeps the protocol version it said hello with")
        if not conn._greeted:
            if conn._closed:  # (its session would outlive it: closed sessions are closed as it goes)
                raise RequestError("connection is closing")
            # the session is opened here, not as the client connects: a stranger costs no
            # session (connections that never say HELLO had each opened and closed one)
            client.session = self.store.open_session(tenant)
            conn._greet(tenant)
        client.version = version
        arena = self.store.host.arena(client.arena) if client.shm and client.arena >= 0 else None
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
            "device_reads": version >= 3 and client.device_reads(quiet=True),
            # A chain put in several ALLOCs keeps its own head (its lineage walks the blocks
            # still pending): a client may send a put in pieces (kvpool_client.pipeline).
            "put_pieces": True,
        }

    def _crowded(self, tenant: str) -> str | None:
        """Why ``tenant`` may not take another slot (None: it may): its greeted connections
        already hold its cap, or hold its reserve while the free slots are the other tenants'
        unused reserves."""
        limits = self.limits
        cap, reserve = limits.tenant_connections, limits.tenant_reserve
        if (cap is None or cap >= limits.max_connections) and not reserve:
            return None
        held = self._live.tenants
        mine = held[tenant]
        if cap is not None and mine >= cap:
            return f"it holds {cap} connections, its limit (api.max_connections_per_tenant)"
        if reserve and mine >= reserve:
            kept = sum(max(0, reserve - held[t]) for t in limits.tenants if t != tenant)
            if self._live.greeted + 1 > limits.max_connections - kept:
                return (f"the slots left are kept for the node's other tenants ({kept} in all, "
                        "api.reserved_connections_per_tenant)")
        return None

    def send_marker(self, arena_index: int = -1) -> None:
        """One byte on the raw socket, with arena ``arena_index``'s memfd attached (-1: none)."""
        raw = self.raw
        arena = self.store.host.arena(arena_index) if arena_index >= 0 else None
        transport = self._conn.transport
        if raw is None or transport is None:
            return
        if transport.get_write_buffer_size():
            raise RequestError("HELLO must be the first request")  # the byte would overtake answers
        try:
            if arena is not None:
                raw.sendmsg([FD_BYTE], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [arena.fd]))])
            else:
                raw.send(NO_FD_BYTE)
        except OSError as e:
            raise RequestError(f"cannot send the handshake byte: {e}") from e
