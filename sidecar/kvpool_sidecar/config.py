"""The sidecar's settings: one typed object, loaded from a YAML file and ``KVPOOL_*`` env.

Of the daemon's modules this is the only one that reads configuration files or the
environment, with one exception: the Mooncake transport
(:mod:`kvpool_sidecar.transfer.mooncake`) reads ``KVPOOL_MOONCAKE_PROTOCOL`` and
``KVPOOL_MOONCAKE_DEVICE`` when it starts. The file is what the operator renders into the
pool's ConfigMap; a contract test checks that every rendering loads here. Sizes accept
integers (bytes) or Kubernetes quantities ("4Gi", "512Mi", "10G"). Invalid settings raise
:class:`ConfigError` naming the field.

Environment overrides (applied after the file):

``KVPOOL_NODE_NAME``, ``KVPOOL_SOCKET_PATH``, ``KVPOOL_DRAM_SIZE``, ``KVPOOL_DISK_PATH``,
``KVPOOL_DISK_SIZE``, ``KVPOOL_HTTP_PORT``, ``KVPOOL_TCP_PORT``, ``KVPOOL_LOG_LEVEL``,
``KVPOOL_PEER_HOST``, ``KVPOOL_PEER_ADVERTISE``, ``KVPOOL_REDIS_URL``.

Names from the ``KVCachePool`` CRD (what the operator renders into this file): a setting
has the same words in both, camelCase in the CRD and snake_case here, by these rules
(``tests/contract/test_operator_sidecar_config.py`` checks every field the operator
renders against them):

- sections: ``spec.tiers.dram|disk|gpu`` -> ``dram|disk|gpu``, ``spec.api`` -> ``api``,
  ``spec.transport`` -> ``peer``, ``spec.eviction`` -> ``policy``, ``spec.redis.external``
  (or the managed Redis) -> ``index``, ``spec.tenants[]`` -> ``tenants[]``, the rest of
  ``spec`` -> the top level;
- a field: camelCase -> snake_case; a size (a quantity) named ``size`` or ``...Size``
  takes ``bytes`` for ``size``: ``size`` -> ``size_bytes``, ``pageSize`` -> ``page_bytes``,
  ``maxBlockSize`` -> ``max_block_bytes``;
- values of enumerations are the same words (``transport.type: rdma`` -> ``peer.transport:
  rdma``), and defaults the same values (the peer port is 9467, the HTTP port 9466), except
  the GPU tier's: the CRD's ``spec.tiers.gpu.enabled`` defaults to false, the sidecar's
  ``gpu.enabled`` to true (on where it finds a GPU and torch with CUDA); the operator always
  renders ``gpu.enabled``, so a pool's sidecars follow the CRD;
- the exceptions, each because the value changes form: ``transport.type`` ->
  ``peer.transport``; ``eviction.policy`` -> ``policy.name``; ``api.socketDir`` ->
  ``api.socket_path`` (the directory joined with ``kvpool.sock``); a Secret reference
  (``auth.secretRef``, ``redis.external.passwordSecretRef``, ``tenants[].tokenSecret``) ->
  the file it is mounted as (``peer.token_file``, ``index.password_file``,
  ``tenants[].token_file``); ``tenants[].quota`` -> ``quota_bytes`` or, for a percentage,
  ``quota_share``; ``tiers.disk.enabled: false`` -> no ``disk.path``.

``kv_events`` (vLLM-format KV events for routers) comes from ``spec.kvEvents``: its port
becomes ``kv_events.endpoint`` (``tcp://*:PORT``), ``replayPort`` ``kv_events.replay_endpoint``
the same way, and ``connectTo`` (a router that listens) ``kv_events.endpoint`` with
``kv_events.connect``; ``routers`` is the pool's NetworkPolicy rule, not a setting.

Deprecated names, still read (each logs a warning naming the new one): ``block_max_bytes``
(now ``max_block_bytes``) and ``peer.transport: mooncake`` (now ``rdma``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpool_sidecar.configcheck import MAX_SIZE, check_settings
from kvpool_sidecar.errors import ConfigError

logger = logging.getLogger(__name__)

#: Old names still read, with a warning: setting -> (old name, new name).
DEPRECATED_NAMES = {"max_block_bytes": ("block_max_bytes", "max_block_bytes"),
                    "peer.transport": ("mooncake", "rdma")}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?|k|)\s*$")
_FACTORS = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}


def parse_size(value: object, field_name: str) -> int:
    """Bytes from an int or a Kubernetes quantity string; raises ConfigError.

    A size must fit in a signed 64-bit byte count (what mmap, ftruncate and the kernel
    take); a larger one is a ConfigError naming the field, not an OverflowError later.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a size, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _QUANTITY.match(value)
        if not m:
            raise ConfigError(f"{field_name}: {value!r} is not a size (e.g. 4Gi, 512Mi, 1000000)")
        try:
            size = int(float(m.group(1)) * _FACTORS[m.group(2)])
        except OverflowError:  # so many digits that the float is infinite
            size = MAX_SIZE + 1
    else:
        raise ConfigError(f"{field_name}: expected a size, got {type(value).__name__}")
    if size < 0:
        raise ConfigError(f"{field_name}: size must not be negative")
    if size > MAX_SIZE:
        raise ConfigError(f"{field_name}: {value!r} is too large (at most {MAX_SIZE} bytes)")
    return size


