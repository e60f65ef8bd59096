"""Objects (a string key, a byte value) stored as blocks of the pool, over one PoolClient.

Every call answers per object with a Mooncake code (:mod:`.codes`) and raises only the
pool client's :class:`KVPoolError` (the connection is gone or the sidecar refused a
request), which the store facade turns into a code.

* A put writes a chunked value's chunks first and its head last, so a reader never finds a
  head whose chunks are not all written; a put that fails, or finds the key already held,
  removes the chunks it wrote.
* A read acquires the head (zero-copy over the shared arena, or inline over TCP), checks
  the header, then reads the chunks the asked range needs, a few at a time, each verified
  by its block checksum; a whole read of a chunked value also verifies the value's checksum.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from kvpool_client.client import PoolClient
from kvpool_client.integrity import CHUNK
from kvpool_client.keys import BlockKey
from kvpool_client.mooncake.codes import ErrorCode, put_code
from kvpool_client.mooncake.layout import HEADER, Header, KeyMap, LayoutError
from kvpool_client.protocol import PutStatus

Parts = Sequence[memoryview]
Views = list[memoryview]
#: A fragment of a read: (offset in the value, length, where its bytes go).
Fragment = tuple[int, int, memoryview]

#: The most bytes of payload one put call copies, and of chunks one read holds, at once.
_BATCH_BYTES = 16 << 20
#: Inline (TCP) answers must fit one frame: blocks stay this far below the frame limit.
_FRAME_SLACK = 64 << 10


@dataclass(frozen=True, slots=True)
class _Head:
    header: Header
    #: The value's first bytes, as held in the head block.
    data: Views


def _skip(views: Views, n: int) -> Views:
    """``views`` without their first ``n`` bytes."""
    out: Views = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out


def _first_bytes(views: Views, n: int) -> bytes:
    out = bytearray()
    for v in views:
        if len(out) >= n:
            break
        out += v[: n - len(out)]
    return bytes(out)


def _gather(src: Views, offset: int, dst: memoryview) -> None:
    """Copy ``dst.nbytes`` bytes starting ``offset`` bytes into ``src`` to ``dst``."""
    pos = 0
    for v in _skip(src, offset):
        if pos >= dst.nbytes:
            break
        n = min(v.nbytes, dst.nbytes - pos)
        dst[pos : pos + n] = v[:n]
        pos += n


def _groups(sizes: Sequence[int], max_items: int, max_bytes: int) -> Iterator[range]:
    """Consecutive index ranges of at most ``max_items`` items and (past one) ``max_bytes``."""
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (i - start >= max_items or total + n > max_bytes):
            yield range(start, i)
            start, total = i, 0
        total += n
    if start < len(sizes):
        yield range(start, len(sizes))


class ObjectStore:
    """Objects of one namespace on the node's sidecar (not thread-safe: the facade locks)."""

    def __init__(self, client: PoolClient, keys: KeyMap, block_bytes: int | None = None) -> None:
        self.client = client
        self.keys = keys
        info = client.info
        limit = int(info.get("block_max_bytes", 256 << 20))
        if not client.shm:
            limit = min(limit, int(info.get("max_frame_bytes", 64 << 20)) - _FRAME_SLACK)
        #: The largest block this store writes: the sidecar's limit unless told smaller.
        self.block_bytes = min(limit, block_bytes) if block_bytes else limit
        self.max_batch = max(1, int(info.get("max_batch", 4096)))
        Header.plan(1, self.block_bytes)  # refuses blocks too small for a header

    # ------------------------------------------------------------------ blocks
    @contextlib.contextmanager
    def _blocks(self, keys: Sequence[BlockKey]) -> Iterator[list[Views | None]]:
        """The blocks' verified bytes (None: a miss), held until the end of the block."""
        out: list[Views | None] = []
        if not self.client.shm:
            for g in range(0, len(keys), self.max_batch):
                out += [None if v is None else [v] for v in self.client.get(keys[g : g + self.max_batch])]
            yield out
            return
        with contextlib.ExitStack() as held:
            for g in range(0, len(keys), self.max_batch):
                out += held.enter_context(self.client.acquire(keys[g : g + self.max_batch])).views
            yield out

    def _put_blocks(self, keys: Sequence[BlockKey], payloads: Sequence[memoryview]) -> list[PutStatus]:
        out: list[PutStatus] = []
        for r in _groups([p.nbytes for p in payloads], self.max_batch, _BATCH_BYTES):
            out += self.client.put([keys[i] for i in r], [payloads[i] for i in r])
        return out

    def _drop(self, keys: Sequence[BlockKey]) -> None:
        for g in range(0, len(keys), self.max_batch):
            self.client.remove(keys[g : g + self.max_batch])

    # ------------------------------------------------------------------ put
    def put(self, keys: Sequence[str], values: Sequence[Parts]) -> list[int]:
        """Store each value (given as parts) under its key, unless the key holds one."""
        codes = [0] * len(keys)
        small = [i for i, parts in enumerate(values) if Header.plan(_size(parts), self.block_bytes).blocks == 1]
        heads = [self.keys.head(keys[i]) for i in small]
        for r in _groups([_size(values[i]) for i in small], self.max_batch, _BATCH_BYTES):
            payloads = [_single(values[small[j]], self.block_bytes) for j in r]
            for j, status in zip(r, self.client.put([heads[j] for j in r], payloads)):
                codes[small[j]] = put_code(status)
        for i in sorted(set(range(len(keys))) - set(small)):
            codes[i] = self._put_chunked(keys[i], values[i])
        return codes

    def _put_chunked(self, key: str, parts: Parts) -> int:
        if self._here(self.keys.head(key)):
            return ErrorCode.OK  # held: keep it, and write no chunks to find that out
        value = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
        nonce = secrets.randbits(64)
        h = Header.plan(value.nbytes, self.block_bytes, nonce, xxhash.xxh3_64_intdigest(value))
        keys = [self.keys.chunk(key, nonce, i) for i in range(1, h.blocks)]
        chunks = [value[slice(*h.piece(i))] for i in range(1, h.blocks)]
        statuses = self._put_blocks(keys, chunks)
        stored = [k for k, s in zip(keys, statuses) if s == PutStatus.STORED]
        failed = [s for s in statuses if s != PutStatus.STORED]
        head_status = PutStatus.STORED
        if not failed:
            head = bytearray(h.pack()) + value[: h.head_bytes]
            head_status = self.client.put([self.keys.head(key)], [head])[0]
        if failed or head_status != PutStatus.STORED:
            self._drop(stored)  # a failed put, or the key held another value: no orphans
        return put_code(failed[0] if failed else head_status)

    # ------------------------------------------------------------------ read
    @contextlib.contextmanager
    def _heads(self, keys: Sequence[str]) -> Iterator[list[_Head | int]]:
        """Each object's checked head, or a code; the head blocks stay held meanwhile."""
        with self._blocks([self.keys.head(k) for k in keys]) as blocks:
            out: list[_Head | int] = []
            for views in blocks:
                if views is None:
                    out.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                try:
                    header = Header.parse(_first_bytes(views, HEADER.size), sum(v.nbytes for v in views))
                except LayoutError:
                    out.append(ErrorCode.INVALID_READ)
                    continue
                out.append(_Head(header, _skip(views, HEADER.size)))
            yield out

    def read(self, keys: Sequence[str], dests: Sequence[memoryview | None],
             alloc: Callable[[int], bytearray] = bytearray) -> list[int | bytearray]:
        """Whole values: into ``dests[i]`` (answer: the bytes read, or a code; a destination
        smaller than the value is INVALID_PARAMS) or, for None, into a new ``alloc(size)``."""
        out: list[int | bytearray] = []
        with self._heads(keys) as heads:
            for key, head, dst in zip(keys, heads, dests):
                if isinstance(head, int):
                    out.append(head)
                    continue
                size = head.header.size
                if dst is not None and dst.nbytes < size:
                    out.append(ErrorCode.INVALID_PARAMS)
                    continue
                buf: bytearray | None = None
                if dst is None:
                    buf = fresh = alloc(size)
                    view = memoryview(fresh)
                else:
                    view = dst[:size]
                code = self._copy(key, head, [(0, size, view)], whole=True)[0]
                out.append(buf if buf is not None and code >= 0 else code)
        return out

    def read_ranges(self, key: str, fragments: Sequence[Fragment]) -> list[int]:
        """Parts of one value: per fragment, its length or a code (a fragment past the
        value's end is INVALID_PARAMS; the others are still read)."""
        with self._heads([key]) as heads:
            head = heads[0]
            if isinstance(head, int):
                return [head] * len(fragments)
            size = head.header.size
            ok = [i for i, (off, n, _) in enumerate(fragments) if off + n <= size]
            got = self._copy(key, head, [fragments[i] for i in ok], whole=False)
        out = [int(ErrorCode.INVALID_PARAMS)] * len(fragments)
        for i, code in zip(ok, got):
            out[i] = code
        return out

    def _copy(self, key: str, head: _Head, fragments: Sequence[Fragment], *, whole: bool) -> list[int]:
        """Copy the fragments' bytes out of the head and the chunks they need; per fragment,
        its length or a code."""
        h = head.header
        results = [n for _, n, _ in fragments]
        hasher = xxhash.xxh3_64() if whole and h.blocks > 1 else None

        def deliver(index: int, views: Views | None) -> None:
            start, end = h.piece(index)
            for f, (off, n, dst) in enumerate(fragments):
                a, b = max(off, start), min(off + n, end)
                if a >= b or results[f] < 0:
                    continue
                if views is None:  # evicted, or failed its checksum
                    results[f] = ErrorCode.OBJECT_NOT_FOUND
                    continue
                if sum(v.nbytes for v in views) != end - start:
                    results[f] = ErrorCode.CHECKSUM_MISMATCH
                    continue
                out = dst[a - off : b - off]
                _gather(views, a - start, out)
                if hasher is not None:
                    for p in range(0, out.nbytes, CHUNK):
                        hasher.update(out[p : p + CHUNK])

        needed = sorted({p for off, n, _ in fragments for p in h.pieces_of(off, off + n)})
        if needed and needed[0] == 0:
            deliver(0, head.data)
        chunks = [p for p in needed if p > 0]
        per = max(1, min(self.max_batch, _BATCH_BYTES // h.chunk_bytes))
        for g in range(0, len(chunks), per):
            group = chunks[g : g + per]
            with self._blocks([self.keys.chunk(key, h.nonce, p) for p in group]) as blocks:
                for p, views in zip(group, blocks):
                    deliver(p, views)
        if hasher is not None and all(r >= 0 for r in results) and hasher.intdigest() != h.checksum:
            return [int(ErrorCode.CHECKSUM_MISMATCH)] * len(results)
        return results

    def sizes(self, keys: Sequence[str]) -> list[int]:
        """Each value's length, or a code."""
        with self._heads(keys) as heads:
            return [h if isinstance(h, int) else h.header.size for h in heads]

    # ------------------------------------------------------------------ exist / remove
    def exists(self, keys: Sequence[str]) -> list[int]:
        """1 where this node or (through the index) a peer holds the object's head, else 0."""
        return [1 if self.client.lookup([self.keys.head(k)]).prefix else 0 for k in keys]

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Delete objects from this node: 0, OBJECT_NOT_FOUND (none here, even if a peer
        holds one), or OBJECT_HAS_LEASE (its head is being promoted from disk: try again)."""
        codes: list[int] = []
        chunks: list[BlockKey] = []
        for key in keys:
            head = self.keys.head(key)
            if not self._here(head):  # never fetch a peer's copy just to delete it
                codes.append(ErrorCode.OBJECT_NOT_FOUND)
                continue
            with self._heads([key]) as heads:
                header = heads[0].header if isinstance(heads[0], _Head) else None
            if self.client.remove([head]):
                codes.append(ErrorCode.OK)
                if header is not None:
                    chunks += [self.keys.chunk(key, header.nonce, i) for i in range(1, header.blocks)]
            else:
                codes.append(ErrorCode.OBJECT_HAS_LEASE if self._here(head) else ErrorCode.OBJECT_NOT_FOUND)
        self._drop(chunks)
        return codes

    def _here(self, key: BlockKey) -> bool:
        """Whether this node holds the block (not only a peer)."""
        found = self.client.lookup([key])
        return bool(found.prefix) and found.tiers[0] != "peer"


def _size(parts: Parts) -> int:
    return sum(p.nbytes for p in parts)


def _single(parts: Parts, block_bytes: int) -> memoryview:
    """The head block of a value that fits one: header, then the value."""
    size = _size(parts)
    out = bytearray(HEADER.size + size)
    out[: HEADER.size] = Header.plan(size, block_bytes).pack()
    pos = HEADER.size
    for p in parts:
        out[pos : pos + p.nbytes] = p
        pos += p.nbytes
    return memoryview(out)
