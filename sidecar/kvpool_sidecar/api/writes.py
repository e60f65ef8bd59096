"""The local API's write path: ALLOC, COMMIT, ABORT, PUT_INLINE, PIN, UNPIN and REMOVE.

A put reserves each block (ALLOC: a lease on room in the client's arena, which the client
fills and checksums), then COMMIT publishes it under its checksum or ABORT gives the room
back; PUT_INLINE does all three with the bytes in the request (clients without the arena).
Every item of a batch is checked before any key is reserved, so a refused batch leaves
nothing behind. PIN, UNPIN and REMOVE keep, let go and delete blocks of the client's key
space; copies on other nodes are theirs.

A large request is served a slice at a time, the event loop turning between slices
(:class:`Slice`): every :data:`BATCH_SLICE` blocks, and, since a block's room may lie in many
extents each gathered or given back one at a time, every :data:`EXTENT_SLICE` extents.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvpool_client.integrity import copy_with_checksum
from kvpool_client.protocol import ErrorCode, Op
from kvpool_sidecar.api.arguments import (
    check_tokens_fit,
    checked_checksum,
    checked_int,
    checked_items,
    checked_keys,
    checked_lease_ids,
    checked_parent,
)
from kvpool_sidecar.api.blockinfo import parse_engine, parse_hints
from kvpool_sidecar.api.limits import BATCH_SLICE, SLICE_BYTES
from kvpool_sidecar.api.pieces import copy_in
from kvpool_sidecar.api.localclient import LocalClient
from kvpool_sidecar.errors import RequestError, UnknownLeaseError
from kvpool_sidecar.policy import Hints
from kvpool_sidecar.store import Session

#: Extents (pieces of a block's room, :mod:`~kvpool_sidecar.tiers.alloc`) one request gathers
#: or gives back between turns of the event loop, whatever its blocks' count (a few
#: milliseconds): a tenant that cut the DRAM tier into one-page holes had its ALLOC of eight
#: blocks gather 32,768 extents in one step, and its ABORT give them back in another, each
#: holding every other client's requests for 150 to 230 ms.
EXTENT_SLICE = 4096


class Slice:
    """What a request did since the event loop last turned: :meth:`step` turns it past
    :data:`BATCH_SLICE` blocks, :data:`EXTENT_SLICE` extents or :data:`SLICE_BYTES` bytes."""

    __slots__ = ("blocks", "extents", "nbytes")

    def __init__(self) -> None:
        self.blocks = self.extents = self.nbytes = 0

    def due(self, extents: int = 1, nbytes: int = 0) -> bool:
        """Count one more block (of ``extents`` extents and ``nbytes`` bytes copied); whether
        the loop should turn now (the counts start again)."""
        self.blocks += 1
        self.extents += extents
        self.nbytes += nbytes
        if self.blocks < BATCH_SLICE and self.extents < EXTENT_SLICE and self.nbytes < SLICE_BYTES:
            return False
        self.blocks = self.extents = self.nbytes = 0
        return True

    async def step(self, extents: int = 1, nbytes: int = 0) -> None:
        """:meth:`due`, and a turn of the loop when it is."""
        if self.due(extents, nbytes):
            await asyncio.sleep(0)  # other clients' requests between slices of a large request


class WriteRequests:
    """One connection's writes: puts (through the arena or inline), pins and removals."""

    def __init__(self, client: LocalClient) -> None:
        self._client = client
        self.store = client.store
        self.limits = client.limits

    def _put_items(self, items: object, hints: object) -> tuple[list[list[Any]], Hints | None]:
        """A put's items as ``[store key, size or data, depth, store parent, engine]``, all
        checked before anything is reserved: a refused batch must leave no key reserved."""
        client = self._client
        if client.version < 3 and hints is not None:
            raise RequestError("hints need protocol version 3")
        checked = []
        for item in checked_items(items, self.limits, 4 if client.version < 3 else (4, 5)):
            key, second, depth, parent = item[:4]
            checked.append([client.scoped(checked_keys([key], self.limits))[0], second, checked_int(depth, "depth"),
                            client.scoped_parent(checked_parent(parent)),
                            parse_engine(item[4] if len(item) > 4 else None)])
        return checked, parse_hints(hints)

    async def alloc(self, items: object, hints: object = None) -> list[Any]:
        client = self._client
        client.need_shm()
        checked, parsed = self._put_items(items, hints)
        for item in checked:
            check_tokens_fit(item[4], checked_int(item[1], "size"))
        out: list[Any] = []
        lineage = self.store.lineage()
        session = client.active_session
        turn = Slice()
        try:
            for key, size, depth, parent, engine in checked:
                status, lease = await self.store.allocate(session, key, size, depth=depth, parent=parent,
                                                          hints=parsed, engine=engine, lineage=lineage)
                out.append([int(status), lease.id, client.mapped(lease.place)] if lease else [int(status), 0, None])
                await turn.step(lease.extents if lease else 1)
        except BaseException:
            # the answer is an error: the leases granted so far are never named to the client,
            # which could not commit or abort them (each key stayed PENDING until its lease
            # expired, its room held until the connection closed)
            for item in out:
                if item[1]:
                    with contextlib.suppress(UnknownLeaseError):
                        self.store.abort(session, item[1])
            raise
        return out

    def commit(self, items: object) -> list[int]:
        return self._commit(self._commits(items))

    def _commits(self, items: object) -> list[tuple[int, int]]:
        # the whole batch is checked before any of it is applied: a refused batch commits nothing
        return [(checked_int(lease_id, "lease"), checked_checksum(csum))
                for lease_id, csum in checked_items(items, self.limits, 2)]

    def _commit(self, checked: list[tuple[int, int]]) -> list[int]:
        out = []
        for lease_id, csum in checked:
            try:
                out.append(int(self.store.commit(self._client.active_session, lease_id, csum)))
            except UnknownLeaseError:
                out.append(-int(ErrorCode.UNKNOWN_LEASE))
        return out

    def abort(self, lease_ids: object) -> int:
        n = 0
        for lid in checked_lease_ids(lease_ids, self.limits):
            with contextlib.suppress(UnknownLeaseError):
                self.store.abort(self._client.active_session, lid)
                n += 1
        return n

    async def put_inline(self, items: object, hints: object = None) -> list[int]:
        """Put for clients without the arena: the sidecar copies and checksums."""
        client = self._client
        checked, parsed = self._put_items(items, hints)
        if not all(isinstance(item[1], bytes) for item in checked):
            raise RequestError("inline data must be bytes")
        for item in checked:
            check_tokens_fit(item[4], len(item[1]))
        out: list[int] = []
        lineage = self.store.lineage()
        turn = Slice()
        for key, data, depth, parent, engine in checked:
            status, lease = await self.store.allocate(client.active_session, key, len(data), depth=depth,
                                                      parent=parent, hints=parsed, engine=engine, lineage=lineage)
            extents, copied = 1, 0
            if lease is not None:
                if not self.store.host.keeps_payloads:
                    self.store.abort(client.active_session, lease.id)
                    raise RequestError("this sidecar keeps no payloads")
                room = self.store.host.views(lease.place)
                if len(data) > SLICE_BYTES:  # a piece at a time, the loop turning between
                    csum = await copy_in(room, memoryview(data), SLICE_BYTES)
                else:
                    csum = copy_with_checksum(room, memoryview(data))
                status = self.store.commit(client.active_session, lease.id, csum)
                extents, copied = lease.extents, len(data)
            out.append(int(status))
            # other clients' requests between slices: a put of 4,096 small blocks in one
            # frame had held the loop for 340 ms (allocate rarely waits)
            await turn.step(extents, copied)
        return out

    def pin(self, keys: object) -> int:
        return self.store.pin(self._client.active_session, self._client.scoped(checked_keys(keys, self.limits)))

    def unpin(self, keys: object) -> int:
        return self.store.unpin(self._client.active_session, self._client.scoped(checked_keys(keys, self.limits)))

    def remove(self, keys: object) -> int:
        """Delete blocks of this client's key space (validated like a pin: the whole batch
        first); copies on other nodes are theirs and stay."""
        return self.store.remove(self._client.active_session, self._client.scoped(checked_keys(keys, self.limits)))

    # -------------------------------------------- the same, a slice at a time
    def long(self, items: object) -> bool:
        """Whether a COMMIT, ABORT, RELEASE, PIN, UNPIN or REMOVE of ``items`` is served a
        slice at a time (:meth:`sliced`): more than :data:`BATCH_SLICE` items (one of 4,096
        blocks had held the event loop for up to 130 ms, a REMOVE, every other client's
        requests waiting), or leases or blocks whose room lies in more than
        :data:`EXTENT_SLICE` extents (an ABORT of eight leases had given back 32,768)."""
        if not isinstance(items, list) or not items:
            return False
        return len(items) > BATCH_SLICE or self._extents_named(items) > EXTENT_SLICE

    def _extents_named(self, items: list[Any]) -> int:
        """The extents of the room of what ``items`` name, as far as it matters (past
        :data:`EXTENT_SLICE` it stops counting): of the leases of an ABORT (lease ids) or a
        COMMIT or RELEASE (``[lease id, ...]`` items), or of the blocks of a REMOVE (keys;
        weighed only while the tenant's blocks lie in more than a few extents, so that a
        LOOKUP, whose keys look the same, costs nothing more otherwise)."""
        session = self._client.session
        if session is None:
            return 0
        first = items[0]
        total = 0
        if type(first) is int or (type(first) is list and first and type(first[0]) is int):
            for item in items:
                lease_id = item[0] if type(item) is list and item else item
                if type(lease_id) is int:
                    total += session.lease_extents(lease_id)
                    if total > EXTENT_SLICE:
                        break
            return total
        if type(first) is not bytes:
            return 0
        report = self.store.report
        if len(items) + report.scattered(session.tenant) <= EXTENT_SLICE:
            return len(items)  # (at most)
        for k in self.limits.spaces.scoped(session.tenant, items):
            total += report.extents(k) if type(k) is bytes else 0
            if total > EXTENT_SLICE:
                break
        return total

    def sliced(self) -> dict[int, Callable[[object], Awaitable[Any]]]:
        """COMMIT, ABORT, RELEASE, PIN, UNPIN and REMOVE served a slice at a time (at most
        :data:`BATCH_SLICE` items, and for those that give room back, the items of about
        :data:`EXTENT_SLICE` extents, per turn of the event loop), the whole batch checked
        first as at once; for :meth:`long` batches."""
        return {Op.COMMIT: self._commit_sliced, Op.ABORT: self._abort_sliced, Op.RELEASE: self._release_sliced,
                Op.PIN: functools.partial(self._keys_sliced, "pin"),
                Op.UNPIN: functools.partial(self._keys_sliced, "unpin"),
                Op.REMOVE: functools.partial(self._keys_sliced, "remove")}

    async def _commit_sliced(self, items: object) -> list[int]:
        checked = self._commits(items)
        out: list[int] = []
        for i in range(0, len(checked), BATCH_SLICE):
            if i:
                await asyncio.sleep(0)
            out += self._commit(checked[i : i + BATCH_SLICE])
        return out

    async def _abort_sliced(self, lease_ids: object) -> int:
        """:meth:`abort`, a slice at a time."""
        n = 0
        turn = Slice()
        for lease_id in checked_lease_ids(lease_ids, self.limits):
            session = self._client.active_session
            extents = session.lease_extents(lease_id)
            with contextlib.suppress(UnknownLeaseError):
                self.store.abort(session, lease_id)
                n += 1
            await turn.step(max(1, extents))
        return n

    async def _release_sliced(self, items: object) -> int:
        """RELEASE (:meth:`ReadRequests.release <kvpool_sidecar.api.reads.ReadRequests.release>`),
        a slice at a time: the room of a block removed while it was read comes back with
        its last read lease."""
        checked = [(checked_int(lease_id, "lease"), bool(corrupt))
                   for lease_id, corrupt in checked_items(items, self.limits, 2)]
        n = 0
        turn = Slice()
        for lease_id, corrupt in checked:
            session = self._client.active_session
            extents = session.lease_extents(lease_id)
            with contextlib.suppress(UnknownLeaseError):
                self.store.release(session, lease_id, corrupt=corrupt)
                n += 1
            await turn.step(max(1, extents))
        return n

    async def _keys_sliced(self, name: str, keys: object) -> int:
        """The store's ``name`` (pin, unpin or remove) of ``keys``, a slice at a time: at
        most :data:`BATCH_SLICE` keys, and for a REMOVE, the keys of their blocks' first
        :data:`EXTENT_SLICE` extents (at least one key)."""
        apply: Callable[[Session, Sequence[bytes]], int] = getattr(self.store, name)
        scoped = self._client.scoped(checked_keys(keys, self.limits))
        weigh = self.store.report.extents if name == "remove" else None
        n = start = 0
        while start < len(scoped):
            if start:
                await asyncio.sleep(0)
            end, extents = start, 0
            while end < len(scoped) and end - start < BATCH_SLICE and extents < EXTENT_SLICE:
                extents += weigh(scoped[end]) if weigh is not None else 1
                end += 1
            n += apply(self._client.active_session, scoped[start:end])
            start = end
        return n