def _parse_share(value: str, field_name: str) -> float:
    """A fraction from ``"25%"`` or ``"0.25"``; raises ConfigError."""
    text = value.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(f"{field_name}: {value!r} is not a share (e.g. 25% or 0.25)") from None


@dataclass(frozen=True)
class DramSettings:
    """The shared-memory arena that local clients map."""

    #: Arena size in bytes (the DRAM tier's capacity).
    size_bytes: int = 1 << 30
    #: Allocation granule; a block takes whole pages, possibly in several extents.
    page_bytes: int = 64 << 10
    #: Touch every page at start-up so that the first puts do not pay page faults.
    populate: bool = True
    #: With a disk tier: the share of DRAM a background writer keeps free or already on
    #: disk (the coldest blocks are written ahead of need and stay in DRAM), so a put that
    #: needs room drops one of them at once instead of waiting for a disk write (and, for
    #: the next puts, the clean ones right after it in the eviction order, up to eight times
    #: its own room in all; a clean block past one not yet written stays).
    #: The writer wakes once puts took a quarter of that share (at most 16 MiB) since its last
    #: pass, or when a put is about to wait for a disk write. 0: write blocks to disk only
    #: when they are evicted.
    clean_share: float = 0.1
    #: With ``clean_share`` above 0 and a disk tier: false (the default), a put that finds
    #: no room free or already on disk (puts came faster than the disk writes) is answered
    #: FULL for that block and the rest of its chain at once, and the writer is woken; its
    #: blocks stored before that stay. An engine never waits on a disk write: it recomputes
    #: or puts again later. true: the put waits for the coldest block's copy to disk. While
    #: the writer's last pass could write nothing (a failing disk, or one with no room it
    #: can make) puts wait, as with true; so do a block larger than the clean share, a
    #: tenant at its quota (for its own block's copy) and a block fetched from a peer for a
    #: reader.
    put_waits_for_disk: bool = False


@dataclass(frozen=True)
class DiskSettings:
    """The NVMe tier; survives sidecar restarts."""

    #: Directory for block files; ``None`` disables the tier.
    path: str | None = None
    size_bytes: int = 0
    #: ``always``: fsync every file and its directory before it counts as written;
    #: ``never``: leave flushing to the kernel (a crash may lose, never tear, blocks).
    fsync: str = "never"
    #: ``none`` or ``zstd`` (lossless; a byte-shuffle filter helps 16-bit KV).
    compression: str = "none"
    #: The zstd level with ``compression: zstd``, 1..22 (higher: more CPU per write for
    #: smaller records); default 1.
    compression_level: int = 1
    #: ``segments``: blocks appended to a few large files, freed by punching holes
    #: (tiers/segments.py); ``files``: one file per block (tiers/disk.py), the layout of
    #: earlier versions. A tier reads only its own layout's blocks.
    layout: str = "segments"
    #: The least of the tier's size a block is charged (its tenant's share of the tier
    #: included), and so at most ``size_bytes`` over it blocks held: the sidecar keeps about
    #: 2 KB of memory for each block it holds, and a block of a few bytes takes a 4 KiB
    #: record, so a tenant putting tiny blocks could make it keep 40-50% of the tier's size
    #: in memory. ``None`` (the default): the DRAM tier's page (``dram.page_bytes``), as
    #: the DRAM tier charges; 0: no least (what a record takes).
    min_block_bytes: int | None = None


