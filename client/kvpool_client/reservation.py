"""Room in the shared arena that a caller fills itself: the two phases of a put, apart.

:meth:`PoolClient.put <kvpool_client.client.PoolClient.put>` copies payloads into the room
the sidecar allocates and checksums them on the way. A GPU engine can do better: it
reserves the room (:meth:`PoolClient.reserve <kvpool_client.client.PoolClient.reserve>`),
copies device memory straight into the extents by DMA (the arena registered with CUDA,
:mod:`kvpool_client.tensors`), and commits: :meth:`Reservation.commit` checksums the bytes
where they lie and makes the blocks visible. No reader sees a block before its commit, and
the checksum is taken over exactly the bytes readers will verify.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvpool_client.errors import KVPoolError
from kvpool_client.integrity import checksum_many
from kvpool_client.protocol import PutStatus


def put_statuses(allocs: list[Any], commit_results: list[int], aborted: Sequence[int] = ()) -> list[PutStatus]:
    """Each block's outcome: its ALLOC status, or for one allocated its COMMIT result in
    order. The leases in ``aborted`` were never committed (a broken answer: their extents
    did not hold the block) and were not stored (FULL); they have no commit result."""
    it = iter(commit_results)
    skipped = set(aborted)
    out = []
    for status, lease, _ in allocs:
        if status == PutStatus.ALLOCATED and lease in skipped:
            out.append(PutStatus.FULL)
        elif status == PutStatus.ALLOCATED:
            code = next(it, -1)
            out.append(PutStatus(code) if code >= 0 else PutStatus.FULL)
        else:
            out.append(PutStatus(status))
    return out


class _Room:
    """What both reservations hold: each block's room and outcome so far (see
    :class:`Reservation`), and whether the room is still open."""

    def __init__(self, allocs: list[Any], views: list[list[memoryview] | None],
                 extents: list[list[tuple[int, int]] | None], broken: list[int]) -> None:
        self._allocs = allocs
        skipped = set(broken)
        self.statuses = [PutStatus.FULL if lease in skipped and status == PutStatus.ALLOCATED else PutStatus(status)
                         for status, lease, _ in allocs]
        self.views = views
        self.extents = extents
        #: Leases whose extents did not hold the block: the client aborted them at once.
        self._broken = broken
        self._open = True

    def __len__(self) -> int:
        return len(self.views)

    def _blocks(self) -> list[list[memoryview]]:
        """The room of each block allocated, to checksum before the commit."""
        if not self._open:
            raise KVPoolError("this reservation was already committed or aborted")
        return [vs for vs in self.views if vs is not None]

    def _close(self) -> list[int]:
        """The leases still open; every view released."""
        if not self._open:
            raise KVPoolError("this reservation was already committed or aborted")
        self._open = False
        for group in self.views:
            for v in group or ():
                v.release()
        return [lease for (status, lease, _), vs in zip(self._allocs, self.views) if vs is not None]

    def _outcome(self, leases: list[int], sums: list[int]) -> list[list[int]]:
        return [[lease, csum] for lease, csum in zip(leases, sums)]

    def abandon(self) -> None:
        """Forget the room without giving it back: the sidecar takes it back when the leases
        expire (for room that a copy may still be writing into)."""
        if self._open:
            self._close()


class Reservation(_Room):
    """Room allocated for blocks, to be written in place and committed.

    ``views[i]`` is block ``i``'s room as writable memoryviews into the arena, and
    ``extents[i]`` the same pieces as ``(arena offset, length)`` for DMA; both None where the
    sidecar allocated nothing (``statuses[i]`` says why: EXISTS, FULL, ...) or answered with
    extents that do not hold the block (the client aborted those leases before handing the
    reservation out). Write every byte of each block, then :meth:`commit`; leaving a
    ``with`` block without committing gives the room back.
    """

    def __init__(self, allocs: list[Any], views: list[list[memoryview] | None],
                 extents: list[list[tuple[int, int]] | None], broken: list[int],
                 commit: Callable[[list[list[int]]], list[int]], abort: Callable[[list[int]], object]) -> None:
        super().__init__(allocs, views, extents, broken)
        self._commit = commit
        self._abort = abort

    def commit(self) -> list[PutStatus]:
        """Checksum each block where it lies and make it visible; each block's outcome."""
        sums = checksum_many(self._blocks())
        leases = self._close()
        done = self._commit(self._outcome(leases, sums)) if leases else []
        return put_statuses(self._allocs, done, self._broken)

    def abort(self) -> None:
        """Give the room back; no block is stored."""
        if not self._open:
            return
        leases = self._close()
        if leases:
            self._abort(leases)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class AsyncReservation(_Room):
    """:class:`Reservation` for asyncio (:meth:`AsyncPoolClient.reserve
    <kvpool_client.client.AsyncPoolClient.reserve>`): ``await room.commit()``, or ``async
    with``. The checksums run on the event loop's thread, as :meth:`AsyncPoolClient.put
    <kvpool_client.client.AsyncPoolClient.put>`'s copies do (and release the GIL)."""

    def __init__(self, allocs: list[Any], views: list[list[memoryview] | None],
                 extents: list[list[tuple[int, int]] | None], broken: list[int],
                 commit: Callable[[list[list[int]]], Awaitable[list[int]]],
                 abort: Callable[[list[int]], Awaitable[object]]) -> None:
        super().__init__(allocs, views, extents, broken)
        self._commit = commit
        self._abort = abort

    async def commit(self) -> list[PutStatus]:
        """Checksum each block where it lies and make it visible; each block's outcome."""
        sums = checksum_many(self._blocks())
        leases = self._close()
        done = await self._commit(self._outcome(leases, sums)) if leases else []
        return put_statuses(self._allocs, done, self._broken)

    async def abort(self) -> None:
        """Give the room back; no block is stored."""
        if not self._open:
            return
        leases = self._close()
        if leases:
            await self._abort(leases)

    async def __aenter__(self) -> AsyncReservation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.abort()


__all__ = ["AsyncReservation", "Reservation", "put_statuses"]
