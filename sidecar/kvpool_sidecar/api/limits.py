"""The local API's limits: what one client, one tenant and the node's clients may make the
sidecar hold and do (``api.*`` settings), and how much of one batch is served per turn of the
event loop.

:class:`LocalLimits` is built once from the settings and shared by the listener, every
connection and every request handler of the local API.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool_sidecar.tenancy import KeySpaces, TenantAccess

#: Blocks of one ALLOC, ACQUIRE or PUT_INLINE served per turn of the event loop: other clients' requests
#: are served between slices (a put of 1,024 blocks had held another client's lookup for
#: tens of milliseconds).
BATCH_SLICE = 256

#: Bytes an inline put copies and checksums between turns of the event loop, whatever its
#: blocks' count (about a millisecond of copying).
SLICE_BYTES = 4 << 20


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