@dataclass(frozen=True)
class GpuSettings:
    """The GPU tier (needs torch with CUDA); sized from pynvml when ``size_bytes`` is 0.

    On by default where the node has an NVIDIA GPU the sidecar can see and torch with CUDA:
    elsewhere it stays off without a word beyond one log line.
    """

    enabled: bool = True
    #: The CUDA device index (``cuda:N``) that holds the tier; default 0. A device the
    #: sidecar cannot see leaves the tier off, with a warning.
    device: int = 0
    size_bytes: int = 0
    #: Fraction of the device's free memory to take when ``size_bytes`` is 0 (the rest is
    #: the engine's).
    fraction: float = 0.1
    #: Reads of a DRAM block after which it is copied up into the GPU tier.
    promote_after_hits: int = 2
    #: The share of the device's total memory the tier always leaves free for engines:
    #: vLLM takes 0.9 of it by default (``gpu_memory_utilization``) and needs its CUDA
    #: context on top. The tier shrinks to fit, or stays off; ``size_bytes`` too is capped.
    engine_reserve: float = 0.95


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
    #: Largest control frame a client may send.
    max_frame_bytes: int = 64 << 20
    #: Most keys in one batched request.
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


@dataclass(frozen=True)
class TenantSettings:
    """A tenant: higher ``priority`` blocks are evicted last; a quota caps its DRAM use.

    The quota is either ``quota_bytes`` or ``quota_share``, a fraction (0, 1] of this node's
    DRAM tier; at most one of the two. Unset: no cap beyond the tier itself.

    Tenants never see each other's blocks unless they name the same ``key_space`` (by
    default each tenant is its own space); see :mod:`kvpool_sidecar.tenancy`.
    """

    name: str
    priority: int = 0
    quota_bytes: int | None = None
    quota_share: float | None = None
    key_space: str | None = None
    #: Who may act as this tenant; any one rule admits a client. ``uids`` / ``gids``: a
    #: client on the Unix socket whose user or primary group (the kernel's SO_PEERCRED, not
    #: a claim) is listed. ``token_file``: a client presenting the secret in this file (at
    #: least 16 bytes; e.g. a Kubernetes Secret mounted into the serving pod). A tenant with
    #: no rule is open to every process that can open the socket (``api.socket_mode``) and
    #: to no client over TCP, which always needs a token.
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    token_file: str | None = None

    @property
    def space(self) -> str:
        return self.key_space or self.name

    def quota(self, dram_bytes: int) -> int | None:
        """The tenant's cap in bytes on a DRAM tier of ``dram_bytes``."""
        if self.quota_share is not None:
            return max(1, int(self.quota_share * dram_bytes))
        return self.quota_bytes


@dataclass(frozen=True)
class PolicySettings:
    """Which eviction policy runs, and its knobs."""

    #: ``prefix`` (prefix-aware; follows ARC's order, plain recency or an order learned from
    #: the blocks' classes and the writers' hints, whichever has had more hits lately on
    #: shadow caches that follow a sample of the blocks: with the learning state, about 250
    #: bytes per resident block; see the policy package, duel.py and reuse.py), ``prefix-arc``,
    #: ``prefix-recency`` or ``prefix-learned`` (one order, no shadows: for very many small
    #: blocks), ``prefix-nolearn`` (the duel of ARC and recency without learning, on shadows
    #: of every block: about 2 KB per resident block), or ``lru``.
    name: str = "prefix"
    #: Demote DRAM victims to disk instead of dropping them (when a disk tier exists).
    #: Disk hits are always promoted back into DRAM (clients read from the arena).
    demote: bool = True


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


