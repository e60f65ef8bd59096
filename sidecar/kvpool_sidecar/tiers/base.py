"""What every tier shares: tier names, the record a block carries between tiers, and the
:class:`Tier` protocol through which the store reaches a tier's bytes.

The store (:mod:`kvpool_sidecar.store`) keeps an ordered list of tiers, hottest first
(GPU memory, DRAM, NVMe). It knows each one only through :class:`Tier`: room
(:meth:`Tier.reserve`, :meth:`Tier.release`), bytes (:meth:`Tier.write_copy`,
:meth:`Tier.read_copy`) and sizes. Where a tier keeps a block is its own business: a
:data:`Place` is whatever the tier handed out at :meth:`Tier.reserve` (page extents in
memory tiers, the block's key in the disk tier), and the store only hands it back.

Every copy is checked: ``write_copy`` refuses source bytes that do not match the record's
checksum and ``read_copy`` refuses bytes read back that do not (both with
:class:`~kvpool_sidecar.errors.CorruptBlockError`), except in tiers that keep accounts
only (the trace replay), which hold no bytes at all.
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvpool_sidecar.errors import CorruptBlockError, TierFullError, TierIOError


class TierKind(str, enum.Enum):
    """Tiers from hottest to coldest."""

    GPU = "gpu"
    DRAM = "dram"
    DISK = "disk"

    @property
    def rank(self) -> int:
        """0 for the hottest tier; used to order holders and promotions."""
        return _RANK[self]


_RANK = {TierKind.GPU: 0, TierKind.DRAM: 1, TierKind.DISK: 2}


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """The identity and integrity of one block's payload, the same in every tier.

    ``key`` is the 48-byte raw :class:`kvpool_client.keys.BlockKey`; ``checksum`` is the
    xxh3-64 of the payload (:mod:`kvpool_client.integrity`) fixed when the block was first
    committed; ``tenant`` names the owner whose quota the block counts against.
    """

    key: bytes
    size: int
    checksum: int
    tenant: str = "default"


#: Where a tier keeps one block: opaque to everyone but the tier that handed it out (each
#: tier types its own: page extents, a key).
Place = Any

#: What a batch write answers per block: None when written, else the error that kept it out.
WriteResult = None | CorruptBlockError | TierFullError | TierIOError

#: The errors of an OS call that say the device could not give back what it held (a bad
#: sector, a device gone, a filesystem that found its own structures damaged): not those
#: that say the system lacked something for the moment (EMFILE, ENOMEM, ENOSPC, EAGAIN),
#: which say nothing about the block.
DEVICE_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.ENOMEDIUM, errno.EREMOTEIO,
                           errno.EUCLEAN, errno.EBADMSG})


def device_failed(err: BaseException) -> bool:
    """Whether ``err`` (a TierIOError, raised ``from`` the OSError behind it as the disk tiers
    raise theirs) is the device's failure to read back what it held (:data:`DEVICE_ERRNOS`)."""
    cause = err.__cause__
    return isinstance(cause, OSError) and cause.errno in DEVICE_ERRNOS


