"""Mooncake Store's return codes, and what kvpool's outcomes and errors become.

The values are Mooncake's own (``mooncake-store/include/types.h``): code written for
Mooncake compares against the same numbers.
"""

from __future__ import annotations

import enum

from kvpool_client.errors import ConnectionLostError, DeadlineError, KVPoolError, ProtocolError, RemoteError
from kvpool_client.protocol import PutStatus


class ErrorCode(enum.IntEnum):
    """The subset of Mooncake's codes this API answers with."""

    OK = 0
    INTERNAL_ERROR = -1
    #: No room for the value (the pool is full of pinned or read blocks, the tenant is at its
    #: quota, the policy declined it, or one of its blocks is larger than the DRAM tier), or
    #: this process had no memory for what the call needed (a MemoryError).
    NO_AVAILABLE_HANDLE = -200
    #: Bad arguments: an empty key or value, lists of different lengths, a destination too
    #: small, a pointer range outside the registered buffers, a range past the value's end.
    INVALID_PARAMS = -600
    #: This client may not do that to the object: another tenant that shares the key space
    #: (``tenants[].key_space``) wrote it, so it may read it but not remove or replace it.
    #: Not worth retrying.
    ILLEGAL_CLIENT = -601
    #: What the pool holds under the key is not an object this API wrote.
    INVALID_READ = -701
    #: Another client is writing a block of the object under that key right now: nothing
    #: was stored (that write may yet fail). Try again.
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    #: The object cannot be removed right now (its head is being brought from disk, or could
    #: not be read to tell: see ``ObjectStore.remove``). Try again.
    OBJECT_HAS_LEASE = -706
    #: The pieces of a value do not add up to what its header says (never served).
    CHECKSUM_MISMATCH = -801
    #: The sidecar is gone, stuck past the deadline (of one call, or of the whole facade
    #: call's calls), or shutting down.
    RPC_FAIL = -900
    #: Called before ``setup`` or after ``close``.
    UNAVAILABLE_IN_CURRENT_STATUS = -1010


_REMOTE = {
    "bad_request": ErrorCode.INVALID_PARAMS,
    "too_large": ErrorCode.NO_AVAILABLE_HANDLE,
    "full": ErrorCode.NO_AVAILABLE_HANDLE,
    "quota": ErrorCode.NO_AVAILABLE_HANDLE,
    "corrupt": ErrorCode.CHECKSUM_MISMATCH,
    "unavailable": ErrorCode.RPC_FAIL,
}


def code_of(error: KVPoolError) -> ErrorCode:
    """The Mooncake code for a failed pool call."""
    if isinstance(error, (ConnectionLostError, ProtocolError, DeadlineError)):
        return ErrorCode.RPC_FAIL
    if isinstance(error, RemoteError):
        return _REMOTE.get(error.code, ErrorCode.INTERNAL_ERROR)
    return ErrorCode.INTERNAL_ERROR


def put_code(status: PutStatus) -> ErrorCode:
    """A block's put outcome as Mooncake reports a put (or an upsert): a key that already
    holds a value is a success that leaves the value as it is. A key another client is
    writing right now (PENDING) is not: that write may still fail and leave nothing, so the
    answer is REPLICA_IS_NOT_READY, Mooncake's code for an object whose replica is still
    being written. (Mooncake itself answers 0 there, a success for a value not yet stored;
    a caller that reads any other code as "not stored", as SGLang's does, is right here.)"""
    if status in (PutStatus.STORED, PutStatus.EXISTS):
        return ErrorCode.OK
    if status == PutStatus.PENDING:
        return ErrorCode.REPLICA_IS_NOT_READY
    return ErrorCode.NO_AVAILABLE_HANDLE
