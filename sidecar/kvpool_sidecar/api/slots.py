"""The node's local connections, kept by state and counted as they change state.

What the connection limit reads at every accept (how many are open, the oldest being closed,
the oldest that has not said HELLO, a user's strangers) and what a HELLO reads (each tenant's
greeted connections) costs the same however many connections are open: each accept had
scanned every live connection twice, and a process needing no credentials, connecting in a
loop, had held the sidecar to about 1,400 accepts a second at ``api.max_connections`` 1024
(2,500 at 64), the socket's listen backlog full and engines' connects failing (a review).

A connection is, in turn: a *stranger* (connected, no HELLO admitted yet), *greeted* (its
tenant counted), *closing* (closed by the sidecar, its client not yet gone), then gone
(:meth:`Slots.discard`). A connection refused for the limit is counted apart and takes no slot.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool_sidecar.api.connection import LocalConnection

#: Connections one user (the uid the kernel reports for a Unix socket's client) may hold
#: before any of them says HELLO; past it, that user's oldest such connection is closed for
#: its new one, so a user flooding the socket displaces only its own (a client says HELLO as
#: it connects: an engine's connection is a stranger for a millisecond or so).
STRANGERS_PER_UID = 64


class Slots:
    """The node's local connections (iterable, sized, as the set they were before) by state."""

    def __init__(self) -> None:
        self._all: set[LocalConnection] = set()
        self._refused: set[LocalConnection] = set()
        #: Strangers, oldest first, each with its client's uid (None: over TCP).
        self._strangers: OrderedDict[LocalConnection, int | None] = OrderedDict()
        #: ... and by uid, oldest first.
        self._by_uid: dict[int, OrderedDict[LocalConnection, None]] = {}
        #: Connections the sidecar closed whose clients have not gone yet, oldest closed first.
        self._closing: OrderedDict[LocalConnection, None] = OrderedDict()
        #: The tenant of each greeted connection not closed, and their counts.
        self._tenant_of: dict[LocalConnection, str] = {}
        self.tenants: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[LocalConnection]:
        return iter(list(self._all))

    def __contains__(self, conn: object) -> bool:
        return conn in self._all

    @property
    def open(self) -> int:
        """Connections that hold a slot (those refused for the limit do not)."""
        return len(self._all) - len(self._refused)

    @property
    def refused(self) -> int:
        """Connections refused for the limit, waiting to read why."""
        return len(self._refused)

    @property
    def greeted(self) -> int:
        """Greeted connections not closed, all tenants together."""
        return len(self._tenant_of)

    def strangers_of(self, uid: int) -> int:
        got = self._by_uid.get(uid)
        return len(got) if got is not None else 0

    def add(self, conn: LocalConnection, uid: int | None) -> None:
        """A new connection, with a slot: a stranger of user ``uid`` (None: unknown)."""
        self._all.add(conn)
        self._strangers[conn] = uid
        if uid is not None:
            self._by_uid.setdefault(uid, OrderedDict())[conn] = None

    def add_refused(self, conn: LocalConnection) -> None:
        self._all.add(conn)
        self._refused.add(conn)

    def greet(self, conn: LocalConnection, tenant: str) -> None:
        """``conn``'s first HELLO was admitted, as ``tenant``."""
        if conn not in self._all or conn in self._tenant_of:
            return
        self._forget_stranger(conn)
        self._tenant_of[conn] = tenant
        self.tenants[tenant] += 1

    def close(self, conn: LocalConnection) -> None:
        """The sidecar closed ``conn``: it keeps its slot until its client is gone."""
        if conn not in self._all or conn in self._refused:
            return
        self._forget_stranger(conn)
        self._forget_tenant(conn)
        self._closing[conn] = None

    def discard(self, conn: LocalConnection) -> None:
        """``conn`` is gone (or is being ended to make room): it holds nothing more."""
        if conn not in self._all:
            return
        self._all.discard(conn)
        self._refused.discard(conn)
        self._closing.pop(conn, None)
        self._forget_stranger(conn)
        self._forget_tenant(conn)

    def oldest_closing(self) -> LocalConnection | None:
        return next(iter(self._closing), None)

    def oldest_stranger(self, uid: int | None = None) -> LocalConnection | None:
        """The oldest stranger of user ``uid`` if it has any, else the oldest of all."""
        mine = self._by_uid.get(uid) if uid is not None else None
        if mine:
            return next(iter(mine))
        return next(iter(self._strangers), None)

    def _forget_stranger(self, conn: LocalConnection) -> None:
        if conn not in self._strangers:
            return
        uid = self._strangers.pop(conn)
        if uid is not None:
            theirs = self._by_uid[uid]
            del theirs[conn]
            if not theirs:
                del self._by_uid[uid]

    def _forget_tenant(self, conn: LocalConnection) -> None:
        tenant = self._tenant_of.pop(conn, None)
        if tenant is not None:
            self.tenants[tenant] -= 1
            if not self.tenants[tenant]:
                del self.tenants[tenant]
