"""The sidecar's error hierarchy.

Library errors are translated at the boundary (``raise TierIOError(...) from e``). Every
error that can reach a client has a stable ``code`` that travels on the wire.
"""

from __future__ import annotations

import os


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""

    code = "internal"


class ConfigError(SidecarError, ValueError):
    """The settings are invalid; raised at start-up, never at run time."""

    code = "config"


class RequestError(SidecarError):
    """A client request is malformed or names things that do not exist."""

    code = "bad_request"


class BlockTooLargeError(RequestError):
    """A block is larger than the largest block any tier accepts."""

    code = "too_large"


class UnknownLeaseError(RequestError):
    """A commit, abort or release names a lease this session does not hold."""

    code = "unknown_lease"


class UnavailableError(SidecarError):
    """The sidecar cannot take this request now (a limit on open connections); retry later."""

    code = "unavailable"


class QuotaError(SidecarError):
    """A tenant is at its quota and none of its own blocks can be evicted."""

    code = "quota"


class TierError(SidecarError):
    """A tier could not do what it was asked."""

    code = "tier"


class TierFullError(TierError):
    """No room in a tier even after eviction (everything left is pinned)."""

    code = "full"


class UnknownSpaceError(TierFullError):
    """A block of a tenant that no key space of this node names (left on disk by a tenant
    since removed from the config, say) has no arena here: its bytes would land in another
    space's arena, readable by that space's clients. No room for it, whatever is free."""


class NoCleanRoomError(TierFullError):
    """No room in the host tier without waiting for a disk write: nothing free, and the
    coldest evictable block is not copied down yet (the write-ahead is behind). A put
    answers FULL at once rather than wait (``dram.put_waits_for_disk``)."""


class TierIOError(TierError):
    """The disk tier hit an I/O error: disk full, missing directory, EIO."""

    code = "io"


class CorruptBlockError(TierError):
    """A block's bytes do not match its recorded checksum, or its file is torn."""

    code = "corrupt"


class IndexUnavailableError(SidecarError):
    """The index (Redis) could not be reached, refused us, or missed its deadline."""

    code = "index"


class IndexDataError(IndexUnavailableError):
    """The index answered, with a value no pool member writes (not UTF-8): the call that read
    it fails, and the index is not taken for down (:class:`~kvpool_sidecar.indexwatch.IndexWatch`)."""


class EventPublishError(SidecarError):
    """The KV-event sockets could not be opened (an address in use, a bad address)."""

    code = "kv_events"


def os_reason(e: OSError) -> str:
    """The reason an OSError gives, once, for a message that names the address or path
    itself (uvloop's messages repeat the address; a resolver's error has no errno)."""
    return os.strerror(e.errno) if e.errno is not None and e.errno > 0 else e.strerror or str(e)
