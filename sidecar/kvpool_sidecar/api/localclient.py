"""The client at the other end of one local connection, as its requests see it.

What HELLO establishes and every later request reads: the connection's store session (and
so its tenant, whose key space the client's keys are scoped to), the protocol version it
said hello with, and whether and which arena it maps (offsets in answers are in that arena).
One :class:`LocalClient` per connection, shared by the connection and its request handlers
(:mod:`kvpool_sidecar.api.admission`, :mod:`kvpool_sidecar.api.reads`,
:mod:`kvpool_sidecar.api.writes`).
"""

from __future__ import annotations

import logging

from kvpool_sidecar.api.limits import LocalLimits
from kvpool_sidecar.errors import RequestError
from kvpool_sidecar.ratelog import warn_once
from kvpool_sidecar.store import Session, TieredStore

logger = logging.getLogger(__name__)


class LocalClient:
    """One connection's client: its session, protocol version and arena."""

    def __init__(self, store: TieredStore, limits: LocalLimits, *, shm: bool) -> None:
        self.store = store
        self.limits = limits
        #: Whether this client maps an arena: False over TCP; once HELLO is answered, whether
        #: the arena's descriptor was sent to it.
        self.shm = shm
        #: The index of the arena this client maps (its tenant's key space's); -1: none.
        self.arena = -1
        #: The protocol version this client said hello with.
        self.version = 0
        #: Opened at its first admitted HELLO, closed (its leases and pins released) when it goes.
        self.session: Session | None = None

    @property
    def active_session(self) -> Session:
        if self.session is None:
            raise RequestError("connection is closing")
        return self.session

    def scoped(self, keys: list[bytes]) -> list[bytes]:
        """The store keys of this client's keys, in its tenant's key space."""
        return self.limits.spaces.scoped(self.active_session.tenant, keys)

    def scoped_parent(self, parent: bytes | None) -> bytes | None:
        return None if parent is None else self.scoped([parent])[0]

    def mapped(self, extents: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
        """A block's extents as offsets in this client's arena (None: it lies in another)."""
        return self.store.host.offsets(extents, self.arena)

    def need_shm(self) -> None:
        if not self.shm or not self.store.host.keeps_payloads:
            raise RequestError("this connection has no shared arena; use the inline operations")

    def device_reads(self, *, quiet: bool = False) -> bool:
        """Whether this connection may read GPU-tier copies in place. A descriptor opens the
        GPU tier's whole buffer, every tenant's blocks in it, for reading and writing: only
        a client that maps the one arena of a node with a single key space (and so reaches
        every block already) gets one."""
        if not self.store.device_reads:
            return False
        if self.store.host.arena_count > 1:
            if not quiet:
                warn_once(logger, "device-spaces", "GPU-tier reads answered as misses: this node keeps %d key "
                          "spaces (a CUDA IPC descriptor would open all of them)", self.store.host.arena_count)
            return False
        if not self.shm:
            if not quiet:
                warn_once(logger, "device-no-arena", "GPU-tier reads answered as misses for clients that map no "
                          "arena (TCP, or api.shared_arena: never)")
            return False
        return True
