"""The sidecar's settings of its KV events for KV-aware routers (``kv_events``): a section of
:class:`~kvpool_sidecar.config.SidecarSettings`, loaded in :mod:`kvpool_sidecar.config`.
"""

from __future__ import annotations

from dataclasses import dataclass


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
