"""Block checksums: xxh3-64 over a block's payload, computed while the bytes are hot.

A block's checksum is fixed when its writer commits it and travels with the block through
every tier and transfer; every reader verifies it before handing the bytes on. Copy and
checksum are fused chunk by chunk so that the hash reads bytes still in cache instead of
making a second pass over memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

#: Bytes copied (and then hashed) per step: small enough to stay in L2.
CHUNK = 256 * 1024

Buffer = memoryview


def checksum(views: Sequence[Buffer] | Buffer) -> int:
    """The checksum of the concatenation of ``views``."""
    if isinstance(views, memoryview):
        return int(xxhash.xxh3_64_intdigest(views))
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return int(h.intdigest())


def copy_with_checksum(dst: Sequence[Buffer], src: Buffer) -> int:
    """Copy ``src`` into the consecutive buffers ``dst`` and return the checksum of ``src``.

    ``dst`` must hold exactly ``len(src)`` bytes in all.
    """
    if sum(d.nbytes for d in dst) != src.nbytes:
        raise ValueError(f"destination holds {sum(d.nbytes for d in dst)} bytes, source {src.nbytes}")
    h = xxhash.xxh3_64()
    pos = 0
    for d in dst:
        n = d.nbytes
        off = 0
        while off < n:
            step = min(CHUNK, n - off)
            chunk = src[pos : pos + step]
            d[off : off + step] = chunk
            h.update(chunk)
            off += step
            pos += step
    return int(h.intdigest())


def gather_with_checksum(dst: Buffer, src: Sequence[Buffer]) -> int:
    """Copy the consecutive buffers ``src`` into ``dst``; return the checksum of the copy.

    The hash reads the destination right after each chunk lands, so what is verified is
    what the caller receives.
    """
    h = xxhash.xxh3_64()
    pos = 0
    for s in src:
        n = s.nbytes
        off = 0
        while off < n:
            step = min(CHUNK, n - off)
            out = dst[pos : pos + step]
            out[:] = s[off : off + step]
            h.update(out)
            off += step
            pos += step
    return int(h.intdigest())