@runtime_checkable
class Forgetting(Protocol):
    """A tier that can lose blocks by itself (a segment file deleted under it, its directory
    removed while it runs): the store asks after each copy into or out of it, and drops its
    record of those copies (they had stayed listed, counted and offered until a read of each
    missed)."""

    def forgotten(self) -> list[bytes]:
        """The keys of the blocks lost since the last call (each once; a block written under
        one of them since is held: :meth:`contains`)."""
        ...

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds a block under ``key``."""
        ...


@runtime_checkable
class Detaching(Protocol):
    """A tier whose releases block (``release_blocks``: a hole to punch, a file to unlink)
    splits them in two, so that the store forgets a block's copy at once and frees its room
    in a thread."""

    def detach(self, place: Place) -> Callable[[], None] | None:
        """Forget the block at ``place`` now (cheap, no I/O): a block written under its key
        from here on is another one, which the call returned never touches. That call frees
        the forgotten block's room (blocking, thread-safe; TierIOError where its bytes
        linger). None when the tier holds no block there."""
        ...


@runtime_checkable
class Tier(Protocol):
    """One tier of the store (see the module docstring)."""

    kind: TierKind
    #: Whether its copies block (disk I/O, device copies): the store runs them in a thread.
    blocking: bool
    #: Whether giving a block's room back blocks (a file to unlink, a hole to punch): the
    #: store then does it in a thread. Freeing pages of memory, on a device or not, does not.
    release_blocks: bool

    @property
    def accounts_only(self) -> bool:
        """Whether it keeps accounts only (no bytes: the trace replay)."""
        ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def free_bytes(self) -> int: ...

    def footprint(self, size: int, tenant: str | None = None) -> int:
        """Bytes of this tier a block of ``size`` payload bytes takes (``tenant``: its owner)."""
        ...

    def reserve(self, record: BlockRecord) -> Place | None:
        """Room for the block (its bytes still to be written), or None when there is none now."""
        ...

    def release(self, place: Place) -> None:
        """Give a block's room back; its bytes are gone (TierIOError: they may linger)."""
        ...

    def write_copy(self, place: Place, record: BlockRecord, src: Sequence[memoryview]) -> None:
        """Fill reserved room with the block's bytes, checked against ``record``."""
        ...

    def write_copies(self, items: Sequence[tuple[Place, BlockRecord, Sequence[memoryview]]]
                     ) -> list[WriteResult]:
        """Several :meth:`write_copy` s, as cheaply as the tier can (one sync for a batch)."""
        ...

    def read_copy(self, place: Place, record: BlockRecord, dest: Sequence[memoryview]) -> None:
        """Copy the block's bytes into ``dest`` (laid end to end), checked against ``record``."""
        ...

    def read_cached(self, place: Place, record: BlockRecord, dest: Sequence[memoryview]) -> bool:
        """:meth:`read_copy` where it needs no wait on a device (a disk tier: bytes in the
        page cache), so the store may run it on its event loop instead of a thread: True when
        copied and checked; False when it would wait, and then ``dest`` holds nothing of
        use (a thread then runs :meth:`read_copy`). Raises as :meth:`read_copy`."""
        ...

    def views(self, place: Place) -> list[memoryview] | None:
        """The block's bytes in place, where they are host memory (else None)."""
        ...

    def prefetch(self, places: Sequence[Place]) -> int:
        """A hint that these blocks are about to be read; how many were hinted (0 where
        it does not help)."""
        ...

    def recover(self) -> list[tuple[BlockRecord, Place]]:
        """The blocks a previous run left in this tier (a warm restart; [] for memory)."""
        ...

    def close(self) -> None: ...


def write_each(tier: Tier, items: Sequence[tuple[Place, BlockRecord, Sequence[memoryview]]]
               ) -> list[WriteResult]:
    """:meth:`Tier.write_copies` for a tier with no cheaper batch: one write after another."""
    out: list[WriteResult] = []
    for place, record, src in items:
        try:
            tier.write_copy(place, record, src)
        except (CorruptBlockError, TierFullError, TierIOError) as e:
            out.append(e)
        else:
            out.append(None)
    return out


def scatter(src: memoryview, dest: Sequence[memoryview]) -> None:
    """Copy the bytes of ``src`` into ``dest`` laid end to end (sizes must add up)."""
    pos = 0
    for d in dest:
        d[:] = src[pos : pos + d.nbytes]
        pos += d.nbytes


@runtime_checkable
class DeviceTier(Tier, Protocol):
    """A tier in device memory that a local engine on the same device may read in place
    (the GPU tier, through CUDA IPC)."""

    def ipc_descriptor(self, place: Place) -> dict[str, Any]:
        """What a local engine needs to open the block's bytes in place: plain values only
        (:func:`kvpool_client.cudaipc.open_descriptor` reads it)."""
        ...


@runtime_checkable
class HostTier(Tier, Protocol):
    """The tier local clients map and peers read in place (DRAM): host memory in shared
    arenas, one per key space (see :mod:`kvpool_sidecar.tiers.dram`)."""

    #: The shared arenas (``SharedArena``); empty when the tier keeps accounts only.
    arenas: list[Any]

    def arena_of(self, tenant: str) -> int:
        """The index of the arena that holds ``tenant``'s blocks."""
        ...

    def file_extents(self, place: Place) -> tuple[Any, list[tuple[int, int]]]:
        """The arena holding a block, and the block's extents as offsets in it."""
        ...

    @property
    def fragments(self) -> int: ...
