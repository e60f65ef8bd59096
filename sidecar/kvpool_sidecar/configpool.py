"""The sidecar's settings of the pool it is part of: the pool's shared block index
(``index``) and the block transfers between its sidecars (``peer``), each a section of
:class:`~kvpool_sidecar.config.SidecarSettings`, loaded in :mod:`kvpool_sidecar.config`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexSettings:
    """The block index: ``memory`` (single node) or ``redis`` (a pool of nodes)."""

    backend: str = "memory"
    #: ``redis://host:port/db`` or ``rediss://`` for TLS; credentials may be in the URL.
    url: str | None = None
    #: File holding the Redis password (AUTH), e.g. a mounted Secret.
    password_file: str | None = None
    #: Talk to a Redis Cluster (keys spread over all slots).
    cluster: bool = False
    #: Seconds between heartbeats; a node is dead after three missed ones.
    heartbeat_s: float = 2.0
    #: Seconds between sweeps of dead nodes' entries.
    sweep_s: float = 10.0
    #: Deadline of one index call.
    timeout_s: float = 1.0
    #: How long lookups trust their list of live nodes: a node whose record expired within
    #: this long may still be named (a fetch from it is a miss). 0: every lookup reads the
    #: node records again, in the same round trip. See docs/redis-schema.md.
    lookup_cache_s: float = 1.0


@dataclass(frozen=True)
class PeerSettings:
    """Block transfers between the sidecars of a pool."""

    enabled: bool = False
    #: Address the peer port binds to (never all interfaces unless asked: ``0.0.0.0``).
    host: str = "127.0.0.1"
    #: The peer port; the same default as the CRD's ``spec.transport.port`` (9467, next to
    #: the HTTP port 9466).
    port: int = 9467
    #: ``host:port`` that other sidecars use to reach this one (default ``host:port``).
    advertise: str | None = None
    #: ``tcp`` or ``rdma`` (the Mooncake Transfer Engine: RDMA where NICs exist; falls back
    #: to tcp when it is not installed or cannot start). ``mooncake`` is read as ``rdma``.
    transport: str = "tcp"
    #: File holding the pool's shared secret (at least 16 bytes).
    token_file: str | None = None
    #: Deadline of one remote fetch; past it the blocks are misses.
    fetch_timeout_s: float = 2.0
    #: Deadline of the peers' part of a ``LOOKUP`` (the index lookup and the node records;
    #: never more than ``fetch_timeout_s``): past it the answer is the local prefix alone.
    #: Under the engines' own lookup timeout (1 s in the vLLM and SGLang connectors), so that
    #: a slow or hung index is a local answer there, not a lookup that times out and drops
    #: the engine's connection to the sidecar.
    lookup_timeout_s: float = 0.25
    #: Connections this node opens to one peer at most, shared by all its fetches from that
    #: peer (positive; default 4).
    connections_per_peer: int = 4
    #: Send payloads with ``sendfile`` from the arena's memfd instead of ``send`` from its
    #: mapping. Both skip user-space copies; ``sendfile`` hands the NIC 4 KiB shmem pages,
    #: which on loopback and veth measured 0.65-0.98x of ``send`` (the receiver copies
    #: page by page). Worth trying only on NICs with scatter-gather offload.
    sendfile: bool = False
    #: Hash what a fetch receives (its checksum and MAC) on a second thread while the first
    #: takes the next bytes off the socket. Null (the default): on where the sidecar may use
    #: 4 CPUs or more (its affinity mask, or its CPU quota where lower); on fewer, the two
    #: threads only take turns.
    pipelined_receive: bool | None = None
