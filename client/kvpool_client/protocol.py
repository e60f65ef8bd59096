"""The local wire format shared by the client and the sidecar.

Control messages travel over a Unix socket (or 127.0.0.1 TCP) as frames::

    u32 little-endian body length | msgpack body

A request body is ``[op, request id, *args]``; a response body is
``[request id, status, result]`` where status is 0 for success or an
:class:`ErrorCode` value, and ``result`` is then ``[code name, message]``.

On a Unix socket the sidecar first sends one plain byte (:data:`NO_FD_BYTE`) at accept.
The client's first request is ``HELLO [version, tenant, token | nil]``; the sidecar checks
that the client may act as that tenant (its peer credentials or the tenant's token), then,
on a Unix socket, sends one more byte before the answer: :data:`FD_BYTE` with the arena's
memfd attached (SCM_RIGHTS) when this client may map the shared DRAM arena, else
:data:`NO_FD_BYTE`. Nothing else is served before a successful HELLO. Block data
never travels over the socket, except in the inline operations used by clients that cannot
map the arena (TCP). A GPU-tier block travels neither: ``ACQUIRE_DEVICE`` answers a CUDA IPC
descriptor that a local engine opens for a device-to-device copy, and only where the HELLO
answer says ``device_reads`` (a GPU tier, one key space for every tenant, an arena mapped).

Keys travel as 48-byte raw :class:`kvpool_client.keys.BlockKey`. Extents are
``[offset, length]`` pairs into the arena.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack

from kvpool_client.errors import ProtocolError

#: The version this client speaks. Version 3 added what a writer may say about its blocks
#: (an optional hints map after ALLOC's and PUT_INLINE's items, and an optional fifth field
#: per item: the engine's identity for the block; see :mod:`kvpool_client.blockinfo`), and
#: ``ACQUIRE_DEVICE`` (GPU-tier reads through CUDA IPC; a version 2 connection is refused it).
PROTOCOL_VERSION = 3
#: The versions a sidecar serves: clients of the previous release keep working.
SUPPORTED_VERSIONS = (2, 3)
HEADER = struct.Struct("<I")
#: The byte that carries the arena descriptor on a Unix socket.
FD_BYTE = b"\x01"
#: Sent instead of FD_BYTE when the sidecar has no arena to share.
NO_FD_BYTE = b"\x00"


class Op(enum.IntEnum):
    HELLO = 1
    LOOKUP = 2
    ALLOC = 3
    COMMIT = 4
    ABORT = 5
    ACQUIRE = 6
    RELEASE = 7
    PIN = 8
    UNPIN = 9
    STATS = 10
    PUT_INLINE = 11
    GET_INLINE = 12
    #: Delete blocks of the caller's key space from this node (answer: how many went).
    REMOVE = 13
    #: Version 3: GPU-tier copies for a local CUDA engine on the same device. Args: a list
    #: of keys; answer per key None (a miss: read it through ACQUIRE) or ``[lease id, size,
    #: checksum, descriptor]``, a CUDA IPC descriptor (:mod:`kvpool_client.cudaipc`) of the
    #: block's copy, kept in place until the lease is RELEASEd.
    ACQUIRE_DEVICE = 14


class ErrorCode(enum.IntEnum):
    BAD_REQUEST = 1
    TOO_LARGE = 2
    UNKNOWN_LEASE = 3
    QUOTA = 4
    FULL = 5
    IO = 6
    CORRUPT = 7
    UNSUPPORTED = 8
    INTERNAL = 9
    #: The sidecar is shutting down and takes no new requests (retry on its successor).
    UNAVAILABLE = 10


class PutStatus(enum.IntEnum):
    """Per-block outcome of an allocation (the first phase of a put)."""

    #: Space is reserved: write the bytes into the extents, then commit.
    ALLOCATED = 0
    #: The pool already holds this block; nothing to write.
    EXISTS = 1
    #: Another writer is writing this block right now.
    PENDING = 2
    #: The admission policy declined the block.
    REJECTED = 3
    #: No room even after eviction (everything left is pinned or being read).
    FULL = 4
    #: Larger than the pool accepts.
    TOO_LARGE = 5
    #: The tenant is at its quota.
    QUOTA = 6
    #: The block was stored (commit and inline put).
    STORED = 7


def encode(body: list[Any]) -> bytes:
    """One frame: length header + msgpack body."""
    try:
        payload: bytes = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode frame: {e}") from e
    return HEADER.pack(len(payload)) + payload


#: Frames up to this size are decoded without counting what they hold: too small to matter
#: (an empty list, map or short string is a byte or three on the wire, some 50 to 64 in memory).
UNCOUNTED_FRAME_BYTES = 64 * 1024

#: A list longer than this whose items are not all numbers counts its items too.
COUNTED_LIST_ITEMS = 16


#: The types of the numbers a list may hold and still count as a list of numbers.
_NUMBERS = (int, float)


class _TooManyObjects(Exception):
    pass


class _TooManyNumbers(Exception):
    pass


def _no_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"extension type {code} is not part of the protocol")


def decode(payload: bytes | memoryview, *, max_items: int | None = None, max_map: int | None = None,
           max_objects: int | None = None, max_numbers: int | None = None,
           uncounted_bytes: int = UNCOUNTED_FRAME_BYTES) -> list[Any]:
    """The body of one frame; raises ProtocolError on anything that is not a msgpack list,
    or (when given) holds a list longer than ``max_items`` or a map of more than ``max_map``
    entries (refused before any of it is built), or, in a frame over ``uncounted_bytes``
    (:data:`UNCOUNTED_FRAME_BYTES` by default), more than ``max_objects`` objects: its lists and maps,
    each map's entries, and the items of each list that holds anything but numbers (refused
    as the count passes it). A byte or three on the wire each, empty lists, maps or short
    strings would otherwise become some 50 to 64 bytes each in memory (a GiB from a frame of
    tens of MiB) and keep the loop for seconds. Maps had counted one each whatever they
    held, and lists of up to :data:`COUNTED_LIST_ITEMS` items one each: 31,000 maps of 64
    entries fitted a budget of 32,832 objects, two million values that held a sidecar's loop
    7 s a frame. The numbers in lists of more than :data:`COUNTED_LIST_ITEMS` (a block's
    tokens) count apart, against ``max_numbers`` when given: a large one is 36 bytes in
    memory for 5 on the wire. Extension types are refused (the protocol has none: a value
    of one was built in Python, 2 to 3 microseconds each), and timestamps decode as
    integers."""
    limits: dict[str, Any] = {}
    if max_items is not None:
        limits["max_array_len"] = max_items
    if max_map is not None:
        limits["max_map_len"] = max_map
    if max_objects is not None and len(payload) > uncounted_bytes:
        built = 0
        numbers = 0
        most_numbers = len(payload) if max_numbers is None else max_numbers  # (a number takes a byte at least)

        def counted_list(items: list[Any]) -> list[Any]:
            nonlocal built, numbers
            built += 1
            if items and type(items[0]) in _NUMBERS:
                try:
                    sum(items)  # in C: fails at the first item that is not a number
                except TypeError:
                    built += len(items)
                else:
                    if len(items) > COUNTED_LIST_ITEMS:
                        numbers += len(items)
                        if numbers > most_numbers:
                            raise _TooManyNumbers
            else:  # (without the exception that sum raises: a request holds thousands of such lists)
                built += len(items)
            if built > max_objects:
                raise _TooManyObjects
            return items

        def counted_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
            nonlocal built
            built += 1 + len(pairs)  # as sent: a key repeated 64 times is 64 entries decoded
            if built > max_objects:
                raise _TooManyObjects
            return dict(pairs)

        limits["list_hook"] = counted_list
        limits["object_pairs_hook"] = counted_map
    try:
        body = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True, ext_hook=_no_extension,
                               timestamp=2, **limits)
    except _TooManyObjects:
        raise ProtocolError(f"malformed frame: more than {max_objects} lists, maps and items") from None
    except _TooManyNumbers:
        raise ProtocolError(f"malformed frame: more than {max_numbers} numbers in lists of more than "
                            f"{COUNTED_LIST_ITEMS}") from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"malformed frame: {e}") from e
    if not isinstance(body, list) or len(body) < 2:
        raise ProtocolError("a frame body must be a list of at least two items")
    return body
