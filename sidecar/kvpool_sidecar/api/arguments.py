"""Checks of a local request's arguments: keys, batches of items, lease ids, checksums.

Each check returns what it was given, typed, or raises :class:`RequestError`: the request is
answered ``BAD_REQUEST`` and the connection stays (its frames were well formed). A handler
checks the whole batch before it applies any of it, so a refused batch changes nothing.
"""

from __future__ import annotations

from typing import Any

from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_sidecar.api.limits import LocalLimits
from kvpool_sidecar.errors import RequestError
from kvpool_sidecar.events import EngineRef


def checked_keys(arg: object, limits: LocalLimits) -> list[bytes]:
    if not isinstance(arg, list):
        raise RequestError("expected a list of keys")
    if len(arg) > limits.max_batch:
        raise RequestError(f"batch of {len(arg)} exceeds the limit of {limits.max_batch}")
    if not all(type(k) is bytes and len(k) == RAW_KEY_BYTES for k in arg):
        raise RequestError(f"a key must be {RAW_KEY_BYTES} raw bytes")
    return arg


def checked_items(arg: object, limits: LocalLimits, width: int | tuple[int, ...]) -> list[list[Any]]:
    widths = width if isinstance(width, tuple) else (width,)
    if not isinstance(arg, list) or len(arg) > limits.max_batch:
        raise RequestError(f"expected a list of at most {limits.max_batch} items")
    for item in arg:
        if not isinstance(item, list) or len(item) not in widths:
            raise RequestError(f"each item must be a list of {' or '.join(map(str, widths))} fields")
    return arg


def checked_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{what} must be an integer")
    return value


#: A block's checksum is an unsigned 64-bit xxh3; anything else is refused at the door (it
#: could never match a block's bytes, and the disk tier's header could not even hold it).
_CHECKSUM_LIMIT = 1 << 64


def checked_checksum(value: object) -> int:
    csum = checked_int(value, "checksum")
    if not 0 <= csum < _CHECKSUM_LIMIT:
        raise RequestError("a checksum must be an unsigned 64-bit integer")
    return csum


def checked_lease_ids(arg: object, limits: LocalLimits) -> list[int]:
    if not isinstance(arg, list) or len(arg) > limits.max_batch:
        raise RequestError(f"expected a list of at most {limits.max_batch} lease ids")
    return [checked_int(lid, "lease") for lid in arg]


def checked_parent(value: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) != RAW_KEY_BYTES:
        raise RequestError(f"a parent key must be {RAW_KEY_BYTES} raw bytes or nil")
    return value


def check_tokens_fit(engine: EngineRef | None, size: int) -> None:
    """A block's engine token ids (kept in memory for KV events, 4 bytes each) may take no
    more room than the block itself: a tenant's metadata stays bounded by its data."""
    if engine is not None and 4 * len(engine.token_ids) > max(size, 0):
        raise RequestError("an engine block's token ids ({} bytes) may not exceed the block ({} bytes)".format(
            4 * len(engine.token_ids), size))
