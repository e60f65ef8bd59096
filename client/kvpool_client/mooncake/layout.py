"""How a Mooncake object lies in the pool: its block keys, its header, its pieces.

**Keys.** A Mooncake key is any string; a pool key is a 48-byte :class:`BlockKey`. The
fingerprint half is the digest of a :class:`ModelFingerprint` of model ``mooncake-api`` in
the caller's ``namespace`` (so objects never share keys with KV blocks, nor with another
namespace's objects). The digest half is BLAKE2b-256, keyed with that fingerprint and
personalised for this purpose, over a role tag and the key's UTF-8 bytes, length-prefixed::

    head(key)               = H_fp(b"h" | len | key)
    chunk(key, nonce, i)    = H_fp(b"c" | len | key | nonce | i)

Keys are never truncated: two different strings share a block only if BLAKE2b-256 collides.

**Objects.** The head block is a 48-byte header followed by the value's first bytes. A
value that does not fit one block (the sidecar's ``max_block_bytes``) continues in chunk
blocks whose keys carry a random 64-bit ``nonce`` chosen at each put: the chunks of two
versions of a key never mix, and a reader finds exactly the chunks its header names. The
header holds the value's length, the number of blocks, the bytes per chunk block, the nonce
and, for a chunked value, the xxh3-64 of the whole value, which a whole read verifies
(each block's own checksum is verified as it is read, as for every pool block).

**Forged heads.** Any writer of the key space (another tenant sharing it through
``tenants[].key_space`` too) can put a head block, and what a header claims decides how many
chunk keys a reader derives and asks for and how much room it allocates. So a reader takes a
header only where :meth:`Header.plausible`: its chunks are blocks of at least
:data:`MIN_CHUNK_BYTES` (a 64-byte head could otherwise name 2**34 chunks of a claimed TiB)
and its value fits what the node holds. Chunk keys are derived a batch at a time, never all
at once.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from kvpool_client.errors import KVPoolError
from kvpool_client.integrity import CHUNK
from kvpool_client.keys import BlockKey, ModelFingerprint
from kvpool_client.mooncake.codes import ErrorCode

#: The fingerprint's model name: objects of this API live in a key space of their own.
MODEL = "mooncake-api"
_PERSON = b"kvpool-mooncake"
_U32 = struct.Struct("<I")
_NONCE_INDEX = struct.Struct("<QQ")

#: A value as given (its parts), and a block's bytes as read (one or more pieces).
Parts = Sequence[memoryview]
Views = list[memoryview]

MAGIC = b"KVMC"
VERSION = 1
#: magic, version, 3 pad bytes, then value bytes, blocks, chunk block bytes, nonce, checksum.
HEADER = struct.Struct("<4sB3xQQQQQ")
#: The smallest block a value that does not fit one block is split into. Stores refuse to
#: write smaller ones and readers take a head that names smaller chunks for a forged one: a
#: chunk of the value costs a reader a key derived and looked up, so a head of a few bytes
#: must not name millions of them (a real sidecar's blocks are far larger: KV blocks).
MIN_CHUNK_BYTES = 4096


class LayoutError(KVPoolError):
    """A head block that is not the header of an object this API wrote."""


def fingerprint(namespace: str = "") -> ModelFingerprint:
    """The fingerprint of the objects of ``namespace``."""
    return ModelFingerprint(model=MODEL, dtype="bytes", block_tokens=1, kv_layout="mooncake-object-v1",
                            namespace=namespace)


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"a key must be a str, not {type(key).__name__}")
    # surrogatepass: every str has one encoding, so distinct strings stay distinct
    return key.encode("utf-8", "surrogatepass")


class KeyMap:
    """Mooncake keys of one namespace as pool keys."""

    def __init__(self, namespace: str = "") -> None:
        self.namespace = namespace
        self._fp = fingerprint(namespace).digest()

    def _digest(self, data: bytes) -> BlockKey:
        return BlockKey(self._fp, hashlib.blake2b(data, digest_size=32, key=self._fp, person=_PERSON).digest())

    def head(self, key: str) -> BlockKey:
        """The block that holds the object's header (and its first bytes)."""
        raw = _key_bytes(key)
        return self._digest(b"h" + _U32.pack(len(raw)) + raw)

    def chunk(self, key: str, nonce: int, index: int) -> BlockKey:
        """Block ``index`` (1, 2, ...) of the version of the object written with ``nonce``."""
        raw = _key_bytes(key)
        return self._digest(b"c" + _U32.pack(len(raw)) + raw + _NONCE_INDEX.pack(nonce, index))

    def chunks(self, key: str, nonce: int, indices: Iterable[int]) -> list[bytes]:
        """The 48-byte keys (:attr:`BlockKey.raw`) of blocks ``indices`` of that version, as
        :meth:`chunk` derives them: the key's part is hashed once and no BlockKey is built
        (a read derives thousands at a time; this takes a third of the time)."""
        raw = _key_bytes(key)
        base = hashlib.blake2b(b"c" + _U32.pack(len(raw)) + raw, digest_size=32, key=self._fp, person=_PERSON)
        out: list[bytes] = []
        for i in indices:
            h = base.copy()
            h.update(_NONCE_INDEX.pack(nonce, i))
            out.append(self._fp + h.digest())
        return out


