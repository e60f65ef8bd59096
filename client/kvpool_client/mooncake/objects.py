"""Objects (a string key, a byte value) stored as blocks of the pool, over one PoolClient.

Every call answers per object with a Mooncake code (:mod:`.codes`) and raises only the
pool client's :class:`KVPoolError` (the connection is gone, the sidecar refused a request,
or the facade call's deadline passed: :meth:`ObjectStore.task`), which the store facade
turns into a code.

* A put writes a chunked value's chunks first and its head last, so a reader never finds a
  head whose chunks were not all written; a put that fails, or finds the key already held,
  removes the chunks it wrote. A head here whose chunks are not all held (evicted: chunks,
  older, go before their head) does not count as held, whatever the size of the value put:
  the put removes that version (not one another client put meanwhile) and what is left of
  its chunks, and writes the value again.
* An upsert (:meth:`ObjectStore.replace`) refuses a value the node could never hold, writes
  the new value's chunks (under a new nonce), then swaps the head: it removes the old head,
  keeping a copy of its bytes, and puts the new one; if the new head is refused, the old
  head is put back and the new chunks dropped. The old chunks go only once the new head is
  stored. A refused upsert leaves the old value as it was, unless the room its new chunks
  took was made by evicting it (as any put may evict), or another client wrote the key in
  the moment of the swap (then the old chunks are dropped: no head names them).
* A read acquires the heads (zero-copy over the shared arena, or inline over TCP)
  ``max_batch`` at a time, checks each header, copies out the head's bytes and releases the
  heads before it reads any chunk. Before allocating room for a chunked value it checks
  that every chunk is held (LOOKUPs of ``max_batch`` keys, under the deadline, stopped at the
  first missing chunk); then it reads the chunks the asked range needs, a few at a time, each
  verified by its block checksum, and stops once every fragment has failed; a whole read of a
  chunked value also verifies the value's checksum.
* A head that this API's stores could not have written (:meth:`Header.plausible`: chunks
  smaller than :data:`MIN_CHUNK_BYTES`, or a value larger than the node's tiers) is a forged
  one: a read answers a miss, and a put takes it for a broken value (removed, then the value
  written; or, another tenant's, ILLEGAL_CLIENT). Chunk keys are derived a batch at a time
  (:meth:`ObjectStore._drop` takes them lazily), never all that a header names at once.
* The pool calls of one facade call end by one deadline (:meth:`ObjectStore.task`), except
  those that settle a change already begun: dropping chunks no head names, and a head swap
  once the old head is read.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_client.client import KeyLike, PoolClient
from kvpool_client.errors import DeadlineError, KVPoolError
from kvpool_client.keys import BlockKey
from kvpool_client.mooncake.codes import ErrorCode, put_code
from kvpool_client.mooncake.layout import (HEADER, MIN_CHUNK_BYTES, Delivery, Fragment, Header, KeyMap, LayoutError,
                                          Parts, Views, first_bytes, joined, new_version, single_block, size_of, skip)
from kvpool_client.protocol import PutStatus

logger = logging.getLogger(__name__)

#: The most bytes of payload one put call copies, and of heads or chunks one read holds, at once.
_BATCH_BYTES = 16 << 20
#: Inline (TCP) answers must fit one frame: blocks stay this far below the frame limit.
_FRAME_SLACK = 64 << 10


@dataclass(frozen=True, slots=True)
class _Head:
    header: Header
    #: The value's first bytes, as held in the head block.
    data: Views


@dataclass(frozen=True, slots=True)
class _Unlinked:
    """What removing a head did: a code, the chunks the removed head named (the caller drops
    them) and, where asked, a copy of its bytes (to put back)."""

    code: int
    #: Derived as iterated (:class:`_Chunks`): never a list of every key a header names.
    chunks: Iterable[KeyLike] = ()
    saved: bytes | None = None
    #: The head there was not the version asked for (another client's meanwhile): left.
    other: bool = False


@dataclass(frozen=True, slots=True)
class _Chunks:
    """The chunk keys of one version of an object, derived as they are iterated, so that a
    caller holds a batch of them at a time (:meth:`ObjectStore._drop`)."""

    keys: KeyMap
    key: str
    header: Header
    batch: int

    def __iter__(self) -> Iterator[KeyLike]:
        for start in range(1, self.header.blocks, self.batch):
            yield from self.keys.chunks(self.key, self.header.nonce, range(start, min(self.header.blocks,
                                                                                      start + self.batch)))


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


def _capacities(stats: Any) -> tuple[int | None, int | None]:
    """The bytes the node's host (DRAM) tier and all its tiers hold, as STATS says (None: not said)."""
    tiers = stats.get("tiers") if isinstance(stats, dict) else None
    if not isinstance(tiers, dict):
        return None, None
    caps: dict[str, int] = {}
    for name, tier in tiers.items():
        cap = tier.get("capacity_bytes") if isinstance(tier, dict) else None
        if type(cap) is int and cap > 0:
            caps[str(name)] = cap
    return caps.get("dram"), (sum(caps.values()) or None)


