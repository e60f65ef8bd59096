"""The sidecar's settings of its local API (``api``): where it listens for local clients and
for HTTP probes and metrics, and the bounds it keeps on those clients (frames, batches,
connections, unread answers, timeouts, shares, index lookups, leases). A section of
:class:`~kvpool_sidecar.config.SidecarSettings`, loaded in :mod:`kvpool_sidecar.config`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ApiSettings:
    """Where the sidecar listens for local clients and for HTTP probes and metrics."""

    #: The local Unix socket (at most 107 bytes). The operator gives each pool its own
    #: directory, ``/run/kvpool/<namespace>.<name>/kvpool.sock`` unless the pool's
    #: ``spec.api.socketDir`` names one, so pools can share a node.
    socket_path: str = "/run/kvpool/kvpool.sock"
    #: Mode of the socket file. It belongs to the sidecar's user and primary group (in the
    #: image and the operator's DaemonSet 10001:10001, in a directory of mode 0750 of the
    #: same owner): with 0660 a client must run as that user or carry that group, e.g. a
    #: serving pod with ``securityContext.supplementalGroups: [10001]``.
    socket_mode: int = 0o660
    #: Optional TCP control port on ``tcp_host`` for host-network pods (no shared memory:
    #: data travels inline).
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = None
    #: Address the HTTP port (``/healthz``, ``/metrics``, ``/stats``) binds to; default
    #: 127.0.0.1.
    http_host: str = "127.0.0.1"
    #: The HTTP port, 0..65535 (0: any free port); default 9466, the CRD's too. None: no HTTP.
    http_port: int | None = 9466
    #: HTTP connections open at once (probes and scrapers need a few); a new one past it
    #: closes the oldest, so that a flood never keeps a probe out.
    http_max_connections: int = 64
    #: An HTTP connection that starts no response this long after opening, or after its
    #: last response, is closed (a request sent a byte at a time, an idle keep-alive).
    http_deadline_s: float = 10.0
    #: Largest control frame a client may send, and the most an inline answer holds; at most
    #: 512 MiB (the clients read no answer longer than 1 GiB).
    max_frame_bytes: int = 64 << 20
    #: Most keys in one batched request; at most 16,384 (an ACQUIRE answer of more blocks
    #: could pass the objects the clients read of one answer).
    max_batch: int = 4096
    #: Requests of one connection that run at once; past it, or while a client does not
    #: read its answers, its connection is not read (backpressure, not an error).
    max_inflight: int = 8
    #: Local connections open at once (Unix socket and TCP together); a client past it is
    #: told UNAVAILABLE and closed, so a runaway client cannot exhaust the sidecar's files.
    max_connections: int = 1024
    #: The most of those one tenant's clients may hold once they said HELLO; a client past
    #: it is told UNAVAILABLE at HELLO and closed, so one tenant cannot take every slot.
    #: None: three quarters of ``max_connections`` on a node with several tenants, else no
    #: cap of its own.
    max_connections_per_tenant: int | None = None
    #: Slots kept for each tenant of the node until its clients hold that many: a client of
    #: a tenant that already holds its reserve is answered UNAVAILABLE at HELLO when taking a
    #: slot would leave fewer than the other tenants' unused reserves, so tenants together
    #: cannot keep a third one out. None: ``max_connections`` over twice the tenants on a
    #: node with several tenants, else none.
    reserved_connections_per_tenant: int | None = None
    #: Answers the sidecar may hold, across all local connections, for clients that do not
    #: read them (each connection's requests in flight still answer after its client stops
    #: reading). Past it, the connection holding the most is aborted and its answers dropped,
    #: so many clients that never read cannot make the sidecar hold more than this. The
    #: same bound applies, apart, to requests received but not yet whole: many clients each
    #: leaving a frame of up to ``max_frame_bytes`` unfinished are aborted, most bytes first.
    max_unread_bytes: int = 256 << 20
    #: A client that has not said HELLO (proved its tenant) this long after connecting is
    #: closed, so idle strangers cannot hold ``max_connections`` slots.
    hello_timeout_s: float = 10.0
    #: A request frame left incomplete this long closes its connection (no half-sent frame
    #: stays buffered).
    frame_timeout_s: float = 30.0
    #: The most of the DRAM tier one client connection, and all the connections of one
    #: tenant together, may hold at once: write leases (allocated, not committed), read
    #: leases and pins, counted in the pages their blocks take. Past it a put answers QUOTA, a get misses and a pin does not take:
    #: one client or tenant cannot hold the node.
    max_session_share: float = 0.5
    #: A lookup asks the pool's index about at most this many keys past the node's own
    #: prefix (longer prefixes show up in later lookups as the engine goes on), and one
    #: tenant runs at most ``index_concurrency`` index lookups at once (a peer fetch's
    #: included, for its index part; its transfer has bounds of its own:
    #: :mod:`kvpool_sidecar.fetchgate`): what one client can make the shared Redis and the
    #: peers do is bounded.
    max_index_keys: int = 512
    index_concurrency: int = 4
    #: Keys one tenant may ask the index and peers about per second on this node (a bucket
    #: holding one second's worth). A lookup or fetch past it is not made: its keys miss at
    #: once, so a flooding client slows neither the index nor the other tenants.
    index_keys_per_s: float = 20000.0
    #: On SIGTERM, how long running requests may finish before connections close.
    drain_s: float = 5.0
    #: Which clients get a DRAM arena mapped (zero-copy): ``per-space`` (default): each key
    #: space has an arena of its own and a client maps only its tenant's space's arena, so
    #: a mapping never shows it another space's blocks; ``shared``: one arena for every
    #: admitted client of every tenant (they can then read and overwrite each other's
    #: blocks: only for tenants that trust each other); ``never``: clients move data inline
    #: through the socket.
    shared_arena: str = "per-space"
    #: Write leases (allocated but not committed blocks) expire after this many seconds: the
    #: key is free for other writers and a late commit is refused; the pages stay held, in the
    #: writer's session share, until that late commit or an abort, or until its connection
    #: closes (a slow writer may still copy into them: docs/security.md). Read leases last
    #: until released or disconnect.
    lease_timeout_s: float = 30.0