@dataclass(frozen=True, slots=True)
class Header:
    """What the head block says of its object."""

    size: int
    blocks: int
    #: Value bytes per chunk block (the head holds that many less the header).
    chunk_bytes: int
    nonce: int = 0
    checksum: int = 0

    @classmethod
    def plan(cls, size: int, block_bytes: int, nonce: int = 0, checksum: int = 0) -> Header:
        """The layout of a ``size``-byte value in blocks of at most ``block_bytes``."""
        if block_bytes <= HEADER.size:
            raise KVPoolError(f"blocks of {block_bytes} bytes cannot hold a {HEADER.size}-byte header")
        rest = max(0, size - (block_bytes - HEADER.size))
        return cls(size, 1 + -(-rest // block_bytes), block_bytes, nonce, checksum)

    @property
    def head_bytes(self) -> int:
        """Value bytes in the head block."""
        return min(self.size, self.chunk_bytes - HEADER.size)

    def piece(self, index: int) -> tuple[int, int]:
        """``(start, end)`` of the value's bytes in block ``index`` (0: the head)."""
        if index == 0:
            return 0, self.head_bytes
        start = self.head_bytes + (index - 1) * self.chunk_bytes
        return start, min(self.size, start + self.chunk_bytes)

    def span(self, start: int, end: int) -> range:
        """Blocks holding any of the value's bytes ``[start, end)``, in order (a range: a
        header may claim billions of blocks, and nothing is built per block)."""
        if end <= start:
            return range(0)
        first = 0 if start < self.head_bytes else 1 + (start - self.head_bytes) // self.chunk_bytes
        last = 0 if end <= self.head_bytes else 1 + (end - 1 - self.head_bytes) // self.chunk_bytes
        return range(first, min(last, self.blocks - 1) + 1)

    def pieces_of(self, start: int, end: int) -> Iterator[int]:
        """Blocks holding any of the value's bytes ``[start, end)``, in order."""
        return iter(self.span(start, end))

    def plausible(self, max_bytes: int | None) -> bool:
        """Whether a store of this API could have written this header: a chunked value's
        blocks are at least :data:`MIN_CHUNK_BYTES` and the value is at most ``max_bytes``
        (what the node's tiers hold, where known: every block of a value is stored at once,
        so none larger is ever whole). A header that is not is a forged one (see the module's
        docstring), read as a miss before anything is built or asked for its chunks."""
        if self.blocks > 1 and self.chunk_bytes < MIN_CHUNK_BYTES:
            return False
        return max_bytes is None or self.size <= max_bytes

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.size, self.blocks, self.chunk_bytes, self.nonce, self.checksum)

    @classmethod
    def parse(cls, first: bytes, block_size: int) -> Header:
        """The header at the start of a head block of ``block_size`` bytes, checked."""
        if len(first) < HEADER.size:
            raise LayoutError("a head block is shorter than its header")
        magic, version, size, blocks, chunk_bytes, nonce, csum = HEADER.unpack_from(first)
        if magic != MAGIC or version != VERSION:
            raise LayoutError("not the head of an object this API wrote")
        h = cls(size, blocks, chunk_bytes, nonce, csum)
        if chunk_bytes <= HEADER.size or h.blocks != cls.plan(size, chunk_bytes).blocks \
                or block_size != HEADER.size + h.head_bytes:
            raise LayoutError("an object header that does not match its block")
        return h


# ---------------------------------------------------------------------- bytes of blocks
def size_of(parts: Parts) -> int:
    return sum(p.nbytes for p in parts)


def joined(parts: Parts) -> memoryview:
    return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))


