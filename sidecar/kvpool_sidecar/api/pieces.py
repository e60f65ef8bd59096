"""A large block's bytes copied in and out of the arena a piece at a time, the event loop
turning between pieces (:data:`~kvpool_sidecar.api.limits.SLICE_BYTES` each, as the callers
say), for the
inline requests (``PUT_INLINE``, ``GET_INLINE``): one 60 MiB block copied and checksummed
in one go had held every other client for 40 to 130 ms. The block is leased throughout, so
nothing takes its room or its bytes between pieces."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

import xxhash

from kvpool_client.integrity import copy_hashing, gather_hashing


def pieces(views: Sequence[memoryview], most: int) -> Iterator[list[memoryview]]:
    """The consecutive bytes of ``views`` in groups of at most ``most`` bytes (a view split
    where a group ends), in order."""
    group: list[memoryview] = []
    size = 0
    for v in views:
        flat = v.cast("B") if v.ndim != 1 or v.format != "B" else v
        off = 0
        while off < flat.nbytes:
            take = min(most - size, flat.nbytes - off)
            group.append(flat[off : off + take])
            size += take
            off += take
            if size >= most:
                yield group
                group, size = [], 0
    if group:
        yield group


async def _each_piece(views: Sequence[memoryview], most: int, do: Callable[[list[memoryview], int, int], None]) -> None:
    """``do(group, offset, length)`` for each group of :func:`pieces` of ``views``, the loop
    turning between two."""
    pos = 0
    for k, group in enumerate(pieces(views, most)):
        if k:
            await asyncio.sleep(0)
        n = sum(g.nbytes for g in group)
        do(group, pos, n)
        pos += n


async def copy_in(dst: Sequence[memoryview], src: memoryview, most: int) -> int:
    """Copy ``src`` into the consecutive buffers ``dst`` (a block's room), ``most`` bytes at
    a time; the checksum of ``src``."""
    h = xxhash.xxh3_64()
    await _each_piece(dst, most, lambda group, pos, n: copy_hashing(group, src[pos : pos + n], h))
    return int(h.intdigest())


async def copy_out(src: Sequence[memoryview], size: int, most: int) -> tuple[bytearray, int]:
    """A copy of the ``size`` bytes of the consecutive buffers ``src`` (a block's copy in the
    arena), made ``most`` bytes at a time, and the checksum of the copy (what is verified is
    what is sent)."""
    out = bytearray(size)
    view = memoryview(out)
    h = xxhash.xxh3_64()
    await _each_piece(src, most, lambda group, pos, n: gather_hashing(view[pos : pos + n], group, h))
    return out, int(h.intdigest())
