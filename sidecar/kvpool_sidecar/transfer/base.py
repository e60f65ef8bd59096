"""The peer transport interface: how one sidecar serves and fetches blocks of another.

A transport moves bytes between two sidecars' DRAM arenas and nothing else: the store
decides what to fetch and from whom (the index), where the bytes land (``BlockSink``) and
which bytes may leave (``BlockSource``). Every transport verifies each block's checksum
before the sink commits it, so a peer that sends wrong bytes produces a miss, never data.
"""

from __future__ import annotations

import errno
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol


class PeerError(Exception):
    """A peer could not be reached, refused us, broke the protocol or missed its deadline."""

    code = "peer"


class PeerAuthError(PeerError):
    """The peer did not prove it holds the pool's secret (or rejected ours)."""

    code = "peer_auth"


class LocalTransferError(PeerError):
    """This node could not do its part of a transfer (an arena it cannot register, the
    transport closing): a miss, and no fault of the peer's (:func:`blames_peer`)."""

    code = "peer_local"


#: What an ``OSError`` of a fetch says of this node, not of its peer: out of descriptors,
#: buffers, memory or local ports.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})


def blames_peer(e: BaseException) -> bool:
    """Whether a fetch that ended in ``e`` failed for its peer's sake (:meth:`Transport.failing`):
    not when it ran out of time, nor when this node lacked something of its own (a reader
    that backed off every holder it met while this node was out of descriptors would turn a
    local shortage into skipped holders for up to a minute after it ends)."""
    if isinstance(e, (TimeoutError, LocalTransferError)):
        return False
    return not (isinstance(e, OSError) and e.errno in LOCAL_ERRNOS)


@dataclass(frozen=True, slots=True)
class OutgoingBlock:
    """A block a source lends to the transport while it is sent."""

    key: bytes
    size: int
    checksum: int
    tenant: str
    views: list[memoryview]
    #: Offsets into the arena file ``fd`` (for zero-copy ``sendfile``), parallel to ``views``.
    extents: list[tuple[int, int]]
    lease: object
    #: The descriptor of the arena holding the block (None: send from ``views``).
    fd: int | None = None


class BlockSource(Protocol):
    """What a transport's server side reads from (the local store)."""

    async def lend(self, keys: Sequence[bytes]) -> list[OutgoingBlock | None]:
        """Pin and describe each held block (None for a miss). A transport asks for each key
        once (:func:`lend_once`). A lend that raises, or is cancelled (its answer's deadline),
        gives back what it pinned."""

    def give_back(self, blocks: Sequence[OutgoingBlock]) -> None:
        """Release what :meth:`lend` pinned."""


class BlockSink(Protocol):
    """Where a transport's client side writes fetched blocks (the local store)."""

    async def reserve(self, key: bytes, size: int, tenant: str, *, depth: int = -1,
                      parent: bytes | None = None) -> tuple[object, list[memoryview]] | None:
        """Room for ``size`` bytes of ``key`` owned by ``tenant`` (a lease and its views), or None.

        ``depth`` and ``parent`` place the block in its chain (a fetch asks for consecutive
        blocks of one prefix), so the eviction policy shortens the chain from its leaf.
        """

    def commit(self, lease: object, checksum: int) -> None:
        """The bytes are in place and verified: make the block visible."""

    def abort(self, lease: object) -> None:
        """Give the room back (the transfer failed or the checksum did not match)."""


async def lend_once(source: BlockSource, keys: Sequence[bytes]) -> list[OutgoingBlock | None]:
    """What a peer's request of ``keys`` is answered: each distinct key lent once, at its first
    place; a later copy of a key in the same request is answered as not held (None).

    A request naming one block 4,096 times had it lent (a read lease each) and sent 4,096
    times: megabytes asked for became gigabytes on the wire, and the copies filled the
    lending account, so other nodes' fetches from this one missed. An honest node asks for
    each block once, so it loses nothing; a node of an older version that repeats a key gets
    the block once, at its first place, and misses the copies."""
    first: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    if len(first) == len(keys):
        return await source.lend(keys)
    out: list[OutgoingBlock | None] = [None] * len(keys)
    for i, block in zip(first.values(), await source.lend(list(first))):
        out[i] = block
    return out


class Transport(Protocol):
    """Serve local blocks to peers and fetch theirs."""

    name: str
    #: The most keys one :meth:`fetch` may ask for (a peer refuses a longer request whole).
    max_keys: int
    #: Fetches from one peer that run at once (more wait for one of them to end).
    connections_per_peer: int

    async def start(self, source: BlockSource) -> str:
        """Start serving; returns the address peers should use (``host:port``)."""

    async def fetch(self, address: str, keys: Sequence[bytes], sink: BlockSink, timeout: float) -> list[bool]:
        """Fetch ``keys`` from the peer at ``address`` into ``sink``; True per stored block.

        Never raises for a slow, dead or lying peer: those blocks come back False.
        """

    def failing(self, address: str) -> bool:
        """Whether the last fetch from ``address`` ended in an error before its time ran out:
        no connection (refused, reset), a handshake that failed (another pool's secret or
        protocol version), an answer malformed or not authenticated. Such a holder is down or
        not one of the pool's, not merely without the blocks (an answer that lacks them is no
        error), and a reader skips it for a while (:class:`~kvpool_sidecar.peers.PeerReader`).
        A fetch that ran out of time is not one: the reader judges those by the time they took;
        nor is one that failed for want of something of this node's own (:func:`blames_peer`)."""

    def forget(self, keep: Collection[str]) -> int:
        """Drop the connections and state kept for peer addresses not in ``keep``; how many
        addresses went."""

    async def close(self) -> None:
        """Stop serving and close every connection."""