def new_version(value: memoryview, block_bytes: int) -> tuple[Header, bytearray]:
    """A new version of a value: its header (a chunked value's with a fresh nonce and its
    checksum) and its head block."""
    h = Header.plan(value.nbytes, block_bytes)
    if h.blocks > 1:
        h = Header.plan(value.nbytes, block_bytes, secrets.randbits(64), xxhash.xxh3_64_intdigest(value))
    return h, bytearray(h.pack()) + value[: h.head_bytes]


def single_block(parts: Parts, block_bytes: int) -> memoryview:
    """The head block of a value that fits one: header, then the value (copied from its parts)."""
    size = size_of(parts)
    out = bytearray(HEADER.size + size)
    out[: HEADER.size] = Header.plan(size, block_bytes).pack()
    pos = HEADER.size
    for p in parts:
        out[pos : pos + p.nbytes] = p
        pos += p.nbytes
    return memoryview(out)


def skip(views: Views, n: int) -> Views:
    """``views`` without their first ``n`` bytes."""
    out: Views = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out


def first_bytes(views: Views, n: int) -> bytes:
    out = bytearray()
    for v in views:
        if len(out) >= n:
            break
        out += v[: n - len(out)]
    return bytes(out)


def gather(src: Views, offset: int, dst: memoryview) -> None:
    """Copy ``dst.nbytes`` bytes starting ``offset`` bytes into ``src`` to ``dst``."""
    pos = 0
    for v in skip(src, offset):
        if pos >= dst.nbytes:
            break
        n = min(v.nbytes, dst.nbytes - pos)
        dst[pos : pos + n] = v[:n]
        pos += n


#: A fragment of a read: (offset in the value, length, where its bytes go).
Fragment = tuple[int, int, memoryview]


def _merged(spans: Sequence[range]) -> list[range]:
    """Disjoint ranges covering ``spans``, in order."""
    out: list[range] = []
    for r in sorted((r for r in spans if r), key=lambda r: r.start):
        if out and r.start <= out[-1].stop:
            out[-1] = range(out[-1].start, max(out[-1].stop, r.stop))
        else:
            out.append(r)
    return out


class Delivery:
    """Fragments of one value filled from its pieces (the head's bytes, then chunks), in
    order, and for a whole read of a chunked value hashed on the way; per fragment, its
    length or a code (:meth:`outcome`)."""

    def __init__(self, header: Header, fragments: Sequence[Fragment], *, whole: bool) -> None:
        self.header = header
        self.fragments = fragments
        self.results = [n for _, n, _ in fragments]
        self._hasher = xxhash.xxh3_64() if whole and header.blocks > 1 else None
        # ranges, not a set of block numbers: one range per fragment, whatever the value's size
        self._needed = _merged([header.span(off, off + n) for off, n, _ in fragments])
        self._head_needed = bool(self._needed) and self._needed[0].start == 0

    def chunks(self) -> Iterator[int]:
        """The chunks (pieces past the head) the fragments need, in order, one at a time."""
        for r in self._needed:
            yield from range(max(1, r.start), r.stop)

    @property
    def failed(self) -> bool:
        """Whether every fragment has failed already: no chunk still to read can help."""
        return all(r < 0 for r in self.results)

    def head(self, views: Views) -> None:
        """Copy what the fragments need of the head's bytes (before the head is released)."""
        if self._head_needed:
            self.deliver(0, views)

    def deliver(self, index: int, views: Views | None) -> None:
        start, end = self.header.piece(index)
        for f, (off, n, dst) in enumerate(self.fragments):
            a, b = max(off, start), min(off + n, end)
            if a >= b or self.results[f] < 0:
                continue
            if views is None:  # evicted, or failed its checksum
                self.results[f] = ErrorCode.OBJECT_NOT_FOUND
                continue
            if sum(v.nbytes for v in views) != end - start:
                self.results[f] = ErrorCode.CHECKSUM_MISMATCH
                continue
            out = dst[a - off : b - off]
            gather(views, a - start, out)
            if self._hasher is not None:
                for p in range(0, out.nbytes, CHUNK):
                    self._hasher.update(out[p : p + CHUNK])

    def outcome(self) -> list[int]:
        if self._hasher is not None and all(r >= 0 for r in self.results) \
                and self._hasher.intdigest() != self.header.checksum:
            return [int(ErrorCode.CHECKSUM_MISMATCH)] * len(self.results)
        return self.results