class ObjectStore:
    """Objects of one namespace on the node's sidecar (not thread-safe: the facade locks)."""

    def __init__(self, client: PoolClient, keys: KeyMap, block_bytes: int | None = None) -> None:
        self.client = client
        self.keys = keys
        info = client.info
        # every block fits one inline answer: a value written over the shared arena is read
        # over TCP too (by another client of the key space)
        limit = min(int(info.get("block_max_bytes", 256 << 20)), int(info.get("max_frame_bytes", 64 << 20)) - _FRAME_SLACK)
        #: The largest block this store writes: the sidecar's limit unless told smaller.
        self.block_bytes = min(limit, block_bytes) if block_bytes else limit
        self.max_batch = max(1, int(info.get("max_batch", 4096)))
        if self.block_bytes < MIN_CHUNK_BYTES:  # (readers take smaller chunks for a forged head's)
            raise KVPoolError(f"blocks of {self.block_bytes} bytes: this API writes blocks of at least "
                              f"{MIN_CHUNK_BYTES} (the sidecar's max_block_bytes, or block_bytes, is too small)")
        #: What the node's host tier, and all its tiers, hold: no value past them is ever stored.
        self.host_bytes, self.node_bytes = _capacities(client.stats())
        self._until: float | None = None

    # ------------------------------------------------------------------ deadline
    @contextlib.contextmanager
    def task(self, seconds: float) -> Iterator[None]:
        """One facade call: its pool calls end by one deadline, ``seconds`` from now (a call
        begun past it raises :class:`DeadlineError`; see :meth:`PoolClient.within`), except
        those that settle a change already begun, which keep their own timeouts."""
        outer = self._until
        until = time.monotonic() + seconds
        self._until = until if outer is None else min(outer, until)
        try:
            yield
        finally:
            self._until = outer

    def _bounded(self) -> contextlib.AbstractContextManager[None]:
        """The task's deadline over the calls made in the ``with`` block (none outside a task)."""
        if self._until is None:
            return contextlib.nullcontext()
        return self.client.within(self._until - time.monotonic())

    # ------------------------------------------------------------------ blocks
    @contextlib.contextmanager
    def _blocks(self, keys: Sequence[KeyLike]) -> Iterator[list[Views | None]]:
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

    def _put_blocks(self, keys: Sequence[KeyLike], payloads: Sequence[memoryview]) -> list[PutStatus]:
        """Put blocks a group at a time; where a call fails (past the deadline too), drops those
        stored and raises."""
        out: list[PutStatus] = []
        try:
            for r in _groups([p.nbytes for p in payloads], self.max_batch, _BATCH_BYTES):
                with self._bounded():
                    out += self.client.put([keys[i] for i in r], [payloads[i] for i in r])
        except KVPoolError:  # (past the deadline, or a call cut short: nothing will name them)
            with contextlib.suppress(KVPoolError):  # (a lost connection drops nothing: evicted in time)
                self._drop([k for k, s in zip(keys, out) if s == PutStatus.STORED])
            raise
        return out

    def _drop(self, keys: Iterable[KeyLike]) -> None:
        """Remove blocks (whatever the task's deadline: what no head names must not stay),
        taking ``max_batch`` keys at a time from ``keys`` (a :class:`_Chunks` derives them as
        taken)."""
        it = iter(keys)
        while batch := list(itertools.islice(it, self.max_batch)):
            self.client.remove(batch)

    # ------------------------------------------------------------------ put
    def put(self, keys: Sequence[str], values: Sequence[Parts]) -> list[int]:
        """Store each value (given as parts) under its key, unless the key holds one."""
        codes = [0] * len(keys)
        small = [i for i, parts in enumerate(values) if Header.plan(size_of(parts), self.block_bytes).blocks == 1]
        heads = [self.keys.head(keys[i]) for i in small]
        first: dict[BlockKey, int] = {}
        with self._bounded():
            for r in _groups([size_of(values[i]) for i in small], self.max_batch, _BATCH_BYTES):
                payloads = [single_block(values[small[j]], self.block_bytes) for j in r]
                for j, status in zip(r, self.client.put([heads[j] for j in r], payloads)):
                    twice = status == PutStatus.PENDING and heads[j] in first  # (pending: this very put's)
                    codes[small[j]] = codes[first[heads[j]]] if twice else put_code(status)
                    if status == PutStatus.EXISTS and heads[j] not in first:
                        codes[small[j]] = self._put_over(keys[small[j]], payloads[j - r.start])
                    first.setdefault(heads[j], small[j])  # the first of a key wins
        for i in sorted(set(range(len(keys))) - set(small)):
            codes[i] = self._put_chunked(keys[i], values[i])
        return codes

    def _put_over(self, key: str, block: memoryview) -> int:
        """A one-block value whose key was found held: kept (OK) unless the head there is a
        chunked value's that outlived some of its chunks; then that goes and this is put."""
        gone = self._unless_whole(key)
        if gone is not None:
            return gone
        with self._bounded():
            return put_code(self.client.put([self.keys.head(key)], [block])[0])

    def _unless_whole(self, key: str) -> int | None:
        """For a key whose head is here: OK where it holds a whole value, or another client's
        that replaced a broken one meanwhile (kept: a put never replaces a value); else the
        broken head and what is left of its chunks are removed, and None (go on and put), or
        the code of a removal refused."""
        with self._bounded():
            nonce = self._broken(key)
        if nonce is None:
            return ErrorCode.OK
        gone = self._unlink(key, nonce=nonce)
        self._drop(gone.chunks)
        if gone.other:
            return ErrorCode.OK
        return None if gone.code in (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND) else gone.code

    def _put_chunked(self, key: str, parts: Parts) -> int:
        head = self.keys.head(key)
        with self._bounded():
            here = self._here(head)
        if here:
            gone = self._unless_whole(key)
            if gone is not None:
                return gone
        value = joined(parts)
        h, block = new_version(value, self.block_bytes)
        chunks = self._put_chunks(key, h, value)
        if isinstance(chunks, int):
            return chunks
        try:
            with self._bounded():
                status = self.client.put([head], [block])[0]
        except DeadlineError:
            self._drop(chunks)
            raise
        if status != PutStatus.STORED:
            self._drop(chunks)  # a failed put, or the key held another value: no orphans
        return put_code(status)

    def _put_chunks(self, key: str, h: Header, value: memoryview) -> list[bytes] | int:
        """Write the chunks of the version ``h`` lays out: their keys, or a code (and none left)."""
        keys = self.keys.chunks(key, h.nonce, range(1, h.blocks))
        statuses = self._put_blocks(keys, [value[slice(*h.piece(i))] for i in range(1, h.blocks)])
        failed = [s for s in statuses if s != PutStatus.STORED]
        if failed:
            self._drop([k for k, s in zip(keys, statuses) if s == PutStatus.STORED])
            return put_code(failed[0])
        return keys

    def replace(self, key: str, parts: Parts) -> int:
        """Store the value under ``key``, replacing the value this node holds there, which stays
        if the new one is not stored. A code as :meth:`put` or :meth:`remove` answers, or
        NO_AVAILABLE_HANDLE for a value the node could never hold (its largest block is
        larger than its host tier, or it all larger than its tiers) or an old head here that
        cannot be read right now (no copy to put back)."""
        value = joined(parts)
        h, block = new_version(value, self.block_bytes)
        largest = HEADER.size + h.head_bytes  # (a chunked value's head is a whole block)
        if (self.host_bytes is not None and largest > self.host_bytes) or \
                (self.node_bytes is not None and HEADER.size + h.size > self.node_bytes):
            return ErrorCode.NO_AVAILABLE_HANDLE  # refused before the old value is touched
        chunks = self._put_chunks(key, h, value) if h.blocks > 1 else []
        if isinstance(chunks, int):
            return chunks
        try:
            old = self._unlink(key, keep=True)
        except DeadlineError:
            self._drop(chunks)
            raise
        if old.code not in (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND):
            self._drop(chunks)
            return old.code
        head = self.keys.head(key)
        status = self.client.put([head], [block])[0]  # (the swap is under way: whatever the deadline)
        if status != PutStatus.STORED:
            back = PutStatus.FULL
            if old.saved is not None:  # the old value again: its chunks were kept
                back = self.client.put([head], [memoryview(old.saved)])[0]
                if back != PutStatus.STORED:  # (EXISTS, PENDING: another client's value came in between)
                    logger.warning("an upsert refused (%s) could not put the old value back (%s)",
                                   status.name, back.name)
            if back != PutStatus.STORED:
                self._drop(old.chunks)  # no head names them any more
            self._drop(chunks)
            return put_code(status)
        self._drop(old.chunks)
        return ErrorCode.OK

    # ------------------------------------------------------------------ read
    @contextlib.contextmanager
    def _heads(self, keys: Sequence[str], forged: bool = False) -> Iterator[list[_Head | int]]:
        """Each object's checked head, or a code; the head blocks stay held meanwhile. A
        header that is not :meth:`Header.plausible` is a miss (OBJECT_NOT_FOUND), unless
        ``forged`` (then it is answered, for the caller to judge)."""
        with self._blocks([self.keys.head(k) for k in keys]) as blocks:
            out: list[_Head | int] = []
            for views in blocks:
                if views is None:
                    out.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                try:
                    header = Header.parse(first_bytes(views, HEADER.size), sum(v.nbytes for v in views))
                except LayoutError:
                    out.append(ErrorCode.INVALID_READ)
                    continue
                if not forged and not header.plausible(self.node_bytes):
                    out.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                out.append(_Head(header, skip(views, HEADER.size)))
            yield out

    def read(self, keys: Sequence[str], dests: Sequence[memoryview | None],
             alloc: Callable[[int], bytearray] = bytearray) -> list[int | bytearray]:
        """Whole values: into ``dests[i]`` (answer: the bytes read, or a code; a destination
        smaller than the value is INVALID_PARAMS) or, for None, into a new ``alloc(size)``.

        The heads are acquired ``max_batch`` at a time (one round trip for a batch of small
        values) and released once their bytes are copied out, before any chunk is read: the
        chunks never wait for room the heads hold. Heads that held more than
        :data:`_BATCH_BYTES` in all may have filled the connection's share, so those that
        missed beside them are asked for again (while each try finds more)."""
        out: list[int | bytearray] = [int(ErrorCode.OBJECT_NOT_FOUND)] * len(keys)
        pending = list(range(len(keys)))
        with self._bounded():
            while pending:
                group, pending = pending[: self.max_batch], pending[self.max_batch :]
                with self._heads([keys[i] for i in group]) as heads:
                    held = sum(HEADER.size + sum(v.nbytes for v in h.data) for h in heads if isinstance(h, _Head))
                    begun = [self._begin(keys[i], head, dests[i], alloc) for i, head in zip(group, heads)]
                missed = [i for i, h in zip(group, heads) if h == ErrorCode.OBJECT_NOT_FOUND]
                if missed and held > _BATCH_BYTES and len(missed) < len(group):
                    pending = missed + pending
                for i, b in zip(group, begun):
                    if isinstance(b, tuple):
                        delivery, buf = b
                        code = self._chunks(keys[i], delivery)[0]
                        out[i] = buf if buf is not None and code >= 0 else code
                    else:
                        out[i] = b
        return out

    def _begin(self, key: str, head: _Head | int, dst: memoryview | None, alloc: Callable[[int], bytearray]
               ) -> tuple[Delivery, bytearray | None] | int | bytearray:
        """One whole read as far as its head goes: the answer for a value of one block (or a
        code), else the head's bytes delivered and the chunks still to read."""
        if isinstance(head, int):
            return head
        h = head.header
        if dst is not None and dst.nbytes < h.size:
            return ErrorCode.INVALID_PARAMS
        buf: bytearray | None = None
        if dst is None:
            if h.blocks > 1 and not self._held(key, h):
                return ErrorCode.OBJECT_NOT_FOUND  # (room for what a head claims only once its chunks are held)
            try:
                buf = alloc(h.size)
            except (MemoryError, OverflowError):  # a head that claims more than this process can hold
                return ErrorCode.OBJECT_NOT_FOUND
            dst = memoryview(buf)
        delivery = Delivery(h, [(0, h.size, dst[: h.size])], whole=True)
        delivery.head(head.data)
        if h.blocks == 1:
            code = delivery.outcome()[0]
            return buf if buf is not None and code >= 0 else code
        return delivery, buf

    def read_ranges(self, key: str, fragments: Sequence[Fragment]) -> list[int]:
        """Parts of one value: per fragment, its length or a code (a fragment past the
        value's end is INVALID_PARAMS; the others are still read)."""
        with self._bounded():
            with self._heads([key]) as heads:
                head = heads[0]
                if isinstance(head, int):
                    return [head] * len(fragments)
                size = head.header.size
                ok = [i for i, (off, n, _) in enumerate(fragments) if off + n <= size]
                delivery = Delivery(head.header, [fragments[i] for i in ok], whole=False)
                delivery.head(head.data)
            got = self._chunks(key, delivery)
        out = [int(ErrorCode.INVALID_PARAMS)] * len(fragments)
        for i, code in zip(ok, got):
            out[i] = code
        return out

    def _chunks(self, key: str, delivery: Delivery) -> list[int]:
        """Read the chunks ``delivery`` needs, a few at a time (its head already delivered),
        until every fragment has failed (a missing chunk fails a whole read: the rest would be
        read for nothing); per fragment, its length or a code."""
        h = delivery.header
        chunks = delivery.chunks()
        per = max(1, min(self.max_batch, _BATCH_BYTES // h.chunk_bytes))
        while not delivery.failed and (group := list(itertools.islice(chunks, per))):
            with self._blocks(self.keys.chunks(key, h.nonce, group)) as blocks:
                for p, views in zip(group, blocks):
                    delivery.deliver(p, views)
        return delivery.outcome()

    def sizes(self, keys: Sequence[str]) -> list[int]:
        """Each value's length, or a code."""
        with self._bounded(), self._heads(keys) as heads:
            return [h if isinstance(h, int) else h.header.size for h in heads]

    # ------------------------------------------------------------------ exist / remove
    def exists(self, keys: Sequence[str]) -> list[int]:
        """1 where this node or (through the index) a peer holds the object's head, else 0."""
        with self._bounded():
            return [1 if self.client.lookup([self.keys.head(k)]).prefix else 0 for k in keys]

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Delete objects from this node: 0, OBJECT_NOT_FOUND (none here, even if a peer
        holds one), ILLEGAL_CLIENT (another tenant of this key space wrote it) or
        OBJECT_HAS_LEASE (its head is being brought from disk: try again); see :meth:`_unlink`."""
        codes: list[int] = []
        chunks: list[Iterable[KeyLike]] = []
        try:
            for key in keys:
                gone = self._unlink(key)
                codes.append(gone.code)
                chunks.append(gone.chunks)
        finally:
            self._drop(itertools.chain.from_iterable(chunks))  # (past the deadline too: no chunk outlives its head)
        return codes

    def _unlink(self, key: str, keep: bool = False, nonce: int | None = None) -> _Unlinked:
        """Remove ``key``'s head from this node, read first and held (over the arena) while the
        sidecar removes it. The sidecar answers a refusal alike for a block another tenant of
        the key space wrote and for one being brought from disk (a REMOVE answers how many
        went); a head this client holds is in the host tier, so never being brought there:
        refused while held, it is another tenant's (ILLEGAL_CLIENT). Over TCP a head is
        copied, not held: brought in for that read, it would have to be evicted and read
        again in between to be taken for another tenant's. A head that cannot be read is
        removed unread (refused: OBJECT_HAS_LEASE, which may be either), or with ``keep``
        left as it is (NO_AVAILABLE_HANDLE: no copy to put back). With ``nonce``, only the
        version of that nonce goes: another is left (``other``). The chunks of a head that is
        not :meth:`Header.plausible` are not dropped: no store of this API wrote them, and
        there may be billions of keys to remove (what was planted is evicted in time)."""
        head = self.keys.head(key)
        with contextlib.ExitStack() as held:
            with self._bounded():
                if not self._here(head):  # never fetch a peer's copy just to delete it
                    return _Unlinked(ErrorCode.OBJECT_NOT_FOUND)
                views = held.enter_context(self._blocks([head]))[0]
            if views is None and keep:
                return _Unlinked(ErrorCode.NO_AVAILABLE_HANDLE if self._here(head) else ErrorCode.OBJECT_NOT_FOUND)
            header = None
            if views is not None:
                with contextlib.suppress(LayoutError):
                    header = Header.parse(first_bytes(views, HEADER.size), sum(v.nbytes for v in views))
            if nonce is not None and (header is None or header.nonce != nonce):
                return _Unlinked(ErrorCode.OK, other=True)
            saved = b"".join(views) if keep and views is not None else None
            gone = self.client.remove([head])  # (the task's deadline held for the read)
        if gone:
            chunks: Iterable[KeyLike] = ()
            if header is not None and header.plausible(self.node_bytes):
                chunks = _Chunks(self.keys, key, header, self.max_batch)
            return _Unlinked(ErrorCode.OK, chunks, saved)
        if not self._here(head):
            return _Unlinked(ErrorCode.OBJECT_NOT_FOUND)
        return _Unlinked(ErrorCode.ILLEGAL_CLIENT if views is not None else ErrorCode.OBJECT_HAS_LEASE)

    def _broken(self, key: str) -> int | None:
        """The nonce of ``key``'s head where it names chunks that are not all held (here or on
        peers), or is a forged one (not :meth:`Header.plausible`: never whole); None for a
        whole value, and for a head that cannot be read now or is not this API's (kept as it
        is)."""
        with self._heads([key], forged=True) as heads:
            head = heads[0]
        if not isinstance(head, _Head):
            return None
        h = head.header
        return None if h.plausible(self.node_bytes) and self._held(key, h) else h.nonce

    def _held(self, key: str, h: Header) -> bool:
        """Whether every chunk ``h`` names is held (here or on peers). LOOKUPs of ``max_batch``
        keys, from the first chunk on (each answers the longest prefix held of what it asks),
        stopped at the first chunk missing: a head whose chunks are gone, or were never
        written, costs one. Each is a pool call under the task's deadline, and keys are
        derived a batch at a time. A value of up to ``max_batch`` chunks takes one LOOKUP."""
        pos = 1
        while pos < h.blocks:
            n = self.client.lookup(self.keys.chunks(key, h.nonce, range(pos, min(h.blocks, pos + self.max_batch)))).prefix
            if n == 0:
                return False
            pos += n
        return True

    def _here(self, key: BlockKey) -> bool:
        """Whether this node holds the block (not only a peer)."""
        found = self.client.lookup([key])
        return bool(found.prefix) and found.tiers[0] != "peer"