@dataclass(frozen=True)
class KvEventsSettings:
    """vLLM-format KV events for KV-aware routers (:mod:`kvpool_sidecar.kvevents`).

    Off by default. Every subscriber of ``endpoint`` (and every client of
    ``replay_endpoint``) learns the token ids of the announced tenants' prompts: see
    docs/security.md before binding anything but 127.0.0.1.
    """

    enabled: bool = False
    #: The ZMQ PUB socket: bound (``tcp://127.0.0.1:5557``: this host only; ``tcp://*:5557``:
    #: every interface; port 0 or ``*``: any free port), or, with ``connect``, connected to
    #: a subscriber that binds (a central router).
    endpoint: str = "tcp://127.0.0.1:5557"
    connect: bool = False
    #: A bound ZMQ ROUTER socket that resends missed batches (vLLM's replay protocol);
    #: ``None``: no replay.
    replay_endpoint: str | None = None
    #: The first frame of every message; ``{node}`` becomes this node's name.
    topic: str = ""
    #: Batches kept for replay, and at most this many bytes of them.
    buffer_steps: int = 10_000
    buffer_bytes: int = 64 << 20
    #: ``tagged`` (vLLM's current encoding) or ``array`` (the older one, for consumers that
    #: still decode it).
    encoding: str = "tagged"
    #: Events waiting for the publisher; past it events are dropped and counted, and the
    #: whole state is announced again (AllBlocksCleared, then every block).
    queue_size: int = 100_000
    #: ZMQ send high-water mark of the PUB socket, in messages (batches of up to 1,024
    #: events and 256 KiB) per subscriber: what a subscriber that stops reading makes the
    #: sidecar hold (past it, that subscriber misses batches, sees the gap and asks the
    #: replay socket). 256 batches are at most 64 MiB; 100,000 had let one subscriber that
    #: never read hold gigabytes.
    hwm: int = 256
    #: The tenants whose blocks are announced; empty: every tenant.
    tenants: tuple[str, ...] = ()


@dataclass(frozen=True)
class SidecarSettings:
    """Everything the sidecar is configured with."""

    #: This node's name in the pool's index and in its node record (not empty); default the
    #: host name.
    node_name: str = field(default_factory=socket.gethostname)
    #: The pool's name in the index: the sidecars of one pool share it (with the redis index:
    #: letters, digits, '.', '_' and '-'; the operator renders ``<namespace>.<name>``);
    #: default ``default``.
    pool: str = "default"
    #: The largest block a client may put (the CRD's ``spec.maxBlockSize``); formerly
    #: ``block_max_bytes``, which is still read.
    max_block_bytes: int = 256 << 20
    dram: DramSettings = DramSettings()
    disk: DiskSettings = DiskSettings()
    gpu: GpuSettings = GpuSettings()
    api: ApiSettings = ApiSettings()
    policy: PolicySettings = PolicySettings()
    index: IndexSettings = IndexSettings()
    peer: PeerSettings = PeerSettings()
    kv_events: KvEventsSettings = KvEventsSettings()
    tenants: tuple[TenantSettings, ...] = (TenantSettings("default"),)
    #: The sidecar's logging level: DEBUG, INFO, WARNING or ERROR (any case); default INFO.
    log_level: str = "INFO"
    #: Freeze the objects that outlive a full garbage collection, so the next one walks
    #: only those made since (:mod:`kvpool_sidecar.collector`); false: Python's collector
    #: as it is, which walks every object the sidecar holds (half a second at 300,000 blocks).
    gc_freeze: bool = True
    #: Seconds between the collections of everything frozen (cycles among frozen objects
    #: wait for it; it pauses the sidecar as long as a full collection of its whole heap);
    #: 0: never.
    gc_reclaim_interval_s: float = 3600.0

    def tenant(self, name: str) -> TenantSettings | None:
        for t in self.tenants:
            if t.name == name:
                return t
        return None


_SIZE_FIELDS = {"size_bytes", "page_bytes", "max_frame_bytes", "max_unread_bytes", "quota_bytes", "max_block_bytes", "buffer_bytes",
                "min_block_bytes"}


def tenant_connection_cap(s: SidecarSettings) -> int:
    """The open local connections one tenant may hold: ``api.max_connections_per_tenant``,
    or its default (three quarters of ``api.max_connections`` where the node has several
    tenants, else all of them)."""
    if s.api.max_connections_per_tenant is not None:
        return s.api.max_connections_per_tenant
    if len(s.tenants) > 1:
        return max(1, s.api.max_connections * 3 // 4)
    return s.api.max_connections


def tenant_connection_reserve(s: SidecarSettings) -> int:
    """The slots kept for each tenant until it holds them: ``api.reserved_connections_per_tenant``,
    or its default (``api.max_connections`` over twice the tenants where the node has
    several, else none)."""
    if s.api.reserved_connections_per_tenant is not None:
        return s.api.reserved_connections_per_tenant
    if len(s.tenants) > 1:
        return s.api.max_connections // (2 * len(s.tenants))
    return 0


def read_secret(path: str | os.PathLike[str], field_path: str) -> bytes:
    """A secret from a file (a mounted Secret): at least 16 bytes once whitespace is stripped."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{field_path}: cannot read {path}: {e.strerror}") from e
    if len(secret) < 16:
        raise ConfigError(f"{field_path}: the token in {path} is shorter than 16 bytes")
    return secret


def _build(cls: type[Any], data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise ConfigError(f"{where or 'settings'}: unknown setting(s) {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        if name in _SIZE_FIELDS and value is not None:
            value = parse_size(value, path)
        elif name == "quota_share" and isinstance(value, str):
            value = _parse_share(value, path)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or 'settings'}: {e}") from e


def validate(s: SidecarSettings) -> None:
    """Raise ConfigError for any setting of the wrong type, out of range or inconsistent
    with another (the rules are in :mod:`~kvpool_sidecar.configcheck`)."""
    check_settings(s)


def _renamed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with deprecated names replaced by their new ones, each with a warning."""
    old, new = DEPRECATED_NAMES["max_block_bytes"]
    if old in data:
        if new in data:
            raise ConfigError(f"{old}: deprecated name of {new}; give only {new}")
        logger.warning("config: %s is deprecated; use %s", old, new)
        data[new] = data.pop(old)
    peer = data.get("peer")
    old, new = DEPRECATED_NAMES["peer.transport"]
    if isinstance(peer, Mapping) and peer.get("transport") == old:
        logger.warning("config: peer.transport %r is deprecated; use %r", old, new)
        data["peer"] = {**peer, "transport": new}
    return data


def settings_from_mapping(data: Mapping[str, Any]) -> SidecarSettings:
    """Build and validate settings from a parsed config file."""
    if not isinstance(data, Mapping):
        raise ConfigError("config: top level must be a mapping")
    data = _renamed(dict(data))
    sections = {
        "dram": DramSettings, "disk": DiskSettings, "gpu": GpuSettings, "api": ApiSettings,
        "policy": PolicySettings, "index": IndexSettings, "peer": PeerSettings, "kv_events": KvEventsSettings,
    }
    kwargs: dict[str, Any] = {}
    for name, cls in sections.items():
        if name in data:
            kwargs[name] = _build(cls, data.pop(name) or {}, name)
    if "tenants" in data:
        raw = data.pop("tenants")
        if not isinstance(raw, list):
            raise ConfigError("tenants: expected a list")
        kwargs["tenants"] = tuple(_build(TenantSettings, t, f"tenants[{i}]") for i, t in enumerate(raw))
    top = _build(SidecarSettings, data, "")
    settings: SidecarSettings = dataclasses.replace(top, **kwargs)
    validate(settings)
    return settings


_ENV = {
    "KVPOOL_NODE_NAME": ("node_name", None),
    "KVPOOL_LOG_LEVEL": ("log_level", None),
    "KVPOOL_SOCKET_PATH": ("socket_path", "api"),
    "KVPOOL_TCP_PORT": ("tcp_port", "api"),
    "KVPOOL_HTTP_PORT": ("http_port", "api"),
    "KVPOOL_DRAM_SIZE": ("size_bytes", "dram"),
    "KVPOOL_DISK_PATH": ("path", "disk"),
    "KVPOOL_DISK_SIZE": ("size_bytes", "disk"),
    "KVPOOL_PEER_HOST": ("host", "peer"),
    "KVPOOL_PEER_ADVERTISE": ("advertise", "peer"),
    "KVPOOL_REDIS_URL": ("url", "index"),
}


def load_settings(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> SidecarSettings:
    """Load the config file at ``path`` (optional), apply ``KVPOOL_*`` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        if loaded is not None:
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {path}: top level must be a mapping")
            data = loaded
    env = os.environ if env is None else env
    for var, (name, section) in _ENV.items():
        if var not in env:
            continue
        raw: Any = env[var]
        if name.endswith("port"):
            try:
                raw = int(raw)
            except ValueError as e:
                raise ConfigError(f"{var}: expected a port number, got {raw!r}") from e
        target = data if section is None else data.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: expected a mapping")
        target[name] = raw
    return settings_from_mapping(data)
